import json
import statistics

import matplotlib
import pytest
import torch

from ar_lab.base.errors import BadValue, ContextFull
from ar_lab.course.views.plots import plot_roofline
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.perf import measure, peaks, side_by_side
from ar_lab.perf.roofline import decode_cost, forward_cost, prefill_cost
from tests.raising import raises

matplotlib.use("Agg")


# --- the roofs -----------------------------------------------------------------------


def test_peaks_are_measured():
    mm = peaks.measure_matmul_peak("cpu", size=128, repeats=2)
    assert mm["size"] == 128 and len(mm["times"]) == 2 and mm["flops_per_s"] > 1e6
    # the roof is the fastest repeat
    assert mm["flops_per_s"] == pytest.approx(2 * 128**3 / min(mm["times"]))
    assert mm["flops_per_s_median"] == pytest.approx(2 * 128**3 / statistics.median(mm["times"]))
    bw = peaks.measure_bandwidth("cpu", nbytes=6 * 2**20, repeats=2)
    assert bw["kernel"] in ("copy", "add", "read", "matvec") and bw["bytes_per_s"] == max(
        bw["by_kernel"].values()
    )
    assert bw["buffer_bytes"] == 6 * 2**20 and bw["bytes_per_s"] > 1e6
    assert set(bw["times"]) == {"copy", "add", "read", "matvec"}
    # the roof is the fastest repeat; the median is kept beside it
    for k, times in bw["times"].items():
        assert bw["by_kernel"][k] == pytest.approx(6 * 2**20 / min(times))  # 6 MiB: 4096 divides it
        assert bw["by_kernel_median"][k] == pytest.approx(6 * 2**20 / statistics.median(times))
    with raises(BadValue, 'nbytes'):
        peaks.measure_bandwidth("cpu", nbytes=8)
    assert (
        peaks.default_dtype("cpu") == torch.float32
        and peaks.default_dtype("cuda") == torch.bfloat16
    )
    both = peaks.measure_peaks("cpu", matmul_size=64, buffer_bytes=2**20)
    assert both["matmul_size"] == 64 and both["bandwidth_buffer_bytes"] <= 2**20
    assert both["bandwidth_bytes_per_s"] == both["bandwidth_by_kernel"][both["bandwidth_kernel"]]


# --- passes of a model ---------------------------------------------------------------


class Recorder(torch.nn.Module):
    """Wraps a model; records (new tokens, cached positions, cache holds data, training) of every
    forward call."""

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
        filled = (
            n == 0
            or bool(cache.k[-1][:, :, :n].abs().min() > 0)
            and bool(cache.v[0][:, :, :n].abs().min() > 0)
        )
        self.calls.append((tuple(idx.shape), n, filled, self.training))
        return self.model(idx, cache)


def test_reads_from_memory_votes_over_spells(monkeypatch):
    """The verdict is the majority of up to three measurements, each "from memory" when the buffer
    reads at most 15 % faster than the reference; it stops when two agree. A fake clock stands in
    for the machine: on this shared host a neighbour slows one core's matrix-vector product to the
    memory's rate for seconds at a time, so a cache-resident read cannot be told from memory there
    on demand (measured: 1 MiB at 12 to 48 GB/s against 20 GB/s from memory, in one process)."""
    spells = []

    def fake_turns(runs, repeats, warmup, clock, device):
        assert set(runs) == {"buffer", "reference"} and repeats == 5
        fast = spells.pop(0)  # about how much faster per byte the buffer reads this time
        return {"buffer": [2**20 / (20e9 * fast)] * repeats, "reference": [2**28 / 20e9] * repeats}

    monkeypatch.setattr(peaks, "interleaved", fake_turns)
    for ratios, verdict, used in (
        ([2.0, 2.0], False, 2),
        ([1.1, 1.0], True, 2),
        ([2.0, 1.0, 2.0], False, 3),  # one slow spell outvoted
        ([1.3, 1.0, 1.1], True, 3),
    ):
        spells[:] = list(ratios) + [99.0]
        read = peaks.reads_from_memory(2**20, reference=2**28, device="cpu")
        assert read["from_memory"] is verdict and len(spells) == 1 + len(ratios) - used
        ratio = read["bytes_per_s"] / read["reference_bytes_per_s"]
        assert ratio == pytest.approx(ratios[used - 1], rel=0.03)
    with raises(BadValue, "reference"):
        peaks.reads_from_memory(2**20, reference=2**19)


