import json
import statistics

import matplotlib
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ar_lab import roofline as rl
from ar_lab.cache import KVCache
from ar_lab.model import GPT, GPTConfig

matplotlib.use("Agg")

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
    # d = 2, one layer, one head, vocabulary 10, context window 8.
    # matmul weights: qkv 2x6 + proj 2x2 + fc 2x8 + proj 8x2 = 12 + 4 + 16 + 16, head 10x2 = 20 -> 68
    assert rl.matmul_parameters(HAND) == 68
    # all parameters: layer = 68 - 20 + biases (6 + 2 + 8 + 2) + 2 LayerNorms (4 + 4) = 74;
    # + token table 20 + position table 16 + final LayerNorm 4 -> 114
    assert rl.parameter_count(HAND) == 114
    assert rl.kv_bytes_per_token(HAND, 4) == 1 * 1 * 2 * 2 * 4  # layers x heads x head_dim x (K, V) x fp32
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
    assert d.kv_bytes == 4 * 2 * (4 + 2) * 4  # per sequence: 4 cached + the new one read, the new one written
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
    with torch.inference_mode(), sdpa_kernel(SDPBackend.MATH):  # the math path shows attention as bmm
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
    assert long.kv_bytes > 7 * one.kv_bytes and long.intensity == pytest.approx(one.intensity, rel=0.01)
    # Grouped-query attention (4 query heads per KV head) reads a quarter of the cache.
    gqa = rl.decode_cost(GPTConfig(block_size=1024, n_layer=12, n_head=12, n_kv_heads=3, n_embd=768), 1024)
    assert gqa.kv_bytes == pytest.approx(long.kv_bytes / 4) and gqa.intensity > long.intensity
    # bf16 halves the bytes: intensity doubles (almost exactly, the FLOPs are unchanged).
    assert rl.decode_cost(cfg, 128, bytes_per_value=2).intensity == pytest.approx(2 * one.intensity)
    peak, bw = 100e9, 10e9
    assert one.bound(peak, bw) == "memory" and rl.prefill_cost(cfg, 512).bound(peak, bw) == "compute"
    assert one.time_at(peak, bw) == pytest.approx(one.bytes / bw)


def test_roofline_helpers():
    assert rl.ridge_point(100e9, 10e9) == 10
    assert rl.attainable_flops(1.0, 100e9, 10e9) == 10e9
    assert rl.attainable_flops(1000.0, 100e9, 10e9) == 100e9
    got = rl.attainable_flops(torch.tensor([1.0, 10.0, 100.0]), 100e9, 10e9)
    assert torch.allclose(got, torch.tensor([10e9, 100e9, 100e9]))
    with pytest.raises(ValueError, match="must be > 0"):
        rl.ridge_point(0, 1)
    assert rl.format_si(1.3e11, "FLOP/s") == "130 GFLOP/s"
    assert rl.format_si(3.35e12, "B/s") == "3.35 TB/s"


def test_cost_errors():
    with pytest.raises(ValueError, match="exceed the context window of 8"):
        rl.prefill_cost(HAND, 9)
    with pytest.raises(ValueError, match="context must be a positive int"):
        rl.decode_cost(HAND, 0)
    with pytest.raises(ValueError, match="batch must be a positive int"):
        rl.decode_cost(HAND, 3, batch=0)
    with pytest.raises(ValueError, match="past must be an int >= 0"):
        rl.forward_cost(HAND, 1, 1, -1)


# --- measuring -----------------------------------------------------------------------


