"""Serving many requests with one model: batched decoding and scheduling (chapter 08).

- **Batched decoding** of sequences of different lengths: a ``BatchKVCache`` gives every
  row its own length, positions and attention mask, so one forward step advances every
  request by one token while reading the weights once.
- **Scheduling**: ``serve`` runs a queue of requests through a fixed number of slots,
  either *static* batching (admit a new batch only when the whole batch is done) or
  *continuous* batching (refill a slot as soon as its request finishes), recording when
  each token of each request appears. ``simulate`` gives the same schedules counted in
  decode steps.
- **Prefix (prompt) caching** lives in ``ar_lab.engine.prefix_cache``: ``serve(..., prefix=...)``
  copies a shared prefix's keys/values into each request, which prefills only the rest.
- **Paged KV memory** (``ar_lab.engine.paged``): ``serve(..., kv="paged")`` keeps the keys and
  values in blocks of one pool, taken as requests grow; with a fixed budget (``num_blocks``), a
  request is admitted only when the pool can hold all of it, and requests sharing a prefix share
  its full blocks.

A new request is prefilled alone (batch 1) straight into its slot (or its blocks), then joins the
running batch. ``serve`` is a loop of one step (``ar_lab.engine.serving.step``: admit, prefill, one
batched decode step, retire), the package's ``serve_step`` or one's own (``serve(..., step=...)``).
The workloads and measurements of chapter 08 are in ``ar_lab.perf.serving_measure``.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from functools import partial

from ar_lab.base.args import check_seed, positive_int
from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.engine.generate import Generation, GenerationStats
from ar_lab.engine.paged import PagedKVCache, blocks_for, check_allocator
from ar_lab.engine.pipeline import LogitsPipeline
from ar_lab.engine.prefix_cache import PrefixCache
from ar_lab.engine.prompts import check_eos, checked_prompt, loop_model
from ar_lab.engine.sampling import GREEDY, Sampler, SamplingParams
from ar_lab.engine.scheduling import POLICIES, policy_function, policy_name
from ar_lab.engine.serving.requests import Request, RequestResult, ServeReport
from ar_lab.engine.serving.step import ServerState, chunked_step, run_step, serve_step
from ar_lab.model.cache import BatchKVCache, KVCache
from ar_lab.model.inference import inference
from ar_lab.model.tokenizer import EOS_ID


def _checked_prompt(
    model, prompt, max_new_tokens: int, where: str, args: dict[str, str]
) -> list[int]:
    """``checked_prompt``; an error about the prompt or the budget is said of ``where``
    (``requests[2]``) and names the caller's argument (``args``: ``"prompt"`` and
    ``"max_new_tokens"`` to the caller's names)."""
    try:
        return checked_prompt(model, prompt, max_new_tokens)
    except (BadType, BadValue) as e:
        if e.arg not in args:
            raise
        raise type(e)(f"{where}: {e}", arg=args[e.arg]) from None


def _check_prefix(prefix, model) -> None:
    if prefix is not None and not isinstance(prefix, PrefixCache):
        raise BadType(
            "prefix must be a PrefixCache(model, prefix_text) or None, got "
            f"{type(prefix).__name__}",
            arg="prefix",
        )
    if prefix is not None:
        prefix.check_model(model, arg="prefix")  # filled by this model, with the weights it has now


def _check_requests(model, requests) -> list[list[int]]:
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence) or not requests:
        raise BadValue("requests must be a non-empty list of Request objects", arg="requests")
    prompts = []
    for i, r in enumerate(requests):
        if not isinstance(r, Request):
            raise BadType(
                f"requests[{i}] must be a Request(prompt, max_new_tokens), got {type(r).__name__}",
                arg="requests",
            )
        at_fault = {"prompt": "requests", "max_new_tokens": "requests"}
        prompts.append(
            _checked_prompt(model, r.prompt, r.max_new_tokens, f"requests[{i}]", at_fault)
        )
        if r.seed is not None:
            check_seed(r.seed, f"requests[{i}].seed", arg="requests")
    return prompts


