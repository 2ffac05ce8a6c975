"""Paged KV memory: the block allocator's invariants, the paged cache against the contiguous one,
serving on blocks (same tokens), the memory accounting and the Llama-3-8B scale-up."""

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.engine.decoder import ForwardDecoder
from ar_lab.engine.paged import (
    BlockAllocator,
    OutOfBlocks,
    PagedKVCache,
    blocks_for,
    check_allocator,
)
from ar_lab.engine.prefix_cache import PrefixCache
from ar_lab.engine.sampling import SamplingParams
from ar_lab.engine.serving import Request, serve
from ar_lab.model.cache import BatchKVCache
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.perf.llm_costs import kv_memory, model, weight_memory
from ar_lab.perf.paged_memory import (
    Footprint,
    contiguous_footprint,
    fit_contiguous,
    fit_paged,
    mixed_lengths,
    paged_footprint,
    scale_up,
)
from tests.raising import raises

# --- the allocator ---------------------------------------------------------------------------

ops = st.lists(
    st.tuples(
        st.sampled_from(["allocate", "grow", "fork", "free"]),
        st.integers(0, 40),
        st.integers(0, 40),
    ),
    max_size=40,
)


def snapshot(a: BlockAllocator) -> tuple:
    tables = {r: (a.table(r), a.length(r)) for r in a.requests}
    return tables, [a.refcount(b) for b in range(a.num_blocks)], a.num_free


def check_invariants(a: BlockAllocator) -> None:
    held = Counter(b for r in a.requests for b in a.table(r))
    for b in range(a.num_blocks):
        assert a.refcount(b) == held[b], (
            f"block {b}: refcount {a.refcount(b)}, held by {held[b]} tables"
        )
    for r in a.requests:
        assert len(a.table(r)) == blocks_for(a.length(r), a.block_size), (
            r,
            a.table(r),
            a.length(r),
        )
        assert len(set(a.table(r))) == len(a.table(r)), f"{r} holds a block twice"
    assert a.num_free + a.num_used == a.num_blocks
    assert a.num_used == len(held), "a block is neither free nor held (a leak), or both"
    assert a.tokens == sum(a.length(r) for r in a.requests)
    # a shared block is full in every table that holds it but (at most) the one that grows into it
    shared = [b for b, n in held.items() if n > 1]
    for r in a.requests:
        t, n = a.table(r), a.length(r)
        assert all(t.index(b) < n // a.block_size for b in shared if b in t), (
            "a partly filled block is shared"
        )


@given(ops, st.sampled_from([1, 3, 4]), st.integers(1, 14))
def test_allocator_invariants_hold_under_any_sequence(seq, block_size, num_blocks):
    a, names = BlockAllocator(num_blocks, block_size), 0
    for op, x, y in seq:
        live = a.requests
        before = snapshot(a)
        try:
            if op == "allocate":
                a.allocate(f"r{names}", x)
                names += 1
            elif op == "grow" and live:
                r = live[x % len(live)]
                a.grow(r, a.length(r) + y % 9)
            elif op == "fork" and live:
                r = live[x % len(live)]
                a.fork(r, f"r{names}", y % (a.length(r) + 1))
                names += 1
            elif op == "free" and live:
                a.free(live[x % len(live)])
        except OutOfBlocks as e:
            assert snapshot(a) == before, "a refused request changed the allocator"
            assert e.asked > e.free == a.num_free
        check_invariants(a)
    for r in a.requests:
        a.free(r)
    assert a.num_free == num_blocks and a.tokens == 0, (
        "freeing every request must return every block"
    )
    assert all(a.refcount(b) == 0 for b in range(num_blocks))


