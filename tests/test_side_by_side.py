"""ar_lab.perf.side_by_side: a decode step timed in interleaved pairs with another call."""

import statistics

import pytest
import torch

from ar_lab.base.errors import BadValue, ContextFull
from ar_lab.perf import side_by_side
from ar_lab.perf.roofline import decode_cost
from tests.raising import raises


def test_decode_bandwidth_fraction_pairs_and_restores_threads(tiny_model):
    before = torch.get_num_threads()
    out = side_by_side.decode_bandwidth_fraction(
        tiny_model, 8, pairs=3, threads=[2, 1], buffer_bytes=2**20
    )
    assert list(out["by_variant"]) == ["1 thread", "2 threads"] and out["best"] in out["by_variant"]
    assert out["kernel"] == max(out["kernel_rates"], key=out["kernel_rates"].get)
    assert out["decode_bytes"] == decode_cost(tiny_model.config, 8).bytes
    for name, v in out["by_variant"].items():
        assert (
            len(v["pairs"]) == 3
            and v["mode"] == "eager"
            and v["threads"] == (1 if name == "1 thread" else 2)
        )
        fr = [
            out["decode_bytes"] / p["decode_seconds"] / (out["kernel_bytes"] / p["probe_seconds"])
            for p in v["pairs"]
        ]
        assert v["pair_range"] == [pytest.approx(min(fr)), pytest.approx(max(fr))]
        assert v["pair_quartiles"] == pytest.approx(
            statistics.quantiles(fr, n=4, method="inclusive")
        )
        step_rate = out["decode_bytes"] / statistics.median(p["decode_seconds"] for p in v["pairs"])
        probe_rate = out["kernel_bytes"] / statistics.median(p["probe_seconds"] for p in v["pairs"])
        # bytes/s at the median times, side by side
        assert v["fraction"] == pytest.approx(step_rate / probe_rate)
        fastest_probe = min(p["probe_seconds"] for p in v["pairs"])
        assert v["of_roof"] == pytest.approx(step_rate / (out["kernel_bytes"] / fastest_probe))
    best = max(v["fraction"] for v in out["by_variant"].values())
    assert out["fraction"] == out["by_variant"][out["best"]]["fraction"] == best
    assert (
        out["best_threads"] == out["by_variant"][out["best"]]["threads"]
        and out["cuda_graph"] is False
    )
    assert torch.get_num_threads() == before
    with raises(BadValue, 'pairs'):
        side_by_side.decode_bandwidth_fraction(tiny_model, 8, pairs=0)


def test_decode_bandwidth_fraction_restores_threads_when_a_step_fails(tiny_model):
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    with raises(ContextFull, 'context'):  # preparing the step at context 65 fails
        side_by_side.decode_bandwidth_fraction(
            tiny_model, 65, pairs=1, threads=[other], buffer_bytes=2**20
        )
    assert torch.get_num_threads() == before


def test_decode_step_growth_interleaves_steps_at_the_two_contexts(tiny_model):
    seen = []  # the cache length each timed pass starts from
    hook = tiny_model.register_forward_pre_hook(
        lambda _m, args: seen.append((args[1].length, args[0].shape[1]))
    )
    tiny_model.train()
    try:
        out = side_by_side.decode_step_growth(tiny_model, 4, 40, pairs=5)
    finally:
        hook.remove()
    assert tiny_model.training  # the model's mode is restored
    assert all(n == 1 for _, n in seen)  # one new token per pass: decode steps
    # a warm-up of each, then short, long, short, long, ...
    assert [c for c, _ in seen[-10:]] == [3, 39] * 5
    assert out["short"] == 4 and out["long"] == 40 and out["short_seconds"] > 0
    assert out["ratio"] == pytest.approx(out["long_seconds"] / out["short_seconds"])
    with raises(BadValue, 'long'):
        side_by_side.decode_step_growth(tiny_model, 40, 40)
    with raises(ContextFull, 'long'):
        side_by_side.decode_step_growth(tiny_model, 4, 65)
    with raises(BadValue, 'pairs'):
        side_by_side.decode_step_growth(tiny_model, 4, 40, pairs=0)
