"""Claims fail loudly, naming the sentence that stopped being true."""

import time

import nbformat
import pytest
import torch

from ar_lab.base.errors import BadType, BadValue
from ar_lab.course.checkers.claims import ClaimFailed, claim, magnitude, plural, timed_claim
from tests.raising import raises


def test_a_true_claim_is_silent_and_a_false_one_names_itself():
    claim("top-p repeats less than greedy", 0.2 < 0.5)
    with pytest.raises(ClaimFailed, match="'top-p repeats less than greedy'.*0.7 vs 0.5"):
        claim("top-p repeats less than greedy", 0.7 < 0.5, "0.7 vs 0.5")


@pytest.mark.parametrize(
    "x, text",
    [
        (6.2e5, "6 × 10⁵"),
        (9.6e5, "1 × 10⁶"),
        (1.2e-3, "1 × 10⁻³"),
        (3, "3 × 10⁰"),
        (1e8, "1 × 10⁸"),
        (5e-324, "5 × 10⁻³²⁴"),
        (1.7e308, "2 × 10³⁰⁸"),
    ],
)
def test_magnitude(x, text):
    assert magnitude(x) == text


def test_magnitude_of_a_0d_tensor_is_its_numbers():
    import numpy as np

    assert magnitude(torch.tensor(5e5)) == magnitude(np.float64(5e5)) == "5 × 10⁵"


def test_magnitude_refuses_what_has_none():
    for bad in (0, -1.0, float("nan"), float("inf"), "1"):
        with raises(BadValue, 'x'):
            magnitude(bad)


def test_plural():
    assert [plural(n, "thread") for n in (0, 1, 2)] == ["0 threads", "1 thread", "2 threads"]
    assert plural(1, "KV head") == "1 KV head" and plural(4, "KV head") == "4 KV heads"
    assert plural(1_000, "step") == "1,000 steps" and plural(3, "query", "queries") == "3 queries"
    with raises(BadType, 'n'):
        plural(1.0, "thread")


