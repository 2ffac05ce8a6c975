"""Chapter 05's probes exercise: each classic wrong version fails the notebook's own graded test
with its mistake named, and the chapter's answer passes.

The answer and test cells are read from the notebook (hidden tests included) and run here as the
kernel runs them: the answer compiled as notebook code, the test inside ``no_delegation``. The rate
check times the matmul probe on a smaller product than the notebook's (``RATE_SIZES``), which keeps
this fast; the timing slips it names are 10x and 1,000x off, far outside its 3x band at any size.
The stream probe keeps the notebook's 2**23 values per array: arrays of 2**21 (24 MiB for the
three) sit partly in a large L3, and the right answer then measured 1.53x ar_lab's in a busy CI run,
over the 1.5x that names a cache-resident buffer.
"""

import math
import time

import nbformat
import pytest
import torch

from ar_lab.base.timing import synchronize
from ar_lab.course.checkers import roofline_checks
from ar_lab.course.checkers.checks import CheckFailed
from ar_lab.course.grading.exercises import NOTEBOOKS, nbgrader_meta
from tests.raising import mistaken

CHAPTER = NOTEBOOKS / "05_prefill_vs_decode.ipynb"


def _cells() -> tuple[str, str]:
    """(the probes' answer cell with its solution, their graded test cell with its hidden tests)."""
    cells = {
        nbgrader_meta(c).get("grade_id"): c.source
        for c in nbformat.read(CHAPTER, as_version=4).cells
    }
    return cells["ch05-probes"], cells["ch05-probes-tests"]


ANSWER, TEST = _cells()


@pytest.fixture(autouse=True)
def small_sizes(monkeypatch):
    """A smaller matmul than the notebook's (the stream probe's arrays as large: they must not fit
    a cache), on one thread (as the chapter measures on a busy machine)."""
    monkeypatch.setitem(roofline_checks.RATE_SIZES, "cpu", (2**23, 256))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_test(answer: str) -> str:
    """Run the test cell on ``answer`` (the answer cell's source) as a kernel would; what it
    printed."""
    namespace = {"torch": torch, "math": math, "time": time, "synchronize": synchronize,
                 "device": torch.device("cpu"), "dtype": torch.float32}
    exec(compile(answer, "<answer cell>", "exec"), namespace)
    exec(compile(TEST, "<test cell>", "exec"), namespace)


def wrong(old: str, new: str) -> str:
    assert ANSWER.count(old) == 1, old
    return ANSWER.replace(old, new)


WRONG = {  # the slip, written out -> a fragment of the mistake's name in the verdict
    "one array's bytes": (wrong("return 3 * a.nbytes,", "return a.nbytes,"), "one array's bytes"),
    "the reads only": (
        wrong("return 3 * a.nbytes,", "return 2 * a.nbytes,"),
        "bytes read (a and b)",
    ),
    "values for bytes": (wrong("return 3 * a.nbytes,", "return 3 * n,"), "values instead of bytes"),
    "a multiply-add as one FLOP": (
        wrong("return 2 * m * k * n,", "return m * k * n,"),
        "multiply-add counted as one",
    ),
    "a square product's count": (
        wrong("return 2 * m * k * n,", "return 2 * n**3,"),
        "a square product's count",
    ),
    "milliseconds": (
        wrong("    return best\n", "    return best * 1e3\n"),
        "seconds read as milliseconds",
    ),
    "the total of the repeats": (
        wrong(
            "        best = min(best, time.perf_counter() - t0)\n    return best\n",
            "        best = (0 if best == math.inf else best) + time.perf_counter() - t0\n    "
            "return best\n",
        ),
        f"the total of all {roofline_checks.RATE_REPEATS} calls",
    ),
    # all three arrays allocated and counted, a slice of them timed: a cache-resident buffer
    "a buffer the caches hold": (
        wrong("fastest(lambda: torch.add(a, b, out=c), repeats)",
              "fastest(lambda: torch.add(a[:4096], b[:4096], out=c[:4096]), repeats)"),
        "a buffer the CPU's caches hold",
    ),
    "a rate, not a pair": (
        wrong("return 3 * a.nbytes, fastest(", "return 3 * a.nbytes / fastest("),
        "one number (a rate?) instead of the pair",
    ),
}


@pytest.mark.parametrize("slip", list(WRONG))
def test_each_classic_slip_fails_the_graded_test_naming_it(slip):
    answer, named = WRONG[slip]
    with mistaken(named):
        run_test(answer)


def test_the_chapters_answer_passes(capsys):
    run_test(ANSWER)
    assert "✔ your probes count bytes and FLOPs right" in capsys.readouterr().out


def test_a_slip_that_gives_the_right_value_is_not_named():
    """4 bytes per value is right for fp32, a square count right for a square product: not named
    there."""
    assert not any("4 bytes per value" in m for m in roofline_checks.stream_probe_mistakes(100, 4))
    assert "4 bytes per value" in " ".join(roofline_checks.stream_probe_mistakes(100, 2))
    assert not any("square" in m for m in roofline_checks.matmul_probe_mistakes(8, 8, 8))


def test_a_rate_far_off_is_named_only_where_a_slip_explains_it():
    mistakes = roofline_checks.rate_mistakes(torch.device("cpu"))
    named = [
        m
        for ratio in (1e-3, 0.1, 1.0, 10.0)
        for m, (lo, hi) in mistakes.items()
        if lo <= ratio <= hi
    ]
    assert len(named) == 3 and "milliseconds" in named[0] and "total" in named[1]
    assert "caches hold" in named[2]  # 10x: faster than memory on the same arrays
    # a matmul faster than ar_lab's is not a cache-resident buffer: that slip is the stream probe's
    flops = roofline_checks.rate_mistakes(torch.device("cpu"), "FLOP/s")
    assert not any("caches hold" in m for m in flops)
    assert any("synchronize" in m for m in roofline_checks.rate_mistakes(torch.device("cuda")))


@pytest.mark.parametrize(
    "got", [1.5e10, (1, 2, 3), (100, 0.0), (100, float("nan")), ("a", 1.0), None]
)
def test_a_probe_that_does_not_return_a_count_and_seconds_is_told_so(got):
    with pytest.raises(CheckFailed, match=r"expected a pair \(count, seconds\)"):
        roofline_checks.probe_result("stream_probe(8)", got)
    assert roofline_checks.probe_result("p", (12, 0.5)) == (12.0, 0.5)


def test_the_rate_check_runs_both_sides_on_one_thread_and_restores_the_thread_count():
    """The grading's fresh run measures ar_lab's side again, with no cell having set the threads:
    one thread on both sides, in the kernel and there, keeps the comparison the same."""
    from ar_lab.perf import peaks

    torch.set_num_threads(2)  # the fixture restores the count it found
    seen = []

    def stream(n, repeats):
        seen.append(torch.get_num_threads())
        return peaks.stream_probe(n, repeats)

    def matmul(m, k, n, repeats):
        seen.append(torch.get_num_threads())
        return peaks.matmul_probe(m, k, n, repeats)

    ratios = roofline_checks.check_probe_rates(stream, matmul, "cpu", torch.float32)
    assert seen == [1] * (2 * roofline_checks.RATE_ROUNDS) and torch.get_num_threads() == 2
    assert set(ratios) == {"bandwidth", "FLOP/s"} and all(1 / 3 <= r <= 3 for r in ratios.values())