def _check_schedule(max_batch: int, policy: str) -> None:
    if policy not in POLICIES:
        raise BadValue(f"policy must be one of {POLICIES}, got {policy!r}", arg="policy")
    positive_int("max_batch", max_batch)


KV_LAYOUTS = ("contiguous", "paged")  # how serve lays out the keys and values


def _blocks_needed(prompt: list[int], max_new_tokens: int, prefix, block_size: int) -> int:
    """Blocks a request holds at its longest, beside the prefix's full blocks it shares."""
    shared = prefix.reusable(prompt) // block_size if prefix is not None else 0
    return blocks_for(len(prompt) + max_new_tokens - 1, block_size) - shared


def _check_kv(kv, block_size, num_blocks, allocator, prefix, prompts, requests) -> None:
    """Refuse a paged set-up that cannot run: bad sizes, an allocator without the interface, or a
    request that the whole pool cannot hold (it would wait forever)."""
    if kv not in KV_LAYOUTS:
        raise BadValue(f"kv must be one of {KV_LAYOUTS}, got {kv!r}", arg="kv")
    options = [("block_size", block_size), ("num_blocks", num_blocks), ("allocator", allocator)]
    given = [n for n, v in options if v is not None]
    if kv == "contiguous":
        if given:
            raise BadValue(
                f"{given[0]} is an option of the paged cache: pass kv='paged' with it", arg=given[0]
            )
        return
    if allocator is not None:
        check_allocator(allocator)
        if block_size is not None or num_blocks is not None:
            raise BadValue(
                "give either an allocator or block_size / num_blocks: the allocator has its own",
                arg="block_size" if block_size is not None else "num_blocks",
            )
        block_size, num_blocks = allocator.block_size, allocator.num_blocks
    block_size = positive_int("block_size", 16 if block_size is None else block_size)
    if num_blocks is None:
        return  # sized from the requests: every slot can hold the longest
    num_blocks = positive_int("num_blocks", num_blocks)
    held = blocks_for(len(prefix), block_size) if prefix is not None else 0
    for i, (p, r) in enumerate(zip(prompts, requests, strict=True)):
        need = _blocks_needed(p, r.max_new_tokens, prefix, block_size)
        if held + need > num_blocks:
            raise ContextFull(
                f"requests[{i}] needs {need} blocks of {block_size} positions"
                f"{' beside the prefix' * bool(held)}, but the pool has {num_blocks - held}: "
                "give more num_blocks (or a larger block_size)",
                arg="num_blocks",
            )


# --- the KV memory a server runs on ------------------------------------------------------------
# One protocol, two implementations: the server asks for room, opens a request's slot (its prefill
# writes there), makes it a row or gives it back, frees a finished row, and reads what is reserved
# and used; it never asks which.


class _ContiguousMemory:
    """Every slot reserves room for the longest request (a ``BatchKVCache``); a prefix is copied
    into each slot."""

    def __init__(self, model, slots: int, max_len: int, prefix: PrefixCache | None) -> None:
        self.cache, self.prefix = (
            BatchKVCache.for_model(model, max_batch=slots, max_len=max_len),
            prefix,
        )

    def room(self, j: int) -> bool:
        """Whether request j can be admitted now (a slot is free: the server knows that)."""
        return True

    def open(self, j: int, ids: list[int]) -> tuple[KVCache, int]:
        """A batch-1 view of the next free slot for request j, and how many of its positions the
        prefix filled."""
        self.at = self.cache.rows  # the next free slot: the prefill writes in place
        slot = self.cache.slot(self.at)
        slot.length = 0
        return slot, (self.prefix.copy_into(slot, ids) if self.prefix is not None else 0)

    def join(self, j: int, slot: KVCache) -> int:
        """Make request j's prefilled slot a row of the batch; its row index. Rows that finished
        while its prompt was prefilled in chunks left the next free slot below it: it moves down."""
        cache, n = self.cache, slot.length
        if self.at != cache.rows:
            for buf in cache.k + cache.v:
                buf[cache.rows, :, :n] = buf[self.at, :, :n]
        return cache.add(n)

    def cancel(self, j: int) -> None:
        """Request j was finished by its prefill alone: its slot was never a row."""

    def remove(self, i: int, j: int) -> int | None:
        """Free row i (request j, finished); the index of the row that moved into it, or None."""
        return self.cache.remove(i)

    def usage(self, rows: list[int]) -> tuple[int, int]:
        """(positions set aside, positions holding keys and values) with ``rows`` running."""
        cache = self.cache
        return cache.max_batch * cache.max_len, sum(cache.lengths[: len(rows)])

    def close(self) -> None:
        """Nothing to give back: the buffers go with the cache."""


