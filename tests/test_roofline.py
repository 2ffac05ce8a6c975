import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.model.cache import KVCache
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.perf import measure
from ar_lab.perf import roofline as rl
from tests.raising import raises

HAND = GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=2)


@st.composite
def configs(draw):
    n_kv = draw(st.sampled_from([1, 2, 4]))
    n_head = n_kv * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([2, 4, 8]))
    return GPTConfig(
        vocab_size=draw(st.integers(3, 40)),
        block_size=draw(st.integers(8, 32)),
        n_layer=draw(st.integers(1, 3)),
        n_head=n_head,
        n_kv_heads=n_kv,
        n_embd=n_head * head_dim,
    )


# --- the analytic model, by hand ---------------------------------------------------


def test_costs_by_hand():
    # d = 2, one layer, one head, vocabulary 10, context window 8. matmul weights: qkv 2x6 + proj
    # 2x2 + fc 2x8 + proj 8x2 = 12 + 4 + 16 + 16, head 10x2 = 20 -> 68
    assert rl.matmul_parameters(HAND) == 68
    # all parameters: layer = 68 - 20 + biases (6 + 2 + 8 + 2) + 2 LayerNorms (4 + 4) = 74;
    # + token table 20 + position table 16 + final LayerNorm 4 -> 114
    assert rl.parameter_count(HAND) == 114
    # layers x heads x head_dim x (K, V) x fp32
    assert rl.kv_bytes_per_token(HAND, 4) == 1 * 1 * 2 * 2 * 4
    c = rl.prefill_cost(HAND, 3)
    assert c.matmul_flops == 2 * 68 * 3
    assert c.attention_flops == 4 * 2 * (1 + 2 + 3)  # token i attends to i keys
    assert c.weight_bytes == 4 * (114 - 16 + 3 * 2)  # only 3 position rows are read
    assert c.kv_bytes == 4 * (3 + 3) * 4  # 3 positions written, 3 read; 4 values each
    assert c.activation_bytes == 4 * 3 * ((2 + 6) + (2 + 2) + (2 + 8) + (8 + 2) + 2 + (2 + 10))
    assert c.flops == 408 + 48 and c.bytes == 416 + 96 + 552
    assert c.intensity == pytest.approx(456 / 1064)
    assert (c.phase, c.batch, c.tokens, c.context) == ("prefill", 1, 3, 3)

    d = rl.decode_cost(HAND, context=5, batch=2)
    assert d.matmul_flops == 2 * 68 * 2
    assert d.attention_flops == 4 * 2 * 2 * 5  # each of 2 sequences: one query against 5 keys
    assert d.weight_bytes == 4 * (114 - 16 + 2)
    # per sequence: 4 cached + the new one read, the new one written
    assert d.kv_bytes == 4 * 2 * (4 + 2) * 4
    assert (d.phase, d.batch, d.tokens, d.context) == ("decode", 2, 1, 5)


def test_the_13b_worked_example():
    # The chapter's seed arithmetic: 13 B parameters, a 2,000-token prompt, fp16 weights.
    assert rl.approx_prefill_flops(13e9, 2000) == pytest.approx(52e12)
    assert rl.approx_ttft(13e9, 2000, 400e12) == pytest.approx(0.13)
    assert rl.approx_decode_bytes(13e9, 2) == pytest.approx(26e9)
    tpot = rl.approx_tpot(13e9, 3.35e12)
    assert tpot == pytest.approx(7.76e-3, rel=1e-3)
    assert 500 * tpot == pytest.approx(3.88, rel=1e-3)


