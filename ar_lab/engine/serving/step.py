"""One step of the server, and the state it works on (chapter 08).

``serve`` is a loop: while requests wait or run, it calls ``step(server)`` once. A step

1. admits requests: the admission policy says how many join now, and each is prefilled alone into
   the next free row (its prefill gives its first token; a request that token finishes takes no
   row);
2. runs one batched decode step: every row's newest token, each at its own position, attending
   through a per-row mask (``ar_lab.model.cache.row_mask``), then picks one token per row;
3. retires the requests that finished: their rows are freed for the next admissions.

``ServerState`` is what a step receives: the queue (``waiting``), the requests in the rows
(``rows``), the KV memory (``cache``), the model, the policy, and a helper for each piece of
mechanics that is not the step's logic (``prefill``, ``decode``, ``pick``, ``record``, ``retire``).
``serve_step`` is the package's step, written against that interface only; a step of one's own (the
learner's, in chapter 08) is passed as ``serve(..., step=...)``. After every step the loop checks
what the step left (``run_step``): a row whose request is finished, a row without its token, or a
step that changed nothing raise ``StepError``.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable
from functools import partial

import torch

from ar_lab.base.errors import ArLabError, BadType, BadValue
from ar_lab.engine.decoder import ForwardDecoder
from ar_lab.engine.scheduling import admitted
from ar_lab.engine.serving.requests import RequestResult
from ar_lab.model.cache import row_mask


class StepError(ArLabError, RuntimeError):
    """A server step left the server in a state the loop cannot go on from (see ``run_step``)."""


def _int(name: str, value) -> int:
    """``value`` as an int (numpy and 0-d torch integers too); else a BadType naming ``name``."""
    try:
        return operator.index(value)
    except TypeError:
        raise BadType(f"{name} must be an int, got {value!r}", arg=name) from None


def _row_list(name: str, value, rows: int) -> list[int]:
    """``value`` as distinct row indices in 0..rows-1; else a BadType or BadValue naming
    ``name``."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise BadType(f"{name} must be a list of row indices (ints), got {value!r}", arg=name)
    try:
        out = [operator.index(i) for i in value]
    except TypeError:
        raise BadType(
            f"{name} must be a list of row indices (ints), got {value!r}", arg=name
        ) from None
    if len(set(out)) != len(out) or any(not 0 <= i < rows for i in out):
        raise BadValue(
            f"{name} must hold distinct rows in 0..{rows - 1} ({rows} rows in use), got {out}",
            arg=name,
        )
    return out