@pytest.mark.slow
def test_a_planted_false_claim_fails_the_notebook_tests_with_its_name(tmp_path):
    """Break the bound of a claim in a copy of chapter 01 (cut after that cell; the claim sits in a
    cell JupyterLab shows collapsed, out of the learner's path): nbval, as make test runs it, fails
    on that cell and names the claim; the unbroken copy passes. One nbval run, one kernel: the
    unbroken copy, then the broken cell after it (nbval runs every cell, whatever failed before), so
    every cell but the last must pass and the last must fail."""
    import subprocess
    import sys
    import xml.etree.ElementTree as ET
    from pathlib import Path

    import nbformat

    source = (
        Path(__file__).resolve().parent.parent / "notebooks" / "01_the_autoregressive_loop.ipynb"
    )
    nb = nbformat.read(source, as_version=4)
    name = "the plausible order is far more likely than the scrambled one"
    at = next(i for i, c in enumerate(nb.cells) if name in c.source)
    assert nb.cells[at].metadata.get("jupyter", {}).get("source_hidden"), (
        "the claim sits in a collapsed cell"
    )
    nb.cells = nb.cells[: at + 1]  # the honest copy
    assert "ratio > 100," in nb.cells[at].source
    planted = nbformat.from_dict(nb.cells[at])
    planted.id, planted.source = "planted", planted.source.replace("ratio > 100,", "ratio > 1e12,")
    nb.cells.append(planted)
    nbformat.write(nb, tmp_path / "honest_then_planted.ipynb")

    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(tmp_path / "honest_then_planted.ipynb"),
        "--nbval-lax",
        "--nbval-current-env",
        f"--junitxml={tmp_path / 'cells.xml'}",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=source.parent, timeout=600)
    cells = ET.parse(tmp_path / "cells.xml").getroot().iter("testcase")
    outcomes = [
        [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        for case in cells
    ]
    assert len(outcomes) == sum(c.cell_type == "code" for c in nb.cells), run.stdout[-2000:]
    assert outcomes[:-1] == [[]] * (len(outcomes) - 1), run.stdout[-2000:]  # the honest copy passes
    assert run.returncode != 0 and outcomes[-1] == ["failure"], run.stdout[-2000:]
    assert "ClaimFailed" in run.stdout and name in run.stdout, run.stdout[-2000:]


# --- two audiences: the tests' strict kernels and a learner's ------------------------------------


def test_a_learners_kernel_shows_a_false_timing_claim_as_a_caveat_and_goes_on(monkeypatch):
    """Not strict (a learner's kernel): a noisy claim that does not hold shows a caveat naming it
    and what was measured, and returns; a claim about logic still raises; so does anything in the
    tests' strict mode."""
    from ar_lab.course.checkers import claims

    shown = []
    monkeypatch.setattr(claims, "say", shown.append)
    monkeypatch.delenv(claims.MODE_ENV, raising=False)
    assert not claims.strict()
    claim("the cache is faster", False, "1.2 ms vs 1.1 ms", noisy=True)  # no raise
    assert len(shown) == 1 and "Not on this machine, this time" in shown[0]
    assert "the cache is faster" in shown[0] and "1.2 ms vs 1.1 ms" in shown[0]
    with pytest.raises(ClaimFailed):
        claim("the cache changes no token", False)  # logic: stops the notebook
    sides = {"small": lambda: spin(0.001), "large": lambda: spin(0.004)}
    timed = timed_claim("large is faster", sides, lambda t: t["large"] < t["small"], rounds=3,
                        budget_s=0, device="cpu")
    assert timed.median("large") > timed.median("small")  # the measurement comes back
    assert len(shown) == 2 and "'large is faster'" not in shown[1] and "large is faster" in shown[1]
    monkeypatch.setenv(claims.MODE_ENV, "strict")
    with pytest.raises(ClaimFailed):
        claim("the cache is faster", False, noisy=True)
    with raises(BadType, "noisy"):
        claim("the cache is faster", True, noisy="yes")


def test_the_tests_run_notebooks_strictly_and_the_student_run_all_as_a_learner(tmp_path):
    """conftest.py makes every kernel the tests start strict; the student Run All's kernel is a
    learner's: a false timing claim there shows its caveat and the next cell runs."""
    import os

    from ar_lab.course.checkers.claims import MODE_ENV
    from tests.test_exercises import run_all

    assert os.environ[MODE_ENV] == "strict"
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(
            "from ar_lab.course.checkers.claims import claim\n"
            "claim('the cache is faster', False, '2 ms vs 1 ms', noisy=True)"
        ),
        nbformat.v4.new_code_cell("print('the lesson goes on')"),
    ])
    done = run_all(nb, tmp_path, timeout=120)
    shown = str(done.cells[0].outputs)
    assert "Not on this machine, this time" in shown and "2 ms vs 1 ms" in shown
    assert done.cells[1].outputs[0]["text"] == "the lesson goes on\n"


# --- timing claims: measured in turns, re-measured while undecided --------------------------------


