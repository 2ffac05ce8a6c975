"""python -m ar_lab.bench against: this tree's decode against another checkout's, in alternating processes."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from raising import raises

from ar_lab.base.errors import BadValue
from ar_lab.bench import against

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_checkout_against_itself_gives_the_same_tokens_and_a_finite_ratio():
    seen = []
    res = against.against_benchmark(ROOT, tokens=4, rounds=1, prompt="def ", say=seen.append)
    assert res["same_tokens"] and len(seen) == 1 and len(res["runs"]["other"]) == 1
    assert 0 < res["s_per_token"]["this tree"] and 0 < res["this_over_other_median_ratio"] < 100
    assert "median of the per-round ratios" in against.format_against(res)


def test_a_folder_that_is_not_a_checkout_is_refused(tmp_path):
    args = argparse.Namespace(checkout=tmp_path, tokens=5, rounds=1, prompt="x")
    with raises(BadValue, "checkout"):
        against.run(args)
    with raises(BadValue, "rounds"):
        against.run(argparse.Namespace(checkout=ROOT, tokens=5, rounds=0, prompt="x"))