# the other test process's reads share the memory's bandwidth: alone, after the others
@pytest.mark.quiet
def test_a_buffer_larger_than_every_cache_reads_from_memory():
    """256 MiB is larger than any CPU's last-level cache share: it reads at a 512 MiB buffer's
    rate, whatever a neighbour does to this core."""
    read = peaks.reads_from_memory(2**28, repeats=3, device="cpu")
    assert read["reference_bytes"] == 2**30 and read["from_memory"]
    assert read["bytes_per_s"] > 1e8


def test_measure_prefill_and_decode_run_the_pass_they_claim(tiny_model):
    rec = Recorder(tiny_model).eval()
    p = measure.measure_prefill(rec, 20, batch=2, repeats=3)
    # warm-up + 3, each into an empty cache, in eval mode
    assert rec.calls == [((2, 20), 0, True, False)] * 4
    assert p.cost == prefill_cost(tiny_model.config, 20, 2) and len(p.times) == 3
    rec.calls.clear()
    d = measure.measure_decode(rec, 30, batch=3, repeats=4)
    # every step is the same step at context 30 (2 warm-ups)
    assert rec.calls == [((3, 1), 29, True, False)] * 6
    assert d.cost == decode_cost(tiny_model.config, 30, 3)
    assert d.flops_per_s == pytest.approx(d.cost.flops / d.seconds)
    assert d.bytes_per_s == pytest.approx(d.cost.bytes / d.seconds)
    rec.calls.clear()
    # e.g. verifying 4 draft tokens + 1
    v = measure.measure_forward(rec, tokens=5, past=10, repeats=2)
    assert rec.calls == [((1, 5), 10, True, False)] * 3
    assert v.cost == forward_cost(tiny_model.config, 1, 5, 10) and v.cost.context == 15
    with raises(ContextFull, 'context'):
        measure.measure_decode(tiny_model, 65)


def test_measuring_never_switches_the_model_mode(tiny_model):
    rec = Recorder(tiny_model).train()  # no dropout: training mode computes what eval mode does
    measure.measure_decode(rec, 8, repeats=1)
    # run as it is, left as it is
    assert rec.training and all(training for *_, training in rec.calls)
    rec.calls.clear()
    fn, *_ = measure.prepare_forward(rec, 1, 7)
    fn()
    assert rec.training and rec.calls[-1][-1] is True  # the prepared pass too
    dropout = GPT(GPTConfig(block_size=16, n_layer=1, n_head=1, n_embd=8, dropout=0.5)).train()
    with raises(BadValue, 'model'):
        measure.measure_decode(dropout, 8, repeats=1)
    tiny_model.eval()
    measure.measure_decode(tiny_model, 8, repeats=1)
    assert not tiny_model.training


def test_fastest_threads_restores_the_thread_count(tiny_model):
    before = torch.get_num_threads()
    out = measure.fastest_threads(tiny_model, 8, [1, before], repeats=1)
    assert set(out["seconds"]) == {1, before} and out["seconds"][out["best"]] == min(
        out["seconds"].values()
    )
    assert torch.get_num_threads() == before
    with raises(BadValue, 'candidates'):
        measure.fastest_threads(tiny_model, 8, [0])
    assert torch.get_num_threads() == before


def test_build_model_in_place():
    cfg = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)
    m = measure.build_model(cfg, "cpu", torch.bfloat16)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16} and not m.training
    assert torch.get_default_dtype() == torch.float32  # restored
    assert (
        measure.measure_decode(m, 4, repeats=1).cost.weight_bytes
        == decode_cost(cfg, 4, bytes_per_value=2).weight_bytes
    )


def test_cuda_graph_is_ignored_on_cpu(tiny_model):
    p = measure.measure_decode(tiny_model, 8, repeats=1, cuda_graph=True)
    assert (
        p.mode == "eager"
        and p.note == ""
        and p.to_dict()["mode"] == "eager"
        and "note" not in p.to_dict()
    )