@given(configs(), st.integers(1, 4), st.integers(1, 6))
def test_counts_match_the_model_and_the_flop_counter(cfg, batch, tokens):
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    assert rl.parameter_count(cfg) == model.num_parameters()
    tokens = min(tokens, cfg.block_size - 1)
    past = cfg.block_size - tokens - 1
    cache = KVCache.for_model(model, batch_size=batch)
    # the math path shows attention as bmm
    with torch.inference_mode(), sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as prefill:
            model(torch.zeros(batch, tokens, dtype=torch.long), cache)
        cache.length = past
        with FlopCounterMode(display=False) as step:
            model(torch.zeros(batch, 1, dtype=torch.long), cache)
    counted = {str(k): v for k, v in prefill.get_flop_counts()["Global"].items()}
    cost = rl.prefill_cost(cfg, tokens, batch)
    assert counted["aten.addmm"] + counted["aten.mm"] == cost.matmul_flops
    # The math kernel computes the whole T x T score matrix; only the causal half is useful work.
    square = 4 * cfg.n_embd * cfg.n_layer * batch * tokens * tokens
    assert counted["aten.bmm"] == square
    assert cost.attention_flops == square * (tokens + 1) / (2 * tokens)
    counted = {str(k): v for k, v in step.get_flop_counts()["Global"].items()}
    cost = rl.decode_cost(cfg, past + 1, batch)
    assert counted["aten.addmm"] + counted["aten.mm"] == cost.matmul_flops
    assert counted["aten.bmm"] == cost.attention_flops  # one query: no masked work


@given(configs(), st.integers(1, 7))
def test_weights_are_read_once_per_pass(cfg, tokens):
    tokens = min(tokens, cfg.block_size)
    p = rl.prefill_cost(cfg, tokens)
    expected = (rl.parameter_count(cfg) - (cfg.block_size - tokens) * cfg.n_embd) * 4
    assert p.weight_bytes == expected
    assert rl.prefill_cost(cfg, tokens, batch=3).weight_bytes == expected  # shared by the batch
    assert rl.prefill_cost(cfg, tokens, bytes_per_value=2).weight_bytes == expected / 2


def test_decode_is_memory_bound_and_batching_moves_it_right():
    cfg = GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768)
    one = rl.decode_cost(cfg, 128)
    # 2 FLOPs per weight, 4 bytes per fp32 weight: just under 0.5 FLOP/byte.
    assert 0.45 < one.intensity < 0.5
    assert one.weight_bytes / one.bytes > 0.95  # the weights are almost all of the traffic
    batched = [rl.decode_cost(cfg, 128, b).intensity for b in (1, 2, 4, 8, 16, 32)]
    assert batched == sorted(batched) and batched[-1] > 10 * batched[0]
    prefill = [rl.prefill_cost(cfg, t).intensity for t in (1, 8, 64, 512)]
    assert prefill == sorted(prefill) and prefill[-1] > 100 * one.intensity
    # A longer context reads more KV cache: more bytes, and (with one KV head per query head)
    # 4 x d FLOPs per 2 x d fp32 values read: the same 0.5 FLOP/byte as the weights.
    long = rl.decode_cost(cfg, 1024)
    assert long.kv_bytes > 7 * one.kv_bytes and long.intensity == pytest.approx(
        one.intensity, rel=0.01
    )
    # Grouped-query attention (4 query heads per KV head) reads a quarter of the cache.
    gqa = rl.decode_cost(
        GPTConfig(block_size=1024, n_layer=12, n_head=12, n_kv_heads=3, n_embd=768), 1024
    )
    assert gqa.kv_bytes == pytest.approx(long.kv_bytes / 4) and gqa.intensity > long.intensity
    # bf16 halves the bytes: intensity doubles (almost exactly, the FLOPs are unchanged).
    assert rl.decode_cost(cfg, 128, bytes_per_value=2).intensity == pytest.approx(2 * one.intensity)
    peak, bw = 100e9, 10e9
    assert (
        one.bound(peak, bw) == "memory" and rl.prefill_cost(cfg, 512).bound(peak, bw) == "compute"
    )
    assert one.time_at(peak, bw) == pytest.approx(one.bytes / bw)