class _PagedMemory:
    """Keys and values in blocks of one pool (a ``PagedKVCache``), taken as requests grow; a request
    is admitted when all of it fits the pool beside what the running ones may still take, so no
    running request ever waits for a block. Requests share a prefix's full blocks."""

    def __init__(
        self,
        model,
        slots: int,
        max_len: int,
        prefix: PrefixCache | None,
        prompts,
        requests,
        options,
    ) -> None:
        self.cache, self.prefix = PagedKVCache.for_model(model, slots, max_len, **options), prefix
        bs = self.cache.block_size
        self.needs = [
            _blocks_needed(p, r.max_new_tokens, prefix, bs)
            for p, r in zip(prompts, requests, strict=True)
        ]
        self.committed = 0  # blocks the running requests (and the prefix) may hold at their longest
        self.shared: dict[int, int] = {}  # request -> prefix positions it shares (by whole blocks)
        if prefix is not None:
            self.committed = blocks_for(len(prefix), bs)
            self.cache.hold_prefix(prefix.cache.k, prefix.cache.v)

    def room(self, j: int) -> bool:
        return self.committed + self.needs[j] <= self.cache.num_blocks

    def open(self, j: int, ids: list[int]) -> tuple[KVCache, int]:
        reused = self.prefix.reusable(ids) if self.prefix is not None else 0
        self.committed += self.needs[j]
        self.shared[j] = reused // self.cache.block_size * self.cache.block_size
        # (its partly filled block copied)
        return self.cache.slot(self.cache.rows, shared=reused), reused

    def join(self, j: int, slot: KVCache) -> int:
        return self.cache.add(slot.length)

    def cancel(self, j: int) -> None:
        self.cache.drop_pending()  # its blocks go back
        self.committed -= self.needs[j]
        del self.shared[j]

    def remove(self, i: int, j: int) -> int | None:
        self.committed -= self.needs[j]
        del self.shared[j]
        return self.cache.remove(i)

    def usage(self, rows: list[int]) -> tuple[int, int]:
        cache, bs = self.cache, self.cache.block_size
        # held once, shared by reference
        prefix = len(self.prefix) if self.prefix is not None else 0
        used = prefix + sum(cache.lengths[: len(rows)]) - sum(self.shared[j] for j in rows)
        return (cache.num_blocks - cache.allocator.num_free) * bs, used

    def close(self) -> None:
        self.cache.close()  # every block back in the pool


def _server_step(step, chunk, policy) -> Callable[[ServerState], object]:
    """The step ``serve`` runs: one's own, the package's, or the package's with chunked prefill."""
    if chunk is not None:
        chunk = positive_int("chunk", chunk)
        if step is not None:
            raise BadValue("chunk sets the package's step (chunked_step): a step of one's own "
                           "prefills as it chooses (server.prefill_chunk); pass one of them",
                           arg="chunk")
        if policy == "static":
            raise BadValue("chunk: chunked prefill admits requests as rows free up, which a "
                           "static batch does not; use policy='continuous' (or one's own)",
                           arg="chunk")
        return partial(chunked_step, chunk=chunk)
    if step is None:
        return serve_step
    if not callable(step):
        raise BadType(
            f"step must be a function of the server's state (e.g. serve_step), got {step!r}",
            arg="step",
        )
    return step