# --- the full run and the results on disk --------------------------------------------

PEAKS = {
    "matmul_flops_per_s": 50e9,
    "bandwidth_bytes_per_s": 5e9,
    "matmul_size": 0,
    "bandwidth_kernel": "read",
}


def test_run_roofline_result_round_trips(tiny_model, tmp_path):
    result = measure.run_roofline(tiny_model, [4, 16], [1, 2], 8, [12], peaks=PEAKS, repeats=1)
    assert result["schema"] == measure.SCHEMA and result["dtype"] == "float32"
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
    assert k["prefill_compute_fraction"] == pytest.approx(result["points"][1]["flops_per_s"] / 50e9)
    path = tmp_path / "roofline_x.json"
    path.write_text(json.dumps(result))
    assert measure.load_result(path) == result
    rows = measure.summary_rows(result)
    assert len(rows) == 5 and len(rows[0]) == len(measure.SUMMARY_HEADERS)
    # decode at batch 1: on the bandwidth slope, the roof is intensity x 5 GB/s
    p = result["points"][2]
    assert rows[2][:5] == ["decode", 1, 1, 8, round(p["seconds"] * 1e3, 2)]
    assert rows[2][-1] == f"{p['flops_per_s'] / (p['intensity'] * 5e9):.0%}"


def test_load_result_rejects_what_it_cannot_plot(tmp_path, tiny_model):
    bad = tmp_path / "roofline_bad.json"
    bad.write_text("{not json")
    with raises(BadValue, 'path'):
        measure.load_result(bad)
    bad.write_text(json.dumps({"schema": measure.SCHEMA}))
    with raises(BadValue, 'path'):
        measure.load_result(bad)
    good = measure.run_roofline(tiny_model, [4], [1], 4, peaks=PEAKS, repeats=1)
    bad.write_text(json.dumps({**good, "schema": "something/9"}))
    with raises(BadValue, 'path'):
        measure.load_result(bad)
    bad.write_text(json.dumps({**good, "peaks": {**PEAKS, "bandwidth_bytes_per_s": 0}}))
    with raises(BadValue, 'path'):
        measure.load_result(bad)
    bad.write_text(json.dumps({**good, "points": [{"phase": "decode"}]}))
    with raises(BadValue, 'path'):
        measure.load_result(bad)


def test_reference_files_by_device(tmp_path, tiny_model, monkeypatch):
    res = measure.run_roofline(tiny_model, [4], [1], 4, peaks=PEAKS, repeats=1)
    (tmp_path / "roofline_cpu.json").write_text(json.dumps(res))
    gpu = {**res, "device": {"type": "cuda", "name": "Some GPU", "threads": 1}}
    (tmp_path / "roofline_gpu.json").write_text(json.dumps(gpu))
    (tmp_path / "other.json").write_text("{}")
    assert [p.name for p in measure.reference_files(tmp_path)] == [
        "roofline_cpu.json",
        "roofline_gpu.json",
    ]
    assert [p.name for p in measure.reference_files(tmp_path, "cuda")] == ["roofline_gpu.json"]
    monkeypatch.setenv("AR_LAB_DATA", str(tmp_path))  # the default folder is read at call time
    assert [p.name for p in measure.reference_files(device_type="cpu")] == ["roofline_cpu.json"]


def test_shipped_references_load():
    paths = measure.reference_files()
    assert paths  # the repository ships at least the CPU reference
    for path in paths:
        result = measure.load_result(path)
        assert result["points"], path
        assert result["device"]["type"] in ("cpu", "cuda")