def test_peaks_are_measured():
    mm = rl.measure_matmul_peak("cpu", size=128, repeats=2)
    assert mm["size"] == 128 and len(mm["times"]) == 2 and mm["flops_per_s"] > 1e6
    assert mm["flops_per_s"] == pytest.approx(2 * 128**3 / min(mm["times"]))
    assert mm["flops_per_s"] >= mm["flops_per_s_median"]
    bw = rl.measure_bandwidth("cpu", nbytes=6 * 2**20, repeats=2)
    assert bw["kernel"] in ("copy", "add", "read", "matvec") and bw["bytes_per_s"] == max(bw["by_kernel"].values())
    assert bw["buffer_bytes"] == 6 * 2**20 and bw["bytes_per_s"] > 1e6
    assert set(bw["times"]) == {"copy", "add", "read", "matvec"}
    for k, times in bw["times"].items():  # the roof is the fastest repeat; the median is kept beside it
        assert bw["by_kernel"][k] == pytest.approx(6 * 2**20 / min(times))  # 6 MiB: 4096 divides it
        assert bw["by_kernel"][k] >= bw["by_kernel_median"][k]
    with pytest.raises(ValueError, match="too small"):
        rl.measure_bandwidth("cpu", nbytes=8)
    assert rl.default_dtype("cpu") == torch.float32 and rl.default_dtype("cuda") == torch.bfloat16
    assert rl.default_buffer_bytes("cpu") >= 2**30
    peaks = rl.measure_peaks("cpu", matmul_size=64, buffer_bytes=2**20)
    assert peaks["matmul_size"] == 64 and peaks["bandwidth_buffer_bytes"] <= 2**20
    assert peaks["bandwidth_bytes_per_s"] == peaks["bandwidth_by_kernel"][peaks["bandwidth_kernel"]]


def test_time_fn_times_each_call():
    calls = []
    times = rl.time_fn(lambda: calls.append(1), "cpu", repeats=4, warmup=2)
    assert len(times) == 4 and len(calls) == 6 and all(t >= 0 for t in times)


