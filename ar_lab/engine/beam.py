"""Beam search: keep the ``num_beams`` most likely partial texts instead of one.

Greedy decoding commits to the best next token; beam search keeps the best few
partial texts by summed log-probability, so a token that looks second-best now can
still win after the tokens it leads to. Each step of ``beam_search_batch`` is a named
phase: **expand** (every live beam by every token), **select** (per prompt, finished
texts out, the best live extensions in), **prune** (stop a prompt once nothing can beat
its finished texts), then **finish** (rank what is left).

The beams of all prompts form one batch through the model and its KV cache; the
bookkeeping (scores, token lists) lives on the CPU. Likelihood-maximising decoders
fall into repetition loops on open-ended text (chapter 06b measures it with
``ar_lab.engine.sampling.repeated_ngram_fraction``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ar_lab.base.errors import BadValue
from ar_lab.engine.decoder import ForwardDecoder
from ar_lab.engine.prompts import check_eos, loop_model, prompt_batch
from ar_lab.model.cache import KVCache
from ar_lab.model.inference import inference
from ar_lab.model.tokenizer import EOS_ID, decode


@dataclass
class Hypothesis:
    tokens: list[int]  # the new tokens (EOS, when it ended the text, is not included)
    # sum of the log-probabilities of the new tokens, EOS included when it ended the text
    logprob: float
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
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise BadValue(
            f"length must be an int >= 1 (new tokens, EOS included), got {length!r}", arg="length"
        )
    return logprob / (length**length_penalty)


@dataclass
class _Beams:
    """The search state of N prompts x K beams (on the CPU)."""

    seqs: torch.Tensor  # (N, K, t) new tokens so far
    sums: torch.Tensor  # (N, K) summed log-probs; -inf marks a beam that is not live
    finished: list[list[Hypothesis]]  # per prompt, its best finished texts so far (at most K)
    done: list[bool]  # per prompt: nothing live can beat its finished texts any more

    @classmethod
    def start(cls, N: int, K: int) -> _Beams:
        # All K beams of a prompt start as copies of it; only beam 0 is live (the rest -inf),
        # so the first step expands one beam instead of K identical ones.
        sums = torch.full((N, K), float("-inf"), dtype=torch.float64)
        sums[:, 0] = 0.0
        return cls(
            torch.empty(N, K, 0, dtype=torch.long), sums, [[] for _ in range(N)], [False] * N
        )


def _reorder_cache(cache: KVCache, rows: torch.Tensor) -> None:
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
            # advanced indexing copies the sources first: overlap is safe
            t[moved, :, :L] = t[src, :, :L]


def _expand(sums: torch.Tensor, logp: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every live beam extended by every token: the 2K best (score, beam * V + token) per prompt.

    Among the 2K best, at most K end in EOS (one per beam): K live ones remain. A stable
    sort ranks ties by (beam, token id), lowest first, as argmax does.
    """
    N, _, V = logp.shape
    cand = (sums[:, :, None] + logp).view(N, K * V)  # (N, K*V)
    top_scores, top_ids = cand.sort(dim=-1, descending=True, stable=True)
    return top_scores[:, : 2 * K], top_ids[:, : 2 * K]


def _select(beams: _Beams, top_scores, top_ids, t: int, V: int, eos_id, alpha: float) -> tuple:
    """Per prompt, walk its best extensions: one by EOS is a finished text, the others become the K
    live beams. Returns (src, new_tok): the beam each live beam extends and its token, (N, K)."""
    N, K = beams.sums.shape
    src = torch.zeros(N, K, dtype=torch.long)
    new_tok = torch.zeros(N, K, dtype=torch.long)
    new_sums = torch.full((N, K), float("-inf"), dtype=torch.float64)
    for i in range(N):
        if beams.done[i]:
            continue
        live = 0
        for s, j in zip(top_scores[i].tolist(), top_ids[i].tolist(), strict=True):
            if s == float("-inf") or live == K:
                break
            beam, tok = divmod(j, V)
            if eos_id is not None and tok == eos_id:
                toks = beams.seqs[i, beam].tolist()
                beams.finished[i].append(
                    Hypothesis(toks, s, length_normalised(s, t + 1, alpha), "eos")
                )
            else:
                src[i, live], new_tok[i, live], new_sums[i, live] = beam, tok, s
                live += 1
        beams.finished[i] = sorted(beams.finished[i], key=lambda h: -h.score)[:K]
    beams.seqs = torch.cat([beams.seqs[torch.arange(N)[:, None], src], new_tok[:, :, None]], dim=-1)
    beams.sums = new_sums
    return src, new_tok