def test_plot_roofline(tiny_model):
    import matplotlib.pyplot as plt

    result = measure.run_roofline(tiny_model, [4, 16], [1, 2], 8, peaks=PEAKS, repeats=1)
    fig, ax = plt.subplots()
    plot_roofline(ax, result, label="test machine")
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    labels = ax.get_legend_handles_labels()[1]
    assert labels == [
        "roofs of test machine: 50 GFLOP/s, 5 GB/s",
        "prefill (test machine)",
        "decode (test machine)",
    ]
    roof = ax.get_lines()[0]
    assert max(roof.get_ydata()) == pytest.approx(50e9)  # flat at the compute peak
    # the bandwidth slope
    assert min(roof.get_ydata()) == pytest.approx(min(roof.get_xdata()) * 5e9)
    assert sorted(t.get_text() for t in ax.texts) == [
        "B=1",
        "B=2",
        "T=16",
        "T=4",
        "ridge 10 FLOP/B",
    ]
    fig2, ax2 = plt.subplots()
    plot_roofline(ax2, result, annotate=False)
    assert len(ax2.texts) == 0  # no labels: for overlaying reference runs
    assert (
        ax2.get_legend_handles_labels()[1][0]
        == f"roofs of {result['device']['name']}: 50 GFLOP/s, 5 GB/s"
    )
    plt.close(fig)
    plt.close(fig2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_measurements_use_bf16():
    cfg = GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64)
    m = measure.build_model(cfg)
    assert m.device.type == "cuda" and next(m.parameters()).dtype == torch.bfloat16
    d = measure.measure_decode(m, 16, 2, repeats=2)
    assert (
        d.cost.weight_bytes == decode_cost(cfg, 16, 2, bytes_per_value=2).weight_bytes
        and d.seconds > 0
    )
    g = measure.measure_decode(m, 16, 2, repeats=2, cuda_graph=True)
    assert g.mode == "cuda graph", g.note
    out = side_by_side.decode_bandwidth_fraction(m, 16, pairs=2, buffer_bytes=2**26)
    assert list(out["by_variant"]) == ["eager", "cuda graph"]
    assert out["by_variant"]["cuda graph"]["mode"] == "cuda graph"
    assert peaks.measure_bandwidth(nbytes=2**26, repeats=2)["bytes_per_s"] > 1e9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_captured_pass_keeps_the_buffers_it_replays_on(monkeypatch):
    """A CUDA graph replays on the addresses it was captured with: the KV cache and ids of
    prepare_forward's step live as long as the replay does, so a replay after the cache is emptied
    and memory reallocated still runs on them (measure_gpu's decode points once replayed on freed
    caches: an illegal memory access)."""
    import gc
    import weakref

    from ar_lab.model.cache import KVCache

    made = []
    for_model = KVCache.for_model.__func__

    def recording(cls, *args, **kwargs):
        made.append(for_model(cls, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(KVCache, "for_model", classmethod(recording))
    m = measure.build_model(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64))
    fns = [measure.prepare_forward(m, 1, 15, b, phase="decode", cuda_graph=True) for b in (1, 4)]
    assert [f[2] for f in fns] == ["cuda graph"] * 2, [f[3] for f in fns]
    caches = [weakref.ref(c) for c in made]
    made.clear()
    gc.collect()
    torch.cuda.empty_cache()
    assert all(c() is not None for c in caches), "a prepared replay let its KV cache go"
    # what would take a freed cache's memory
    filler = torch.full((2**26,), float("nan"), device=m.device)
    with torch.inference_mode():  # the caches are inference tensors
        for ref in caches:
            # the decode step's position: each replay writes its key there again
            ref().k[0][:, :, 15].zero_()
    for fn, *_ in fns:
        fn()
    torch.cuda.synchronize()
    for ref in caches:
        written = ref().k[0][:, :, 15]
        assert torch.isfinite(written).all() and written.abs().sum() > 0, (
            "a replay did not write its own cache"
        )
    assert torch.isnan(filler).all(), "a replay wrote into memory it does not own"


@pytest.mark.parametrize(
    ("capability", "dtype"),
    [((7, 5), torch.float16), ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)],
)
def test_a_gpu_without_bf16_tensor_cores_measures_in_fp16(monkeypatch, capability, dtype):
    """A T4 (7.5) or a V100 (7.0) has fp16 tensor cores and none for bf16: its roofs are measured
    in fp16; Ampere (8.0) and later in bf16. (A fake GPU: the capability is what torch would
    report.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert peaks.default_dtype("cuda") == dtype
    assert peaks.default_dtype("cpu") == torch.float32
