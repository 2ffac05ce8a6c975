"""The decode benchmark, run with tiny sizes: structure, counts and token identity (not speed)."""

import json

import pytest
import torch

from ar_lab.base.errors import BadValue, ContextFull
from ar_lab.bench.__main__ import main
from ar_lab.bench.decode import decode_benchmark, format_decode_results
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.model.reference import have_transformers
from tests.raising import raises

needs_hf = pytest.mark.skipif(not have_transformers(), reason="transformers is not installed")


@pytest.fixture
def small_model():
    torch.manual_seed(1)
    return GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32)).eval()


@needs_hf
def test_decode_benchmark_structure_and_identical_tokens(small_model):
    res = decode_benchmark(  # (the compiled column: tests/test_compiled.py, a model compiled there)
        small_model, tokens=12, repeats=2, uncached_repeats=1, prompt="ab", threads=1,
        compiled=False,
    )
    runs = res["runs"]
    assert set(runs) == {
        "ar_lab cached",
        "ar_lab cached, forward()",
        "ar_lab uncached",
        "transformers generate",
        "weights only (floor)",
        "weights + KV cache reads (floor)",
    }
    assert res["new_tokens"] == 12 and res["prompt_tokens"] == 2
    P, N = 2, 12
    assert (
        runs["ar_lab cached"]["positions"]
        == runs["transformers generate"]["positions"]
        == P + N - 1
    )
    assert runs["ar_lab uncached"]["positions"] == N * P + N * (N - 1) // 2
    assert (
        runs["ar_lab cached"]["forward_calls"]
        == runs["ar_lab cached, forward()"]["forward_calls"]
        == N
    )
    assert runs["ar_lab cached, forward()"]["positions"] == P + N - 1
    assert (
        len(runs["ar_lab cached"]["seconds"]) == len(runs["transformers generate"]["seconds"]) == 2
    )
    assert len(runs["ar_lab uncached"]["seconds"]) == 1
    assert "positions" not in runs["weights only (floor)"]  # it generates nothing
    assert len(runs["weights only (floor)"]["seconds"]) == 2
    for run in runs.values():
        assert run["median_s"] > 0
        assert run["tokens_per_s"] == pytest.approx(N / run["median_s"])
    r = res["ratios"]
    assert r["ar_lab_vs_transformers"] == pytest.approx(
        runs["transformers generate"]["median_s"] / runs["ar_lab cached"]["median_s"]
    )
    assert r["lean_vs_forward"] == pytest.approx(
        runs["ar_lab cached, forward()"]["median_s"] / runs["ar_lab cached"]["median_s"]
    )
    assert r["compiled_vs_lean"] is None and r["compiled_vs_transformers"] is None
    assert r["positions_uncached_vs_cached"] == pytest.approx(
        (N * P + N * (N - 1) // 2) / (P + N - 1)
    )
    floor = runs["weights only (floor)"]["median_s"]
    assert r["floor_ms_per_token"] == pytest.approx(1000 * floor / N)
    assert "compiled_over_floor" not in r and "compiled_over_reads_floor" not in r
    reads = runs["weights + KV cache reads (floor)"]
    assert "positions" not in reads and r["reads_floor_ms_per_token"] == pytest.approx(
        1000 * reads["median_s"] / N
    )
    assert "weights + KV cache reads (floor)" not in r["overhead_ms_per_token"]
    assert r["overhead_ms_per_token"]["ar_lab cached"] == pytest.approx(
        1000 * (runs["ar_lab cached"]["median_s"] - floor) / N
    )
    if r["overhead_ms_per_token"]["ar_lab cached"] > 0:
        over = r["overhead_ms_per_token"]
        assert r["overhead_transformers_vs_ar_lab"] == pytest.approx(
            over["transformers generate"] / over["ar_lab cached"]
        )
    assert json.loads(json.dumps(res)) == res  # JSON-serialisable as written by --json
    table = format_decode_results(res)
    assert "transformers generate" in table and "ar_lab uncached" in table
    assert "ar_lab's lean step vs" in table and "target 3x" in table  # (no compiled run: the lean)


@needs_hf
def test_decode_benchmark_detects_different_tokens(small_model, monkeypatch):
    import ar_lab.model.reference as reference

    real = reference.to_hf_gpt2

    def perturbed(model):
        hf = real(model)
        with torch.no_grad():
            # other weights
            hf.transformer.ln_f.bias.add_(torch.randn_like(hf.transformer.ln_f.bias))
        return hf

    monkeypatch.setattr(reference, "to_hf_gpt2", perturbed)
    with pytest.raises(AssertionError, match="different tokens"):
        decode_benchmark(
            small_model, tokens=20, repeats=1, uncached_repeats=0, prompt="ab", compiled=False
        )


def test_decode_benchmark_without_peer_and_bad_input(small_model):
    threads = torch.get_num_threads()
    res = decode_benchmark(
        small_model, tokens=5, repeats=1, uncached_repeats=0, peer=False, threads=1, compiled=False
    )
    assert set(res["runs"]) == {
        "ar_lab cached", "ar_lab cached, forward()", "weights only (floor)",
        "weights + KV cache reads (floor)",
    }
    assert res["ratios"]["compiled_vs_lean"] is None and "compiled_over_floor" not in res["ratios"]
    assert "ar_lab's lean step vs" not in format_decode_results(res)  # (no peer: no comparison)
    assert (
        res["ratios"]["ar_lab_vs_transformers"] is None
        and "overhead_transformers_vs_ar_lab" not in res["ratios"]
    )
    assert torch.get_num_threads() == threads  # restored
    assert "KV cache:" not in format_decode_results(res)  # (no uncached run)
    with raises(ContextFull, 'max_new_tokens'):
        decode_benchmark(small_model, tokens=64, prompt="abc", peer=False)
    with raises(BadValue, 'tokens'):
        decode_benchmark(small_model, tokens=0, peer=False)
    with raises(BadValue, 'repeats'):
        decode_benchmark(small_model, tokens=3, repeats=0, peer=False)


def test_decode_command_line(tmp_path, capsys):
    out = tmp_path / "decode.json"
    args = [
        "decode",
        "--tokens",
        "4",
        "--repeats",
        "1",
        "--uncached-repeats",
        "1",
        "--json",
        str(out),
        "--no-compile",  # (compiled in test_decode_benchmark_structure_and_identical_tokens)
    ]
    if not have_transformers():
        args.append("--no-peer")
    assert main([*args, "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "ar_lab cached" in printed and "tokens/s" in printed and "lean decode step" in printed
    res = json.loads(out.read_text())
    assert (
        res["new_tokens"] == 4
        and res["runs"]["ar_lab cached"]["positions"] == 4 + len("Python ") - 1
    )
    # Several thread counts: one result per setting, the slow uncached run only in the first.
    assert main([*args, "--threads", "1", "2"]) == 0
    settings = json.loads(out.read_text())["settings"]
    assert [r["threads"] for r in settings] == [1, 2]
    assert "ar_lab uncached" in settings[0]["runs"] and "ar_lab uncached" not in settings[1]["runs"]
    assert (
        printed.count("decode: batch 1") == 1
        and capsys.readouterr().out.count("decode: batch 1") == 2
    )


def test_the_reads_floor_attends_over_a_cache_as_long_as_each_steps(small_model, monkeypatch):
    """The floor with the cache: per step, every weight product once and, per layer, one query over
    the prompt's length plus one a step; its bytes per step are the cache's, counted exactly."""
    import torch.nn.functional as F

    from ar_lab.bench.decode import kv_bytes_per_step, reads_pass

    lengths, real = [], F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        lengths.append(k.shape[2])
        return real(q, k, v, **kwargs)

    run = reads_pass(small_model, 3, 4)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    run(4)
    layers = small_model.config.n_layer
    assert lengths == [L for L in (4, 5, 6, 7) for _ in range(layers)]
    cfg = small_model.config  # 2 (K and V) x layers x heads x head_dim x 4 bytes x mean length
    per_position = 2 * layers * cfg.kv_heads * cfg.head_dim * 4
    assert kv_bytes_per_step(small_model, 3, 4) == per_position * 5.5


def test_each_goal_is_a_time_per_token_placed_against_the_floor_with_the_caches_reads():
    """The goals' times follow from the runs (transformers' over the target, the weights-only
    floor's times the allowed ratio), and each is said to be below the floor with the cache's
    reads (out of reach) or above it by how much."""
    from ar_lab.bench.decode import _ratios
    from ar_lab.bench.decode_report import _goal_lines

    def run(seconds):
        return {"median_s": seconds}

    runs = {"ar_lab cached": run(1.2), "ar_lab cached, compiled": run(1.1),
            "transformers generate": run(3.6), "weights only (floor)": run(0.6),
            "weights + KV cache reads (floor)": run(0.95)}
    n = 1000
    r = _ratios({k: {**v, "median_cpu_s": v["median_s"]} for k, v in runs.items()}, n)
    goals = r["goal_ms_per_token"]
    assert goals["vs_transformers"] == pytest.approx(3.6 / 3)  # 1.2 ms/token
    assert goals["over_floor"] == pytest.approx(0.6 * 1.5)  # 0.9 ms/token
    res = {"ratios": r, "runs": runs, "new_tokens": n, "target_ar_lab_vs_transformers": 3.0,
           "target_compiled_over_floor": 1.5}
    vs_peer, over_floor = _goal_lines(res)
    assert vs_peer.startswith("goal 3x") and "0.25 ms/token above" in vs_peer
    assert "compiled step spends 0.15" in vs_peer
    assert over_floor.startswith("goal 1.5x") and "0.05 ms below" in over_floor
