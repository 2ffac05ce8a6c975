"""``python -m ar_lab.bench batched``: a decode step for B rows against a batch-1 step."""

import pytest

from ar_lab.base.errors import BadValue
from ar_lab.bench.batched import batched_benchmark, format_batched_results
from tests.raising import raises


@pytest.mark.slow
def test_the_batched_steps_agree_and_are_timed_against_batch_1():
    res = batched_benchmark("small", [2, 4], context=8, rounds=1)
    assert res["parameters"] > 95e6 and res["context"] == 8 and res["threads"] >= 1
    assert set(res["batches"]) == {"2", "4"}
    for row in res["batches"].values():
        for path in ("ar_lab", "forward"):
            t = row[path]
            assert t["seconds"] > 0
            assert t["x_batch_1"] == pytest.approx(t["seconds"] / res["batch_1_seconds"])
    assert res["goal"]["batch"] == 4 and res["goal"]["met"] == (
        res["batches"]["4"]["ar_lab"]["x_batch_1"] <= 1.3
    )
    text = format_batched_results(res)
    assert "goal: batch 4 within 1.3x" in text and "GPT.forward ms" in text


def test_bad_settings_are_refused_before_anything_is_built():
    with raises(BadValue, "config"):
        batched_benchmark("huge")
    with raises(BadValue, "batches"):
        batched_benchmark("small", [1, 4])
    with raises(BadValue, "context"):
        batched_benchmark("small", [4], context=512)
    with raises(BadValue, "rounds"):
        batched_benchmark("small", [4], rounds=0)
