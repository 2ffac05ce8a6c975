"""Chapter 05's what-if explorer: a real model on a real GPU, from the datasheet and the FLOP/byte
model.

A thin shell over ``ar_lab.course.views.gpu_view.gpu_scenario`` (a pure function the tests call
directly): GPU, model, weight format, batch, prompt and context -> the roofline with the
prefill and decode points, predicted TTFT, TPOT, tokens/s and memory, or "does not fit".
``scenario`` holds the last result and ``error`` the message for impossible input, so
tests can set ``.value`` on the controls and read what it shows. The number boxes keep what
was typed (a bounded box would clamp 0 to 1 and a fractional batch to a whole one, silently):
a value that is not a whole number in range is refused with a message, and the plot cleared.
"""

from __future__ import annotations

import html

from ar_lab.base.args import finite_number
from ar_lab.base.errors import BadType, BadValue
from ar_lab.course.views.gpu_view import Scenario
from ar_lab.course.views.widgets import refuse, whole_number


def format_time(seconds: float) -> str:
    """Seconds as a reader wants them: "2.50 s", "8.3 ms" or "65 µs"."""
    seconds = finite_number("seconds", seconds)
    if seconds >= 1:
        return f"{seconds:,.2f} s"
    return f"{seconds * 1e3:,.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:,.0f} µs"


def scenario_html(s: Scenario) -> str:
    """The explorer's summary: a 'does not fit' banner or the fit, then the predicted clocks."""
    if not isinstance(s, Scenario):
        raise BadType(f"s must be a Scenario (from gpu_view.gpu_scenario(...)), got {s!r}", arg="s")
    p = s.placement
    if s.fits:
        banner = (
            f"<b style='color:#16a085'>fits</b>: {s.memory / 1e9:,.1f} GB of "
            f"{s.gpu.memory / 1e9:.0f} GB (weights {s.weights / 1e9:,.1f} GB + KV cache); up to "
            f"{p.max_batch:,} sequences at this context"
        )
    else:
        banner = f"<b style='color:#c0392b'>{html.escape(s.verdict)}</b>"
    never = f"never (its limit is {p.intensity_limit:,.0f} FLOP/B)"
    compute = never if p.compute_bound_batch is None else f"from batch {p.compute_bound_batch:,}"
    if p.compute_bound_batch is not None and not p.turns_compute_bound:
        compute += f", more than fit ({p.max_batch:,})"
    hypothetical = "" if s.fits else " <i>(if it fitted)</i>"
    rows = [
        (
            "TTFT (prefill of the batch's prompts)",
            f"{format_time(s.ttft)}{hypothetical}",
            s.bound(s.prefill),
        ),
        ("TPOT (one decode step)", f"{format_time(s.tpot)}{hypothetical}", s.bound(s.decode)),
        ("tokens/s for the batch", f"{s.tokens_per_s:,.0f}{hypothetical}", ""),
    ]
    td = "<td style='padding:1px 10px;white-space:nowrap'>"
    table = "".join(
        f"<tr>{td}{a}</td>{td}<b>{b}</b></td>{td}{c + '-bound' if c else ''}</td></tr>"
        for a, b, c in rows
    )
    return (
        f"<div>{banner}</div><table>{table}</table><div>decode: weights stop dominating the "
        f"bytes at batch {p.weights_stop_dominating_batch:,}; compute-bound {compute}; ridge "
        f"{p.ridge:,.0f} FLOP/B. Datasheet roofs ({html.escape(s.gpu.source)}): a floor on time, "
        "not a measurement.</div>"
    )


def typed_whole(label: str, value) -> int:
    """A number box's ``value`` (a float box holds 4.0 for a typed 4) as an int if it is a whole
    number >= 1; else ``widgets.whole_number``'s ValueError naming the box by its label."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return whole_number(label, value, 1)


class GPUExplorer:
    """GPU, model, weight format, batch, prompt and context -> roofline, TTFT, TPOT, tokens/s,
    memory.

    An unknown GPU, model or weight format is a ValueError at construction (a dropdown holds only
    its options); a number out of range is shown as ``error``, at construction too, like any later
    edit."""

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

        from ar_lab.perf.gpus import GPUS, as_gpu
        from ar_lab.perf.llm_costs import MODELS, WEIGHT_BYTES, as_model, check_dtype

        # unknown names: a ValueError listing them
        gpu, model = as_gpu(gpu).name, as_model(model, "model").name
        weight_dtype = check_dtype(weight_dtype)
        if model not in MODELS:
            raise BadValue(
                f"model must be a name from MODELS, one of {list(MODELS)}, got {model!r}",
                arg="model",
            )
        style = {"description_width": "110px"}
        box = dict(style=style, layout=W.Layout(width="300px"))
        self.gpu = W.Dropdown(options=list(GPUS), value=gpu, description="GPU", **box)
        self.model = W.Dropdown(options=list(MODELS), value=model, description="model", **box)
        self.dtype = W.Dropdown(
            options=list(WEIGHT_BYTES), value=weight_dtype, description="weights", **box
        )

        def number(value, description):
            """A box that keeps what was typed (checked in ``update``); the refused value is shown
            as typed."""
            shown = value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0
            control = W.FloatText(
                shown, step=1, description=description, tooltip="a whole number >= 1", **box
            )
            # the value as given, for the check (a FloatText holds floats)
            self._typed[control] = value
            return control

        self._typed: dict = {}
        self.batch = number(batch, "batch")
        self.prompt_len = number(prompt_len, "prompt tokens")
        self.context = number(context, "decode context")
        self.status = W.HTML()
        self.image = W.Image(format="png")
        self.scenario: Scenario | None = None
        self.error, self.refused = "", None
        controls = [self.gpu, self.model, self.dtype, self.batch, self.prompt_len, self.context]
        for c in controls:
            c.observe(lambda change: self._edited(change), names="value")
        self.widget = W.VBox(
            [W.HBox([W.VBox(controls[:3]), W.VBox(controls[3:])]), self.status, self.image]
        )
        self.update()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def _edited(self, change) -> None:
        self._typed.pop(change["owner"], None)  # a typed value replaces the constructor's
        self.update()

    def update(self) -> None:
        import matplotlib.pyplot as plt

        from ar_lab.course.views.gpu_view import gpu_scenario, plot_scenario
        from ar_lab.course.views.plots import png_bytes

        try:
            boxes = (self.batch, self.prompt_len, self.context)
            batch, prompt_len, context = (
                typed_whole(c.description, self._typed.get(c, c.value)) for c in boxes
            )
            s = gpu_scenario(
                self.gpu.value, self.model.value, self.dtype.value, batch, prompt_len, context
            )
        except ValueError as e:
            self.scenario = None
            self.status.value = refuse(self, e)
            self.image.value = b""  # no plot of settings the boxes no longer show
            return
        self.scenario, self.error, self.refused = s, "", None
        self.status.value = scenario_html(s)
        fig, ax = plt.subplots(figsize=(8.5, 4.6))
        plot_scenario(ax, s)
        fig.tight_layout()
        self.image.value = png_bytes(fig)


def gpu_explorer(**settings) -> GPUExplorer:
    """Build the chapter-05 explorer (display it by leaving it last in a cell)."""
    return GPUExplorer(**settings)
