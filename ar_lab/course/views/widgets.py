"""ipywidgets explorers for the notebooks.

Every explorer is a thin shell: its callback calls a pure function from the chapter's
module (which unit tests call directly), and the builder returns the widget so tests
can set ``.value`` on its controls headlessly and read what it shows. Number controls
are plain text boxes, not bounded ones or sliders (which silently clamp a typed 100 to
their maximum): a value out of range is refused with a message in the widget that gives
the allowed range (``whole_number``, ``sampler_params``, ``speculation_settings``).
"""

from __future__ import annotations

import html
import math

import torch

from ar_lab.base.args import check_seed, finite_number
from ar_lab.base.errors import BadType, BadValue
from ar_lab.course.views.speculative_view import plot_speculation_view, speculation_text_html

# chapter 07 imports them from here too
__all__ = ["plot_speculation_view", "speculation_text_html"]


def refuse(explorer, error: ValueError) -> str:
    """Keep a refused value's ``error`` on ``explorer`` (``.error``: its message, ``.refused``: the
    error, whose ``arg`` names the control) and return the message as the red HTML the explorer
    shows in place."""
    explorer.error, explorer.refused = str(error), error
    return f"<b style='color:#c0392b'>{html.escape(explorer.error)}</b>"


def whole_number(
    label: str, value, low: int, high: int | None = None, hint: str = "", *, arg: str | None = None
) -> int:
    """``value`` if it is a whole number in [low, high]; else a BadValue (a ValueError) naming the
    control by its label; ``arg``: the argument's name where it is not the label (the message names
    it too), the label otherwise."""
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < low
        or (high is not None and value > high)
    ):
        allowed = f">= {low}" if high is None else f"from {low} to {high}"
        named = f" for {arg}" if arg and arg != label else ""
        raise BadValue(
            f"{label} must be a whole number {allowed}{hint}, got {value!r}{named}",
            arg=arg or label,
        )
    return value


def _fraction(label: str, value, *, open_low: bool, arg: str) -> float:
    """``value`` in (0, 1] (``open_low``) or [0, 1], else a BadValue giving the range and naming
    ``arg``."""
    real = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not real or not (0 < value if open_low else 0 <= value) or value > 1:
        raise BadValue(
            f"{label} must be in {'(0, 1]' if open_low else '[0, 1]'}, got {value!r} for {arg}",
            arg=arg,
        )
    return float(value)


class _Shown:
    """Shows its ``widget`` when left last in a notebook cell."""

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


# --- chapter 06: sampler explorer ----------------------------------------------------


def plot_sampler_view(ax, view, top: int = 20, legend: bool = True):
    """Bars of the model's distribution (grey) and the sampler's (blue) for the ``top`` most likely
    tokens.

    Tokens the sampler dropped keep their grey bar and get a grey label; the title says
    how many tokens are kept, how much of the model's mass they hold, and the entropy.
    """
    from ar_lab.course.views.plots import COLORS, token_label

    order = view.before.argsort(descending=True)[:top].tolist()
    xs = range(len(order))
    ax.bar(
        [x - 0.2 for x in xs],
        view.before[order].numpy(),
        width=0.4,
        color=COLORS["dropped"],
        label="model (T = 1)",
    )
    ax.bar(
        [x + 0.2 for x in xs],
        view.after[order].numpy(),
        width=0.4,
        color=COLORS["kept"],
        label="sampler",
    )
    ax.set_xticks(list(xs), [token_label(i) for i in order])
    for tick, i in zip(ax.get_xticklabels(), order, strict=True):
        tick.set_color("black" if bool(view.kept[i]) else COLORS["theory"])
    ax.set_xlabel(f"next token (the {len(order)} most likely under the model; grey label: dropped)")
    ax.set_ylabel("probability")
    ax.set_title(
        f"{view.params.label}: {view.n_kept} kept ({view.kept_mass:.0%} of the mass), "
        f"entropy {view.entropy_before:.2f} → {view.entropy_after:.2f} bits",
        fontsize=10.5,
    )
    if legend:
        ax.legend(loc="upper right")
    return ax