def test_allocate_grow_fork_free_by_hand():
    a = BlockAllocator(8, 4)
    assert a.allocate("p", 9) == [0, 1, 2]  # 9 tokens: 3 blocks, not 2 (ceil), not 3 + 1
    assert a.grow("p", 12) == [0, 1, 2]  # fills the last block: no new one
    assert a.grow("p", 13) == [0, 1, 2, 3]
    # two full blocks shared; the partly filled third copied to a fresh one
    assert a.fork("p", "c", 10) == [0, 1, 4]
    assert [a.refcount(b) for b in range(5)] == [2, 2, 1, 1, 1] and a.num_free == 3
    a.free("p")  # the shared blocks stay with "c"
    assert [a.refcount(b) for b in range(5)] == [1, 1, 0, 0, 1] and a.num_free == 5
    assert a.allocate("q", 1) == [2]  # the lowest free block first
    a.free("c")
    a.free("q")
    assert a.num_free == 8 and a.tokens == 0


def test_allocator_errors_say_what_to_do():
    a = BlockAllocator(2, 4)
    a.allocate("x", 5)
    with raises(OutOfBlocks, 'allocator') as e:
        a.grow("x", 9)
    assert (e.value.asked, e.value.free) == (1, 0) and a.length("x") == 5
    with raises(BadValue, 'request'):
        a.allocate("x")
    with raises(BadValue, 'n_tokens'):
        a.grow("x", 3)
    with pytest.raises(KeyError, match="unknown request 'y'"):
        a.free("y")
    with raises(BadValue, 'n_tokens'):
        a.fork("x", "z", 6)
    a.free("x")
    with pytest.raises(KeyError, match="already freed"):
        a.free("x")
    with pytest.raises(KeyError, match="already freed"):
        a.grow("x", 6)
    with raises(BadType, 'request'):
        a.allocate(["a"])
    for bad in [0, -1, 1.5, True]:
        with raises(BadValue, 'block_size'):
            BlockAllocator(4, bad)
        with raises(BadValue, 'num_blocks'):
            BlockAllocator(bad, 4)
    with raises(BadValue, 'block'):
        BlockAllocator(4, 2).refcount(4)


def test_check_allocator_names_the_missing_method():
    class Half:
        block_size, num_blocks, num_free = 4, 8, 8

        def allocate(self, r, n=0): ...

        def grow(self, r, n): ...

    with raises(BadType, 'allocator'):
        check_allocator(Half())
    used = BlockAllocator(4, 2)
    used.allocate("a", 1)
    with raises(BadValue, 'allocator'):
        check_allocator(used)


# --- the paged cache against the contiguous one ----------------------------------------------


@pytest.fixture
def gqa_model():
    torch.manual_seed(1)
    return GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_kv_heads=2, n_embd=32)).eval()


def test_paged_cache_gathers_what_the_contiguous_cache_holds(gqa_model):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [40, 41, 42, 43, 44]]
    dec = ForwardDecoder(gqa_model)
    paged = PagedKVCache.for_model(gqa_model, 3, 20, block_size=3, num_blocks=12)
    plain = BatchKVCache.for_model(gqa_model, 3, 20)
    with torch.inference_mode():
        for p in prompts:
            for c in (paged, plain):
                slot = c.slot(c.rows)
                dec.prefill(torch.tensor([p]), slot, 0)
                c.add(slot.length)
        for step in range(4):
            tokens = torch.tensor([3 + step, 4, 5])
            a, b = dec.step(tokens, paged, None), dec.step(tokens, plain, None)
            assert torch.equal(a, b), f"step {step}: paged logits differ from contiguous"
        assert paged.lengths == plain.lengths
        paged.begin(1)
        plain.begin(1)
        for layer in range(2):
            table = paged._table
            got = PagedKVCache.gather(paged.k[layer], table, paged._end)
            for i, n in enumerate(paged.lengths[:3]):
                assert torch.equal(got[i, :, :n], plain.k[layer][i, :, :n])
    assert paged.remove(0) == 2 and paged.ids[:2] == [2, 1]  # the last row's table moved, no data
    assert paged.allocator.num_free == 12 - blocks_for(12, 3) - blocks_for(9, 3)
    paged.close()
    assert paged.allocator.num_free == 12


def test_paged_cache_bad_input(gqa_model):
    with raises(BadValue, 'block_size'):
        PagedKVCache.for_model(gqa_model, 2, 16, block_size=0)
    with raises(BadValue, 'num_blocks'):
        PagedKVCache.for_model(gqa_model, 2, 16, allocator=BlockAllocator(8, 4), num_blocks=3)
    c = PagedKVCache.for_model(gqa_model, 1, 16)
    with raises(BadValue, 'cache'):
        c.add(0)
    with raises(BadValue, 'shared'):
        c.slot(0, shared=3)


