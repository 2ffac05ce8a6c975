"""The exercise mechanism: student versions strip answers; each exercise then fails, and the chapter
still runs.

The source notebooks pass their own tests through nbval (make test runs them); here
every student version is run as a learner's Run All runs it: it reaches the last cell, and each
graded cell fails on its own (nbgrader's ``validate --invert``), so no exercise can be passed
without doing it and no unfinished exercise stops the chapter.
"""

import copy
import os
import re
from pathlib import Path

import nbformat
import pytest

from ar_lab.base.errors import BadValue
from ar_lab.course.checkers.claims import MODE_ENV as CLAIMS_MODE
from ar_lab.course.grading.cells import names
from ar_lab.course.grading.exercises import (
    CODE_STUB,
    cell_checksum,
    execute,
    exercises_only,
    grade,
    graded_cells,
    nbgrader_meta,
    release,
    strip_hidden_tests,
    strip_solutions,
    student_version,
)
from tests.raising import raises

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
WITH_EXERCISES = [
    p for p in sorted(NOTEBOOKS.glob("*.ipynb")) if graded_cells(nbformat.read(p, as_version=4))
]


def test_strip_solutions_keeps_the_scaffold_and_indentation():
    src = "def f(x):\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION\n\nprint(f)"
    out = strip_solutions(src)
    assert out == "def f(x):\n    # YOUR CODE HERE\n    raise NotImplementedError()\n\nprint(f)"
    assert "x + 1" not in out
    assert strip_solutions("answer = 42") == CODE_STUB
    assert strip_solutions("The answer.", "markdown") == "YOUR ANSWER HERE"


def test_strip_hidden_tests():
    src = (
        "assert f(1) == 2\n### BEGIN HIDDEN TESTS\nassert f(5) == 6\n### END HIDDEN "
        "TESTS\nprint('ok')"
    )
    assert strip_hidden_tests(src) == "assert f(1) == 2\nprint('ok')"


def _toy_notebook():
    from nbformat.v4 import new_code_cell, new_notebook

    sol = new_code_cell("def f(x):\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION")
    sol.metadata["nbgrader"] = {"solution": True, "grade": False, "grade_id": "f", "locked": False}
    test = new_code_cell(
        "assert f(1) == 2\n### BEGIN HIDDEN TESTS\nassert f(5) == 6\n### END HIDDEN TESTS"
    )
    test.metadata["nbgrader"] = {
        "solution": False,
        "grade": True,
        "grade_id": "f-test",
        "points": 2,
        "locked": True,
    }
    sol.outputs, sol.execution_count = [], 3
    return new_notebook(cells=[sol, test])


def test_student_version_and_grading_on_a_toy_notebook(tmp_path):
    nb = _toy_notebook()
    student = student_version(nb)
    assert "return x + 1" not in student.cells[0].source and "f(5)" not in student.cells[1].source
    assert student.cells[0].execution_count is None
    assert student.cells[1].metadata["nbgrader"]["points"] == 2  # metadata kept for nbgrader
    assert (
        student.cells[1].metadata["editable"] is False
        and student.cells[0].metadata["deletable"] is False
    )
    assert student.cells[0].metadata["nbgrader"]["checksum"] == cell_checksum(student.cells[0])
    assert nb.cells[0].metadata["nbgrader"].get("checksum") is None  # the source is left alone
    assert [r.passed for r in grade(execute(nb, tmp_path))] == [True]
    failed = grade(execute(student, tmp_path))
    assert [r.passed for r in failed] == [False] and "NotImplementedError" in failed[0].error


def test_grade_counts_stderr_as_failure_like_nbgrader():
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    cell = new_code_cell(
        "check()", outputs=[new_output("stream", name="stderr", text="Warning: wrong\n")]
    )
    cell.metadata["nbgrader"] = {
        "grade": True,
        "grade_id": "t",
        "points": 1,
        "solution": False,
        "locked": True,
    }
    [result] = grade(new_notebook(cells=[cell]))
    assert not result.passed and result.error == "stderr: Warning: wrong"
    cell.outputs = [new_output("stream", name="stdout", text="ok\n")]
    assert grade(new_notebook(cells=[cell]))[0].passed


