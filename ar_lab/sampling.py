"""From logits to the next token: greedy, temperature, top-k, top-p, min-p, penalties, beam search.

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

Beam search (``beam_search``) keeps the ``num_beams`` most likely partial texts
instead of one; ``repeated_ngram_fraction`` measures the repetition loops that
likelihood-maximising decoders fall into (Holtzman et al., 2020).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ar_lab.tokenizer import EOS_ID, decode, encode

GREEDY_EPS = 1e-5  # temperatures below this are treated as 0, i.e. greedy (no division by ~0)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


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
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {t!r}")
        k = self.top_k
        if k is not None and (not isinstance(k, numbers.Integral) or isinstance(k, bool) or k < 1):
            raise ValueError(f"top_k must be an int >= 1 or None (no top-k), got {k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 keeps everything), got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 keeps everything), got {self.min_p!r}")
        r = self.repetition_penalty
        if not _is_real(r) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 means none), got {r!r}")
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
    V = logits.shape[-1]
    if isinstance(history, torch.Tensor) and history.dtype == torch.bool:
        if history.shape[-1] != V:
            raise ValueError(f"history mask has {history.shape[-1]} entries, the logits {V}")
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        return torch.where(history, penalised, logits)
    if isinstance(history, torch.Tensor):
        idx = history.flatten().long().unique()  # each distinct id once
        lo, hi = (int(idx[0]), int(idx[-1])) if idx.numel() else (0, 0)
    else:
        ids = set(map(int, history))  # each distinct id once
        if not ids:
            return logits
        lo, hi = min(ids), max(ids)
        idx = torch.from_numpy(np.fromiter(ids, dtype=np.int64, count=len(ids)))
    if idx.numel() == 0:
        return logits
    if lo < 0 or hi >= V:
        raise ValueError(f"history holds token id {lo if lo < 0 else hi}, outside the vocabulary [0, {V - 1}]")
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
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
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
        raise ValueError(f"top_k must be an int >= 1, got {k!r}")
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
        raise ValueError(f"top_p must be in (0, 1], got {p!r}")
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
        raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
    if min_p <= 0.0:
        return logits
    threshold = logits.amax(dim=-1, keepdim=True) + math.log(min_p)
    return logits.masked_fill(logits < threshold, float("-inf"))


def _bad_logits(logits: torch.Tensor, after_penalty: torch.Tensor) -> ValueError:
    if torch.isnan(logits).any():
        return ValueError("logits contain NaN; the model output is broken (check its inputs and weights)")
    if torch.isposinf(logits).any():
        return ValueError("logits contain +inf; the model output overflowed (check its dtype and weights)")
    if torch.isneginf(logits).all(dim=-1).any():
        return ValueError("every logit is -inf: no token can be picked")
    return ValueError("the repetition penalty made a logit overflow to +inf; use a penalty closer to 1")


def processed_logits(
    logits: torch.Tensor, params: SamplingParams = SamplingParams(), history: Iterable[int] | torch.Tensor = ()
) -> torch.Tensor:
    """Steps 1-3 in float32: the logits the token is drawn from; dropped tokens are -inf.

    ``softmax`` of the result is ``probabilities``; ``result > -inf`` is the kept set.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {type(logits).__name__}")
    if logits.ndim not in (1, 2):
        raise ValueError(f"logits must have shape (vocab,) or (batch, vocab), got {tuple(logits.shape)}")
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    x = apply_repetition_penalty(logits.float(), history, params.repetition_penalty)
    # One check covers NaN (max propagates it), +inf and all -inf; diagnose only on failure.
    if not torch.isfinite(x.amax(dim=-1)).all():
        raise _bad_logits(logits, x)
    x = apply_temperature(x, params.temperature)
    if params.greedy:
        return x  # one token left; every filter keeps the most likely token anyway
    if params.top_k is not None:
        x = filter_top_k(x, params.top_k)
    x = filter_top_p(x, params.top_p)
    return filter_min_p(x, params.min_p)