# --- serving on blocks: the contiguous cache's tokens ----------------------------------------


def tokens(report):
    return [r.tokens for r in report.results]


def workload(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        Request(
            torch.randint(
                0, 256, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g
            ).tolist(),
            int(torch.randint(1, 14, (1,), generator=g)),
            seed=i,
        )
        for i in range(n)
    ]


SERVING_SAMPLING = SamplingParams(temperature=0.8, top_k=30)
_contiguous_runs: dict[tuple[int, int], tuple] = {}


def contiguous_run(max_batch: int, seed: int) -> tuple:
    """The seed's model and workload and the contiguous cache's greedy and sampled reports: they do
    not depend on the block size, so the examples that share (max_batch, seed) compute them once."""
    if (max_batch, seed) not in _contiguous_runs:
        torch.manual_seed(seed)
        m = GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_kv_heads=2, n_embd=32)).eval()
        work = workload(seed=seed)
        plain = serve(m, work, max_batch=max_batch, eos_id=None)
        sampled = serve(m, work, max_batch=max_batch, sampling=SERVING_SAMPLING)
        _contiguous_runs[max_batch, seed] = m, work, plain, sampled
    return _contiguous_runs[max_batch, seed]


@settings(max_examples=15)
@given(st.sampled_from([1, 2, 5, 16]), st.integers(1, 4), st.integers(0, 3))
def test_paged_serving_gives_the_contiguous_tokens(block_size, max_batch, seed):
    m, work, plain, sampled = contiguous_run(max_batch, seed)
    paged = serve(m, work, max_batch=max_batch, eos_id=None, kv="paged", block_size=block_size)
    assert tokens(paged) == tokens(plain)
    # rows end apart
    assert [r.finish_step for r in paged.results] == [r.finish_step for r in plain.results]
    assert len({r.finish_step for r in plain.results}) > 1
    sp = SERVING_SAMPLING
    assert tokens(
        serve(m, work, max_batch=max_batch, sampling=sp, kv="paged", block_size=block_size)
    ) == tokens(sampled)


def test_a_fixed_pool_makes_requests_wait_but_changes_no_token(gqa_model):
    work = workload(8, seed=3)
    plain = serve(gqa_model, work, max_batch=4, eos_id=None)
    need = [blocks_for(len(r.prompt) + r.max_new_tokens - 1, 4) for r in work]
    tight = serve(
        gqa_model,
        work,
        max_batch=4,
        eos_id=None,
        kv="paged",
        block_size=4,
        num_blocks=max(need) + 1,
    )
    assert tokens(tight) == tokens(plain)
    assert tight.decode_steps > plain.decode_steps  # fewer rows at once: it waited for blocks
    assert max(tight.kv_reserved) <= (max(need) + 1) * 4
    assert all(u <= r for u, r in zip(tight.kv_used, tight.kv_reserved, strict=True))
    with raises(ContextFull, 'num_blocks'):
        serve(gqa_model, work, kv="paged", block_size=4, num_blocks=2)


def test_prefix_blocks_are_shared_and_tokens_unchanged(gqa_model):
    prefix_ids = list(range(30, 53))  # 23 tokens: 5 full blocks of 4 and a partly filled one
    pre = PrefixCache(gqa_model, prefix_ids)
    work = [Request(prefix_ids + [7, 8, 9][:k], 6) for k in (1, 2, 3)] + [Request([1, 2], 4)]
    plain = serve(gqa_model, work, max_batch=3, prefix=pre, eos_id=None)
    paged = serve(gqa_model, work, max_batch=3, prefix=pre, eos_id=None, kv="paged", block_size=4)
    assert tokens(paged) == tokens(plain)
    assert [r.reused for r in paged.results] == [r.reused for r in plain.results] == [23, 23, 23, 0]
    # three requests at once hold the prefix's 5 full blocks once, not three times
    assert paged.kv_reserved[0] < plain.kv_used[0]