def test_roofline_helpers():
    assert rl.ridge_point(100e9, 10e9) == 10
    assert rl.attainable_flops(1.0, 100e9, 10e9) == 10e9
    assert rl.attainable_flops(1000.0, 100e9, 10e9) == 100e9
    got = rl.attainable_flops(torch.tensor([1.0, 10.0, 100.0]), 100e9, 10e9)
    assert torch.allclose(got, torch.tensor([10e9, 100e9, 100e9]))
    with raises(BadValue, 'peak_flops'):
        rl.ridge_point(0, 1)
    assert rl.format_si(1.3e11, "FLOP/s") == "130 GFLOP/s"
    assert rl.format_si(3.35e12, "B/s") == "3.35 TB/s"


def test_the_probes_chapter_05_stands_in_count_what_they_run_and_time_the_fastest_call():
    from ar_lab.perf import peaks

    moved, seconds = peaks.stream_probe(1000, 3)
    assert moved == 3 * 1000 * 4 and 0 < seconds < 1  # three fp32 arrays, each read or written once
    half, _ = peaks.stream_probe(1000, 1, dtype=torch.bfloat16)
    assert half == moved // 2
    flops, seconds = peaks.matmul_probe(30, 50, 70, 2)
    assert flops == 2 * 30 * 50 * 70 and 0 < seconds < 1
    # the fastest of the repeats: never slower than a single timed call of the same work
    calls = []
    real = peaks.time_call
    try:
        peaks.time_call = lambda fn, **kw: calls.append(kw) or [0.3, 0.1, 0.2]
        assert (
            peaks.stream_probe(8, 3) == (96, 0.1)
            and calls[-1]["repeats"] == 3
            and calls[-1]["warmup"] == 1
        )
        assert peaks.matmul_probe(2, 3, 4, 7)[1] == 0.1 and calls[-1]["repeats"] == 7
    finally:
        peaks.time_call = real
    for bad in (0, -3, 2.5, "8"):
        with raises(BadValue, 'n'):
            peaks.stream_probe(bad)
    with raises(BadValue, 'k'):
        peaks.matmul_probe(2, 0, 2)


def test_cost_errors():
    with raises(ContextFull, 'prompt_len'):
        rl.prefill_cost(HAND, 9)
    with raises(BadValue, 'context'):
        rl.decode_cost(HAND, 0)
    with raises(BadValue, 'batch'):
        rl.decode_cost(HAND, 3, batch=0)
    with raises(BadValue, 'past'):
        rl.forward_cost(HAND, 1, 1, -1)
    with raises(BadType, 'cfg'):
        rl.matmul_parameters("small")
    shape = rl.from_gpt_config(HAND)
    with raises(BadType, 'shape'):
        rl.shape_cost(HAND, 1, 1, 0, 4, 4)
    with raises(BadValue, 'weight_bytes'):
        rl.shape_cost(shape, 1, 1, 0, 0, 4)
    with raises(ContextFull, 'tokens'):
        rl.shape_cost(shape, 1, 9, 0, 4, 4)


# --- the benchmark command ----------------------------------------------------------


def test_bench_roofline_quick(tmp_path, capsys):
    from ar_lab.bench.__main__ import main

    path = tmp_path / "roofline_quick.json"
    assert main(["roofline", "--quick", "--json", str(path)]) == 0
    result = measure.load_result(path)
    out = capsys.readouterr().out
    assert "ridge point" in out and "key figure" in out and "phase" in out
    k = result["key_figures"]
    key = result["bandwidth_fraction"]
    assert (
        0 < k["decode_bandwidth_fraction"] == key["fraction"] and k["decode_variant"] == key["best"]
    )
    q1, q3 = k["decode_bandwidth_fraction_pair_quartiles"]
    assert 0 < q1 <= q3
    assert key["context"] == 32 and result["device"]["threads"] == key["best_threads"]
    assert k["decode_bandwidth_fraction_of_roof"] <= k["decode_bandwidth_fraction"]
    assert all(p["mode"] == "eager" for p in result["points"])
    assert {p["phase"] for p in result["points"]} == {"prefill", "decode"}