def serve(
    model,
    requests: Sequence[Request],
    *,
    max_batch: int = 8,
    policy: str = "continuous",
    prefix: PrefixCache | None = None,
    sampling: SamplingParams = GREEDY,
    eos_id: int | None = EOS_ID,
    clock: Callable[[], float] = time.perf_counter,
    kv: str = "contiguous",
    block_size: int | None = None,
    num_blocks: int | None = None,
    allocator=None,
    sampler: Sampler | None = None,
    step: Callable[[ServerState], object] | None = None,
    chunk: int | None = None,
) -> ServeReport:
    """Run ``requests`` (all queued at time 0, served in order) through ``max_batch`` slots.

    ``policy="static"``: a batch of up to ``max_batch`` requests is admitted only when the previous
    batch has completely finished (finished rows stop being computed, but their slots stay empty
    until the whole batch is done). ``"continuous"``: before every decode step, free slots are
    refilled from the queue. Or a function of one's own
    (``ar_lab.engine.scheduling.AdmissionPolicy``), asked before every step. Each admitted request
    is prefilled alone (reusing ``prefix``'s keys/values where its prompt starts with them), which
    gives its first token; then every decode step gives one more token to every row.

    ``kv="contiguous"``: every slot reserves room for the longest request (a ``BatchKVCache``).
    ``kv="paged"``: keys and values live in blocks of ``block_size`` positions (16 by default) taken
    as each request grows (a ``PagedKVCache``); ``num_blocks`` fixes the pool (by default, the
    contiguous cache's memory), and a request then waits, whatever the policy says, until the pool
    can hold all of it beside the running ones; with ``prefix``, requests share its full blocks.
    ``allocator``: an object with ``ar_lab.engine.paged.BlockAllocator``'s interface, empty, that
    the paged cache runs on (its ``block_size`` and ``num_blocks`` size the pool). The tokens are
    the contiguous cache's. ``sampler``: a function that picks each request's token instead of
    ``sample`` (``ar_lab.engine.sampling.Sampler``), called with that request's generator.

    ``chunk``: chunked prefill, at most this many prompt positions per step, after the running rows'
    decode step (``chunked_step``): a long prompt no longer stalls every running request for its
    whole prefill. The tokens are those of unchunked serving; a continuous policy only.

    ``step``: the server's step, a function of a ``ServerState`` (``ar_lab.engine.serving.step``),
    called while requests wait or run; by default ``serve_step``. Chapter 08's learner writes their
    own. After each step the loop checks what it left and raises ``StepError`` for a finished row
    left in the batch, a row without its token, or a step that changed nothing.
    """
    loop_model(model)
    # a name of POLICIES or a function; anything else is refused here
    admit = policy_function(policy)
    max_batch = positive_int("max_batch", max_batch)
    picker = LogitsPipeline(sampling, sampler)  # checks both
    _check_prefix(prefix, model)
    eos_id = check_eos(model, eos_id)  # (an id the model cannot emit would never stop a request)
    if not callable(clock):
        raise BadType(
            f"clock must be a function returning seconds (e.g. time.perf_counter), got {clock!r}",
            arg="clock",
        )
    step = _server_step(step, chunk, policy)
    prompts = _check_requests(model, requests)
    _check_kv(kv, block_size, num_blocks, allocator, prefix, prompts, requests)
    paged = (
        {"block_size": block_size, "num_blocks": num_blocks, "allocator": allocator}
        if kv == "paged"
        else None
    )
    slots = min(max_batch, len(requests))
    max_len = max(len(p) + r.max_new_tokens - 1 for p, r in zip(prompts, requests, strict=True))
    if paged is None:
        memory = _ContiguousMemory(model, slots, max_len, prefix)
    else:
        memory = _PagedMemory(model, slots, max_len, prefix, prompts, requests, paged)
    results = [RequestResult(r, p) for r, p in zip(requests, prompts, strict=True)]
    server = ServerState(
        model, results, memory, slots, policy=admit, picker=picker, eos_id=eos_id, clock=clock
    )
    try:
        with inference(model):
            server.t0 = clock()
            while server.waiting or server.rows or server.prefilling is not None:
                run_step(server, step)
            total = clock() - server.t0
    finally:
        memory.close()  # (paged: every block back in the pool, even when a step raised)
    return ServeReport(
        policy_name(policy), max_batch, results, total, server.step_times, server.step_rows,
        server.prefill_times, kv=kv, kv_reserved=server.kv_reserved, kv_used=server.kv_used,
    )