def test_serving_runs_on_any_allocator_and_checks_it(gqa_model):
    class Counting(BlockAllocator):
        calls = 0

        def grow(self, request, n_tokens):
            Counting.calls += 1
            return super().grow(request, n_tokens)

    alloc, work = Counting(40, 4), workload(5)
    assert tokens(serve(gqa_model, work, kv="paged", allocator=alloc, eos_id=None)) == tokens(
        serve(gqa_model, work, eos_id=None)
    )
    assert Counting.calls > 0 and alloc.num_free == 40 and alloc.requests == []  # nothing leaked
    with raises(BadType, 'allocator'):
        serve(gqa_model, work, kv="paged", allocator=object())
    with raises(BadValue, 'block_size'):
        serve(gqa_model, work, kv="paged", allocator=BlockAllocator(40, 4), block_size=4)
    with raises(BadValue, 'kv'):
        serve(gqa_model, work, kv="pages")
    with raises(BadValue, 'num_blocks'):
        serve(gqa_model, work, num_blocks=8)


# --- memory accounting ------------------------------------------------------------------------


def test_footprints_by_hand():
    assert contiguous_footprint([3, 10, 17], 32) == Footprint(96, 30)
    p = paged_footprint([3, 10, 17], 8)  # blocks 1 + 2 + 3 = 6 of 8 positions
    assert p == Footprint(48, 30) and p.waste == 18 and p.waste_share == pytest.approx(18 / 48)
    assert paged_footprint([16, 32], 16).waste == 0  # full blocks waste nothing
    assert contiguous_footprint([4], 8, bytes_per_position=10) == Footprint(80, 40)
    assert fit_contiguous([1, 1, 1, 1], 20, 8) == 2
    assert fit_paged([3, 10, 17, 1], 48, 8) == 3 and fit_paged([3, 10, 17, 1], 56, 8) == 4
    with raises(ContextFull, 'max_len'):
        contiguous_footprint([9], 8)
    with raises(BadValue, 'lengths'):
        paged_footprint([], 8)
    with raises(BadValue, 'lengths'):
        paged_footprint([3, 0], 8)


def test_llama3_8b_on_80gb_scale_up_arithmetic():
    s = scale_up(n_requests=500, seed=1)
    shape = model("Llama-3-8B")
    # layers x KV heads x D x (K, V) x bf16
    assert s.bytes_per_position == 32 * 8 * 128 * 2 * 2 == kv_memory(shape, 1)
    assert s.weights == weight_memory(shape) and s.kv_budget == int(80e9 - s.weights)
    budget = s.kv_budget // s.bytes_per_position
    assert s.contiguous_fit == budget // 8192
    assert sum(blocks_for(n, 16) for n in s.lengths[: s.paged_fit]) * 16 <= budget
    assert sum(blocks_for(n, 16) for n in s.lengths[: s.paged_fit + 1]) * 16 > budget
    assert s.contiguous.reserved == s.contiguous_fit * 8192 * s.bytes_per_position
    assert s.paged.waste < s.paged_fit * 16 * s.bytes_per_position  # under one block per request
    assert s.gain > 2 and math.isclose(s.gain, s.paged_fit / s.contiguous_fit)
    lengths = mixed_lengths(200, 8192, seed=1)
    assert (
        lengths == mixed_lengths(200, 8192, seed=1) and 64 <= min(lengths) and max(lengths) <= 8192
    )


# --- chapter 08's checker names the classic mistakes ------------------------------------------


