"""What quantization costs in quality: three measures of a model against its full-precision
reference.

- ``bits_per_byte``: the validation loss in bits per byte under the course's one evaluation
  protocol (``ar_lab.model.evaluation.COURSE_EVAL``). Lower is better; a quantized
  model is usually a little above its reference.
- ``greedy_agreement``: how often the model picks the reference's greedy token. Measured
  teacher-forced: both models read the reference's own greedy continuation, and at every
  position we compare their argmax (top-1 agreement). Each position is judged on the same
  text, so one early disagreement does not decide every later one. Beside it, the length of
  the two models' free-running greedy continuations before they first differ.
- ``self_draft_acceptance``: the acceptance rate alpha when the quantized model drafts for the
  full-precision one in speculative decoding (chapter 07): greedy, and sampled at T = 1 (where
  the exact alpha = sum_x min(p, q) is the mean of 1 - total variation). A quantized model is
  a draft that costs fewer bytes per token and agrees with the target almost always.
- ``kv_cache_agreement``: the same two agreement figures for an int8 KV cache
  (``ar_lab.engine.kv_quant``) against a float one, on one model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ar_lab.base.args import check_seed, positive_int
from ar_lab.base.errors import BadType, BadValue
from ar_lab.engine.generate import generate
from ar_lab.engine.kv_quant import Int8KVCache
from ar_lab.engine.prompts import prompt_ids
from ar_lab.engine.sampling import GREEDY, SamplingParams
from ar_lab.engine.speculative import speculative_generate
from ar_lab.model.data import benchmark_prompts
from ar_lab.model.evaluation import COURSE_EVAL, EvalProtocol, evaluate_protocol
from ar_lab.model.gpt import GPT, checked_model
from ar_lab.model.inference import inference
from ar_lab.model.tokenizer import EOS_ID
from ar_lab.perf.roofline import model_or_format


def bits_per_byte(model, protocol: EvalProtocol = COURSE_EVAL) -> float:
    """Validation loss in bits per byte under ``protocol`` (default ``COURSE_EVAL``, the course's
    one protocol: ``ar_lab.model.evaluation``). The tokenizer is byte-level, so a token is a byte;
    bits = nats / ln 2."""
    return evaluate_protocol(model, protocol).bits


def _prompts(prompts) -> list[list[int]]:
    if prompts is None:
        return benchmark_prompts(4)
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
        raise BadValue(
            "prompts must be a non-empty list of prompts (text or token ids)", arg="prompts"
        )
    return [prompt_ids(p) for p in prompts]


def _same_vocabulary(a, b, name_a: str, name_b: str) -> None:
    if a.config.vocab_size != b.config.vocab_size:
        raise BadValue(
            f"{name_a} and {name_b} must share the vocabulary: their token ids would not mean "
            f"the same text ({a.config.vocab_size} vs {b.config.vocab_size} tokens)",
            arg=name_b,
        )


@dataclass(frozen=True)
class GreedyAgreement:
    """Teacher-forced top-1 agreement and free-running first divergence, over several prompts."""

    # share of positions where the model's argmax equals the reference's (teacher-forced)
    top1: float
    # mean number of greedy tokens before the two continuations first differ
    first_divergence: float
    n_tokens: int  # tokens per prompt
    per_prompt_top1: list[float]
    per_prompt_divergence: list[int]


def _argmax_on(model, ids: list[int], n: int, cache=None) -> torch.Tensor:
    """The model's argmax at each of the last ``n`` positions of ``ids`` (what it predicts for
    them), (n,); with ``cache`` (empty), the pass writes its keys/values there and attends over what
    it holds."""
    with inference(model):
        # predicts ids[-n:]
        logits = model(torch.tensor([ids[:-1]], device=model.device), cache)[0, -n:]
    return logits.float().argmax(-1).cpu()


def greedy_agreement(reference, other, prompts=None, n_tokens: int = 32) -> GreedyAgreement:
    """How often ``other`` picks ``reference``'s greedy token (see the module docstring for the
    definitions).

    For each prompt: the reference's greedy continuation of ``n_tokens`` tokens (no EOS stop); both
    models then read prompt + continuation in one forward pass each, and their argmaxes at the
    ``n_tokens`` predicted positions are compared. Separately, ``other``'s own greedy continuation
    is compared with the reference's until the first difference (``n_tokens`` if none). ``prompts``
    default to four prompts from the validation text. ``other`` may be a weight format name
    ("int8"...): ``reference`` stored that way (``ar_lab.perf.roofline.model_or_format``). The two
    models must share the vocabulary (as a speculative draft and its target do).
    """
    positive_int("n_tokens", n_tokens)
    reference = checked_model(reference, "reference")
    other = model_or_format(reference, other, "other")
    _same_vocabulary(reference, other, "reference", "other")
    agree, diverge = [], []
    for ids in _prompts(prompts):
        ref = generate(reference, ids, n_tokens, eos_id=None).tokens
        mine = generate(other, ids, n_tokens, eos_id=None).tokens
        full = ids + ref
        agree.append(
            float(
                (_argmax_on(reference, full, n_tokens) == _argmax_on(other, full, n_tokens))
                .float()
                .mean()
            )
        )
        diverge.append(
            next((i for i, (a, b) in enumerate(zip(ref, mine, strict=True)) if a != b), n_tokens)
        )
    return GreedyAgreement(
        sum(agree) / len(agree), sum(diverge) / len(diverge), n_tokens, agree, diverge
    )


def kv_cache_agreement(model, prompts=None, n_tokens: int = 32) -> GreedyAgreement:
    """``greedy_agreement`` of ``model`` with an ``Int8KVCache`` against the same model with a float
    cache.

    Teacher-forced: one pass over prompt + the float-cache greedy continuation, its keys and values
    written to an int8 cache and attention reading them back (so every position sees quantized keys
    and values); free-running: ``generate`` with ``cache=Int8KVCache...``. ``model`` must be a GPT:
    a model that keeps no keys and values (a ``BigramModel``) would agree trivially.
    """
    positive_int("n_tokens", n_tokens)
    if not isinstance(model, GPT):
        raise BadType(
            "model must be a GPT, whose KV cache is measured (e.g. load_pretrained('course')), "
            f"got {type(model).__name__}",
            arg="model",
        )
    agree, diverge = [], []
    for ids in _prompts(prompts):
        ref = generate(model, ids, n_tokens, eos_id=None).tokens
        cache = Int8KVCache.for_model(model, max_len=len(ids) + n_tokens - 1)
        mine = generate(model, ids, n_tokens, eos_id=None, cache=cache).tokens
        full = ids + ref
        cache.truncate(0)
        int8 = _argmax_on(model, full, n_tokens, cache)
        agree.append(float((_argmax_on(model, full, n_tokens) == int8).float().mean()))
        diverge.append(
            next((i for i, (a, b) in enumerate(zip(ref, mine, strict=True)) if a != b), n_tokens)
        )
    return GreedyAgreement(
        sum(agree) / len(agree), sum(diverge) / len(diverge), n_tokens, agree, diverge
    )


@dataclass(frozen=True)
class DraftAcceptance:
    """Acceptance of a draft's proposals by the target, pooled over prompts
    (``SpeculativeStats``)."""

    greedy: float  # accepted / tested draft tokens, greedy on both sides
    sampled: float  # accepted / tested at T = 1 (coin flips included)
    # mean of sum_x min(p, q) over the tested positions at T = 1 (no coin-flip noise)
    sampled_exact: float
    gamma: int


def self_draft_acceptance(
    target, draft, prompts=None, *, n_tokens: int = 32, gamma: int = 4, seed: int = 0
) -> DraftAcceptance:
    """The acceptance rate when ``draft`` (e.g. a quantized copy of ``target``) drafts for
    ``target``.

    Runs ``speculative_generate`` greedy and at temperature 1 (draws from a generator seeded with
    ``seed``) on each prompt and pools its statistics: alpha = accepted / tested. ``draft`` may be a
    weight format name: ``self_draft_acceptance(m, "int8")`` drafts with the int8 copy of ``m``.
    """
    positive_int("n_tokens", n_tokens)
    positive_int("gamma", gamma)
    check_seed(seed)
    target = checked_model(target, "target")
    draft = model_or_format(target, draft, "draft")
    ids = _prompts(prompts)
    pooled = {}
    for name, sampling in (("greedy", GREEDY), ("sampled", SamplingParams(temperature=1.0))):
        g = torch.Generator(device=target.device).manual_seed(seed)
        accepted = tested = 0
        exact = 0.0
        for p in ids:
            stats = speculative_generate(
                target, draft, p, n_tokens, gamma, sampling=sampling, generator=g, eos_id=None
            ).stats
            accepted, tested, exact = (
                accepted + stats.acceptances,
                tested + stats.tested,
                exact + stats.alpha_sum,
            )
        pooled[name] = (accepted / tested, exact / tested) if tested else (math.nan, math.nan)
    return DraftAcceptance(pooled["greedy"][0], pooled["sampled"][0], pooled["sampled"][1], gamma)


def path_summary(scored: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """(mean over texts of the mean log-probability per token, share of steps where the model's
    favourite token was refused) of ``path_logprobs`` results, one per text."""
    mean_lp = sum(float(lp.mean()) for lp, _ in scored) / len(scored)
    refused = sum(int((~ok).sum()) for _, ok in scored) / sum(len(ok) for _, ok in scored)
    return mean_lp, refused


def path_logprobs(
    model, prompt: Sequence[int], tokens: Sequence[int], grammar=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a text cost the model: for each new token (EOS included if given), its log-probability
    under the model's own distribution (unmasked, T = 1), and whether the model's most likely token
    was one the grammar allowed there (all True without a grammar). One forward pass over prompt +
    tokens; (n,) float and (n,) bool.

    A constrained text with a much lower mean log-probability than free text from the same prompt is
    the forced low-probability path; steps where the model's favourite was refused are where the
    mask overrode it.
    """
    prompt, tokens = list(prompt), list(tokens)
    ids = torch.tensor([prompt + tokens], device=model.device)
    with inference(model):
        # (n, vocab): the logits before each new token
        logits = model(ids[:, :-1])[0, len(prompt) - 1 :].float().cpu()
    logp = torch.log_softmax(logits, dim=-1)
    new = torch.tensor(tokens)
    chosen = logp.gather(1, new[:, None])[:, 0]
    if grammar is None:
        return chosen, torch.ones(len(tokens), dtype=torch.bool)
    state, top_ok = grammar.start(), []
    for i, token in enumerate(tokens):
        top_ok.append(bool(grammar.allowed(state)[int(logits[i].argmax())]))
        if token != EOS_ID:
            state = grammar.advance(state, token)
    return chosen, torch.tensor(top_ok)
