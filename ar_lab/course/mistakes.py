"""Named mistakes for the function exercises of chapters 01, 02, 04 and 06: what a classic slip computes.

A test that only says "values differ at index 17" leaves a learner guessing. Each function here
computes, with the exercise's own inputs, what the common wrong versions of the answer return (the
smoothing left out, the pair's indices swapped, the scores not scaled, the last token fed back, ...);
``check_matches(mistakes=...)`` (tensors) and ``check_exact`` (counts, token lists, numbers) name the
mistake a learner's output equals. The GPT's modules have theirs in ``ar_lab.course.model_checks``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ar_lab.course.checks import CheckFailed, check_equal


def _same(got: Any, value: Any) -> bool:
    if isinstance(got, torch.Tensor) or isinstance(value, torch.Tensor):
        got, value = torch.as_tensor(got), torch.as_tensor(value)
        return got.shape == value.shape and bool(torch.allclose(got.double(), value.double(), atol=1e-5, rtol=1e-4))
    if isinstance(got, float) or isinstance(value, float):
        try:
            return math.isclose(float(got), float(value), rel_tol=1e-6, abs_tol=1e-4)
        except (TypeError, ValueError):
            return False
    return got == value


def name_mistake(what: str, got: Any, expected: Any, mistakes: dict[str, Any], hint: str = "") -> None:
    """Fail naming the mistake (``mistakes``: description -> the value it gives) whose value ``got`` equals;
    return quietly when ``got`` equals ``expected`` or no mistake: the exercise's own checker decides then."""
    if _same(got, expected):
        return
    for mistake, value in mistakes.items():
        if not _same(value, expected) and _same(got, value):
            shown = f"a tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else repr(got)
            message = f"{what}: got {shown}, which is what {mistake} gives"
            raise CheckFailed(message + (f"\nHint: {hint}" if hint else ""))


def check_exact(what: str, got: Any, expected: Any, mistakes: dict[str, Any], hint: str = "") -> None:
    """``check_equal``, naming the mistake whose value ``got`` equals (see ``name_mistake``)."""
    name_mistake(what, got, expected, mistakes, hint)
    check_equal(what, got, expected, hint)


# --- chapter 01 ----------------------------------------------------------------------------


@torch.no_grad()
def distribution_mistakes(counts: torch.Tensor, token: int, smoothing: float) -> dict[str, torch.Tensor]:
    """p(next | token) from bigram counts (V, V), computed wrongly."""
    counts = counts.double()
    row, column = counts[token], counts[:, token]
    right = (row + smoothing) / (row + smoothing).sum()
    out = {
        "the column counts[:, token] (what comes before the token) instead of its row": (column + smoothing)
        / (column + smoothing).sum(),
        "smoothing added to the counts but the raw row sum as the divisor": (row + smoothing) / max(row.sum(), 1e-300),
        "dividing by the whole table's sum instead of the row's": (row + smoothing) / (counts + smoothing).sum(),
        "log-probabilities instead of probabilities": right.log(),
    }
    if row.sum() > 0:
        out["no smoothing (a pair never seen gets probability 0)"] = row / row.sum()
    return {k: v.float() for k, v in out.items()}


def sequence_log_prob_mistakes(log_probs: torch.Tensor, tokens: Sequence[int]) -> dict[str, float]:
    """The log-probability of ``tokens`` under a bigram table (V, V), computed wrongly."""
    lp = log_probs.double()
    pairs = list(zip(tokens[:-1], tokens[1:], strict=True))
    if not pairs:
        return {}
    terms = [float(lp[a, b]) for a, b in pairs]
    return {
        "log_probs[current, previous] (the pair's indices swapped)": sum(float(lp[b, a]) for a, b in pairs),
        "the mean over the pairs instead of their sum": sum(terms) / len(terms),
        "the first pair left out": sum(terms[1:]),
        "probabilities (exp of the table) added instead of log-probabilities": sum(math.exp(t) for t in terms),
    }


def generation_mistakes(prompt: Sequence[int], expected: Sequence[int], eos_id: int | None) -> dict[str, list[int]]:
    """What a greedy loop that should return ``expected`` (the new tokens) returns with a classic slip."""
    out = {"returning the prompt with the new tokens": list(prompt) + list(expected)}
    if eos_id is not None:
        out["keeping EOS in the returned tokens"] = list(expected) + [eos_id]
    if expected:
        out["stopping one token early"] = list(expected[:-1])
    return out


