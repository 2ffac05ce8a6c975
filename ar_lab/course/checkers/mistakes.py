"""Named mistakes for the function exercises of chapters 00, 01, 02 and 04 to 08: what a classic
slip computes.

A test that only says "values differ at index 17" leaves a learner guessing. Each function here
computes, with the exercise's own inputs, what the common wrong versions of the answer return (the
smoothing left out, the pair's indices swapped, the scores not scaled, the last token fed back,
...); ``check_matches(mistakes=...)`` (tensors) and ``check_exact`` (counts, token lists, numbers)
name the mistake a learner's output equals. The GPT's modules have theirs in
``ar_lab.course.checkers.model_checks``.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from ar_lab.course.checkers.answers import is_whole, require_answer, whole_number
from ar_lab.course.checkers.checks import CheckFailed, check_cases, check_equal


def _same(got: Any, value: Any) -> bool:
    if isinstance(got, torch.Tensor) or isinstance(value, torch.Tensor):
        got, value = torch.as_tensor(got), torch.as_tensor(value)
        return got.shape == value.shape and bool(
            torch.allclose(got.double(), value.double(), atol=1e-5, rtol=1e-4)
        )
    # numbers only: "0.4" or True is not 0.4 or 1.0
    if isinstance(got, float) or isinstance(value, float):
        numbers_both = all(
            isinstance(x, numbers.Real) and not isinstance(x, bool) for x in (got, value)
        )
        return numbers_both and math.isclose(float(got), float(value), rel_tol=1e-6, abs_tol=1e-4)
    return got == value


def name_mistake(
    what: str, got: Any, expected: Any, mistakes: dict[str, Any], hint: str = ""
) -> None:
    """Fail naming the mistake (``mistakes``: description -> the value it gives) whose value ``got``
    equals; return quietly when ``got`` equals ``expected`` or no mistake: the exercise's own
    checker decides then."""
    if _same(got, expected):
        return
    for mistake, value in mistakes.items():
        if not _same(value, expected) and _same(got, value):
            shown = (
                f"a tensor of shape {tuple(got.shape)}"
                if isinstance(got, torch.Tensor)
                else repr(got)
            )
            message = f"{what}: got {shown}, which is what {mistake} gives"
            raise CheckFailed(message + (f"\nHint: {hint}" if hint else ""), mistake)


def check_exact(
    what: str, got: Any, expected: Any, mistakes: dict[str, Any], hint: str = ""
) -> None:
    """``check_equal``, naming the mistake whose value ``got`` equals (see ``name_mistake``). Where
    ``expected`` is an int (a count), ``got`` must be one too: 1000.0, "1000" or True is not read as
    the count (``answers``)."""
    if is_whole(expected):
        whole_number(what, got, hint)
    name_mistake(what, got, expected, mistakes, hint)
    check_equal(what, got, expected, hint)


# --- chapter 00 ----------------------------------------------------------------------------


def token_mistakes(text: str) -> dict[str, Any]:
    """The tokens of ``text`` (its UTF-8 byte values, as a list) computed wrongly."""
    return {
        "the characters' code points (ord) instead of their UTF-8 bytes": [ord(c) for c in text],
        "a bytes object instead of a list of ints": text.encode("utf-8"),
    }


def tokens_per_char_mistakes(text: str) -> dict[str, float]:
    """Tokens (UTF-8 bytes) per character of ``text`` computed wrongly."""
    n_bytes, n_chars = len(text.encode("utf-8")), len(text)
    return {
        "characters per token (the ratio upside down)": n_chars / n_bytes,
        "integer division (//) instead of /": float(n_bytes // n_chars),
        "counting characters as tokens (code points, not UTF-8 bytes)": 1.0,
    }


# --- chapter 01 ----------------------------------------------------------------------------


@torch.no_grad()
def distribution_mistakes(
    counts: torch.Tensor, token: int, smoothing: float
) -> dict[str, torch.Tensor]:
    """p(next | token) from bigram counts (V, V), computed wrongly."""
    counts = counts.double()
    row, column = counts[token], counts[:, token]
    right = (row + smoothing) / (row + smoothing).sum()
    out = {
        "the column counts[:, token] (what comes before the token) instead of its row": (
            column + smoothing
        )
        / (column + smoothing).sum(),
        "smoothing added to the counts but the raw row sum as the divisor": (row + smoothing)
        / max(row.sum(), 1e-300),
        "dividing by the whole table's sum instead of the row's": (row + smoothing)
        / (counts + smoothing).sum(),
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
        "log_probs[current, previous] (the pair's indices swapped)": sum(
            float(lp[b, a]) for a, b in pairs
        ),
        "the mean over the pairs instead of their sum": sum(terms) / len(terms),
        "the first pair left out": sum(terms[1:]),
        "probabilities (exp of the table) added instead of log-probabilities": sum(
            math.exp(t) for t in terms
        ),
    }


def generation_mistakes(
    prompt: Sequence[int], expected: Sequence[int], eos_id: int | None
) -> dict[str, list[int]]:
    """What a greedy loop that should return ``expected`` (the new tokens) returns with a classic
    slip."""
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
    """Attention of queries q (T, d) over keys k and values v (S, d), with a bool mask (T, S) of
    what each query may read (None: everything), computed wrongly."""
    d = q.shape[-1]
    scores = q @ k.T  # (T, S), unscaled

    def read(s: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return s.softmax(dim=dim) @ v

    def masked(s: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        return s if mask is None else s.masked_fill(~mask, fill)

    out = {
        "scores not scaled by 1/√d": read(masked(scores)),
        "scores divided by d instead of √d": read(masked(scores / d)),
        "the softmax over the queries (dim 0) instead of over the keys": read(
            masked(scores / math.sqrt(d)), dim=0
        ),
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
        "counting each step's tokens after it appends (P + n + 1 at step n)": sum(
            P + n + 1 for n in range(N)
        ),
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
        "multiplying the logits by T instead of dividing by it": (z * temperature)
        .softmax(-1)
        .float(),
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
        "dropping the token that crosses p (the running sum with the token itself compared with "
        "p)": unsorted(running <= p),
        "the running sum taken in token order instead of from the most likely token": in_order
        - probs.double()
        < p,
    }


@torch.no_grad()
def sampler_mistakes(logits: torch.Tensor, params) -> dict[str, torch.Tensor]:
    """The distribution the sampler chain gives for logits (vocab,) and ``params`` (a
    SamplingParams), with the steps in a classic wrong order or a renormalisation left out."""
    from ar_lab.engine.sampling import (
        apply_temperature,
        filter_min_p,
        filter_top_k,
        filter_top_p,
        probabilities,
    )

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
        "min-p before the temperature (on the untempered distribution)": top_p(
            top_k(temper(min_p(z)))
        ).softmax(-1),
        "the temperature last (the filters on the untempered logits)": temper(
            min_p(top_p(top_k(z)))
        ).softmax(-1),
        "top-p on the whole distribution instead of what top-k left": min_p(
            temper(z).masked_fill(~both, float("-inf"))
        ).softmax(-1),
        "the kept probabilities not renormalised (they no longer sum to 1)": temper(z).softmax(-1)
        * kept,
    }


def ngram_mistakes(tokens: Sequence[int], n: int) -> dict[str, float]:
    """The fraction of the n-grams of ``tokens`` already seen earlier in them, computed wrongly (a
    mistake giving the same value as another one on these tokens is left out: it could not be told
    apart)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return {}
    counts, short = Counter(grams), grams[:-1]
    found = {
        "counting every copy of a repeated n-gram, its first occurrence included": sum(
            c for c in counts.values() if c > 1
        )
        / len(grams),
        "dividing by the number of tokens instead of the number of n-grams": (
            len(grams) - len(counts)
        )
        / len(tokens),
        "the share of n-grams seen for the first time (1 minus the answer)": len(counts)
        / len(grams),
        "leaving out the last n-gram (range(len(tokens) - n) instead of range(len(tokens) - n + "
        "1))": (len(short) - len(set(short))) / len(short)
        if short
        else 0.0,
    }
    return {m: v for m, v in found.items() if sum(_same(v, w) for w in found.values()) == 1}


