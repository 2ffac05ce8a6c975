"""Claims fail loudly, naming the sentence that stopped being true."""

import pytest

from ar_lab.course.claims import ClaimFailed, claim, magnitude, plural


def test_a_true_claim_is_silent_and_a_false_one_names_itself():
    claim("top-p repeats less than greedy", 0.2 < 0.5)
    with pytest.raises(ClaimFailed, match="'top-p repeats less than greedy'.*0.7 vs 0.5"):
        claim("top-p repeats less than greedy", 0.7 < 0.5, "0.7 vs 0.5")


@pytest.mark.parametrize(
    "x, text", [(6.2e5, "6 × 10⁵"), (9.6e5, "1 × 10⁶"), (1.2e-3, "1 × 10⁻³"), (3, "3 × 10⁰"), (1e8, "1 × 10⁸")]
)
def test_magnitude(x, text):
    assert magnitude(x) == text


def test_magnitude_refuses_what_has_none():
    for bad in (0, -1.0, float("nan"), float("inf"), "1"):
        with pytest.raises(ValueError, match="finite positive"):
            magnitude(bad)


def test_plural():
    assert [plural(n, "thread") for n in (0, 1, 2)] == ["0 threads", "1 thread", "2 threads"]
    assert plural(1, "KV head") == "1 KV head" and plural(4, "KV head") == "4 KV heads"
    assert plural(1_000, "step") == "1,000 steps" and plural(3, "query", "queries") == "3 queries"
    with pytest.raises(TypeError, match="int count"):
        plural(1.0, "thread")


@pytest.mark.slow
def test_a_planted_false_claim_fails_the_notebook_tests_with_its_name(tmp_path):
    """Break the bound of a claim in a copy of chapter 01 (cut after that cell): nbval, as make test runs
    it, fails on that cell and names the claim; the unbroken copy passes."""
    import subprocess
    import sys
    from pathlib import Path

    import nbformat

    source = Path(__file__).resolve().parent.parent / "notebooks" / "01_the_autoregressive_loop.ipynb"
    nb = nbformat.read(source, as_version=4)
    name = "the plausible order is far more likely than the scrambled one"
    at = next(i for i, c in enumerate(nb.cells) if name in c.source)
    nb.cells = nb.cells[: at + 1]
    nbformat.write(nb, tmp_path / "honest.ipynb")
    assert "ratio > 100," in nb.cells[at].source
    nb.cells[at].source = nb.cells[at].source.replace("ratio > 100,", "ratio > 1e12,")
    nbformat.write(nb, tmp_path / "planted.ipynb")

    def nbval(path):
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(path),
            "--nbval-lax",
            "--nbval-current-env",
        ]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=source.parent, timeout=600)

    honest, planted = nbval(tmp_path / "honest.ipynb"), nbval(tmp_path / "planted.ipynb")
    assert honest.returncode == 0, honest.stdout[-2000:]
    assert planted.returncode != 0
    assert "ClaimFailed" in planted.stdout and name in planted.stdout, planted.stdout[-2000:]