# --- chapter 02 ----------------------------------------------------------------------------


@torch.no_grad()
def single_head_mistakes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Attention of queries q (T, d) over keys k and values v (S, d), with a bool mask (T, S) of what each
    query may read (None: everything), computed wrongly."""
    d = q.shape[-1]
    scores = q @ k.T  # (T, S), unscaled

    def read(s: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return s.softmax(dim=dim) @ v

    def masked(s: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        return s if mask is None else s.masked_fill(~mask, fill)

    out = {
        "scores not scaled by 1/√d": read(masked(scores)),
        "scores divided by d instead of √d": read(masked(scores / d)),
        "the softmax over the queries (dim 0) instead of over the keys": read(masked(scores / math.sqrt(d)), dim=0),
    }
    if mask is not None and not bool(mask.all()):
        out["the mask ignored (every query reads every key)"] = read(scores / math.sqrt(d))
        out["masked scores set to 0 instead of -inf (a 0 score still gets weight)"] = read(
            masked(scores / math.sqrt(d), 0.0)
        )
    return out


# --- chapter 04 ----------------------------------------------------------------------------


def positions_mistakes(P: int, N: int, use_cache: bool) -> dict[str, int]:
    """Positions fed to the model to generate N tokens from a P-token prompt, counted wrongly."""
    uncached = sum(P + n for n in range(N))
    if use_cache:
        return {
            "feeding the last new token back too (it is never needed)": P + N,
            "the count without a cache": uncached,
        }
    return {
        "feeding the last new token back too (one step too many)": sum(P + n for n in range(N + 1)),
        "counting each step's tokens after it appends (P + n + 1 at step n)": sum(P + n + 1 for n in range(N)),
        "the count with a cache": P + N - 1,
        "P x N (the prompt alone, every step)": P * N,
    }


# --- chapter 06 ----------------------------------------------------------------------------


@torch.no_grad()
def temperature_mistakes(logits: torch.Tensor, temperature: float) -> dict[str, torch.Tensor]:
    """The distribution at temperature T of logits (vocab,), computed wrongly (T > 0)."""
    if temperature <= 0:
        return {}
    z = logits.double() - logits.double().max()
    return {
        "multiplying the logits by T instead of dividing by it": (z * temperature).softmax(-1).float(),
        "the temperature left out (the plain softmax)": z.softmax(-1).float(),
    }


@torch.no_grad()
def top_p_mistakes(probs: torch.Tensor, p: float) -> dict[str, torch.Tensor]:
    """The bool mask top-p keeps of probs (vocab,), computed wrongly."""
    sorted_probs, order = probs.double().sort(descending=True, stable=True)
    running = sorted_probs.cumsum(-1)

    def unsorted(keep_sorted: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)

    in_order = probs.double().cumsum(-1)
    return {
        "dropping the token that crosses p (the running sum with the token itself compared with p)": unsorted(
            running <= p
        ),
        "the running sum taken in token order instead of from the most likely token": in_order - probs.double() < p,
    }


@torch.no_grad()
def sampler_mistakes(logits: torch.Tensor, params) -> dict[str, torch.Tensor]:
    """The distribution the sampler chain gives for logits (vocab,) and ``params`` (a SamplingParams), with
    the steps in a classic wrong order or a renormalisation left out."""
    from ar_lab.engine.sampling import apply_temperature, filter_min_p, filter_top_k, filter_top_p, probabilities

    if params.greedy:
        return {}
    z = logits.float()

    def temper(x):
        return apply_temperature(x, params.temperature)

    def top_k(x):
        return x if params.top_k is None else filter_top_k(x, params.top_k)

    def top_p(x):
        return filter_top_p(x, params.top_p)

    def min_p(x):
        return filter_min_p(x, params.min_p)

    kept = probabilities(z, params) > 0
    both = (top_p(temper(z)) > float("-inf")) & (top_k(temper(z)) > float("-inf"))
    return {
        "min-p before the temperature (on the untempered distribution)": top_p(top_k(temper(min_p(z)))).softmax(-1),
        "the temperature last (the filters on the untempered logits)": temper(min_p(top_p(top_k(z)))).softmax(-1),
        "top-p on the whole distribution instead of what top-k left": min_p(
            temper(z).masked_fill(~both, float("-inf"))
        ).softmax(-1),
        "the kept probabilities not renormalised (they no longer sum to 1)": temper(z).softmax(-1) * kept,
    }
