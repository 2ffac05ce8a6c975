"""Chapter 08's block-allocator exercise: a learner's allocator run side by side with
``ar_lab.engine.paged``'s.

``check_allocator_ops`` applies the same operations (allocate, grow, fork, free) to both and, after
each one, compares what can be observed: the free count, each request's block table (up to a
renaming of physical blocks: which free block comes first is the learner's choice) and the reference
count of every block in it. When they differ, the message names the classic mistake the state points
to: an off-by-one in the blocks n tokens need, a shared block returned to the free list while
another request still uses it, blocks leaked on finish, a fork that copies or forgets reference
counts. A request the pool cannot hold must raise and change nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ar_lab.course.checkers.answers import require_answer
from ar_lab.course.checkers.checks import CheckFailed, check_equal
from ar_lab.engine.paged import BlockAllocator, OutOfBlocks

# ("allocate", request, n) | ("grow", request, n) | ("fork", parent, child, n) | ("free", request)
Op = tuple


def _state(alloc, requests: Sequence[Hashable]) -> tuple[int, dict, dict]:
    """(free blocks, tables with blocks renamed in order of first appearance, refcounts per
    table)."""
    names: dict[int, int] = {}
    tables, refs = {}, {}
    for r in requests:
        t = list(alloc.table(r))
        tables[r] = [names.setdefault(b, len(names)) for b in t]
        refs[r] = [alloc.refcount(b) for b in t]
    return alloc.num_free, tables, refs


def _hint(op: Op, yours: tuple, ours: tuple, block_size: int) -> str:
    kind = op[0]
    (free_y, tables_y, refs_y), (free_o, tables_o, refs_o) = yours, ours
    if kind in ("allocate", "grow"):
        r, n = op[1], op[2]
        got, want = len(tables_y.get(r, [])), len(tables_o[r])
        if got == want + 1:
            return (
                f"{n} tokens need ceil({n} / {block_size}) = {want} blocks: (n + block_size - 1) "
                "// block_size, not n // block_size + 1 (an off-by-one when n fills its last "
                "block exactly)"
            )
        if got == want - 1:
            return (
                f"{n} tokens need ceil({n} / {block_size}) = {want} blocks: n // block_size "
                "drops the partly filled one"
            )
        if got != want:
            return f"{n} tokens need {want} blocks; grow adds blocks only when the last one is full"
    if kind == "free":
        if free_y < free_o:
            return (
                "leaking blocks on finish: every block of the request whose reference count "
                "drops to 0 must go back to the free list"
            )
        if free_y > free_o:
            return (
                "a freed block that another request still uses went back to the free list: "
                "decrement its reference count, and return it only when the count reaches 0"
            )
    if kind == "fork":
        if refs_y != refs_o:
            return (
                "fork shares the blocks that n tokens fill completely: +1 on each one's "
                "reference count; a partly filled last block is not shared, the child gets a "
                "fresh block for it"
            )
        if free_y != free_o:
            return (
                "fork takes a fresh block only for a partly filled last block; the full ones are "
                "shared, not copied"
            )
    if refs_y != refs_o:
        return "a block's reference count is the number of requests whose tables hold it"
    return "compare your free list, tables and reference counts with the rules above"


_RAISED = {
    "free": "free must accept every request that holds blocks; a shared block stays with its "
    "other users",
    "fork": "the child takes only a fresh block for a partly filled last block; the full ones "
    "are shared",
    "grow": "n tokens need ceil(n / block_size) blocks, (n + block_size - 1) // block_size: one "
    "too many runs out of blocks early (an off-by-one)",
}


def check_allocator_ops(
    yours_cls, ops: Sequence[Op], *, num_blocks: int, block_size: int, what: str = ""
) -> None:
    """Run ``ops`` on ``yours_cls(num_blocks, block_size)`` and on ``BlockAllocator``; compare after
    each op. None, or ar_lab's own allocator, is no answer yet (``answers.require_answer``)."""
    require_answer(f"{what}your block allocator", yours_cls)
    yours, ours = yours_cls(num_blocks, block_size), BlockAllocator(num_blocks, block_size)
    live: list[Hashable] = []
    done = []
    for op in ops:
        kind, args = op[0], op[1:]
        before = _state(yours, live)
        label = (
            f"{what}after {' ; '.join(map(repr, done + [op]))}"
            if len(done) < 6
            else f"{what}after ... {op!r}"
        )
        try:
            getattr(ours, kind)(*args)
        except OutOfBlocks:
            try:
                getattr(yours, kind)(*args)
            except Exception:  # noqa: BLE001 (any error is a refusal)
                check_equal(
                    f"{label}: your allocator's state after refusing",
                    _state(yours, live),
                    before,
                    hint="a request the pool cannot hold must raise before changing anything",
                )
                done.append(op)
                continue
            raise CheckFailed(
                f"{label}: there are only {ours.num_free} free blocks, your allocator did not "
                "raise\nHint: check that enough blocks are free before taking any, and raise if "
                "not"
            ) from None
        try:
            getattr(yours, kind)(*args)
        except CheckFailed:  # (Delegated among them)
            raise
        except Exception as e:  # noqa: BLE001 (the learner's error, explained)
            raise CheckFailed(
                f"{label}: your allocator raised {type(e).__name__}: {e}; ar_lab's did this with "
                f"{ours.num_free} blocks left free\nHint: {_RAISED.get(kind, _RAISED['grow'])}"
            ) from e
        done.append(op)
        if kind in ("allocate", "fork"):
            live.append(args[1] if kind == "fork" else args[0])
        elif kind == "free":
            live.remove(args[0])
        got, want = _state(yours, live), _state(ours, live)
        if got != want:
            check_equal(
                f"{label}: (free blocks, tables with blocks renamed 0, 1, ... in order of "
                "appearance, reference counts)",
                got,
                want,
                hint=_hint(op, got, want, block_size),
            )


def random_ops(n: int, *, seed: int, num_blocks: int, block_size: int) -> list[Op]:
    """``n`` seeded operations on live requests (ending with every request freed), for hidden tests;
    which ones the pool refuses is for the reference to say."""
    g = torch.Generator().manual_seed(seed)
    ref, ops, name = BlockAllocator(num_blocks, block_size), [], 0

    def pick(k: int) -> int:
        return int(torch.randint(0, k, (1,), generator=g))

    for _ in range(n):
        live, kind = ref.requests, ["allocate", "grow", "fork", "free"][pick(4)]
        if kind != "allocate" and not live:
            kind = "allocate"
        if kind == "allocate":
            op = ("allocate", f"r{name}", pick(3 * block_size + 2))
            name += 1
        elif kind == "grow":
            r = live[pick(len(live))]
            op = ("grow", r, ref.length(r) + pick(2 * block_size + 1))
        elif kind == "fork":
            r = live[pick(len(live))]
            op = ("fork", r, f"r{name}", pick(ref.length(r) + 1))
            name += 1
        else:
            op = ("free", live[pick(len(live))])
        try:
            getattr(ref, op[0])(*op[1:])
        except OutOfBlocks:
            pass
        ops.append(op)
    ops += [("free", r) for r in ref.requests]
    return ops
