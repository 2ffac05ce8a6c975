"""From logits to the next token: greedy, temperature, top-k, top-p, min-p, penalties.

The model's forward pass is the same whatever the strategy: a sampler only changes
which token is picked from the logits. ``probabilities`` applies one documented order:

1. **repetition penalty** on the raw logits: every *distinct* token in ``history``
   once (seen twice is penalised once); a positive logit is divided by the penalty, a
   negative one multiplied by it (so both move down for a penalty > 1). ``generate``
   passes prompt + generated tokens, so **the prompt counts**;
2. **temperature**: logits / T. T below ``GREEDY_EPS`` means greedy (argmax, ties to
   the lowest token id), so T = 0 never divides by zero;
3. **truncation**, each on what the previous step left (renormalised):
   top-k (the k largest, plus any tied with the k-th), then top-p (the smallest set
   of most likely tokens whose mass reaches p, including the token that crosses p),
   then min-p (tokens with p >= min_p x p_max, after temperature);
4. **softmax in float32** -> the exact distribution the token is drawn from; then the
   pick (``torch.multinomial`` with an explicit ``torch.Generator``, or argmax).

Every truncation keeps the most likely token, so at least one token always survives,
and no step can produce NaN: logits are shifted by their maximum before dividing by T,
``-inf`` logits (masked tokens) simply get probability 0, and logits that are NaN,
+inf or all -inf raise a ``ValueError`` that says so.

``LogitsPipeline`` is this chain as one object, built once per call and run by every loop that picks
tokens (generate, stream, token_steps, sample_batch, serve, speculative decoding): the greedy
shortcut (the argmax of the raw logits, no distribution built) lives there once.

A sampler of your own (chapter 06's learner writes one) plugs into generate, stream, token_steps,
sample_batch and serve through ``sampler=``: a function ``(logits (vocab,), params, generator) ->
token id`` called once per row and step, instead of ``sample``, on the logits after step 1 (the
loops keep the repetition penalty, which needs the history); ``pick`` is that call, with its answer
checked. Speculative decoding compares distributions, which a sampler does not give, and beam search
has no pick step.

Nothing here runs a model: the loops that do (``generate``, ``sample_batch``, the
explorer's ``sampler_view``) live in ``ar_lab.generate``, beam search in ``ar_lab.engine.beam``.
``repeated_ngram_fraction`` measures what a sampler's choices lead to: the repetition
loops that likelihood-maximising decoders fall into (Holtzman et al., 2020).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ar_lab.base.errors import BadType, BadValue

GREEDY_EPS = 1e-5  # temperatures below this are treated as 0, i.e. greedy (no division by ~0)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _is_id(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a token; the defaults sample from the model's own distribution."""

    temperature: float = 1.0  # 0 (or below GREEDY_EPS): greedy
    top_k: int | None = None  # None: no top-k; k larger than the vocabulary keeps all
    top_p: float = 1.0  # 1.0 keeps everything
    min_p: float = 0.0  # 0.0 keeps everything
    repetition_penalty: float = 1.0  # 1.0: no penalty

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise BadValue(
                f"temperature must be a finite number >= 0 (0 means greedy), got {t!r}",
                arg="temperature",
            )
        k = self.top_k
        if k is not None and (not isinstance(k, numbers.Integral) or isinstance(k, bool) or k < 1):
            raise BadValue(f"top_k must be an int >= 1 or None (no top-k), got {k!r}", arg="top_k")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise BadValue(
                f"top_p must be in (0, 1] (1 keeps everything), got {self.top_p!r}", arg="top_p"
            )
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise BadValue(
                f"min_p must be in [0, 1] (0 keeps everything), got {self.min_p!r}", arg="min_p"
            )
        r = self.repetition_penalty
        if not _is_real(r) or not math.isfinite(r) or r <= 0:
            raise BadValue(
                f"repetition_penalty must be a finite number > 0 (1 means none), got {r!r}",
                arg="repetition_penalty",
            )
        # Plain Python numbers from here on (numpy scalars and the like are accepted above).
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", None if k is None else int(k))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "min_p", float(self.min_p))
        object.__setattr__(self, "repetition_penalty", float(r))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def label(self) -> str:
        """A short description for plots and tables, e.g. 'T=0.8, top-p 0.9'."""
        if self.greedy:
            parts = ["greedy"]
        else:
            parts = [f"T={self.temperature:g}"]
            if self.top_k is not None:
                parts.append(f"top-k {self.top_k}")
            if self.top_p < 1.0:
                parts.append(f"top-p {self.top_p:g}")
            if self.min_p > 0.0:
                parts.append(f"min-p {self.min_p:g}")
        if self.repetition_penalty != 1.0:
            parts.append(f"penalty {self.repetition_penalty:g}")
        return ", ".join(parts)