class ServerState:
    """The state of one ``serve`` run, as a step sees it, with the mechanics as helpers.

    ``waiting``: a deque of request indices not admitted yet, in arrival order. ``rows``:
    ``rows[i]`` is the request decoding in row i (rows are packed at the front). ``lengths``:
    positions cached in each row. ``max_batch``: the rows there are. ``policy(waiting, running,
    max_batch)``: how many requests join now (the policy ``serve`` was given, its answer checked).
    ``requests``, ``results``: per request. ``model``, ``cache`` (a ``BatchKVCache`` or
    ``PagedKVCache``): what the helpers run.
    """

    def __init__(
        self,
        model,
        results: list[RequestResult],
        memory,
        slots: int,
        *,
        policy,
        picker,
        eos_id,
        clock,
    ):
        self.model, self.results, self._memory, self.max_batch = model, results, memory, slots
        self.requests = [r.request for r in results]
        self.cache = memory.cache
        self.policy: Callable[[int, int, int], int] = partial(admitted, policy)
        self._picker, self._eos_id, self._clock, self.t0 = picker, eos_id, clock, 0.0
        self.waiting: deque[int] = deque(range(len(results)))
        self.rows: list[int] = []
        self._decoder = ForwardDecoder(model)  # rows at lengths of their own: through forward
        device = model.device
        self._penalised = picker.params.repetition_penalty != 1.0
        self._generators = [
            None
            if r.seed is None or picker.argmax_only
            else torch.Generator(device=device).manual_seed(r.seed)
            for r in self.requests
        ]
        # each row's newest token: the next input
        self._last = torch.zeros(slots, dtype=torch.long, device=device)
        self.steps = 0  # decode steps run
        self.step_times: list[float] = []
        self.step_rows: list[int] = []
        self.prefill_times: list[float] = []
        self.kv_reserved: list[int] = []  # positions of KV memory set aside at each decode step
        self.kv_used: list[int] = []  # positions of it holding keys and values
        self._tokens_given = 0  # tokens recorded so far (a step that adds none makes no progress)
        self._admitted = 0  # requests prefilled so far
        self.finished: set[int] = set()
        self._pending: set[int] = set()  # rows of the running decode step still without their token
        self._step_start = self._now = 0.0
        # [request, its slot, prompt positions cached] while a prompt is prefilled in chunks
        self._partial: list | None = None
        self._positions_prefilled = 0  # prompt positions run so far (a chunk is progress too)

    @property
    def lengths(self) -> list[int]:
        """Positions cached in each row (row i's next token goes at position ``lengths[i]``)."""
        return self.cache.lengths[: len(self.rows)]

    def has_room(self) -> bool:
        """Whether the KV memory can take the next waiting request now (always, with contiguous
        slots)."""
        return bool(self.waiting) and self._memory.room(self.waiting[0])

    @property
    def positions_prefilled(self) -> int:
        """Prompt positions run through the model so far, by every prefill and chunk."""
        return self._positions_prefilled

    @property
    def prefilling(self) -> int | None:
        """The request whose prompt is being prefilled in chunks (``prefill_chunk``), else None."""
        return None if self._partial is None else self._partial[0]

    def prompt_left(self, j: int) -> int:
        """Prompt positions of request ``j`` not prefilled yet (its whole prompt, less what a prefix
        gives, before it starts)."""
        j = _int("j", j)
        if not 0 <= j < len(self.results):
            raise BadValue(f"j must be a request index in 0..{len(self.results) - 1}, got {j}",
                           arg="j")
        if self._partial is not None and self._partial[0] == j:
            return len(self.results[j].prompt) - self._partial[2]
        return 0 if self.results[j].token_times else len(self.results[j].prompt)

    def prefill(self, j: int) -> int:
        """Prefill request ``j`` alone, straight into the next free row, and record its first token
        (returned). It joins ``rows`` unless that token finished it."""
        slot, start = self._open(j)
        return self._finish(j, slot, self._run(j, slot, start, len(self.results[j].prompt)))

    def prefill_chunk(self, j: int, n: int) -> int | None:
        """Run the next ``n`` positions of request ``j``'s prompt (fewer where it ends) into its
        slot, at their own positions: chunked prefill. ``j`` starts (taken from ``waiting``) when no
        prompt is being prefilled, else it must be that one (``prefilling``). Returns the first
        token once the prompt is done (then as ``prefill``), None before."""
        n = _int("n", n)
        if n < 1:
            raise BadValue(f"n must be at least 1 prompt position, got {n}", arg="n")
        if self._partial is None:
            slot, start = self._open(j)
            self._partial = [j, slot, start]
        elif _int("j", j) != self._partial[0]:
            raise BadValue(
                f"j: request {self._partial[0]} is being prefilled (server.prefilling): finish its "
                f"prompt before starting request {j}",
                arg="j",
            )
        j, slot, start = self._partial
        end = min(start + n, len(self.results[j].prompt))
        logits = self._run(j, slot, start, end)
        if end < len(self.results[j].prompt):
            self._partial[2] = end
            return None
        self._partial = None
        return self._finish(j, slot, logits)

    def _open(self, j: int):
        """Check that request ``j`` may start now, open its slot; (slot, positions a prefix
        filled)."""
        j = _int("j", j)
        if not 0 <= j < len(self.results) or self.results[j].token_times or j == self.prefilling:
            raise BadValue(
                f"j must be a request not admitted yet (an index from waiting), got {j!r}", arg="j"
            )
        if self._partial is not None:  # (its slot is the next free row)
            raise BadValue(
                f"j: request {self._partial[0]}'s prompt is being prefilled in chunks: finish it "
                f"(server.prefill_chunk) before admitting request {j}",
                arg="j",
            )
        # (the server is full: no argument of prefill's is at fault)
        if len(self.rows) == self.max_batch:
            raise BadValue(
                f"all {self.max_batch} rows are in use: retire finished requests (server.retire) "
                "before admitting more",
                arg="server",
            )
        if not self._memory.room(j):
            raise BadValue(
                f"the KV memory cannot hold request {j} now: admit only while server.has_room() "
                "is True",
                arg="server",
            )
        res = self.results[j]
        slot, res.reused = self._memory.open(j, res.prompt)
        self._admitted += 1
        res.admitted, res.admitted_step = self._clock() - self.t0, self.steps
        return slot, res.reused

    def _run(self, j: int, slot, start: int, end: int) -> torch.Tensor:
        """Prompt positions ``start`` .. ``end`` - 1 of request ``j`` through the model into
        ``slot``; the last position's logits."""
        res, t = self.results[j], self._clock()
        new = torch.tensor([res.prompt[start:end]], device=self.model.device)
        logits = self._decoder.prefill(new, slot, start)[0, -1]
        res.prefill_time += self._clock() - t
        self._positions_prefilled += end - start
        return logits

    def _finish(self, j: int, slot, logits: torch.Tensor) -> int:
        """Request ``j``'s prompt is in: pick and record its first token; it joins ``rows`` unless
        that token finished it."""
        res = self.results[j]
        token = self._pick(logits, j)
        self.prefill_times.append(res.prefill_time)
        if not self._record(j, token, self._clock() - self.t0):
            self._last[self._memory.join(j, slot)] = token
            self.rows.append(j)
        else:  # done by its prefill alone: its slot was never a row
            self._memory.cancel(j)
        return token

    def decode(self, mask: torch.Tensor) -> torch.Tensor:
        """One batched forward step: every row's newest token, at its own position ``lengths[i]``,
        attending to the keys ``mask`` allows (bool (rows, 1, 1, max(lengths) + 1), as
        ``row_mask(lengths, 1)``: the mask is used as given). Returns the logits (rows, vocab); then
        ``pick`` and ``record`` a token for every row."""
        n = len(self.rows)
        if n == 0:
            raise BadValue(
                "no row is running: prefill a request (server.prefill) before a decode step",
                arg="server",
            )
        if self._pending:
            raise BadValue(
                f"rows {sorted(self._pending)} have no token from the last decode step: record "
                "them first (server.record)",
                arg="server",
            )
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise BadType(
                "mask must be a bool tensor (rows, 1, 1, keys): True where a row may attend, "
                f"got {mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__}",
                arg="mask",
            )
        want = (n, 1, 1, max(self.lengths) + 1)
        if tuple(mask.shape) != want:
            raise BadValue(
                f"mask must have shape (rows, 1, 1, max(lengths) + 1) = {want}, got "
                f"{tuple(mask.shape)}",
                arg="mask",
            )
        reserved, used = self._memory.usage(self.rows)
        self.kv_reserved.append(reserved)
        self.kv_used.append(used)
        self._step_start = self._clock()
        self.steps += 1
        # (rows, vocab)
        logits = self._decoder.step(
            self._last[:n], self.cache, None, mask=mask.to(self._last.device)
        )
        self._pending = set(range(n))
        return logits

    def pick(self, logits: torch.Tensor) -> list[int]:
        """One token per row from the decode step's logits (rows, vocab), by the run's sampling
        settings (each request's own generator), in one call of the logits pipeline for the
        batch."""
        if (
            not isinstance(logits, torch.Tensor)
            or logits.ndim != 2
            or logits.shape[0] != len(self.rows)
        ):
            got = (
                tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            )
            raise BadValue(
                f"logits must be the decode step's (rows, vocab) = ({len(self.rows)}, vocab), "
                f"got {got}",
                arg="logits",
            )
        histories = (
            [self.results[j].prompt + self.results[j].tokens for j in self.rows]
            if self._penalised
            else None
        )
        return self._picker.rows(logits, [self._generators[j] for j in self.rows], histories)

    def record(self, i: int, token: int) -> bool:
        """Give row ``i``'s request its new ``token`` from this step (it is the row's next input);
        True when that finished the request (the end-of-sequence token, or its ``max_new_tokens``):
        then ``retire`` its row."""
        i, token = _int("i", i), _int("token", token)
        if i not in self._pending:
            raise BadValue(f"i must be a row waiting for its token from this decode step "
                           f"({sorted(self._pending)}), got {i}", arg="i")
        if len(self._pending) == len(self.rows):  # the step's first token: its tokens appear now
            self._now = self._clock()
        self._pending.discard(i)
        if not self._pending:  # every row has its token: the step is over
            self.step_times.append(self._now - self._step_start)
            self.step_rows.append(len(self.rows))
        self._last[i] = token
        return self._record(self.rows[i], token, self._now - self.t0)

    def retire(self, done: list[int]) -> None:
        """Free the rows ``done`` (row indices), whose requests finished; the rows left stay packed
        at the front (a freed row takes the last row's request), so row indices change: take them
        from this step only."""
        done = _row_list("done", done, len(self.rows))
        early = [i for i in done if self.rows[i] not in self.finished]
        if early:
            raise BadValue(
                f"done: row {early[0]}'s request (requests[{self.rows[early[0]]}]) is not "
                "finished: retire only the rows whose record(...) returned True",
                arg="done",
            )
        # highest first: the row moved into i is never a retired one
        for i in sorted(done, reverse=True):
            moved = self._memory.remove(i, self.rows[i])
            if moved is not None:
                self._last[i] = self._last[moved]
            self.rows[i] = self.rows[-1]
            self.rows.pop()

    def _pick(self, logits: torch.Tensor, j: int) -> int:
        """Request j's next token from its logits (vocab,)."""
        res = self.results[j]
        history = res.prompt + res.tokens if self._penalised else ()
        return self._picker.one(logits, self._generators[j], history)

    def _record(self, j: int, token: int, now: float) -> bool:
        """Add request j's new token at ``now``; True when the request is finished."""
        res = self.results[j]
        res.token_times.append(now)
        self._tokens_given += 1
        if self._eos_id is not None and token == self._eos_id:
            res.stop_reason = "eos"
        else:
            res.tokens.append(token)
            if len(res.token_times) == res.request.max_new_tokens:
                res.stop_reason = "max_new_tokens"
        if res.stop_reason:
            res.finish_step = self.steps
            self.finished.add(j)
        return bool(res.stop_reason)


