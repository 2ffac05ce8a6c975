"""The autoregressive loop: predict, pick, append, repeat until EOS or the cap.

One loop serves every use: ``token_steps`` yields token ids, ``stream`` turns them into
text as they are produced, and ``generate`` runs the stream to the end and returns the
tokens, the text and the counters. ``use_cache=False`` feeds the whole sequence every
step (what a model without a KV cache must do); ``use_cache=True`` feeds the prompt once
(prefill) and then one token per step (decode). ``sample_batch`` runs the same loop on
several prompts at once, one batched forward per step, and ``sampler_view`` gathers what
the chapter-06 explorer shows (the sampler's distribution and a few continuations). ``constraint=``
masks each step's logits with a grammar before the sampler (``ar_lab.engine.constrained``).

The public functions check their arguments once (``ar_lab.engine.prompts``) and hand checked
token ids to private loops. Each model step runs inside ``inference`` on its own, so a
paused ``stream`` leaves the model in the mode it was in and gradients on.

Counters are instrumentation, not formulas: ``positions_processed`` adds up the
sequence length of every forward call actually made.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.engine.compiled import CompiledDecoder
from ar_lab.engine.constrained import check_constraint, check_constraint_eos, masked_logits
from ar_lab.engine.decoder import Decoder, ForwardDecoder, pick_decoder
from ar_lab.engine.pipeline import LogitsPipeline
from ar_lab.engine.prompts import (
    check_budget,
    check_eos,
    checked_prompt,
    loop_model,
    prompt_batch,
    stop_list,
)
from ar_lab.engine.sampling import GREEDY, Sampler, SamplingParams, check_sampler, check_sampling
from ar_lab.model.cache import KVCache
from ar_lab.model.inference import check_inference_ready, inference
from ar_lab.model.tokenizer import EOS_ID, N_BYTES, StreamDecoder


@dataclass
class GenerationStats:
    forward_calls: int = 0
    positions_processed: int = 0  # sum over forward calls of the tokens fed in
    prefill_time: float = 0.0  # seconds from the start to the first token (TTFT)
    decode_times: list[float] = field(default_factory=list)  # seconds for each later token
    stop_reason: str = ""  # "eos", "max_new_tokens" or "stop_string"

    @property
    def total_time(self) -> float:
        return self.prefill_time + sum(self.decode_times)

    @property
    def tokens(self) -> int:
        return self.forward_calls

    @property
    def mean_tpot(self) -> float:
        """Mean time per output token after the first (decode), in seconds."""
        return (
            sum(self.decode_times) / len(self.decode_times) if self.decode_times else float("nan")
        )


@dataclass
class StreamEvent:
    token: int  # the token id just produced
    text: str  # the new text it completes ("" while inside a multi-byte character)
    stats: GenerationStats  # counters so far (the same object throughout the stream)
    # seconds this token took: TTFT for the first, its TPOT after (0 for held-back text)
    latency: float = 0.0


@dataclass
class Generation:
    prompt: list[int]
    tokens: list[int]  # the new tokens (EOS, when it ended the text, is not included)
    text: str  # the new text (cut before a stop string)
    stats: GenerationStats


# --- checks, once per public call ------------------------------------------------------


def _check_cache(cache, use_cache: bool, ids: list[int], max_new_tokens: int) -> None:
    if not use_cache:
        raise BadValue(
            "a cache was given with use_cache=False: pass use_cache=True to reuse it",
            arg="use_cache",
        )
    if not isinstance(cache, KVCache):
        raise BadType(f"cache must be a KVCache, got {type(cache).__name__}", arg="cache")
    if cache.batch_size != 1:
        raise BadValue(
            "generation runs one sequence: the cache must have batch size 1, got "
            f"{cache.batch_size}",
            arg="cache",
        )
    needed = len(ids) + max_new_tokens - 1
    if cache.max_len < needed:
        raise ContextFull(
            f"the cache holds {cache.max_len} positions but this generation needs {needed} "
            "(prompt + new tokens - 1): build it with KVCache.for_model(model, max_len=...)",
            arg="cache",
        )
    cache.reusable(ids)  # raises if the cache holds positions whose token ids it does not know


def _stats(stats) -> GenerationStats:
    if stats is None:
        return GenerationStats()
    if not isinstance(stats, GenerationStats):
        raise BadType(
            f"stats must be a GenerationStats (or None for a new one), got {type(stats).__name__}",
            arg="stats",
        )
    return stats


@dataclass
class _Plan:
    """One generation, checked: what the loop runs (built once per public call by ``_plan``)."""

    decoder: Decoder
    prompt: list[int]
    max_new_tokens: int
    use_cache: bool
    sampling: SamplingParams
    generator: torch.Generator | None
    cache: KVCache | None
    stats: GenerationStats
    # the settings and the sampler of one's own, checked: the step from logits to a token
    picker: LogitsPipeline
    # a grammar (``ar_lab.engine.constrained``); None: every token allowed
    constraint: object = None


def _check_compile(compile, lean: bool, use_cache: bool) -> None:
    """``compile=True`` compiles the lean engine's cached step: it needs both."""
    if not isinstance(compile, bool):
        raise BadType(f"compile must be True or False, got {compile!r}", arg="compile")
    if compile and not (lean and use_cache):
        raise BadValue(
            "compile=True compiles the lean engine's cached decode step: leave lean=True and "
            "use_cache=True (or compile=False)",
            arg="compile",
        )