def check_ngram_cases(name: str, fn, cases, hint: str = "") -> None:
    """``check_cases`` for the repeated n-gram exercise, naming the classic mistake a wrong fraction
    equals."""
    for args, expected in cases:
        try:
            got = fn(*args)
        except Exception:
            # calls again: says which case raised, and how
            check_cases(name, fn, [(args, expected)], hint=hint)
            raise
        what = f"{name}({', '.join(map(repr, args))})"
        name_mistake(what, got, expected, ngram_mistakes(*args), hint)
        if not _same(got, expected):
            check_equal(what, got, expected, hint)


# --- chapter 07 ----------------------------------------------------------------------------


def accepted_count_mistakes(
    p: torch.Tensor, q: torch.Tensor, drafts: Sequence[int], u: torch.Tensor
) -> dict[str, int]:
    """How many of ``drafts`` one speculative iteration accepts, counted wrongly
    (p: (γ + 1, V), q: (γ, V), u: (γ,) uniforms; draft i passes if u[i] q[i, x] < p[i, x])."""
    passes = [bool(u[i] * q[i, x] < p[i, x]) for i, x in enumerate(drafts)]
    upside_down = [bool(u[i] * p[i, x] < q[i, x]) for i, x in enumerate(drafts)]
    return {
        "counting every draft that passes instead of stopping at the first rejection": sum(passes),
        "the ratio upside down (accepting when u < q(x) / p(x))": next(
            (i for i, ok in enumerate(upside_down) if not ok), len(drafts)
        ),
    }