def probabilities(
    logits: torch.Tensor, params: SamplingParams = SamplingParams(), history: Iterable[int] | torch.Tensor = ()
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
    x = processed_logits(logits, params, history)
    if params.greedy:
        return x.argmax(dim=-1)
    probs = torch.softmax(x, dim=-1)
    if probs.ndim == 1:
        return torch.multinomial(probs, 1, generator=generator)[0]
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def entropy_bits(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in bits along the last axis (0 log 0 counts as 0)."""
    return torch.special.entr(probs.double()).sum(dim=-1) / math.log(2)


# --- sampling many continuations at once ---------------------------------------------


def _prompt_batch(model, prompts, max_new_tokens: int) -> torch.Tensor:
    """Token ids (B, P) for a list of equal-length prompts (text or ids), checked like generate's."""
    from ar_lab.generate import _check_args, _prompt_ids  # late import: generate imports this module

    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts (texts or lists of token ids)")
    ids = [_prompt_ids(p) for p in prompts]
    lengths = sorted({len(p) for p in ids})
    if len(lengths) > 1:
        raise ValueError(
            f"the prompts must all have the same number of tokens (the model has no padding), got lengths {lengths}"
        )
    _check_args(model, ids[0], max_new_tokens, None)
    for p in ids[1:]:
        _check_args(model, p, max_new_tokens, None)
    return torch.tensor(ids, dtype=torch.long, device=model.device)


def sample_batch(
    model,
    prompts: Sequence[str | Sequence[int]],
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    eos_id: int | None = EOS_ID,
    use_cache: bool = True,
) -> list[list[int]]:
    """Continue each of several equal-length prompts at once (one batched forward per step).

    Row i is what ``generate(model, prompts[i], ...)`` would do with the same sampler
    (the repetition penalty sees each row's own prompt and tokens); the random draws of
    all rows come from the one ``generator``. Each list stops before its first EOS.
    """
    from ar_lab.cache import KVCache

    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    idx = _prompt_batch(model, prompts, max_new_tokens)  # (B, P)
    B, P = idx.shape
    N = max_new_tokens
    buf = torch.empty(B, P + N, dtype=torch.long, device=idx.device)  # (B, P + N)
    buf[:, :P] = idx
    cache = KVCache.for_model(model, batch_size=B, max_len=P + N - 1) if use_cache else None
    seen = None
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(B, model.config.vocab_size, dtype=torch.bool, device=idx.device)
        seen.scatter_(1, idx, True)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for n in range(N):
                end = P + n
                x = buf[:, end - 1 : end] if (cache is not None and n > 0) else buf[:, :end]
                logits = model(x, cache)[:, -1]  # (B, vocab)
                token = sample(logits, params, generator, seen if seen is not None else ())  # (B,)
                buf[:, end] = token
                if seen is not None:
                    seen.scatter_(1, token[:, None], True)
    finally:
        model.train(was_training)
    out = []
    for row in buf[:, P:].tolist():
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id)]
        out.append(row)
    return out


# --- what the chapter-06 explorer shows ----------------------------------------------


@dataclass
class SamplerView:
    """One state of the sampler explorer: the distribution before and after, and samples."""

    prompt: str
    params: SamplingParams
    seed: int
    before: torch.Tensor  # (vocab,) the model's own next-token distribution (T = 1, no filters)
    after: torch.Tensor  # (vocab,) the distribution the sampler draws from
    continuations: list[str] = field(default_factory=list)

    @property
    def kept(self) -> torch.Tensor:
        """(vocab,) bool: tokens the sampler can pick."""
        return self.after > 0

    @property
    def n_kept(self) -> int:
        return int(self.kept.sum())

    @property
    def kept_mass(self) -> float:
        """How much of the model's own probability the kept set holds."""
        return float(self.before[self.kept].sum())

    @property
    def entropy_before(self) -> float:
        return float(entropy_bits(self.before))

    @property
    def entropy_after(self) -> float:
        return float(entropy_bits(self.after))


def sampler_view(
    model,
    prompt: str,
    params: SamplingParams,
    seed: int = 0,
    n_samples: int = 4,
    max_new_tokens: int = 40,
) -> SamplerView:
    """Everything the explorer draws for one setting (a pure function of its arguments).

    ``n_samples`` continuations are drawn in one batch from a generator seeded with
    ``seed``, so the same arguments always give the same view.
    """
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("the prompt is empty: type at least one character")
    if not isinstance(n_samples, int) or n_samples < 0:
        raise ValueError(f"n_samples must be an int >= 0, got {n_samples!r}")
    ids = encode(prompt)
    window = model.config.block_size
    ids = ids[-window:]  # a long prompt keeps its end: that is what predicts the next token
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device))[0, -1].float()  # (vocab,)
    history = ids if params.repetition_penalty != 1.0 else ()
    before = torch.softmax(logits, dim=-1)
    after = probabilities(logits, params, history)
    texts = []
    if n_samples and max_new_tokens:
        max_new = min(max_new_tokens, window - len(ids) + 1)
        g = torch.Generator(device=model.device).manual_seed(int(seed))
        rows = sample_batch(model, [ids] * n_samples, max_new, params, g)
        texts = [decode(r) for r in rows]
    return SamplerView(prompt, params, int(seed), before.cpu(), after.cpu(), texts)