class SamplerExplorer(_Shown):
    """Prompt, temperature, top-k, top-p, min-p and seed -> the next-token distribution and samples.

    Every change calls ``ar_lab.course.views.sampler_view.sampler_view`` (a pure function) and
    redraws. ``view`` holds the last result and ``error`` the last message for invalid input (shown
    in the widget instead of raising), so tests can drive the controls headlessly.
    """

    def __init__(
        self,
        model,
        prompt: str = "The ",
        n_samples: int = 4,
        max_new_tokens: int = 40,
        top: int = 20,
        samplers=None,
    ):
        import ipywidgets as W

        from ar_lab.course.views.sampler_view import named_samplers

        self.model, self.n_samples, self.max_new_tokens, self.top = (
            model,
            n_samples,
            max_new_tokens,
            top,
        )
        self.samplers = named_samplers(samplers)
        style = {"description_width": "90px"}
        box = dict(style=style, layout=W.Layout(width="220px"))
        self.prompt = W.Text(
            value=prompt, description="prompt", continuous_update=False, style=style
        )
        self.temperature = W.FloatText(
            1.0, step=0.05, description="temperature", tooltip=">= 0 (0: greedy)", **box
        )
        self.top_k = W.IntText(0, description="top-k (0 off)", tooltip="a whole number >= 0", **box)
        self.top_p = W.FloatText(1.0, step=0.01, description="top-p", tooltip="in (0, 1]", **box)
        self.min_p = W.FloatText(0.0, step=0.01, description="min-p", tooltip="in [0, 1]", **box)
        self.seed = W.IntText(0, description="seed", style=style, layout=W.Layout(width="200px"))
        self.sampler = W.Dropdown(
            options=list(self.samplers) or ["ar_lab"], description="sampler", style=style
        )
        self.status = W.HTML()
        self.image = W.Image(format="png")
        self.samples = W.HTML()
        self.view = None
        self.error, self.refused = "", None
        controls = [self.prompt, self.temperature, self.top_k, self.top_p, self.min_p, self.seed]
        if self.samplers:
            controls.append(self.sampler)
        for c in controls:
            c.observe(lambda _change: self.update(), names="value")
        self.widget = W.VBox([W.VBox(controls), self.status, self.image, self.samples])
        self.update()

    @property
    def params(self):
        """The ``SamplingParams`` the controls describe (a ValueError naming the control if one is
        out of range)."""
        return sampler_params(
            self.temperature.value, self.top_k.value, self.top_p.value, self.min_p.value
        )

    def update(self) -> None:
        import html

        import matplotlib.pyplot as plt

        from ar_lab.course.views.plots import png_bytes
        from ar_lab.course.views.sampler_view import sampler_view

        try:
            view = sampler_view(
                self.model,
                self.prompt.value,
                self.params,
                seed=check_seed(self.seed.value),
                n_samples=self.n_samples,
                max_new_tokens=self.max_new_tokens,
                sampler=self.samplers.get(self.sampler.value),
            )
        except ValueError as e:
            self.status.value = refuse(self, e)
            return
        self.view, self.error, self.refused = view, "", None
        self.status.value = (
            f"<b>{html.escape(view.params.label)}</b>: {view.n_kept} token(s) can be picked, "
            f"holding {view.kept_mass:.1%} of the model's probability; entropy "
            f"{view.entropy_before:.2f} → {view.entropy_after:.2f} bits"
        )
        fig, ax = plt.subplots(figsize=(8.5, 3.4))
        plot_sampler_view(ax, view, self.top)
        fig.tight_layout()
        self.image.value = png_bytes(fig)
        prompt = html.escape(view.prompt)
        rows = "".join(
            f"<pre style='white-space:pre-wrap;margin:2px 0'><span style='color:#7f8c8d'>{prompt}"
            f"</span><b>{html.escape(text)}</b></pre>"
            for text in view.continuations
        )
        self.samples.value = (
            f"<div>{len(view.continuations)} samples ({html.escape(view.params.label)}, seed "
            f"{view.seed}, picked by {html.escape(self.sampler.value)}):</div>{rows}"
        )


def sampler_params(temperature, top_k, top_p, min_p):
    """The sampler explorer's controls as ``SamplingParams`` (top-k 0: off), each checked with its
    label and range."""
    from ar_lab.engine.sampling import SamplingParams

    k = whole_number("top-k", top_k, 0, hint=" (0 turns it off)", arg="top_k")
    return SamplingParams(
        temperature=finite_number("temperature", temperature),
        top_k=k or None,
        top_p=_fraction("top-p", top_p, open_low=True, arg="top_p"),
        min_p=_fraction("min-p", min_p, open_low=False, arg="min_p"),
    )