def serve_step(server: ServerState, *, mask: Callable = row_mask) -> None:
    """The package's server step (``serve``'s default): admit what the policy says, prefill each new
    request into a free row, one batched decode step over the rows through the per-row mask, retire
    what finished.

    ``mask``: the function ``(lengths, T) -> bool (rows, 1, T, max(lengths) + T)`` the decode step
    attends through (``row_mask``; a test passes a wrong one to see what it changes)."""
    # a request its prefill alone finishes takes no row: the next one is admitted in its place
    if server.waiting:
        goal = len(server.rows) + server.policy(
            len(server.waiting), len(server.rows), server.max_batch
        )
        while server.waiting and len(server.rows) < goal and server.has_room():
            server.prefill(server.waiting.popleft())
    if server.rows:
        tokens = server.pick(server.decode(mask(server.lengths, 1)))
        server.retire([i for i, t in enumerate(tokens) if server.record(i, t)])


def chunked_step(server: ServerState, chunk: int, *, mask: Callable = row_mask) -> None:
    """The package's server step with chunked prefill (``serve(chunk=...)``): one batched decode
    step for the running rows first, then at most ``chunk`` prompt positions, continuing the prompt
    being prefilled and starting waiting requests (as the policy admits them) with what is left. A
    long prompt then costs each running request at most ``chunk`` positions of delay per token,
    where ``serve_step`` runs all of it between two of their tokens."""
    if server.rows:
        tokens = server.pick(server.decode(mask(server.lengths, 1)))
        server.retire([i for i, t in enumerate(tokens) if server.record(i, t)])
    running = len(server.rows) + (server.prefilling is not None)
    goal = running + (
        server.policy(len(server.waiting), running, server.max_batch) if server.waiting else 0
    )
    budget = chunk
    while budget:
        j = server.prefilling
        if j is None:
            if not (running < goal and server.has_room()):
                return
            j, running = server.waiting.popleft(), running + 1
        before = server.positions_prefilled
        server.prefill_chunk(j, min(budget, server.prompt_left(j)))
        budget -= server.positions_prefilled - before  # (a prefix's positions cost nothing)