# --- measuring degeneration ----------------------------------------------------------


def repeated_ngram_fraction(tokens: Sequence[int], n: int = 4) -> float:
    """Fraction of the n-grams in ``tokens`` that already occurred earlier in it.

    0 when every n-gram is new; close to 1 for a text stuck in a loop. A sequence shorter
    than n has no n-grams and scores 0.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
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


# --- beam search ---------------------------------------------------------------------


@dataclass
class Hypothesis:
    tokens: list[int]  # the new tokens (EOS, when it ended the text, is not included)
    logprob: float  # sum of the log-probabilities of the new tokens, EOS included when it ended the text
    score: float  # logprob / length ** length_penalty, length = new tokens counting EOS
    finished_by: str  # "eos" or "max_new_tokens"

    @property
    def text(self) -> str:
        return decode(self.tokens)


@dataclass
class BeamSearchResult:
    prompt: list[int]
    hypotheses: list[Hypothesis]  # up to num_beams finished texts, best score first
    forward_calls: int = 0
    positions_processed: int = 0

    @property
    def best(self) -> Hypothesis:
        return self.hypotheses[0]

    @property
    def tokens(self) -> list[int]:
        return self.best.tokens

    @property
    def text(self) -> str:
        return self.best.text


def length_normalised(logprob: float, length: int, length_penalty: float) -> float:
    """The beam-search score: logprob / length ** length_penalty.

    length_penalty 0 ranks by plain log-probability (which favours short texts, since
    every token lowers it); 1 ranks by log-probability per token; above 1 favours long texts.
    """
    return logprob / (length**length_penalty)


def _reorder_cache(cache, rows: torch.Tensor) -> None:
    """Make batch row i of every layer's keys/values a copy of row rows[i] (filled part only).

    Only the rows that change are copied: a beam that extends its own parent stays put.
    """
    L = cache.length
    moved = (rows != torch.arange(len(rows), device=rows.device)).nonzero().flatten()
    if moved.numel() == 0:
        return
    src = rows[moved]
    for buffers in (cache.k, cache.v):
        for t in buffers:
            t[moved, :, :L] = t[src, :, :L]  # advanced indexing copies the sources first: overlap is safe


def beam_search(
    model,
    prompt: str | Sequence[int],
    max_new_tokens: int,
    num_beams: int = 4,
    length_penalty: float = 1.0,
    eos_id: int | None = EOS_ID,
    use_cache: bool = True,
) -> BeamSearchResult:
    """The ``num_beams`` highest-scoring continuations found by beam search (best first).

    See ``beam_search_batch`` for the rules; this is the one-prompt case.
    """
    return beam_search_batch(model, [prompt], max_new_tokens, num_beams, length_penalty, eos_id, use_cache)[0]


def beam_search_batch(
    model,
    prompts: Sequence[str | Sequence[int]],
    max_new_tokens: int,
    num_beams: int = 4,
    length_penalty: float = 1.0,
    eos_id: int | None = EOS_ID,
    use_cache: bool = True,
) -> list[BeamSearchResult]:
    """Beam search on several equal-length prompts at once (the beams of all prompts form one batch).

    Each step extends every live beam by every token and keeps, per prompt, the
    ``num_beams`` best extensions by summed log-probability (the model's own
    distribution, T = 1). An extension by ``eos_id`` is a finished text (scored with
    ``length_normalised``, its length counting the EOS) and leaves the beam; live beams
    still running after ``max_new_tokens`` tokens finish there. The best ``num_beams``
    finished texts are returned. A prompt stops early only when no live beam can still
    beat its ``num_beams``-th finished text (log-probabilities only fall, so the bound is
    exact), which never changes the result. With ``num_beams`` >= vocab ** max_new_tokens
    nothing is pruned and the result is the exact best sequence; ``num_beams=1`` is greedy.
    """
    from ar_lab.cache import KVCache

    if not isinstance(num_beams, int) or isinstance(num_beams, bool) or num_beams < 1:
        raise ValueError(f"num_beams must be an int >= 1, got {num_beams!r}")
    if not _is_real(length_penalty) or not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    V = model.config.vocab_size
    if eos_id is not None and not 0 <= eos_id < V:
        raise ValueError(f"eos_id {eos_id} is outside the vocabulary [0, {V - 1}]")
    idx = _prompt_batch(model, prompts, max_new_tokens)  # (N, P)
    Np, P = idx.shape
    K, T_new, alpha = num_beams, max_new_tokens, float(length_penalty)
    dev = idx.device
    # Bookkeeping (scores, token lists) lives on the CPU; only the model's input moves to dev.
    # All K beams of a prompt start as copies of it; only beam 0 is live (the rest -inf),
    # so the first step expands one beam instead of K identical ones.
    seqs = torch.empty(Np, K, 0, dtype=torch.long)  # (N, K, t) new tokens so far
    sums = torch.full((Np, K), float("-inf"), dtype=torch.float64)  # (N, K) summed log-probs
    sums[:, 0] = 0.0
    finished: list[list[Hypothesis]] = [[] for _ in range(Np)]
    done = [False] * Np
    cache = KVCache.for_model(model, batch_size=Np * K, max_len=P + T_new - 1) if use_cache else None
    forward_calls = positions = 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            x = idx.repeat_interleave(K, dim=0)  # (N*K, P) prompt of each beam
            for t in range(T_new):
                logits = model(x, cache)[:, -1]  # (N*K, V)
                forward_calls += 1
                positions += x.shape[1]
                logp = torch.log_softmax(logits.float(), dim=-1).double().cpu().view(Np, K, V)
                cand = (sums[:, :, None] + logp).view(Np, K * V)  # (N, K*V)
                # Among the 2K best, at most K end in EOS (one per beam): K live ones remain.
                # A stable sort ranks ties by (beam, token id), lowest first, as argmax does.
                top_scores, top_ids = cand.sort(dim=-1, descending=True, stable=True)
                top_scores, top_ids = top_scores[:, : 2 * K], top_ids[:, : 2 * K]
                src = torch.zeros(Np, K, dtype=torch.long)
                new_tok = torch.zeros(Np, K, dtype=torch.long)
                new_sums = torch.full((Np, K), float("-inf"), dtype=torch.float64)
                for i in range(Np):
                    if done[i]:
                        continue
                    live = 0
                    for s, j in zip(top_scores[i].tolist(), top_ids[i].tolist(), strict=True):
                        if s == float("-inf") or live == K:
                            break
                        beam, tok = divmod(j, V)
                        if eos_id is not None and tok == eos_id:
                            toks = seqs[i, beam].tolist()
                            finished[i].append(Hypothesis(toks, s, length_normalised(s, t + 1, alpha), "eos"))
                        else:
                            src[i, live], new_tok[i, live], new_sums[i, live] = beam, tok, s
                            live += 1
                    finished[i] = sorted(finished[i], key=lambda h: -h.score)[:K]
                seqs = torch.cat([seqs[torch.arange(Np)[:, None], src], new_tok[:, :, None]], dim=-1)
                sums = new_sums
                for i in range(Np):
                    if done[i] or t == T_new - 1:
                        continue
                    # Best score a live beam could still reach: its log-prob only falls, so the
                    # most favourable length is the longest for alpha > 0, the shortest otherwise.
                    bound_len = T_new if alpha > 0 else t + 2
                    best_live = float(sums[i].max())
                    if best_live == float("-inf") or (
                        len(finished[i]) == K
                        and finished[i][-1].score >= length_normalised(best_live, bound_len, alpha)
                    ):
                        done[i] = True
                        sums[i] = float("-inf")
                if all(done) or t == T_new - 1:
                    break
                if cache is not None:
                    flat_src = (torch.arange(Np)[:, None] * K + src).view(-1)  # (N*K,) row each beam came from
                    _reorder_cache(cache, flat_src.to(dev))
                    x = new_tok.view(-1, 1).to(dev)  # (N*K, 1)
                else:
                    x = torch.cat([idx.repeat_interleave(K, dim=0), seqs.view(Np * K, -1).to(dev)], dim=1)
    finally:
        model.train(was_training)
    results = []
    for i in range(Np):
        hyps = list(finished[i])
        if not done[i]:
            for b in range(K):
                s = float(sums[i, b])
                if s > float("-inf"):
                    hyps.append(
                        Hypothesis(seqs[i, b].tolist(), s, length_normalised(s, T_new, alpha), "max_new_tokens")
                    )
        hyps = sorted(hyps, key=lambda h: -h.score)[:K]
        results.append(BeamSearchResult(idx[i].tolist(), hyps, forward_calls, positions))
    return results
