"""The autoregressive loop: predict, pick, append, repeat until EOS or the cap.

One loop serves every use: ``stream`` yields text as tokens are produced, and
``generate`` runs the stream to the end and returns the tokens, the text and the
counters. ``use_cache=False`` feeds the whole sequence every step (what a model
without a KV cache must do); ``use_cache=True`` feeds the prompt once (prefill) and
then one token per step (decode).

Counters are instrumentation, not formulas: ``positions_processed`` adds up the
sequence length of every forward call actually made.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ar_lab.cache import KVCache
from ar_lab.lean import engine_for
from ar_lab.sampling import GREEDY, SamplingParams, sample
from ar_lab.tokenizer import EOS_ID, StreamDecoder, encode


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
        return sum(self.decode_times) / len(self.decode_times) if self.decode_times else float("nan")


@dataclass
class StreamEvent:
    token: int  # the token id just produced
    text: str  # the new text it completes ("" while inside a multi-byte character)
    stats: GenerationStats  # counters so far (the same object throughout the stream)
    latency: float = 0.0  # seconds this token took: TTFT for the first, its TPOT after (0 for held-back text)


@dataclass
class Generation:
    prompt: list[int]
    tokens: list[int]  # the new tokens (EOS, when it ended the text, is not included)
    text: str  # the new text (cut before a stop string)
    stats: GenerationStats


def _prompt_ids(prompt: str | Sequence[int]) -> list[int]:
    ids = encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty: give at least one token (e.g. a character of text)")
    return ids


def _check_args(model, prompt: list[int], max_new_tokens: int, stop_strings) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    vocab, window = model.config.vocab_size, model.config.block_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt holds token id {bad[0]}, outside the vocabulary [0, {vocab - 1}]")
    # The last new token is never fed back, so the model sees at most P + N - 1 positions.
    if len(prompt) > window:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens but the context window holds {window}; "
            f"shorten it to at most {window} tokens"
        )
    if len(prompt) + max_new_tokens - 1 > window:
        raise ValueError(
            f"a {len(prompt)}-token prompt plus {max_new_tokens} new tokens needs "
            f"{len(prompt) + max_new_tokens - 1} positions, more than the context window of {window}; "
            f"ask for at most {window - len(prompt) + 1} new tokens"
        )
    if stop_strings is not None and (
        isinstance(stop_strings, str) or not all(isinstance(s, str) and s for s in stop_strings)
    ):
        raise ValueError("stop_strings must be a list of non-empty strings, e.g. ['\\n\\n']")


def _check_cache(cache, use_cache: bool, needed: int) -> None:
    if not use_cache:
        raise ValueError("a cache was given with use_cache=False: pass use_cache=True to reuse it")
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
    if cache.batch_size != 1:
        raise ValueError(f"generation runs one sequence: the cache must have batch size 1, got {cache.batch_size}")
    if cache.max_len < needed:
        raise ValueError(
            f"the cache holds {cache.max_len} positions but this generation needs {needed} "
            "(prompt + new tokens - 1): build it with KVCache.for_model(model, max_len=...)"
        )


def token_steps(
    model,
    prompt: str | Sequence[int],
    max_new_tokens: int,
    use_cache: bool = True,
    sampling: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
    stats: GenerationStats | None = None,
    cache: KVCache | None = None,
    lean: bool = True,
) -> Iterator[int]:
    """Yield new token ids one at a time (no stop rule other than the count).

    The inner loop, kept lean: the token buffer and the cache are allocated once, and with
    a cache each decode step of a ``GPT`` runs through ``ar_lab.lean`` (the same arithmetic
    without nn.Module layers; ``lean=False`` calls ``model.forward`` instead, to compare).
    ``cache``: a cache of your own that already holds the keys/values of the prompt's first
    ``cache.length`` tokens (a shared prefix, the earlier turns of a conversation): only the
    rest of the prompt is prefilled. It is left holding the sequence, for the next call.
    """
    prompt = _prompt_ids(prompt)
    _check_args(model, prompt, max_new_tokens, None)
    stats = GenerationStats() if stats is None else stats
    P, N = len(prompt), max_new_tokens
    buf = torch.empty(1, P + N, dtype=torch.long, device=model.device)  # (1, P + N)
    buf[0, :P] = torch.tensor(prompt)
    skip = 0  # prompt positions whose keys/values the cache already holds
    if cache is not None:
        _check_cache(cache, use_cache, P + N - 1)
        # At least the last prompt token must be fed: its logits give the first new token.
        cache.truncate(min(cache.length, P - 1))
        skip = cache.length
    elif use_cache:
        cache = KVCache.for_model(model, max_len=P + N - 1)
    history = list(prompt) if sampling.repetition_penalty != 1.0 else ()
    # Greedy without a penalty is the argmax of the raw logits: take it directly rather
    # than have sample() build the one-token distribution every step.
    greedy = sampling.greedy and sampling.repetition_penalty == 1.0
    engine = engine_for(model) if (lean and cache is not None) else None
    token = -1  # the token picked by the previous step
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            t_last = time.perf_counter()
            for n in range(N):
                end = P + n  # tokens known so far
                if engine is not None and n > 0:
                    logits = engine.step(token, cache)  # (vocab,): fed the token picked last step
                    fed = 1
                else:
                    x = buf[:, end - 1 : end] if (cache is not None and n > 0) else buf[:, skip:end]
                    logits = model(x, cache)[0, -1]  # (vocab,)
                    fed = x.shape[1]
                token = int(logits.argmax()) if greedy else -1
                if not greedy or not math.isfinite(logits[token]):
                    # A NaN or inf would win the argmax: one look at the winner is enough,
                    # and sample() then raises its explanatory error.
                    token = int(sample(logits, sampling, generator, history))
                stats.forward_calls += 1
                stats.positions_processed += fed
                if engine is None:  # the lean step takes the token itself, not the buffer
                    buf[0, end] = token
                if history != ():
                    history.append(token)
                now = time.perf_counter()  # .item() above has synchronised the device
                if n == 0:
                    stats.prefill_time = now - t_last
                else:
                    stats.decode_times.append(now - t_last)
                yield token
                t_last = time.perf_counter()  # time spent by the consumer is not counted
    finally:
        model.train(was_training)


def stream(
    model,
    prompt: str | Sequence[int],
    max_new_tokens: int = 200,
    use_cache: bool = True,
    sampling: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
    eos_id: int | None = EOS_ID,
    stop_strings: Sequence[str] | None = None,
    stats: GenerationStats | None = None,
    cache: KVCache | None = None,
    lean: bool = True,
) -> Iterator[StreamEvent]:
    """Yield a ``StreamEvent`` per new token; text never splits a UTF-8 character.

    Stops at EOS (unless ``eos_id`` is None), after ``max_new_tokens``, or once the
    text contains one of ``stop_strings`` (text is held back while it could still be
    the start of a stop string, and the stop string itself is never yielded). An event
    with ``token == -1`` carries only such held-back text, released at the end.
    Pass ``stats`` to have the counters filled in an object of your own. Each event's
    ``latency`` is the model time of its token (TTFT for the first, TPOT after), so a
    consumer can plot latency against position as the stream goes. ``cache``: see
    ``token_steps`` (reuse the keys/values of the prompt's start); so is ``lean``.
    """
    prompt = _prompt_ids(prompt)
    _check_args(model, prompt, max_new_tokens, stop_strings)
    stats = GenerationStats() if stats is None else stats
    stats.stop_reason = "max_new_tokens"
    decoder = StreamDecoder()
    stops = list(stop_strings or [])
    hold = max((len(s) for s in stops), default=1) - 1  # chars that might start a stop string
    pending = ""
    steps = token_steps(model, prompt, max_new_tokens, use_cache, sampling, generator, stats, cache, lean)
    first = True
    try:
        for token in steps:
            latency = stats.prefill_time if first else stats.decode_times[-1]
            first = False
            if eos_id is not None and token == eos_id:
                stats.stop_reason = "eos"
                break
            pending += decoder.feed(token) if token < 256 else ""
            hits = [pending.find(s) for s in stops if s in pending]
            if hits:
                stats.stop_reason = "stop_string"
                yield StreamEvent(token, pending[: min(hits)], stats, latency)
                pending = ""
                return
            cut = max(0, len(pending) - hold)
            yield StreamEvent(token, pending[:cut], stats, latency)
            pending = pending[cut:]
    finally:
        steps.close()
    pending += decoder.flush()
    if pending:
        yield StreamEvent(-1, pending, stats)  # held-back text released at the end


def generate(
    model,
    prompt: str | Sequence[int],
    max_new_tokens: int = 200,
    use_cache: bool = True,
    sampling: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
    eos_id: int | None = EOS_ID,
    stop_strings: Sequence[str] | None = None,
    cache: KVCache | None = None,
    lean: bool = True,
) -> Generation:
    """Generate up to ``max_new_tokens`` tokens after ``prompt`` (text or token ids).

    ``cache``: a cache already holding the keys/values of the prompt's first ``cache.length``
    tokens (see ``token_steps``); only the rest is prefilled. ``lean=False``: every decode step
    through ``model.forward`` instead of ``ar_lab.lean`` (same tokens; for comparison).
    """
    prompt_ids = _prompt_ids(prompt)
    tokens, pieces, stats = [], [], GenerationStats()
    events = stream(
        model, prompt_ids, max_new_tokens, use_cache, sampling, generator, eos_id, stop_strings, stats, cache, lean
    )
    for event in events:
        if event.token >= 0:
            tokens.append(event.token)
        pieces.append(event.text)
    return Generation(prompt_ids, tokens, "".join(pieces), stats)