@torch.no_grad()
def accept_dist_mistakes(p: torch.Tensor, q: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """The distribution an iteration's last token is drawn from after ``n`` accepted drafts (of γ =
    len(q)), computed wrongly: after a rejection, p itself (the classic mistake), the residual
    unnormalised or the wrong way round; after a full accept, the bonus from the wrong row."""
    p, q = p.double(), q.double()
    gamma = q.shape[0]
    if n >= gamma:
        wrong_row = (
            "drawing the bonus token from p[γ - 1] (the last draft's position) instead of p[γ]"
        )
        return {wrong_row: p[gamma - 1].float()}
    residual = (p[n] - q[n]).clamp_min(0.0)
    reverse = (q[n] - p[n]).clamp_min(0.0)
    out = {
        "drawing the replacement from p instead of the residual norm(max(0, p − q)) (the classic "
        "mistake: the tokens the draft over-proposed get their accepted share and a share of p "
        "again)": p[n],
        "the residual max(0, p − q) left unnormalised (it sums to 1 − α, not 1)": residual,
    }
    if reverse.sum() > 0:
        out["the residual the wrong way round, norm(max(0, q − p))"] = reverse / reverse.sum()
    return {k: v.float() for k, v in out.items()}


# The classic slips of one speculative iteration (chapter 07's loop), written as a learner would.
LOOP_SLIPS = {
    "rollback": "forgetting the rollback: without `truncate` the rejected drafts' keys stay in "
    "the caches and the target's next pass reads them",
    "bonus": "dropping the bonus token after a full accept: the target's cache then holds the "
    "whole text, and its next pass feeds the last token again",
    "lag": "feeding the draft only the text's last token: after a full accept it has not read "
    "its own last proposal, so the last token lands where that proposal belongs in the draft's "
    "cache",
}


def slipped_iteration(slip: str):
    """A speculative iteration (``speculative_generate(..., iteration=)``'s signature) with one of
    ``LOOP_SLIPS``: what a learner's loop with that slip does."""
    from ar_lab.engine.accept import draw

    def iteration(target, draft, seq, gamma, accept, probs, generator):
        drafts, qs = [], []
        for _ in range(gamma):
            text = seq + drafts
            fed = (drafts[-1:] or seq[-1:]) if slip == "lag" else text[draft.length :]
            qs.append(probs(draft.feed(fed)[-1], text))
            drafts.append(draw(qs[-1], generator))
        p = probs(target.feed(seq[-1:] + drafts), seq + drafts)
        n, dist = accept(p, qs, drafts)
        if slip != "rollback":
            target.truncate(len(seq) + n)
            draft.truncate(min(draft.length, len(seq) + n))
        return (
            drafts if slip == "bonus" and n == len(drafts) else drafts[:n] + [draw(dist, generator)]
        )

    return iteration


def loop_outcome(target, draft, prompt, max_new_tokens: int, gamma: int, iteration) -> tuple:
    """Greedy ``speculative_generate`` (no EOS stop) with ``iteration``: (tokens, drafts accepted
    per iteration), or ("raised", "TypeName: message") if it raised."""
    from ar_lab.engine.speculative import speculative_generate

    try:
        out = speculative_generate(
            target, draft, prompt, max_new_tokens, gamma, eos_id=None, iteration=iteration
        )
    except Exception as e:  # the learner's loop may fail in any way: the outcome says how
        return "raised", f"{type(e).__name__}: {e}"
    return out.tokens, out.stats.accepted_per_iteration


def check_loop(
    what: str, iteration, target, draft, prompt, max_new_tokens: int, gamma: int
) -> None:
    """Greedy speculative decoding with ``iteration`` against plain greedy decoding
    (``ar_lab.generate``, no EOS stop): the same tokens, and ar_lab's drafts accepted in each
    iteration; a difference names the slip of ``LOOP_SLIPS`` that gives it (``loop_outcome`` of
    each). None, or ar_lab's own iteration, is no answer yet (``answers.require_answer``):
    ``speculative_generate`` would run its own loop."""
    from ar_lab.engine.generate import generate

    require_answer(what, iteration)  # None would run ar_lab's own loop: no answer yet
    got = loop_outcome(target, draft, prompt, max_new_tokens, gamma, iteration)
    if got[0] == "raised" and got[1].startswith("NotImplementedError"):
        raise CheckFailed(
            f"{what}: not implemented yet\nHint: replace `raise NotImplementedError()` with your "
            "code"
        )
    ours = loop_outcome(target, draft, prompt, max_new_tokens, gamma, None)
    want = (generate(target, prompt, max_new_tokens, eos_id=None).tokens, ours[1])
    if got == want:
        return
    slips = {
        LOOP_SLIPS[s]: loop_outcome(
            target, draft, prompt, max_new_tokens, gamma, slipped_iteration(s)
        )
        for s in LOOP_SLIPS
    }
    hint = (
        "each cache must hold at most the text minus its last token when an iteration ends: "
        "truncate both to len(seq) + n, and emit the accepted drafts and one token of the "
        "target's"
    )
    name_mistake(what, got, want, slips, hint)
    if got[0] == "raised":
        raise CheckFailed(f"{what}: your loop raised {got[1]}\nHint: {hint}")
    tokens, accepted = got
    if tokens != want[0]:
        i = next(
            (i for i, (a, b) in enumerate(zip(tokens, want[0], strict=False)) if a != b),
            len(tokens),
        )
        raise CheckFailed(
            f"{what}: your tokens differ from plain greedy decoding's from token {i} on\nHint: "
            f"{hint}"
        )
    raise CheckFailed(
        f"{what}: the same text, but drafts accepted per iteration {accepted[:12]} where "
        f"ar_lab's loop accepts {want[1][:12]}\nHint: the draft's first pass feeds everything "
        "its cache lacks"
    )

def check_raises(name: str, fn, cases, error: type[Exception] = ValueError, hint: str = "") -> None:
    """``fn(*args)`` raises ``error`` for every ``args`` in ``cases`` (arguments the exercise says
    to refuse). Returning a value instead (the check left out) or raising another error fails,
    naming the case."""
    for args in cases:
        what = f"{name}({', '.join(map(repr, args))})"
        tail = f"\nHint: {hint}" if hint else ""
        try:
            got = fn(*args)
        except error:
            continue
        except NotImplementedError:
            raise CheckFailed(
                f"{what}: not implemented yet\nHint: replace `raise NotImplementedError()` with "
                "your code"
            ) from None
        except Exception as e:
            raise CheckFailed(
                f"{what}: your code raised {type(e).__name__}: {e}; expected a {error.__name__}"
                + tail
            ) from e
        raise CheckFailed(
            f"{what}: returned {got!r}; expected a {error.__name__} (the task asks to refuse "
            "these arguments)" + tail
        )


# --- chapter 08 ----------------------------------------------------------------------------


def row_mask_mistakes(lengths: Sequence[int], T: int) -> dict[str, list]:
    """The per-row mask of one batched step, (rows, 1, T, max(lengths) + T) as nested lists,
    computed wrongly."""
    keys = torch.arange(max(lengths) + T)  # (keys,)
    news = torch.arange(T)  # (T,)
    rows = torch.tensor(list(lengths))[:, None]  # (rows, 1)

    # last: (rows, T), the last key each token sees
    def mask(last: torch.Tensor, strict: bool = False) -> list:
        seen = keys < last[:, :, None] if strict else keys <= last[:, :, None]
        return seen[:, None].tolist()

    return {
        "a token that does not see itself (keys < position instead of <=)": mask(
            rows + news, strict=True
        ),
        "a padding position attended: every row at the longest row's length (one length for the "
        "batch)": mask((max(lengths) + news).expand(len(lengths), T)),
        "no causal part among the new tokens (each sees all T new keys of its row)": mask(
            (rows + T - 1).expand(len(lengths), T)
        ),
    }


def admission_mistakes(policy: str, waiting: int, running: int, max_batch: int) -> dict[str, int]:
    """How many requests a ``policy`` ("static" or "continuous") admits in a state, computed
    wrongly."""
    free, idle = max_batch - running, running == 0
    if policy == "static":
        return {
            "admitting into free slots while requests still run (that is continuous batching)": min(
                waiting, free
            ),
            "a whole batch whatever is waiting (max_batch, not capped by the queue)": max_batch
            if idle
            else 0,
        }
    return {
        "every free slot even when fewer requests wait (max_batch - running, not capped by the "
        "queue)": free,
        "waiting for the whole batch to finish (that is static batching)": min(waiting, max_batch)
        if idle
        else 0,
        "one request per step, however many slots are free": min(waiting, free, 1),
    }