def _plan(
    model,
    prompt,
    max_new_tokens: int,
    *,
    use_cache,
    sampling,
    generator,
    stats,
    cache,
    lean,
    sampler=None,
    constraint=None,
    compile=False,
) -> _Plan:
    """Check every option of ``token_steps`` against ``model`` and pick the decoder: the public
    boundary."""
    loop_model(model)  # the model is checked here, once: what follows trusts it
    max_new_tokens = check_budget(max_new_tokens)  # an int from here on (a numpy integer is taken)
    ids = checked_prompt(model, prompt, max_new_tokens)
    picker = LogitsPipeline(sampling, sampler)  # checks both
    if not isinstance(use_cache, bool):
        raise BadType(f"use_cache must be True or False, got {use_cache!r}", arg="use_cache")
    if not isinstance(lean, bool):
        raise BadType(f"lean must be True or False, got {lean!r}", arg="lean")
    _check_compile(compile, lean, use_cache)
    if cache is not None:
        _check_cache(cache, use_cache, ids, max_new_tokens)
    check_constraint(constraint, model.config.vocab_size)
    check_inference_ready(model)
    decoder = CompiledDecoder(model) if compile else pick_decoder(model, lean=lean and use_cache)
    if cache is not None:
        # the cache against the model, here at the call; the decoder remembers it
        decoder.fits(cache)
    stats = _stats(stats)
    return _Plan(
        decoder,
        ids,
        max_new_tokens,
        use_cache,
        sampling,
        generator,
        cache,
        stats,
        picker,
        constraint,
    )


# --- the loops (arguments already checked) ----------------------------------------------