def spin(seconds: float) -> None:
    """Keep this process's CPU busy for ``seconds`` of its CPU time (what the steady clock
    counts)."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def slow_at_first(fast: float, slow: float, slow_calls: int):
    """A side that takes ``slow`` seconds on its first ``slow_calls`` calls, then ``fast``: a burst
    of load."""
    calls = []

    def run():
        calls.append(None)
        spin(slow if len(calls) <= slow_calls else fast)

    return run


def test_a_true_timing_claim_is_decided_by_one_measurement():
    timed = timed_claim("a tenth of the work takes under half the time",
                        {"small": lambda: spin(0.001), "large": lambda: spin(0.01)},
                        lambda t: t["small"] < t["large"] / 2)
    assert timed.attempts == 1 and len(timed.samples["small"]) == len(timed.samples["large"]) == 5
    assert 0.0009 < timed.median("small") < timed.median("large")


def test_a_false_timing_claim_fails_with_the_ratio_and_its_spread():
    with pytest.raises(
        ClaimFailed, match=r"'large is faster'.*large / small = \d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)"
    ):
        timed_claim("large is faster", {"small": lambda: spin(0.001), "large": lambda: spin(0.01)},
                    lambda t: t["large"] < t["small"], budget_s=5)


def test_a_claim_false_at_every_corner_of_the_spreads_fails_at_once():
    t0 = time.perf_counter()
    with pytest.raises(ClaimFailed, match="1 measurement"):
        timed_claim("large is faster", {"small": lambda: spin(0.001), "large": lambda: spin(0.01)},
                    lambda t: t["large"] < t["small"], budget_s=60)
    assert time.perf_counter() - t0 < 5


def test_a_burst_of_load_delays_the_verdict_instead_of_failing_it():
    """The first calls of one side are slowed (as by another process): its median breaks the bound,
    its fastest call does not, so the helper measures again, and the quiet second measurement
    decides."""
    burst = slow_at_first(fast=0.001, slow=0.02, slow_calls=4)  # warm-up + 3 of 5 rounds slow
    timed = timed_claim(
        "checking is cheaper than a step",
        {"check": burst, "step": lambda: spin(0.005)},
        lambda t: t["check"] < t["step"],
    )
    assert timed.attempts == 2 and max(timed.samples["check"]) < 0.005


def test_a_claim_that_stays_undecided_fails_after_its_budget():
    flip = [0]

    # two calls in three slow: the median stays slow, the fastest call keeps it open
    def sometimes_slow():
        flip[0] += 1
        spin(0.02 if flip[0] % 3 else 0.001)

    # (a budget of several rounds even when a busy machine makes one take 0.6 s)
    t0 = time.perf_counter()
    # measured again, then gave up
    with pytest.raises(ClaimFailed, match=r"\b([2-9]|\d\d+) measurement\(s\)"):
        timed_claim(
            "sometimes slow is faster",
            {"side": sometimes_slow, "step": lambda: spin(0.005)},
            lambda t: t["side"] < t["step"],
            budget_s=1.5,
        )
    assert time.perf_counter() - t0 < 10


def test_one_slow_sample_a_cell_measured_is_timed_again_not_failed():
    timed = timed_claim(
        "a is faster",
        {"a": lambda: spin(0.001), "b": lambda: spin(0.005)},
        lambda t: t["a"] < t["b"],
        # one slow call of a, as under a burst of load
        first={"a": [0.05], "b": [0.005]},
    )
    assert timed.attempts == 2 and timed.median("a") < 0.005


def test_samples_a_cell_already_measured_are_judged_first():
    runs = {"a": lambda: pytest.fail("measured again"), "b": lambda: pytest.fail("measured again")}
    timed = timed_claim(
        "a is faster", runs, lambda t: t["a"] < t["b"], first={"a": [1.0, 1.1], "b": [2.0, 2.1]}
    )
    assert timed.attempts == 1 and timed.medians() == {"a": 1.05, "b": 2.05}


def test_a_true_timing_claim_passes_while_another_process_keeps_a_core_busy():
    """A busy loop on one core for the whole measurement (a second process, as on a shared runner):
    a claim that holds on a quiet machine still holds, with one torch thread."""
    import subprocess
    import sys

    import torch

    x = torch.randn(128, 128)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        time.sleep(0.2)  # let it start
        for _ in range(3):
            runs = {
                "one": lambda: x @ x,
                "two": lambda: (x @ x, x @ x),
                "eight": lambda: [x @ x for _ in range(8)],
            }
            timed_claim(
                "eight products take longer than two, and less than eight times as long as one",
                runs,
                lambda t: t["two"] < t["eight"] < 8 * t["one"] * 1.5,
                rounds=9,
            )
    finally:
        torch.set_num_threads(threads)
        busy.kill()
        busy.wait()


@pytest.mark.parametrize(
    "kwargs, kind, arg",
    [
        (dict(runs={}), BadValue, "runs"),
        (dict(holds="fast"), BadType, "holds"),  # not a function of the sides' median
        (dict(budget_s=-1), BadValue, "budget_s"),
        (dict(rounds=0), BadValue, "rounds"),
        (dict(first={"a": [1.0]}), BadValue, "first"),  # not exactly the sides
        (dict(first={"a": [1.0], "b": []}), BadValue, "first"),
        (dict(device="tpu"), BadValue, "device"),
    ],
)
def test_timed_claim_refuses_bad_arguments(kwargs, kind, arg):
    args = dict(
        name="a is faster",
        runs={"a": lambda: None, "b": lambda: None},
        holds=lambda t: t["a"] < t["b"],
    )
    args.update(kwargs)
    with raises(kind, arg):
        timed_claim(**args)


def test_a_collapsed_cell_shows_what_it_checks_not_a_test_marker():
    """JupyterLab shows a collapsed cell's first line: the learner reads "# Checks: ..." there, and
    nbval finds its marker on any line."""
    import json
    from pathlib import Path

    shown = {}
    for path in sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "code" and cell["metadata"].get("jupyter", {}).get(
                "source_hidden"
            ):
                shown[f"{path.name} cell {i}"] = "".join(cell["source"]).split("\n")[0]
    assert shown, "no collapsed cell found"
    markers = {where: line for where, line in shown.items() if line.startswith("# NBVAL_")}
    assert not markers, markers
