"""Chapter 05 on a GPU: real models on real GPUs' rooflines, predicted, and measured where a GPU is
present.

``gpu_scenario`` is the what-if the chapter's explorer shows (``ar_lab.course.views.gpu_explorer``):
a GPU from ``ar_lab.perf.gpus``, a model from ``ar_lab.perf.llm_costs``, a weight format, a batch, a
prompt and a context -> predicted TTFT, TPOT, tokens/s and memory, or a clear "does not fit".
``plot_scenario`` and ``plot_decode_intensity`` draw it. ``spec_comparison`` and
``plot_measured_vs_spec`` put a measured roofline result (``ar_lab.perf.measure``'s JSON, from this
GPU or a committed ``data/roofline_gpu_*.json``) beside the datasheet's prediction for the same GPU;
``measure_gpu`` takes that measurement, ``gpu_measurement`` takes or finds one.

- ``ar_lab.course.views.gpu_view.scenario``: the what-if and its plots.
- ``ar_lab.course.views.gpu_view.measured``: a measured roofline beside the datasheet's.
"""

from ar_lab.course.views.gpu_view.measured import (
    COMPARISON_HEADERS,
    GPU_CONFIGS,
    check_result,
    comparison_rows,
    gpu_measurement,
    measure_config,
    measure_gpu,
    plot_measured_vs_spec,
    result_label,
    roof_lines,
    spec_comparison,
)
from ar_lab.course.views.gpu_view.scenario import (
    BATCHES,
    PROMPT_LENS,
    Scenario,
    compact_legend,
    gpu_scenario,
    plot_decode_intensity,
    plot_gpu_roof,
    plot_operators,
    plot_scenario,
)

__all__ = [
    "BATCHES",
    "COMPARISON_HEADERS",
    "GPU_CONFIGS",
    "PROMPT_LENS",
    "Scenario",
    "check_result",
    "compact_legend",
    "comparison_rows",
    "gpu_measurement",
    "gpu_scenario",
    "measure_config",
    "measure_gpu",
    "plot_decode_intensity",
    "plot_gpu_roof",
    "plot_measured_vs_spec",
    "plot_operators",
    "plot_scenario",
    "result_label",
    "roof_lines",
    "spec_comparison",
]