def generate_batch(
    model,
    prompts: Sequence[str | Sequence[int]],
    max_new_tokens: int | Sequence[int],
    *,
    sampling: SamplingParams = GREEDY,
    seeds: Sequence[int] | None = None,
    eos_id: int | None = EOS_ID,
) -> list[Generation]:
    """Generate for several prompts of any lengths at once; one ``Generation`` per prompt.

    Each prompt is prefilled alone, then all rows decode together (one forward step per
    token for the whole batch). Greedy output is the same as ``generate`` on each prompt
    alone; sampled output too when each prompt's seed seeds its own generator.
    """
    loop_model(model)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise BadValue(
            "prompts must be a non-empty list of prompts (texts or lists of token ids)",
            arg="prompts",
        )
    if (bad_counts := not isinstance(max_new_tokens, (int, Sequence))) or not isinstance(
        seeds, (Sequence, type(None))
    ):
        raise BadValue(
            "give max_new_tokens as an int (or one per prompt) and seeds as None or one int per "
            "prompt",
            arg="max_new_tokens" if bad_counts else "seeds",
        )
    counts = (
        [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    )
    seeds = [None] * len(prompts) if seeds is None else list(seeds)
    if len(counts) != len(prompts) or len(seeds) != len(prompts):
        raise BadValue(
            f"give one max_new_tokens and one seed per prompt ({len(prompts)} prompts): got "
            f"{len(counts)} max_new_tokens and {len(seeds)} seeds",
            arg="max_new_tokens" if len(counts) != len(prompts) else "seeds",
        )
    # said of this call's arguments
    for i, (p, n, s) in enumerate(zip(prompts, counts, seeds, strict=True)):
        _checked_prompt(
            model, p, n, f"prompts[{i}]", {"prompt": "prompts", "max_new_tokens": "max_new_tokens"}
        )
        if s is not None:
            check_seed(s, f"seeds[{i}]")
    requests = [Request(p, n, seed=s) for p, n, s in zip(prompts, counts, seeds, strict=True)]
    report = serve(
        model, requests, max_batch=len(requests), policy="static", sampling=sampling, eos_id=eos_id
    )
    out = []
    for r in report.results:
        times = r.token_times
        stats = GenerationStats(
            forward_calls=len(times),
            positions_processed=len(r.prompt) + len(times) - 1,
            prefill_time=r.prefill_time,
            decode_times=[b - a for a, b in zip(times, times[1:], strict=False)],
            stop_reason=r.stop_reason,
        )
        out.append(Generation(r.prompt, r.tokens, r.text, stats))
    return out


# --- the schedules in decode steps ----------------------------------------------------------


def simulate(steps_needed: Sequence[int], max_batch: int, policy: str = "continuous") -> list[int]:
    """The decode step at which each request finishes, for requests queued in order.

    ``steps_needed[i]``: decode steps request i needs after its prefill (its new tokens
    minus one; 0 means its prefill alone finishes it, and it never takes a slot). Every
    step advances every running request by one. Static: a new batch is admitted only
    when no request is running; continuous: free slots are refilled before every step.
    This is ``serve``'s schedule: ``serve(...).results[i].finish_step`` is the same number. Counted
    by events, not stepped: the time grows with the number of requests, not with their steps.
    """
    _check_schedule(max_batch, policy)
    if not isinstance(steps_needed, Sequence) or isinstance(steps_needed, str):
        raise BadValue(
            f"steps_needed must be a list of ints >= 0 (one per request), got {steps_needed!r}",
            arg="steps_needed",
        )
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in steps_needed):
        raise BadValue(
            f"steps_needed must hold ints >= 0, got {list(steps_needed)}", arg="steps_needed"
        )
    finish, running, step = [], [], 0  # running: the steps at which the requests in slots finish
    for s in steps_needed:  # each request, in order, admitted at the first step with a free slot
        # no free slot: static waits for the whole batch, continuous for one
        if len(running) == max_batch:
            step, running = (
                (max(running), []) if policy == "static" else (heapq.heappop(running), running)
            )
        finish.append(step + s)
        if s:  # 0 steps: its prefill alone finishes it, and it never takes a slot
            heapq.heappush(running, step + s)
    return finish
