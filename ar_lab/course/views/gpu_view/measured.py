"""A measured GPU roofline beside its datasheet: ``spec_comparison`` and ``plot_measured_vs_spec``
put a measured result (``ar_lab.perf.measure``'s JSON, from this GPU or a committed
``data/roofline_gpu_*.json``) beside the datasheet's prediction for the same GPU; ``measure_gpu``
takes that measurement, ``gpu_measurement`` takes or finds one."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from ar_lab.base.args import finite_number
from ar_lab.base.errors import BadType
from ar_lab.course.views.gpu_view.scenario import plot_gpu_roof
from ar_lab.course.views.plots import COLORS
from ar_lab.model.gpt import GPTConfig
from ar_lab.perf import llm_costs as lc
from ar_lab.perf.gpus import GPUSpec, as_gpu, match_gpu
from ar_lab.perf.roofline import attainable_flops


def check_result(result, keys=("device", "dtype", "peaks", "points")) -> dict:
    """``result`` if it looks like a roofline result (``measure.load_result(path)`` or
    ``measure_gpu(...)``: a dict with ``keys``); else a TypeError saying what to pass."""
    if not isinstance(result, dict) or any(k not in result for k in keys):
        raise BadType(
            f"result must be a roofline result dict with {list(keys)} (measure.load_result(path) "
            f"or measure_gpu(device)), got {str(result)[:120]}",
            arg="result",
        )
    return result


def result_label(result: dict) -> str:
    """A measured result's device as a legend says it: name, dtype and, on a CPU, the thread
    count."""
    d = check_result(result, ("device", "dtype"))["device"]
    threads = (
        f", {d['threads']} thread{'s' if d['threads'] != 1 else ''}" if d["type"] == "cpu" else ""
    )
    return f"{d['name']}, {result['dtype']}{threads}"


def spec_comparison(result: dict, spec: GPUSpec | None = None) -> dict:
    """A measured roofline ``result`` against the datasheet of its GPU (``spec``, else matched by
    device name).

    Returns {"spec", "roofs": {name: (measured, datasheet, ratio)}, "rows": [...]} where each row is
    a measured point with its predicted time at the datasheet roofs and the ratio measured /
    predicted. Without a tabulated spec, "spec" is None and only the measured roofs predict.
    ``spec`` may be a name.
    """
    check_result(result)
    spec = match_gpu(result["device"]["name"]) if spec is None else as_gpu(spec, "spec")
    dtype = "fp32" if result["dtype"] in ("float32", "fp32") else "bf16"
    peaks = result["peaks"]
    mp, mb = peaks["matmul_flops_per_s"], peaks["bandwidth_bytes_per_s"]
    roofs, rows = {}, []
    if spec is not None:
        roofs["compute"] = (mp, spec.peak_flops(dtype), mp / spec.peak_flops(dtype))
        roofs["bandwidth"] = (mb, spec.bandwidth, mb / spec.bandwidth)
    for p in result["points"]:
        at_measured = max(p["flops"] / mp, p["bytes"] / mb)
        row = {
            "phase": p["phase"],
            "batch": p["batch"],
            "tokens": p["tokens"],
            "context": p["context"],
            "intensity": p["intensity"],
            "measured_s": p["seconds"],
            "at_measured_roofs_s": at_measured,
            "measured_over_measured_roofs": p["seconds"] / at_measured,
        }
        if spec is not None:
            predicted = max(p["flops"] / spec.peak_flops(dtype), p["bytes"] / spec.bandwidth)
            row.update(predicted_s=predicted, measured_over_predicted=p["seconds"] / predicted)
        rows.append(row)
    return {"spec": spec, "dtype": dtype, "roofs": roofs, "rows": rows}


COMPARISON_HEADERS = [
    "phase",
    "B",
    "T",
    "context",
    "FLOP/B",
    "measured ms",
    "datasheet ms",
    "measured/datasheet",
]


def comparison_rows(comparison: dict) -> list[list]:
    """Rows under ``COMPARISON_HEADERS`` (datasheet columns "-" when the GPU is not tabulated)."""
    if not isinstance(comparison, dict) or "rows" not in comparison:
        raise BadType(
            "comparison must be the dict spec_comparison(result) returns, got "
            f"{str(comparison)[:120]}",
            arg="comparison",
        )
    out = []
    for r in comparison["rows"]:
        pred = r.get("predicted_s")
        out.append(
            [
                r["phase"],
                r["batch"],
                r["tokens"],
                r["context"],
                round(r["intensity"], 1),
                round(r["measured_s"] * 1e3, 3),
                "-" if pred is None else round(pred * 1e3, 3),
                "-" if pred is None else round(r["measured_over_predicted"], 2),
            ]
        )
    return out


def roof_lines(comparison: dict) -> list[str]:
    """Each measured roof of ``comparison`` (``spec_comparison``'s) against its datasheet figure, a
    line each."""
    if not isinstance(comparison, dict) or "roofs" not in comparison:
        raise BadType(
            "comparison must be the dict spec_comparison(result) returns, got "
            f"{str(comparison)[:120]}",
            arg="comparison",
        )
    if comparison["spec"] is None:
        return ["this GPU is not in ar_lab.perf.gpus: compared with its measured roofs only"]
    return [
        f"{roof} roof: measured {value:.3g}, datasheet {sheet:.3g} -> measured / datasheet = "
        f"{ratio:.2f}"
        for roof, (value, sheet, ratio) in comparison["roofs"].items()
    ]


def plot_measured_vs_spec(ax, result: dict, spec: GPUSpec | None = None):
    """Measured roofs and points (filled) beside the datasheet roofline and predicted points
    (hollow)."""
    from ar_lab.course.views.plots import plot_roofline

    comparison = spec_comparison(result, spec)
    spec = comparison["spec"]
    # "roofs of ..."
    plot_roofline(ax, result, label=f"{result_label(result)}, measured", annotate=False)
    if spec is not None:
        xs = [p["intensity"] for p in result["points"]]
        plot_gpu_roof(
            ax, spec, comparison["dtype"], lo=min(xs) / 4, hi=max(xs) * 40, color=COLORS["theory"]
        )
        peak = spec.peak_flops(comparison["dtype"])
        for phase, marker in (("prefill", "o"), ("decode", "^")):
            pts = [p for p in result["points"] if p["phase"] == phase]
            ys = [attainable_flops(p["intensity"], peak, spec.bandwidth) for p in pts]
            ax.scatter(
                [p["intensity"] for p in pts],
                ys,
                marker=marker,
                s=40,
                facecolors="none",
                edgecolors=COLORS[phase],
                label=f"{phase} predicted from the datasheet",
            )
    ax.set_title(
        f"{result['device']['name']}: measured (filled) and datasheet (hollow)", fontsize=10.5
    )
    ax.legend(loc="lower right", fontsize=7.5)
    return comparison


# A random-init model per GPU memory size, large enough that a decode step streams its
# weights from memory (far beyond the L2 cache) rather than waiting on kernel launches.
GPU_CONFIGS = {
    # 6.5 B parameters, 13 GB in bf16
    40e9: GPTConfig(block_size=4096, n_layer=32, n_head=32, n_embd=4096),
    # 1.2 B parameters, 2.4 GB in bf16
    12e9: GPTConfig(block_size=4096, n_layer=24, n_head=16, n_embd=2048),
}


def measure_config(memory: float) -> GPTConfig:
    """The largest of ``GPU_CONFIGS`` for a device with ``memory`` bytes (the smallest below 12
    GB)."""
    memory = finite_number("memory (bytes)", memory, arg="memory")
    for need, cfg in sorted(GPU_CONFIGS.items(), reverse=True):
        if memory >= need:
            return cfg
    return min(GPU_CONFIGS.items())[1]


def measure_gpu(
    device,
    cfg: GPTConfig | None = None,
    *,
    prompt_lens: Sequence[int] = (128, 512, 2048),
    batches: Sequence[int] = (1, 8, 32, 128),
    context: int = 512,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
    **run_options,
) -> dict:
    """Measure this device's roofs and prefill/decode points of a random-init model
    (``measure.run_roofline``'s result). On CUDA the model is ``measure_config(memory)`` in bf16,
    every pass replays as a CUDA graph, and batches whose weights + KV cache would take more than 60
    % of the memory are left out."""
    import torch

    from ar_lab.base.timing import checked_device
    from ar_lab.perf.measure import build_model, run_roofline

    # "banana", "mps" or "cuda" without a GPU: a ValueError saying what to pass
    device = checked_device(device)
    cuda = device.type == "cuda"
    memory = torch.cuda.get_device_properties(device).total_memory if cuda else 0
    cfg = measure_config(memory) if cfg is None else cfg
    if cuda:
        shape = lc.from_gpt_config(cfg)
        batches = [b for b in batches if lc.memory_needed(shape, context, b) <= 0.6 * memory] or [1]
    model = build_model(cfg, device)
    try:
        return run_roofline(
            model,
            prompt_lens,
            batches,
            context,
            repeats=repeats,
            progress=progress,
            cuda_graph=cuda,
            **run_options,
        )
    finally:
        del model
        if cuda:
            torch.cuda.empty_cache()


def gpu_measurement(
    device, *, progress: Callable[[str], None] | None = None
) -> tuple[dict | None, str]:
    """A GPU roofline result and where it comes from: measured now (``measure_gpu``) when ``device``
    is a CUDA GPU, else the newest committed ``data/roofline_gpu_*.json``; without either, None and
    a sentence saying so."""
    import time

    from ar_lab.base.timing import checked_device, device_name
    from ar_lab.perf.measure import load_result, reference_files

    device = checked_device(device)
    if device.type == "cuda":
        start = time.perf_counter()
        result = measure_gpu(device, progress=progress)
        return result, f"measured now on this GPU, in {time.perf_counter() - start:.0f} s"
    if files := reference_files(device_type="cuda"):
        return load_result(
            files[-1]
        ), f"committed measurement {files[-1].parent.name}/{files[-1].name}"
    return None, (
        f"This machine has no GPU ({device_name(device)}) and the repository holds no GPU "
        "measurement: nothing in this chapter was measured on a GPU. The GPU figures above are "
        "predictions from datasheets."
    )
