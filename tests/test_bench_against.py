"""python -m ar_lab.bench against: this tree's decode against another checkout's, in alternating
processes."""

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


def test_instructions_per_step_is_the_difference_over_the_extra_tokens(monkeypatch):
    counts = {(ROOT.resolve(), against.SHORT): 1_000, (ROOT.resolve(), 120): 1_000 + 100 * 2_500}
    monkeypatch.setattr(
        against, "_instructions", lambda root, prompt, n: counts[(root.resolve(), n)]
    )
    monkeypatch.setattr(against.shutil, "which", lambda name: "/usr/bin/valgrind")
    res = against.instructions_benchmark(ROOT, tokens=120, prompt="x", say=lambda s: None)
    assert res["instructions_per_step"] == {"this tree": 2_500, "other": 2_500}
    assert res[
        "this_over_other_instructions"
    ] == 1 and "instructions per decode step" in against.format_against(res)
    with raises(BadValue, "tokens"):
        against.instructions_benchmark(ROOT, tokens=against.SHORT, prompt="x")
    monkeypatch.setattr(against.shutil, "which", lambda name: None)
    with raises(BadValue, "instructions"):
        against.instructions_benchmark(ROOT, tokens=120, prompt="x")