def test_a_correct_answer_that_makes_torch_warn_keeps_its_points(tmp_path):
    """``float(loss)`` of a tensor that requires grad makes torch warn (on stderr, which nbgrader
    scores 0); under ``no_delegation``, as every graded test runs the learner's code, the warning
    goes to stdout."""
    from nbformat.v4 import new_code_cell, new_notebook

    answer = new_code_cell(
        "import torch\n\ndef train_step(x):\n    ### BEGIN SOLUTION\n    loss = (x * 2).sum()\n"
        "    return float(loss)\n    ### END SOLUTION"
    )
    answer.metadata["nbgrader"] = {
        "solution": True,
        "grade": False,
        "grade_id": "step",
        "locked": False,
    }
    guarded = ("from ar_lab.course.checkers.checks import no_delegation\n\n"
               "with no_delegation(train_step, exercise='step'):\n")
    guarded += "    assert train_step(torch.ones(3, requires_grad=True)) == 6.0"
    test = new_code_cell(guarded)
    test.metadata["nbgrader"] = {
        "solution": False,
        "grade": True,
        "grade_id": "step-test",
        "points": 3,
        "locked": True,
    }
    [result] = grade(executed := execute(new_notebook(cells=[answer, test]), tmp_path))
    assert result.passed, result.error
    assert "requires_grad=True to a scalar" in "".join(
        o.get("text", "") for o in executed.cells[1].outputs
    )
    # unguarded: the warning fails it
    test.source = "assert train_step(torch.ones(3, requires_grad=True)) == 6.0"
    [result] = grade(execute(new_notebook(cells=[answer, test]), tmp_path))
    assert not result.passed and "requires_grad=True to a scalar" in result.error