def _steps(plan: _Plan) -> Iterator[int]:
    """``token_steps`` on a checked plan: the loop itself."""
    decoder, prompt, N, sampling, generator, stats = (
        plan.decoder, plan.prompt, plan.max_new_tokens, plan.sampling, plan.generator, plan.stats
    )
    model, P = decoder.model, len(prompt)
    cache, skip = plan.cache, 0  # skip: prompt positions whose keys/values the cache already holds
    if cache is not None:
        # Keep the positions whose recorded token ids are the prompt's start, never its last
        # token (its logits give the first new token); the rest is prefilled again.
        skip = cache.reusable(prompt)
    elif plan.use_cache:
        cache = KVCache.for_model(model, max_len=P + N - 1)
    # (1, P + N): the text so far
    seq = torch.empty(1, P + N, dtype=torch.long, device=model.device)
    seq[0, :P] = torch.tensor(prompt)
    history = list(prompt) if sampling.repetition_penalty != 1.0 else ()
    picker = plan.picker
    token = None  # the token picked by the previous step
    state = plan.constraint.start() if plan.constraint is not None else None
    t_last = time.perf_counter()
    for n in range(N):
        end = P + n  # tokens known so far
        with inference(model):  # per step: nothing is held across the yield below
            if cache is None:  # no cache: the whole sequence, every step
                logits, fed = decoder.prefill(seq[:, :end], None)[0, -1], end
            elif n == 0:  # prefill: the prompt, past what the cache already holds
                logits, fed = decoder.prefill(seq[:, skip:end], cache, skip)[0, -1], end - skip
            else:  # decode: the token picked last step, at the next position
                logits, fed = decoder.step(token, cache, end - 1), 1
            # the grammar's mask, before the sampler chain (which renormalises)
            if state is not None:
                logits = masked_logits(logits, plan.constraint, state, n)
            token = picker.one(logits, generator, history)
        stats.forward_calls += 1
        stats.positions_processed += fed
        if cache is None:  # (with a cache, the next step is fed the token itself)
            seq[0, end] = token
        if history != ():
            history.append(token)
        now = time.perf_counter()  # int() above has synchronised the device
        if n == 0:
            stats.prefill_time = now - t_last
        else:
            stats.decode_times.append(now - t_last)
        yield token
        if state is not None:
            if token == EOS_ID:
                return  # the grammar's text is complete: nothing follows its EOS
            state = plan.constraint.advance(state, token)
        t_last = time.perf_counter()  # time spent by the consumer is not counted


def _events(steps: Iterator[int], stats, eos_id, stops: tuple[str, ...]) -> Iterator[StreamEvent]:
    """``stream`` on checked arguments: token ids -> text, with the stop rules."""
    stats.stop_reason = "max_new_tokens"
    decoder = StreamDecoder()
    hold = max((len(s) for s in stops), default=1) - 1  # chars that might start a stop string
    pending = ""
    first = True
    try:
        for token in steps:
            latency = stats.prefill_time if first else stats.decode_times[-1]
            first = False
            if eos_id is not None and token == eos_id:
                stats.stop_reason = "eos"
                break
            pending += decoder.feed(token) if token < N_BYTES else ""
            hits = [pending.find(s) for s in stops if s in pending]
            if hits:
                stats.stop_reason = "stop_string"
                yield StreamEvent(token, pending[: min(hits)], stats, latency)
                return
            cut = max(0, len(pending) - hold)
            yield StreamEvent(token, pending[:cut], stats, latency)
            pending = pending[cut:]
    finally:
        steps.close()
    pending += decoder.flush()
    if pending:
        yield StreamEvent(-1, pending, stats)  # held-back text released at the end


# --- the public entry points --------------------------------------------------------------


def token_steps(
    model,
    prompt: str | Sequence[int],
    max_new_tokens: int,
    *,
    use_cache: bool = True,
    sampling: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
    stats: GenerationStats | None = None,
    cache: KVCache | None = None,
    lean: bool = True,
    sampler: Sampler | None = None,
    constraint=None,
    compile: bool = False,
) -> Iterator[int]:
    """Yield new token ids one at a time (no stop rule other than the count).

    The inner loop, kept lean: the token buffer and the cache are allocated once, and with a cache
    each decode step of a ``GPT`` runs through ``ar_lab.engine.lean`` (the same arithmetic without
    nn.Module layers; ``lean=False`` calls ``model.forward`` instead, to compare). ``cache``: a
    cache of your own, e.g. from an earlier call (a shared prefix, the earlier turns of a
    conversation): the positions whose recorded token ids (``KVCache.token_ids``) agree with the
    prompt's start are reused, and only the rest of the prompt is prefilled; the cache is left
    holding the sequence, for the next call. A cache holding positions whose ids it does not know is
    refused. ``constraint``: see ``generate`` (the steps end after the EOS it allows). Arguments are
    checked here, before the first token is asked for.
    """
    options = dict(
        use_cache=use_cache,
        sampling=sampling,
        generator=generator,
        stats=stats,
        cache=cache,
        lean=lean,
        sampler=sampler,
        constraint=constraint,
        compile=compile,
    )
    return _steps(_plan(model, prompt, max_new_tokens, **options))