def run_step(server: ServerState, step: Callable[[ServerState], object]) -> None:
    """``step(server)``, then check what it left: every row of its decode step has its token, no
    finished request holds a row, and something moved (else the loop would go round for ever)."""
    before = server._tokens_given, server._positions_prefilled
    step(server)
    if server._pending:
        raise StepError(f"rows {sorted(server._pending)} got no token from the step's decode step: "
                        "call server.record(i, token) for every row", arg="step")
    left = [i for i, j in enumerate(server.rows) if j in server.finished]
    if left:
        j = server.rows[left[0]]
        raise StepError(
            f"a finished row left in the batch by the step: row {left[0]} holds requests[{j}], "
            f"finished ({server.results[j].stop_reason}), which would decode on: "
            "server.retire([...]) the rows whose record(...) returned True",
            arg="step",
        )
    if (server._tokens_given, server._positions_prefilled) == before:
        raise StepError(
            f"the step gave no request a token and prefilled nothing ({len(server.waiting)} "
            f"waiting, {len(server.rows)} running): each step must admit a request, prefill a "
            "chunk or run a decode step, or the server never ends",
            arg="step",
        )
    if server._admitted + len(server.waiting) != len(server.results):
        raise StepError(
            f"after the step, {server._admitted} requests were prefilled and "
            f"{len(server.waiting)} wait, of {len(server.results)}: pass every request taken "
            "from server.waiting to server.prefill, once",
            arg="step",
        )