def test_release_never_overwrites_a_learners_work(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    nbformat.write(_toy_notebook(), src / "01_x.ipynb")
    assert release(src, out) == [out / "01_x.ipynb"]
    (out / "01_x.ipynb").write_text(
        (out / "01_x.ipynb").read_text().replace("YOUR CODE HERE", "my work")
    )
    assert release(src, out) == []
    assert "my work" in (out / "01_x.ipynb").read_text()
    with pytest.raises(FileNotFoundError, match="no folder"):
        release(tmp_path / "missing", out)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no notebook"):
        release(tmp_path / "empty", out)
    with raises(BadValue, "chapters"):
        release(src, out, chapters=["abc"])


def test_release_refuses_the_source_folder_however_it_is_spelled(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    nbformat.write(_toy_notebook(), src / "01_x.ipynb")
    before = (src / "01_x.ipynb").read_bytes()
    link = tmp_path / "link"
    link.symlink_to(src)
    monkeypatch.chdir(tmp_path)
    for out in [
        src,
        Path("src"),
        Path("src/../src"),
        tmp_path / "out" / ".." / "src",
        link,
        src / "sub",
        NOTEBOOKS,
    ]:
        with raises(BadValue, "out"):  # the source folder, however it is spelled
            release(src, out)
    out = tmp_path / "out"
    out.mkdir()
    # a learner's file that is the source itself
    (out / "01_x.ipynb").symlink_to(src / "01_x.ipynb")
    assert release(src, out) == []
    assert (src / "01_x.ipynb").read_bytes() == before
    assert not (src / "sub").exists()


def test_release_command_line(tmp_path, capsys):
    from ar_lab.course.grading.exercises import main

    assert main(["release", "--chapter", "00", "--out", str(tmp_path / "c")]) == 0
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [
        ".jupyter",  # the learner's JupyterLab settings (tests/test_lab_settings.py)
        "00_start_here.ipynb",
        "glossary.md",
    ]
    assert "wrote 1 student notebook(s) and the glossary" in capsys.readouterr().out
    assert main(["release", "--chapter", "00", "--out", str(tmp_path / "c")]) == 0
    assert "kept 1 already there" in capsys.readouterr().out
    assert main(["release", "--chapter", "A1", "--out", str(tmp_path / "a")]) == 0  # the appendix
    assert (tmp_path / "a" / "A1_measuring_time.ipynb").exists()
    bad_inputs = [
        ["--chapter", "abc"],
        ["--chapter", "A"],
        ["--src", str(tmp_path / "missing")],
        ["--out", str(NOTEBOOKS)],
        ["--out", str(NOTEBOOKS / ".." / "notebooks")],
        ["--overwrite"],
    ]
    for bad in bad_inputs:
        try:
            code = main(["release", *bad])
        except SystemExit as stop:  # argparse's own errors (unknown option)
            code = stop.code
        err = capsys.readouterr().err
        assert code == 2, bad
        assert err.count("\n") == 1 and "error" in err and "Traceback" not in err, err


def test_every_graded_cell_lets_run_all_go_on_and_is_still_checked_by_nbval():
    """raises-exception lets a learner's Run All pass a failing test; it would also let nbval pass a
    source notebook whose own test fails, so every graded cell also carries nbval-check-output:
    nbval compares its output with the committed one (the test's verdict), which holds no error."""
    for path in WITH_EXERCISES:
        nb = nbformat.read(path, as_version=4)
        for i, meta in graded_cells(nb):
            cell = nb.cells[i]
            tags = cell.metadata.get("tags", [])
            assert {"raises-exception", "nbval-check-output"} <= set(tags), (
                f"{path.name} {meta['grade_id']}: {tags}"
            )
            kinds = [o.output_type for o in cell.outputs]
            said = "".join(o.get("text", "") for o in cell.outputs)
            assert "error" not in kinds and said.startswith("✔"), (
                f"{path.name} {meta['grade_id']}: {kinds} {said!r}"
            )


def test_grade_ids_are_unique_across_the_course():
    seen = {}
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
            if gid:
                assert gid not in seen, f"grade_id {gid!r} is in both {seen[gid]} and {path.name}"
                seen[gid] = path.name


def run_all(nb: nbformat.NotebookNode, cwd: Path, *, timeout: int = 300) -> nbformat.NotebookNode:
    """JupyterLab's Run All, headless, in a learner's kernel (its timing claims show a caveat where
    a busy machine leaves them false; its other claims stop it): every cell in order, stopping at
    the first error in a cell without the ``raises-exception`` tag (nbclient honours the tag as
    JupyterLab does)."""
    from nbclient import NotebookClient

    nb = copy.deepcopy(nb)
    learner = {k: v for k, v in os.environ.items() if k != CLAIMS_MODE}
    NotebookClient(
        nb, timeout=timeout, allow_errors=False, resources={"metadata": {"path": str(cwd)}},
        shutdown_kernel="immediate",  # the outputs are in: no need to wait for the kernel's exit
    ).execute(env=learner)
    return nb


# Every chapter's student version is run whole, as a learner's Run All, by make test-busy
# (tests/test_busy_run_all.py, beside a busy loop on every core: check_student_run_all). make test
# runs each one cut to its exercises and the cells they need (cells.cut), which is where a stub
# could pass its test, and leaves that second run of every experiment to make test-busy (chapter
# 02's student version also runs whole in JupyterLab, tests/test_browser.py).


@pytest.mark.slow
@pytest.mark.parametrize("path", WITH_EXERCISES, ids=[p.stem for p in WITH_EXERCISES])
def test_every_graded_test_of_the_student_version_fails_for_its_missing_answer(path):
    from tests.conftest import one_thread_env

    source = nbformat.read(path, as_version=4)
    student = exercises_only(student_version(source))
    check_missing_answers(path, source, execute(student, path.parent, env=one_thread_env()))


def check_student_run_all(path: Path) -> nbformat.NotebookNode:
    """A learner who has done no exercise runs the whole chapter: Run All reaches the last cell;
    every graded test cell fails (nbgrader's grade: 0 points), because the answer is missing (never
    because a cell it needs failed); no other cell fails; the cells that use a learner's piece run
    on ar_lab's and say so. A chapter without exercises: Run All reaches its end. Returns the
    executed notebook."""
    source = nbformat.read(path, as_version=4)
    if not graded_cells(source):
        executed = run_all(source, path.parent)
        assert all(c.execution_count is not None for c in executed.cells if c.cell_type == "code")
        return executed
    # raises CellExecutionError if Run All stops
    executed = run_all(student_version(source), path.parent)
    code = [c for c in executed.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), (
        f"{path.name}: Run All did not reach the end"
    )
    check_missing_answers(path, source, executed)
    said = "".join(o.get("text", "") for c in code for o in c.get("outputs", []))
    assert "▶ this runs on your" not in said, (
        f"{path.name}: a cell claims to run the learner's unfinished piece"
    )
    uses = re.compile(r"\byours_or_ours\(")
    if any(uses.search(c.source) for c in source.cells):
        assert "this runs on ar_lab's" in said, (
            f"{path.name}: no cell said it fell back to ar_lab's piece"
        )
    return executed


def check_missing_answers(path: Path, source, executed) -> None:
    """In ``executed`` (the student version of ``source``, run), every graded test cell failed
    (nbgrader's grade: 0 points), because the answer is missing (never because a cell it needs
    failed), and no cell but the exercises' failed."""
    answers = set().union(
        *(names(c.source)[0] for c in source.cells if nbgrader_meta(c).get("solution"))
    )
    results = grade(executed)
    assert results, f"{path.name} has no graded cells"
    passing = [r.grade_id for r in results if r.passed]
    assert not passing, f"{path.name}: these tests pass without the learner's work: {passing}"
    missing = re.compile(
        r"^NotImplementedError|^CheckFailed: .*: not implemented yet|^NameError: name '(\w+)' is "
        r"not"
    )
    wrong = {r.grade_id: r.error[:200] for r in results
             if not (m := missing.match(r.error)) or (m.group(1) and m.group(1) not in answers)}
    assert not wrong, f"{path.name}: failed for a reason other than the missing answer: {wrong}"
    for i, cell in enumerate(executed.cells):
        if any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            meta = nbgrader_meta(cell)
            assert meta.get("grade") or meta.get("solution"), (
                f"{path.name}: cell {i} failed and is no exercise"
            )


@pytest.mark.slow
def test_the_installed_package_carries_no_solution(tmp_path):
    """The graded set-up INSTRUCTORS.md gives installs the package from its wheel (`pip install .`):
    the wheel holds ar_lab's modules only: no notebook, no solution region, so a learner's kernel
    there has the answers nowhere to read. (The package's own code is the reference each exercise
    is checked against; the delegation guard keeps it from being called or copied by code.)"""
    import subprocess
    import sys
    import zipfile

    from ar_lab.course.grading.exercises import _SOLUTION

    root = Path(__file__).resolve().parent.parent
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(root),
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = tmp_path.glob("ar_lab-*.whl")
    with zipfile.ZipFile(wheel) as z:
        texts = {n: z.read(n).decode("utf-8", "replace") for n in z.namelist()}
    assert texts and all(n.startswith(("ar_lab/", "ar_lab-")) for n in texts), list(texts)
    assert not [n for n in texts if n.endswith(".ipynb")]
    assert not [n for n, text in texts.items() if _SOLUTION.search(text)]
    source = "".join(
        c.source for c in nbformat.read(NOTEBOOKS / "06_sampling.ipynb", as_version=4).cells
    )
    assert _SOLUTION.search(source), "the check finds a solution region where there is one"


WRONG_SAMPLERS = {
    "min-p in another order than ar_lab's": (
        "T=1.5, min-p 0.1",
        """
def my_sampler_probabilities(logits, params):
    p = torch.softmax(logits.float(), -1)
    # min-p on the untempered distribution: not ar_lab's order
    p = torch.where(p >= params.min_p * p.max(), p, 0.0)
    probs = my_temperature_probabilities(
        torch.where(p > 0, logits.float(), float("-inf")), params.temperature
    )
    if params.top_k is not None and params.top_k < len(probs):
        probs = torch.where(probs >= probs.topk(params.top_k).values[-1], probs, 0.0)
        probs = probs / probs.sum()
    probs = torch.where(my_top_p_keep(probs, params.top_p), probs, 0.0)
    return probs / probs.sum()


def my_sample(logits, params, generator=None):
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(my_sampler_probabilities(logits, params), 1, generator=generator))
""",
    ),
    "a draw that ignores the generator": (
        "50 draws of my_sample",
        """
def my_sampler_probabilities(logits, params):
    probs = my_temperature_probabilities(logits, params.temperature)
    if params.top_k is not None and params.top_k < len(probs):
        probs = torch.where(probs >= probs.topk(params.top_k).values[-1], probs, 0.0)
        probs = probs / probs.sum()
    probs = torch.where(my_top_p_keep(probs, params.top_p), probs, 0.0)
    probs = probs / probs.sum()
    if params.min_p > 0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def my_sample(logits, params, generator=None):
    if params.greedy:
        return int(logits.argmax())
    # the global generator
    return int(torch.multinomial(my_sampler_probabilities(logits, params), 1))
""",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("mistake", WRONG_SAMPLERS)
def test_a_wrong_sampler_fails_the_distribution_comparison(mistake):
    """Chapter 06's whole-sampler exercise, answered with a classic mistake: its graded test fails
    at the setting that exposes it (the distribution, or the draws), while the other exercises keep
    passing."""
    from ar_lab.course.grading.exercises import exercises_only

    path = NOTEBOOKS / "06_sampling.ipynb"
    nb = nbformat.read(path, as_version=4)
    where, answer = WRONG_SAMPLERS[mistake]
    [cell] = [c for c in nb.cells if nbgrader_meta(c).get("grade_id") == "ch06-sampler"]
    cell.source = answer.strip()
    results = {r.grade_id: r for r in grade(execute(exercises_only(nb), path.parent))}
    verdict = results["ch06-sampler-tests"]
    assert (
        not verdict.passed and verdict.error.startswith("CheckFailed") and where in verdict.error
    ), verdict.error
    if mistake.startswith("min-p"):  # a mistake ar_lab.course.checkers.mistakes knows is named
        assert (
            "what min-p before the temperature (on the untempered distribution) gives"
            in verdict.error
        )
    assert all(r.passed for gid, r in results.items() if gid != "ch06-sampler-tests"), results


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=[p.stem for p in WITH_EXERCISES])
def test_the_committed_chapter_runs_its_experiments_on_the_learners_pieces(path):
    """In the source notebook (every answer written), each cell that picks a learner's piece ran on
    it: its committed output says so (the README's chapter table names these cells). With no answer
    written, the same cells fall back to ar_lab's (check_student_run_all, make test-busy)."""
    nb = nbformat.read(path, as_version=4)
    picks = [
        c for c in nb.cells if c.cell_type == "code" and re.search(r"\byours_or_ours\(", c.source)
    ]
    assert picks or path.stem[:2] in {"00", "01"}, (
        f"{path.name}: no experiment runs on the learner's pieces"
    )
    for cell in picks:
        said = "".join(o.get("text", "") for o in cell.get("outputs", []))
        assert "▶ this runs on your" in said and "▷" not in said, (
            f"{path.name}: a cell that picks the learner's piece did not run on it:\n"
            f"{cell.source[:300]}"
        )