def stream(
    model,
    prompt: str | Sequence[int],
    max_new_tokens: int = 200,
    *,
    use_cache: bool = True,
    sampling: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
    eos_id: int | None = EOS_ID,
    stop_strings: Sequence[str] | None = None,
    stats: GenerationStats | None = None,
    cache: KVCache | None = None,
    lean: bool = True,
    sampler: Sampler | None = None,
    constraint=None,
    compile: bool = False,
) -> Iterator[StreamEvent]:
    """Yield a ``StreamEvent`` per new token; text never splits a UTF-8 character.

    Stops at EOS (unless ``eos_id`` is None), after ``max_new_tokens``, or once the text contains
    one of ``stop_strings`` (a list, tuple or set of non-empty strings; text is held back while it
    could still be the start of a stop string, and the stop string itself is never yielded). An
    event with ``token == -1`` carries only such held-back text, released at the end. Pass ``stats``
    to have the counters filled in an object of your own. Each event's ``latency`` is the model time
    of its token (TTFT for the first, TPOT after), so a consumer can plot latency against position
    as the stream goes. ``cache``: see ``token_steps`` (reuse the keys/values of the prompt's
    start); so is ``lean``; ``constraint``: see ``generate``. Arguments are checked here, before the
    first event is asked for.
    """
    options = dict(
        use_cache=use_cache,
        sampling=sampling,
        generator=generator,
        stats=stats,
        cache=cache,
        lean=lean,
        sampler=sampler,
        constraint=constraint,
        compile=compile,
    )
    return _stream(model, prompt, max_new_tokens, eos_id, stop_strings, options)[1]


def _stream(
    model, prompt, max_new_tokens, eos_id, stop_strings, options: dict
) -> tuple[_Plan, Iterator[StreamEvent]]:
    """``stream``'s checks and its events, with the plan they run (``generate`` reads its prompt and
    stats)."""
    plan = _plan(model, prompt, max_new_tokens, **options)
    stops = stop_list(stop_strings)
    check_eos(model, eos_id)
    check_constraint_eos(plan.constraint, eos_id)  # a constraint needs its EOS to stop
    return plan, _events(_steps(plan), plan.stats, eos_id, stops)


def generate(
    model,
    prompt: str | Sequence[int],
    max_new_tokens: int = 200,
    *,
    use_cache: bool = True,
    sampling: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
    eos_id: int | None = EOS_ID,
    stop_strings: Sequence[str] | None = None,
    cache: KVCache | None = None,
    lean: bool = True,
    sampler: Sampler | None = None,
    constraint=None,
    compile: bool = False,
) -> Generation:
    """Generate up to ``max_new_tokens`` tokens after ``prompt`` (text or token ids).

    ``cache``: a cache from an earlier call (see ``token_steps``): the positions where its token ids
    agree with the prompt's start are reused, only the rest is prefilled. ``lean=False``: every
    decode step through ``model.forward`` instead of ``ar_lab.engine.lean`` (same tokens; for
    comparison). ``compile=True``: the lean step compiled by ``torch.compile``
    (``ar_lab.engine.compiled``: the same tokens, seconds to compile once per model, fewer
    milliseconds per token; ``CompileUnavailable`` where it cannot be built). ``sampler``: a
    function that picks each token instead of ``ar_lab.engine.sampling.sample`` (see ``Sampler``;
    chapter 06). ``constraint``: a grammar
    (``ar_lab.engine.constrained``) whose refused tokens get logit -inf each step, before the
    sampler chain; the text ends at the EOS it allows once complete (stop reason "eos": a whole
    sentence of the grammar) or at the cap (stop reason "max_new_tokens": a valid but possibly
    unfinished prefix).
    """
    options = dict(
        use_cache=use_cache,
        sampling=sampling,
        generator=generator,
        stats=None,
        cache=cache,
        lean=lean,
        sampler=sampler,
        constraint=constraint,
        compile=compile,
    )
    plan, events = _stream(model, prompt, max_new_tokens, eos_id, stop_strings, options)
    tokens, pieces = [], []
    for event in events:
        if event.token >= 0:
            tokens.append(event.token)
        pieces.append(event.text)
    return Generation(plan.prompt, tokens, "".join(pieces), plan.stats)


