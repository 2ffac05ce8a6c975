"""Chapter 05's what-if explorer: a real model on a real GPU, from the datasheet and the FLOP/byte model.

A thin shell over ``ar_lab.course.gpu_view.gpu_scenario`` (a pure function the tests call
directly): GPU, model, weight format, batch, prompt and context -> the roofline with the
prefill and decode points, predicted TTFT, TPOT, tokens/s and memory, or "does not fit".
``scenario`` holds the last result and ``error`` the message for impossible input, so
tests can set ``.value`` on the controls and read what it shows.
"""

from __future__ import annotations

import html

from ar_lab.course.gpu_view import Scenario


def format_time(seconds: float) -> str:
    """Seconds as a reader wants them: "2.50 s", "8.3 ms" or "65 µs"."""
    if seconds >= 1:
        return f"{seconds:,.2f} s"
    return f"{seconds * 1e3:,.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:,.0f} µs"


def scenario_html(s: Scenario) -> str:
    """The explorer's summary: a 'does not fit' banner or the fit, then the predicted clocks."""
    p = s.placement
    if s.fits:
        banner = (
            f"<b style='color:#16a085'>fits</b>: {s.memory / 1e9:,.1f} GB of {s.gpu.memory / 1e9:.0f} GB "
            f"(weights {s.weights / 1e9:,.1f} GB + KV cache); up to {p.max_batch:,} sequences at this context"
        )
    else:
        banner = f"<b style='color:#c0392b'>{html.escape(s.verdict)}</b>"
    never = f"never (its limit is {p.intensity_limit:,.0f} FLOP/B)"
    compute = never if p.compute_bound_batch is None else f"from batch {p.compute_bound_batch:,}"
    if p.compute_bound_batch is not None and not p.turns_compute_bound:
        compute += f", more than fit ({p.max_batch:,})"
    hypothetical = "" if s.fits else " <i>(if it fitted)</i>"
    rows = [
        ("TTFT (prefill of the batch's prompts)", f"{format_time(s.ttft)}{hypothetical}", s.bound(s.prefill)),
        ("TPOT (one decode step)", f"{format_time(s.tpot)}{hypothetical}", s.bound(s.decode)),
        ("tokens/s for the batch", f"{s.tokens_per_s:,.0f}{hypothetical}", ""),
    ]
    td = "<td style='padding:1px 10px;white-space:nowrap'>"
    table = "".join(f"<tr>{td}{a}</td>{td}<b>{b}</b></td>{td}{c + '-bound' if c else ''}</td></tr>" for a, b, c in rows)
    return (
        f"<div>{banner}</div><table>{table}</table>"
        f"<div>decode: weights stop dominating the bytes at batch {p.weights_stop_dominating_batch:,}; "
        f"compute-bound {compute}; ridge {p.ridge:,.0f} FLOP/B. "
        f"Datasheet roofs ({html.escape(s.gpu.source)}): a floor on time, not a measurement.</div>"
    )


class GPUExplorer:
    """GPU, model, weight format, batch, prompt and context -> roofline, TTFT, TPOT, tokens/s, memory."""

    def __init__(
        self,
        gpu: str = "H100 SXM",
        model: str = "Llama-2-13B",
        weight_dtype: str = "bf16",
        batch: int = 1,
        prompt_len: int = 2000,
        context: int = 2500,
    ):
        import ipywidgets as W

        from ar_lab.perf.gpus import GPUS
        from ar_lab.perf.llm_costs import MODELS, WEIGHT_BYTES

        style = {"description_width": "110px"}
        box = dict(style=style, layout=W.Layout(width="300px"))
        self.gpu = W.Dropdown(options=list(GPUS), value=gpu, description="GPU", **box)
        self.model = W.Dropdown(options=list(MODELS), value=model, description="model", **box)
        self.dtype = W.Dropdown(options=list(WEIGHT_BYTES), value=weight_dtype, description="weights", **box)
        self.batch = W.BoundedIntText(batch, min=1, max=65_536, description="batch", **box)
        self.prompt_len = W.BoundedIntText(prompt_len, min=1, max=1_000_000, description="prompt tokens", **box)
        self.context = W.BoundedIntText(context, min=1, max=1_000_000, description="decode context", **box)
        self.status = W.HTML()
        self.image = W.Image(format="png")
        self.scenario: Scenario | None = None
        self.error = ""
        controls = [self.gpu, self.model, self.dtype, self.batch, self.prompt_len, self.context]
        for c in controls:
            c.observe(lambda _change: self.update(), names="value")
        self.widget = W.VBox([W.HBox([W.VBox(controls[:3]), W.VBox(controls[3:])]), self.status, self.image])
        self.update()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def update(self) -> None:
        import matplotlib.pyplot as plt

        from ar_lab.course.gpu_view import gpu_scenario, plot_scenario
        from ar_lab.course.plots import png_bytes

        try:
            s = gpu_scenario(
                self.gpu.value,
                self.model.value,
                self.dtype.value,
                int(self.batch.value),
                int(self.prompt_len.value),
                int(self.context.value),
            )
        except ValueError as e:
            self.scenario, self.error = None, str(e)
            self.status.value = f"<b style='color:#c0392b'>{html.escape(self.error)}</b>"
            return
        self.scenario, self.error = s, ""
        self.status.value = scenario_html(s)
        fig, ax = plt.subplots(figsize=(8.5, 4.6))
        plot_scenario(ax, s)
        fig.tight_layout()
        self.image.value = png_bytes(fig)


def gpu_explorer(**settings) -> GPUExplorer:
    """Build the chapter-05 explorer (display it by leaving it last in a cell)."""
    return GPUExplorer(**settings)