GREEDY = SamplingParams(temperature=0.0)


# --- the steps, in order -------------------------------------------------------------


def apply_repetition_penalty(
    logits: torch.Tensor, history: Iterable[int] | torch.Tensor, penalty: float
) -> torch.Tensor:
    """Make already-seen tokens less likely: positive logits / penalty, negative x penalty.

    ``history`` is the token ids seen so far (each distinct id is penalised once, however
    often it occurs), or a bool mask of seen ids, shape (vocab,) or (batch, vocab).
    """
    if penalty == 1.0:
        return logits
    if not _is_real(penalty) or not math.isfinite(penalty) or penalty <= 0:
        raise BadValue(
            f"repetition_penalty must be a finite number > 0 (1 means none), got {penalty!r}",
            arg="penalty",
        )
    V = logits.shape[-1]
    if isinstance(history, torch.Tensor) and history.dtype == torch.bool:
        if history.shape[-1] != V:
            raise BadValue(
                f"history mask has {history.shape[-1]} entries, the logits {V}", arg="history"
            )
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        return torch.where(history, penalised, logits)
    if isinstance(history, torch.Tensor):
        if history.dtype.is_floating_point or history.dtype.is_complex:
            raise BadType(
                f"history must hold integer token ids, got a {history.dtype} tensor", arg="history"
            )
        idx = history.flatten().long().unique()  # each distinct id once
        lo, hi = (int(idx[0]), int(idx[-1])) if idx.numel() else (0, 0)
    else:
        ids = set(history)  # each distinct id once
        if not all(_is_id(i) for i in ids):
            bad = next(i for i in ids if not _is_id(i))
            raise BadType(
                f"history must hold integers (token ids), got {bad!r} ({type(bad).__name__})",
                arg="history",
            )
        ids = {int(i) for i in ids}
        if not ids:
            return logits
        lo, hi = min(ids), max(ids)
        idx = torch.from_numpy(np.fromiter(ids, dtype=np.int64, count=len(ids)))
    if idx.numel() == 0:
        return logits
    if lo < 0 or hi >= V:
        raise BadValue(
            f"history holds token id {lo if lo < 0 else hi}, outside the vocabulary [0, {V - 1}]",
            arg="history",
        )
    idx = idx.to(logits.device)
    dim = logits.ndim - 1
    seen = logits.index_select(dim, idx)
    return logits.index_copy(dim, idx, torch.where(seen > 0, seen / penalty, seen * penalty))


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Scale logits by 1/T (after shifting the maximum to 0, so nothing can overflow).

    T below ``GREEDY_EPS`` is greedy: the argmax (first maximum) gets logit 0, every
    other token -inf. Shifting by a constant does not change the softmax.
    """
    if not _is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise BadValue(
            f"temperature must be a finite number >= 0, got {temperature!r}", arg="temperature"
        )
    return _temperature(logits, temperature)


def _temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature < GREEDY_EPS:
        keep = F.one_hot(logits.argmax(dim=-1), logits.shape[-1]).bool()
        return torch.zeros_like(logits).masked_fill(~keep, float("-inf"))
    return (logits - logits.amax(dim=-1, keepdim=True)) / temperature


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits; the rest become -inf.

    k larger than the vocabulary keeps everything. Ties: every token whose logit equals
    the k-th largest is kept too, so more than k tokens survive when the k-th is tied
    (the result does not depend on the order of the vocabulary).
    """
    if not isinstance(k, numbers.Integral) or isinstance(k, bool) or k < 1:
        raise BadValue(f"top_k must be an int >= 1, got {k!r}", arg="k")
    return _top_k(logits, k)


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus: keep the smallest set of most likely tokens whose probability mass reaches p.

    The token whose probability makes the running sum reach or cross p is kept; the most
    likely token is always kept; p = 1 keeps everything. Tokens of equal probability
    are ranked by id (lowest first), so a tie at the boundary is broken deterministically.
    """
    if not _is_real(p) or not 0.0 < p <= 1.0:
        raise BadValue(f"top_p must be in (0, 1], got {p!r}", arg="p")
    return _top_p(logits, p)


def _top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1.0:
        return logits
    probs = torch.softmax(logits.float(), dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    sp = sorted_probs.double()  # the running sum in float64: the boundary is decided exactly
    mass_before = sp.cumsum(dim=-1) - sp  # mass of the strictly more likely tokens
    drop_sorted = mass_before >= p  # the first token has mass_before 0 < p: always kept
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens with probability >= min_p x (probability of the most likely token).

    Decided in log space (p_i / p_max = exp(z_i - z_max)), so tiny probabilities that
    underflow to 0 in float32 are still judged correctly. min_p = 0 keeps everything,
    min_p = 1 keeps only the most likely token(s).
    """
    if not _is_real(min_p) or not 0.0 <= min_p <= 1.0:
        raise BadValue(f"min_p must be in [0, 1], got {min_p!r}", arg="min_p")
    return _min_p(logits, min_p)