class Plain:
    """A learner-style allocator (a list as the free list), right unless a subclass breaks it."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_list, self.refs, self.tables = list(range(num_blocks)), [0] * num_blocks, {}

    @property
    def num_free(self):
        return len(self.free_list)

    def table(self, r):
        return list(self.tables[r])

    def refcount(self, b):
        return self.refs[b]

    def needed(self, n):
        return -(-n // self.block_size)

    def take(self, table, n):
        more = self.needed(n) - len(table)
        if more > len(self.free_list):
            raise MemoryError("out of blocks")
        for _ in range(more):
            b = self.free_list.pop()
            self.refs[b] = 1
            table.append(b)

    def allocate(self, r, n=0):
        t = []
        self.take(t, n)
        self.tables[r] = t

    def grow(self, r, n):
        self.take(self.tables[r], n)

    def fork(self, parent, child, n):
        shared = self.tables[parent][: n // self.block_size]
        t = list(shared)
        self.take(t, n)
        for b in shared:
            self.refs[b] += 1
        self.tables[child] = t

    def free(self, r):
        for b in self.tables.pop(r):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_list.append(b)


class OffByOne(Plain):
    def needed(self, n):
        return n // self.block_size + 1 if n else 0


class EarlyFree(Plain):
    def free(self, r):
        for b in self.tables.pop(r):
            self.refs[b] = 0
            self.free_list.append(b)


class Leaky(Plain):
    def free(self, r):
        for b in self.tables.pop(r):
            self.refs[b] -= 1


class PartialTake(Plain):
    def take(self, table, n):
        for _ in range(self.needed(n) - len(table)):
            b = self.free_list.pop()  # IndexError half-way: some blocks already taken
            self.refs[b] = 1
            table.append(b)


SHARED = [("allocate", "a", 8), ("fork", "a", "b", 8), ("free", "a"), ("free", "b")]


@pytest.mark.parametrize(
    ("cls", "ops", "hint"),
    [
        (OffByOne, [("allocate", "a", 8)], "off-by-one when n fills its last block exactly"),
        (
            OffByOne,
            [("allocate", "a", 12)],
            "(?s)MemoryError: out of blocks.*one too many runs out",
        ),
        (EarlyFree, SHARED, "another request still uses went back to the free list"),
        (Leaky, [("allocate", "a", 5), ("free", "a")], "leaking blocks on finish"),
        (
            PartialTake,
            [("allocate", "a", 4), ("allocate", "b", 9)],
            "raise before changing anything",
        ),
    ],
)
def test_allocator_checker_names_the_mistake(cls, ops, hint):
    from ar_lab.course.checkers.checks import CheckFailed
    from ar_lab.course.checkers.paged_checks import check_allocator_ops

    # the same operations pass when done right
    check_allocator_ops(Plain, ops, num_blocks=3, block_size=4)
    with pytest.raises(CheckFailed, match=hint):
        check_allocator_ops(cls, ops, num_blocks=3, block_size=4)


def test_random_ops_catch_every_mistake():
    from ar_lab.course.checkers.checks import CheckFailed
    from ar_lab.course.checkers.paged_checks import check_allocator_ops, random_ops

    caught = Counter()
    for seed in range(8):
        bs = [1, 3, 4, 16][seed % 4]
        ops = random_ops(40, seed=seed, num_blocks=12, block_size=bs)
        assert {op[0] for op in ops} == {"allocate", "grow", "fork", "free"}
        check_allocator_ops(Plain, ops, num_blocks=12, block_size=bs)
        for wrong in (OffByOne, EarlyFree, Leaky):
            try:
                check_allocator_ops(wrong, ops, num_blocks=12, block_size=bs)
            except CheckFailed:
                caught[wrong] += 1
    assert min(caught[w] for w in (OffByOne, EarlyFree, Leaky)) >= 6, caught


class _AliasingAllocator(BlockAllocator):
    """A learner's allocator with a bug: every request's first block is block 0."""

    def table(self, request):
        t = super().table(request)
        return [0, *t[1:]] if t else t


def test_a_block_handed_to_two_running_requests_is_refused_naming_the_allocator():
    """Two requests writing one block would mix their keys and values: serving refuses instead of
    decoding on."""
    from ar_lab.engine.serving.requests import Request
    from ar_lab.engine.serving.server import serve

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=16)).eval()
    requests = [Request([1, 2, 3], 4), Request([4, 5, 6], 4)]
    with raises(BadValue, "allocator"):
        serve(model, requests, kv="paged", allocator=_AliasingAllocator(16, 4), block_size=None)
    good = serve(model, requests, kv="paged", allocator=BlockAllocator(16, 4), eos_id=None)
    assert [r.tokens for r in good.results] == [
        r.tokens for r in serve(model, requests, eos_id=None).results
    ]