# --- sampling many continuations at once ---------------------------------------------


def sample_rows(
    model,
    idx: torch.Tensor,
    N: int,
    sampling,
    generator,
    use_cache: bool,
    sampler=None,
    constraint=None,
) -> torch.Tensor:
    """The batched loop on checked prompts ``idx`` (B, P): returns all B x N new tokens
    (``sampler``: see ``pick``; ``constraint``: one grammar state per row, None once the row has
    picked EOS)."""
    B, P = idx.shape
    decoder = ForwardDecoder(model)  # rows of one batch: through forward
    buf = torch.empty(B, P + N, dtype=torch.long, device=idx.device)  # (B, P + N)
    buf[:, :P] = idx
    cache = KVCache.for_model(model, batch_size=B, max_len=P + N - 1) if use_cache else None
    seen = None
    if sampling.repetition_penalty != 1.0:
        seen = torch.zeros(B, model.config.vocab_size, dtype=torch.bool, device=idx.device)
        seen.scatter_(1, idx, True)
    states = [constraint.start()] * B if constraint is not None else None
    picker = LogitsPipeline(sampling, sampler)
    with inference(model):  # not a generator: one block for the whole loop
        for n in range(N):
            end = P + n
            if cache is not None and n > 0:
                logits = decoder.step(buf[:, end - 1], cache, end - 1)  # (B, vocab)
            else:
                logits = decoder.prefill(buf[:, :end], cache)[:, -1]  # (B, vocab)
            history = seen if seen is not None else ()
            if states is not None:
                logits = masked_logits(logits, constraint, states, n)
            # (B,) (a sampler of one's own: called row by row)
            token = picker(logits, generator, history)
            buf[:, end] = token
            if states is not None:
                states = [None if s is None or t == EOS_ID else constraint.advance(s, t)
                          for s, t in zip(states, token.tolist(), strict=True)]
            if seen is not None:
                seen.scatter_(1, token[:, None], True)
    return buf[:, P:]


def sample_batch(
    model,
    prompts: Sequence[str | Sequence[int]],
    max_new_tokens: int,
    *,
    sampling: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    eos_id: int | None = EOS_ID,
    use_cache: bool = True,
    sampler: Sampler | None = None,
    constraint=None,
) -> list[list[int]]:
    """Continue each of several equal-length prompts at once (one batched forward per step).

    Row i is what ``generate(model, prompts[i], ..., sampling=sampling)`` would do (the repetition
    penalty sees each row's own prompt and tokens); the random draws of all rows come from the one
    ``generator``. The default ``sampling`` draws from the model's own distribution (T = 1). Each
    list stops before its first EOS. ``sampler``: a function that picks each row's token instead of
    ``sample`` (called row by row, in order, with the one generator). ``constraint``: see
    ``generate`` (each row keeps its own grammar state).
    """
    loop_model(model)
    check_sampling(sampling)
    check_sampler(sampler)
    check_eos(model, eos_id)
    check_constraint(constraint, model.config.vocab_size)
    check_constraint_eos(constraint, eos_id)
    idx = prompt_batch(model, prompts, max_new_tokens)  # (B, P)
    out = []
    for row in sample_rows(
        model, idx, max_new_tokens, sampling, generator, use_cache, sampler, constraint
    ).tolist():
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id)]
        out.append(row)
    return out