def _min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0.0:
        return logits
    threshold = logits.amax(dim=-1, keepdim=True) + math.log(min_p)
    return logits.masked_fill(logits < threshold, float("-inf"))


def logits_error(logits: torch.Tensor, after_penalty: torch.Tensor) -> BadValue:
    if torch.isnan(logits).any():
        return BadValue(
            "logits contain NaN; the model output is broken (check its inputs and weights)",
            arg="logits",
        )
    if torch.isposinf(logits).any():
        return BadValue(
            "logits contain +inf; the model output overflowed (check its dtype and weights)",
            arg="logits",
        )
    if torch.isneginf(logits).all(dim=-1).any():
        return BadValue(
            "every logit is -inf: no token can be picked from these logits", arg="logits"
        )
    return BadValue(
        "the repetition penalty (params.repetition_penalty) made a logit overflow to +inf; use a "
        "penalty closer to 1",
        arg="params",
    )


def processed_logits(
    logits: torch.Tensor,
    params: SamplingParams = SamplingParams(),
    history: Iterable[int] | torch.Tensor = (),
) -> torch.Tensor:
    """Steps 1-3 in float32: the logits the token is drawn from; dropped tokens are -inf.

    ``softmax`` of the result is ``probabilities``; ``result > -inf`` is the kept set.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise BadType(
            f"logits must be a floating-point tensor, got {type(logits).__name__}", arg="logits"
        )
    if logits.ndim not in (1, 2):
        raise BadValue(
            f"logits must have shape (vocab,) or (batch, vocab), got {tuple(logits.shape)}",
            arg="logits",
        )
    if not isinstance(params, SamplingParams):
        raise BadType(f"params must be a SamplingParams, got {type(params).__name__}", arg="params")
    x = apply_repetition_penalty(logits.float(), history, params.repetition_penalty)
    # One check covers NaN (max propagates it), +inf and all -inf; diagnose only on failure.
    if not torch.isfinite(x.amax(dim=-1)).all():
        raise logits_error(logits, x)
    # SamplingParams checked its values when it was made: the steps run unchecked from here.
    # greedy: one finite logit left, which every filter keeps
    x = _temperature(x, params.temperature)
    if params.top_k is not None:
        x = _top_k(x, params.top_k)
    x = _top_p(x, params.top_p)
    return _min_p(x, params.min_p)


def probabilities(
    logits: torch.Tensor,
    params: SamplingParams = SamplingParams(),
    history: Iterable[int] | torch.Tensor = (),
) -> torch.Tensor:
    """The exact float32 distribution a token is drawn from, (vocab,) or (batch, vocab)."""
    return torch.softmax(processed_logits(logits, params, history), dim=-1)


def sample(
    logits: torch.Tensor,
    params: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    history: Iterable[int] | torch.Tensor = (),
) -> torch.Tensor:
    """Pick token ids: shape () for logits (vocab,), (batch,) for (batch, vocab).

    Greedy returns the argmax; otherwise one draw per row from ``probabilities`` using
    ``generator`` (pass a seeded ``torch.Generator`` for reproducible results).
    """
    if generator is not None and not isinstance(generator, torch.Generator):
        raise BadType(
            "generator must be a torch.Generator (e.g. torch.Generator().manual_seed(0)) or "
            f"None, got {generator!r}",
            arg="generator",
        )
    return choose(processed_logits(logits, params, history), params, generator)


def choose(
    x: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """Token ids from processed logits x (vocab,) or (batch, vocab): the argmax when greedy, else
    one draw per row from softmax(x) with ``generator``. The one place a loop's pick depends on
    ``params.greedy``."""
    if params.greedy:
        return x.argmax(dim=-1)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise BadType(
            "generator must be a torch.Generator (e.g. torch.Generator().manual_seed(0)) or "
            f"None, got {generator!r}",
            arg="generator",
        )
    probs = torch.softmax(x, dim=-1)
    drawn = torch.multinomial(on_generator_device(probs, generator), 1, generator=generator).to(
        probs.device
    )
    return drawn[0] if probs.ndim == 1 else drawn.squeeze(-1)


def on_generator_device(t: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``t`` where ``generator`` draws: a seeded ``torch.Generator()`` (on the CPU) then also draws
    for a model on a GPU, the same numbers as beside a model on the CPU, where torch would refuse a
    generator of another device."""
    return t if generator is None or generator.device == t.device else t.to(generator.device)