def _prune(beams: _Beams, t: int, T_new: int, alpha: float) -> None:
    """Mark done every prompt whose live beams can no longer beat its K-th finished text."""
    K = beams.sums.shape[1]
    for i in range(len(beams.done)):
        if beams.done[i] or t == T_new - 1:
            continue
        # Best score a live beam could still reach: its log-prob only falls, so the
        # most favourable length is the longest for alpha > 0, the shortest otherwise.
        bound_len = T_new if alpha > 0 else t + 2
        best_live = float(beams.sums[i].max())
        if best_live == float("-inf") or (
            len(beams.finished[i]) == K
            and beams.finished[i][-1].score >= length_normalised(best_live, bound_len, alpha)
        ):
            beams.done[i] = True
            beams.sums[i] = float("-inf")


def _finish(
    beams: _Beams, idx: torch.Tensor, T_new: int, alpha: float, calls: int, positions: int
) -> list:
    """Each prompt's best K texts: its finished ones and the live beams that ran to the cap."""
    N, K = beams.sums.shape
    results = []
    for i in range(N):
        hyps = list(beams.finished[i])
        if not beams.done[i]:
            for b in range(K):
                s = float(beams.sums[i, b])
                if s > float("-inf"):
                    toks = beams.seqs[i, b].tolist()
                    hyps.append(
                        Hypothesis(toks, s, length_normalised(s, T_new, alpha), "max_new_tokens")
                    )
        hyps = sorted(hyps, key=lambda h: -h.score)[:K]
        results.append(BeamSearchResult(idx[i].tolist(), hyps, calls, positions))
    return results


def beam_search(
    model,
    prompt: str | Sequence[int],
    max_new_tokens: int,
    *,
    num_beams: int = 4,
    length_penalty: float = 1.0,
    eos_id: int | None = EOS_ID,
    use_cache: bool = True,
) -> BeamSearchResult:
    """The ``num_beams`` highest-scoring continuations found by beam search (best first).

    See ``beam_search_batch`` for the rules; this is the one-prompt case.
    """
    return beam_search_batch(
        model,
        [prompt],
        max_new_tokens,
        num_beams=num_beams,
        length_penalty=length_penalty,
        eos_id=eos_id,
        use_cache=use_cache,
    )[0]


def beam_search_batch(
    model,
    prompts: Sequence[str | Sequence[int]],
    max_new_tokens: int,
    *,
    num_beams: int = 4,
    length_penalty: float = 1.0,
    eos_id: int | None = EOS_ID,
    use_cache: bool = True,
) -> list[BeamSearchResult]:
    """Beam search on several equal-length prompts at once (the beams of all prompts form one
    batch).

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
    loop_model(model)
    if not isinstance(num_beams, int) or isinstance(num_beams, bool) or num_beams < 1:
        raise BadValue(f"num_beams must be an int >= 1, got {num_beams!r}", arg="num_beams")
    real = isinstance(length_penalty, numbers.Real) and not isinstance(length_penalty, bool)
    if not real or not math.isfinite(length_penalty):
        raise BadValue(
            f"length_penalty must be a finite number, got {length_penalty!r}", arg="length_penalty"
        )
    V = model.config.vocab_size
    eos_id = check_eos(model, eos_id)
    idx = prompt_batch(model, prompts, max_new_tokens)  # (N, P)
    N, P = idx.shape
    K, T_new, alpha = num_beams, max_new_tokens, float(length_penalty)
    dev = idx.device  # only the model's input moves there
    beams = _Beams.start(N, K)
    cache = KVCache.for_model(model, batch_size=N * K, max_len=P + T_new - 1) if use_cache else None
    calls = positions = 0
    decoder = ForwardDecoder(model)  # N x K rows: through forward
    with inference(model):  # not a generator: one block for the whole search
        x = idx.repeat_interleave(K, dim=0)  # (N*K, P) prompt of each beam
        for t in range(T_new):
            if cache is not None and t > 0:
                # (N*K, V): each beam's newest token
                logits = decoder.step(x[:, 0], cache, P + t - 1)
            else:
                logits = decoder.prefill(x, cache)[:, -1]  # (N*K, V)
            calls += 1
            positions += x.shape[1]
            logp = torch.log_softmax(logits.float(), dim=-1).double().cpu().view(N, K, V)
            top_scores, top_ids = _expand(beams.sums, logp, K)
            src, new_tok = _select(beams, top_scores, top_ids, t, V, eos_id, alpha)
            _prune(beams, t, T_new, alpha)
            if all(beams.done) or t == T_new - 1:
                break
            if cache is not None:
                # (N*K,) row each beam came from
                flat_src = (torch.arange(N)[:, None] * K + src).view(-1)
                _reorder_cache(cache, flat_src.to(dev))
                x = new_tok.view(-1, 1).to(dev)  # (N*K, 1)
            else:
                x = torch.cat(
                    [idx.repeat_interleave(K, dim=0), beams.seqs.view(N * K, -1).to(dev)], dim=1
                )
    return _finish(beams, idx, T_new, alpha, calls, positions)