def sampler_explorer(
    model, prompt: str = "The ", n_samples: int = 4, max_new_tokens: int = 40, samplers=None
):
    """The chapter-06 explorer (leave it last in a cell); ``samplers``: named token pickers, chosen
    in a drop-down."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise BadType(
            "sampler_explorer needs model to be a GPT (ar_lab.load_pretrained('course')), got "
            f"{model!r}",
            arg="model",
        )
    return SamplerExplorer(model, prompt, n_samples, max_new_tokens, samplers=samplers)


# --- chapter 07: speculative decoding explorer ---------------------------------------


class SpeculationExplorer(_Shown):
    """γ, temperature, draft model and prompt -> measured α, tokens per target call and speedup,
    beside the theory's curves.

    Every change calls ``ar_lab.course.views.speculative_view.speculation_view`` (plain and
    speculative decoding of the same prompt, ``repeats`` runs of each in turns) and redraws; the
    speedup it shows is the median of the runs with their range, since one run of a setting is one
    draw from a spread. ``view`` holds the last result and ``error`` the message for invalid input,
    so tests can drive the controls headlessly.
    """

    def __init__(
        self,
        target,
        drafts: dict,
        prompt: str = "The ",
        gamma: int = 4,
        max_new_tokens: int = 64,
        max_gamma: int = 8,
        repeats: int = 5,
    ):
        import ipywidgets as W

        if not drafts:
            raise BadValue(
                "drafts must name at least one draft model, e.g. {'draft checkpoint': draft}",
                arg="drafts",
            )
        self.target, self.drafts, self.max_new_tokens, self.max_gamma = (
            target,
            dict(drafts),
            max_new_tokens,
            max_gamma,
        )
        self.repeats = whole_number("repeats", repeats, 1)
        style = {"description_width": "90px"}
        box = dict(style=style, layout=W.Layout(width="220px"))
        self.prompt = W.Text(
            value=prompt, description="prompt", continuous_update=False, style=style
        )
        self.gamma = W.IntText(
            gamma, description="γ", tooltip=f"a whole number from 1 to {max_gamma}", **box
        )
        self.temperature = W.FloatText(
            0.0, step=0.05, description="temperature", tooltip=">= 0 (0: greedy)", **box
        )
        self.draft = W.Dropdown(options=list(self.drafts), description="draft", style=style)
        self.seed = W.IntText(0, description="seed", style=style, layout=W.Layout(width="200px"))
        self.status = W.HTML()
        self.image = W.Image(format="png")
        self.text = W.HTML()
        self.view = None
        self.error, self.refused = "", None
        controls = [self.prompt, self.gamma, self.temperature, self.draft, self.seed]
        for c in controls:
            c.observe(lambda _change: self.update(), names="value")
        self.widget = W.VBox(
            [
                W.HBox([W.VBox(controls[:3]), W.VBox(controls[3:])]),
                self.status,
                self.image,
                self.text,
            ]
        )
        self.update()

    def update(self) -> None:
        import html

        import matplotlib.pyplot as plt

        from ar_lab.course.views.plots import png_bytes
        from ar_lab.course.views.speculative_view import speculation_view

        try:
            gamma, sampling, seed = speculation_settings(
                self.gamma.value, self.temperature.value, self.seed.value, self.max_gamma
            )
            view = speculation_view(
                self.target,
                self.drafts[self.draft.value],
                self.prompt.value,
                gamma=gamma,
                sampling=sampling,
                seed=seed,
                max_new_tokens=self.max_new_tokens,
                draft_name=self.draft.value,
                max_gamma=self.max_gamma,
                repeats=self.repeats,
            )
        except ValueError as e:
            self.status.value = refuse(self, e)
            return
        self.view, self.error, self.refused = view, "", None
        s = view.result.stats
        exact = ""
        if view.sampling.greedy:
            exact = " Same tokens as plain greedy decoding: " + (
                "<b>yes</b>" if view.same_tokens else "<b>NO</b>"
            )
        self.status.value = (
            f"<b>{html.escape(view.draft_name)}</b>, γ = {view.gamma}, "
            f"{html.escape(view.sampling.label)}: α = <b>{view.alpha:.2f}</b> ({s.acceptances}/"
            f"{s.tested} tested drafts accepted), <b>{view.tokens_per_target_call:.2f}</b> "
            f"tokens per target call ({s.target_calls} calls for {s.produced} tokens);<br>c = "
            f"{view.cost_ratio:.3f}; speedup measured <b>{view.measured_speedup:.2f}×</b> "
            f"(median of {len(view.speedups)} runs in turns, {view.speedup_range[0]:.2f}× to "
            f"{view.speedup_range[1]:.2f}×; {view.clock_name}), theory "
            f"{view.predicted_speedup:.2f}×.{exact}"
        )
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
        plot_speculation_view(axes, view)
        fig.tight_layout()
        self.image.value = png_bytes(fig)
        self.text.value = speculation_text_html(view)


def speculation_settings(gamma, temperature, seed, max_gamma: int = 8):
    """The speculative explorer's controls as (gamma, ``SamplingParams``, seed), each checked with
    its label."""
    from ar_lab.engine.sampling import SamplingParams

    gamma = whole_number("γ", gamma, 1, max_gamma, arg="gamma")
    return (
        gamma,
        SamplingParams(temperature=finite_number("temperature", temperature)),
        check_seed(seed),
    )


def speculation_explorer(
    target,
    drafts: dict,
    prompt: str = "The ",
    gamma: int = 4,
    max_new_tokens: int = 64,
    *,
    repeats: int = 5,
) -> SpeculationExplorer:
    """Build the chapter-07 explorer (display it by leaving it last in a cell); ``repeats``: runs of
    each side per setting, whose spread it shows."""
    return SpeculationExplorer(target, drafts, prompt, gamma, max_new_tokens, repeats=repeats)