# A sampler hook: one row of logits (vocab,) in float32, after the repetition penalty; the settings;
# the generator every draw must use -> the token id picked (an int, or a one-element integer
# tensor).
Sampler = Callable[[torch.Tensor, "SamplingParams", "torch.Generator | None"], int]


def check_sampling(sampling, name: str = "sampling") -> None:
    """A ``sampling=`` argument: a ``SamplingParams``."""
    if not isinstance(sampling, SamplingParams):
        raise BadType(f"{name} must be a SamplingParams, got {type(sampling).__name__}", arg=name)


def check_sampler(sampler) -> None:
    """A ``sampler=`` argument: None (the package's ``sample``) or a function as ``Sampler``
    describes."""
    if sampler is not None and not callable(sampler):
        raise BadType(
            "sampler must be a function (logits (vocab,), params, generator) -> token id, e.g. "
            f"ar_lab.engine.sampling.sample, or None; got {type(sampler).__name__}",
            arg="sampler",
        )


def entropy_bits(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in bits along the last axis (0 log 0 counts as 0)."""
    if not isinstance(probs, torch.Tensor):
        raise BadType(
            f"probs must be a tensor of probabilities, got {type(probs).__name__}", arg="probs"
        )
    return torch.special.entr(probs.double()).sum(dim=-1) / math.log(2)


# --- measuring degeneration ----------------------------------------------------------


def repeated_ngram_fraction(tokens: Sequence[int], n: int = 4) -> float:
    """Fraction of the n-grams in ``tokens`` that already occurred earlier in it.

    0 when every n-gram is new; close to 1 for a text stuck in a loop. A sequence shorter
    than n has no n-grams and scores 0.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise BadValue(f"n must be an int >= 1, got {n!r}", arg="n")
    tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    if isinstance(tokens, (str, bytes)) or not all(_is_id(t) for t in tokens):
        raise BadType(
            "tokens must be a list of token ids (ints), e.g. generate(...).tokens; text: "
            "encode(text)",
            arg="tokens",
        )
    tokens = [int(t) for t in tokens]
    total = len(tokens) - n + 1
    if total <= 0:
        return 0.0
    seen, repeats = set(), 0
    for i in range(total):
        gram = tuple(tokens[i : i + n])
        repeats += gram in seen
        seen.add(gram)
    return repeats / total