class Recorder(torch.nn.Module):
    """Wraps a model and records (new tokens, cached positions, cache holds data) of every forward call."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.calls = model, model.config, []

    @property
    def device(self):
        return self.model.device

    def num_parameters(self):
        return self.model.num_parameters()

    def forward(self, idx, cache=None):
        n = cache.length
        filled = n == 0 or bool(cache.k[-1][:, :, :n].abs().min() > 0) and bool(cache.v[0][:, :, :n].abs().min() > 0)
        self.calls.append((tuple(idx.shape), n, filled))
        return self.model(idx, cache)


def test_measure_prefill_and_decode_run_the_pass_they_claim(tiny_model):
    rec = Recorder(tiny_model)
    p = rl.measure_prefill(rec, 20, batch=2, repeats=3)
    assert rec.calls == [((2, 20), 0, True)] * 4  # warm-up + 3, each into an empty cache
    assert p.cost == rl.prefill_cost(tiny_model.config, 20, 2) and len(p.times) == 3
    rec.calls.clear()
    d = rl.measure_decode(rec, 30, batch=3, repeats=4)
    assert rec.calls == [((3, 1), 29, True)] * 6  # every step is the same step at context 30 (2 warm-ups)
    assert d.cost == rl.decode_cost(tiny_model.config, 30, 3)
    assert d.flops_per_s == pytest.approx(d.cost.flops / d.seconds)
    assert d.bytes_per_s == pytest.approx(d.cost.bytes / d.seconds)
    rec.calls.clear()
    v = rl.measure_forward(rec, tokens=5, past=10, repeats=2)  # e.g. verifying 4 draft tokens + 1
    assert rec.calls == [((1, 5), 10, True)] * 3
    assert v.cost == rl.forward_cost(tiny_model.config, 1, 5, 10) and v.cost.context == 15
    with pytest.raises(ValueError, match="exceed the context window"):
        rl.measure_decode(tiny_model, 65)


def test_fastest_threads_restores_the_thread_count(tiny_model):
    before = torch.get_num_threads()
    out = rl.fastest_threads(tiny_model, 8, [1, before], repeats=1)
    assert set(out["seconds"]) == {1, before} and out["best"] in out["seconds"]
    assert out["seconds"][out["best"]] == min(out["seconds"].values())
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads must be a positive int"):
        rl.fastest_threads(tiny_model, 8, [0])
    assert torch.get_num_threads() == before


def test_build_model_in_place():
    cfg = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)
    m = rl.build_model(cfg, "cpu", torch.bfloat16)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16} and not m.training
    assert torch.get_default_dtype() == torch.float32  # restored
    assert (
        rl.measure_decode(m, 4, repeats=1).cost.weight_bytes == rl.decode_cost(cfg, 4, bytes_per_value=2).weight_bytes
    )


PEAKS = {"matmul_flops_per_s": 50e9, "bandwidth_bytes_per_s": 5e9, "matmul_size": 0, "bandwidth_kernel": "read"}


def test_run_roofline_result_round_trips(tiny_model, tmp_path):
    result = rl.run_roofline(tiny_model, [4, 16], [1, 2], 8, [12], peaks=PEAKS, repeats=1)
    assert result["schema"] == rl.SCHEMA and result["dtype"] == "float32"
    assert result["device"]["type"] == "cpu" and result["versions"]["torch"] == torch.__version__
    assert result["ridge_point"] == 10
    phases = [(p["phase"], p["batch"], p["tokens"], p["context"]) for p in result["points"]]
    assert phases == [
        ("prefill", 1, 4, 4),
        ("prefill", 1, 16, 16),
        ("decode", 1, 1, 8),
        ("decode", 2, 1, 8),
        ("decode", 1, 1, 12),
    ]
    k = result["key_figures"]
    assert k["decode_context"] == 8 and k["prefill_tokens"] == 16
    assert k["decode_bandwidth_fraction"] == pytest.approx(result["points"][2]["bytes_per_s"] / 5e9)
    path = tmp_path / "roofline_x.json"
    path.write_text(json.dumps(result))
    assert rl.load_result(path) == result
    rows = rl.summary_rows(result)
    assert len(rows) == 5 and len(rows[0]) == len(rl.SUMMARY_HEADERS)


def test_load_result_rejects_what_it_cannot_plot(tmp_path, tiny_model):
    bad = tmp_path / "roofline_bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        rl.load_result(bad)
    bad.write_text(json.dumps({"schema": rl.SCHEMA}))
    with pytest.raises(ValueError, match="missing"):
        rl.load_result(bad)
    good = rl.run_roofline(tiny_model, [4], [1], 4, peaks=PEAKS, repeats=1)
    bad.write_text(json.dumps({**good, "schema": "something/9"}))
    with pytest.raises(ValueError, match="schema"):
        rl.load_result(bad)
    bad.write_text(json.dumps({**good, "peaks": {**PEAKS, "bandwidth_bytes_per_s": 0}}))
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s must be a positive"):
        rl.load_result(bad)
    bad.write_text(json.dumps({**good, "points": [{"phase": "decode"}]}))
    with pytest.raises(ValueError, match="point 0 has no"):
        rl.load_result(bad)


def test_reference_files_by_device(tmp_path, tiny_model):
    res = rl.run_roofline(tiny_model, [4], [1], 4, peaks=PEAKS, repeats=1)
    (tmp_path / "roofline_cpu.json").write_text(json.dumps(res))
    gpu = {**res, "device": {"type": "cuda", "name": "Some GPU", "threads": 1}}
    (tmp_path / "roofline_gpu.json").write_text(json.dumps(gpu))
    (tmp_path / "other.json").write_text("{}")
    assert [p.name for p in rl.reference_files(tmp_path)] == ["roofline_cpu.json", "roofline_gpu.json"]
    assert [p.name for p in rl.reference_files(tmp_path, "cuda")] == ["roofline_gpu.json"]


def test_shipped_references_load():
    for path in rl.reference_files():
        result = rl.load_result(path)
        assert result["points"], path
        assert result["device"]["type"] in ("cpu", "cuda")


def test_plot_roofline(tiny_model):
    import matplotlib.pyplot as plt

    result = rl.run_roofline(tiny_model, [4, 16], [1, 2], 8, peaks=PEAKS, repeats=1)
    fig, ax = plt.subplots()
    rl.plot_roofline(ax, result, label="test machine")
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["roofs of test machine: 50 GFLOP/s, 5 GB/s", "prefill (test machine)", "decode (test machine)"]
    roof = ax.get_lines()[0]
    assert max(roof.get_ydata()) == pytest.approx(50e9)  # flat at the compute peak
    assert min(roof.get_ydata()) == pytest.approx(min(roof.get_xdata()) * 5e9)  # the bandwidth slope
    assert sorted(t.get_text() for t in ax.texts) == ["B=1", "B=2", "T=16", "T=4", "ridge 10 FLOP/B"]
    fig2, ax2 = plt.subplots()
    rl.plot_roofline(ax2, result, annotate=False)
    assert len(ax2.texts) == 0  # no labels: for overlaying reference runs
    assert ax2.get_legend_handles_labels()[1][0] == f"roofs of {result['device']['name']}: 50 GFLOP/s, 5 GB/s"
    plt.close(fig)
    plt.close(fig2)


def test_decode_bandwidth_fraction_pairs_and_restores_threads(tiny_model):
    before = torch.get_num_threads()
    out = rl.decode_bandwidth_fraction(tiny_model, 8, pairs=3, threads=[2, 1], buffer_bytes=2**20)
    assert list(out["by_variant"]) == ["1 thread", "2 threads"] and out["best"] in out["by_variant"]
    assert out["kernel"] == max(out["kernel_rates"], key=out["kernel_rates"].get)
    assert out["decode_bytes"] == rl.decode_cost(tiny_model.config, 8).bytes
    for name, v in out["by_variant"].items():
        assert len(v["pairs"]) == 3 and v["mode"] == "eager" and v["threads"] == (1 if name == "1 thread" else 2)
        fr = [
            out["decode_bytes"] / p["decode_seconds"] / (out["kernel_bytes"] / p["probe_seconds"]) for p in v["pairs"]
        ]
        assert v["pair_range"] == [pytest.approx(min(fr)), pytest.approx(max(fr))]
        assert min(fr) <= v["pair_quartiles"][0] <= v["pair_quartiles"][1] <= v["pair_quartiles"][2] <= max(fr)
        step_rate = out["decode_bytes"] / statistics.median(p["decode_seconds"] for p in v["pairs"])
        probe_rate = out["kernel_bytes"] / statistics.median(p["probe_seconds"] for p in v["pairs"])
        assert v["fraction"] == pytest.approx(step_rate / probe_rate)  # bytes/s at the median times, side by side
        fastest_probe = min(p["probe_seconds"] for p in v["pairs"])
        assert v["of_roof"] == pytest.approx(step_rate / (out["kernel_bytes"] / fastest_probe))
        assert v["of_roof"] <= v["fraction"]
    best = max(v["fraction"] for v in out["by_variant"].values())
    assert out["fraction"] == out["by_variant"][out["best"]]["fraction"] == best
    assert out["best_threads"] == out["by_variant"][out["best"]]["threads"] and out["cuda_graph"] is False
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="pairs must be a positive int"):
        rl.decode_bandwidth_fraction(tiny_model, 8, pairs=0)


def test_cuda_graph_is_ignored_on_cpu(tiny_model):
    p = rl.measure_decode(tiny_model, 8, repeats=1, cuda_graph=True)
    assert p.mode == "eager" and p.note == "" and p.to_dict()["mode"] == "eager" and "note" not in p.to_dict()


def test_bench_roofline_quick(tmp_path, capsys):
    from ar_lab.bench import main

    path = tmp_path / "roofline_quick.json"
    assert main(["roofline", "--quick", "--json", str(path)]) == 0
    result = rl.load_result(path)
    out = capsys.readouterr().out
    assert "ridge point" in out and "key figure" in out and "phase" in out
    k = result["key_figures"]
    key = result["bandwidth_fraction"]
    assert 0 < k["decode_bandwidth_fraction"] == key["fraction"] and k["decode_variant"] == key["best"]
    q1, q3 = k["decode_bandwidth_fraction_pair_quartiles"]
    assert 0 < q1 <= q3
    assert key["context"] == 32 and result["device"]["threads"] == key["best_threads"]
    assert k["decode_bandwidth_fraction_of_roof"] <= k["decode_bandwidth_fraction"]
    assert all(p["mode"] == "eager" for p in result["points"])
    assert {p["phase"] for p in result["points"]} == {"prefill", "decode"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_measurements_use_bf16():
    cfg = GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64)
    m = rl.build_model(cfg)
    assert m.device.type == "cuda" and next(m.parameters()).dtype == torch.bfloat16
    d = rl.measure_decode(m, 16, 2, repeats=2)
    assert d.cost.weight_bytes == rl.decode_cost(cfg, 16, 2, bytes_per_value=2).weight_bytes and d.seconds > 0
    g = rl.measure_decode(m, 16, 2, repeats=2, cuda_graph=True)
    assert g.mode == "cuda graph", g.note
    out = rl.decode_bandwidth_fraction(m, 16, pairs=2, buffer_bytes=2**26)
    assert list(out["by_variant"]) == ["eager", "cuda graph"]
    assert out["by_variant"]["cuda graph"]["mode"] == "cuda graph"
    assert rl.measure_bandwidth(nbytes=2**26, repeats=2)["bytes_per_s"] > 1e9
