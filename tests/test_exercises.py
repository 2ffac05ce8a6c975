"""The exercise mechanism: student versions strip answers; each exercise then fails.

The source notebooks pass their own tests through nbval (make test runs them); here
every student version is executed and each graded cell must fail on its own
(nbgrader's ``validate --invert``), so no exercise can be passed without doing it.
"""

from pathlib import Path

import nbformat
import pytest

from ar_lab.exercises import (
    CODE_STUB,
    execute,
    grade,
    graded_cells,
    release,
    strip_hidden_tests,
    strip_solutions,
    student_version,
)

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
WITH_EXERCISES = [p for p in sorted(NOTEBOOKS.glob("*.ipynb")) if graded_cells(nbformat.read(p, as_version=4))]


def test_strip_solutions_keeps_the_scaffold_and_indentation():
    src = "def f(x):\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION\n\nprint(f)"
    out = strip_solutions(src)
    assert out == "def f(x):\n    # YOUR CODE HERE\n    raise NotImplementedError()\n\nprint(f)"
    assert "x + 1" not in out
    assert strip_solutions("answer = 42") == CODE_STUB
    assert strip_solutions("The answer.", "markdown") == "YOUR ANSWER HERE"


def test_strip_hidden_tests():
    src = "assert f(1) == 2\n### BEGIN HIDDEN TESTS\nassert f(5) == 6\n### END HIDDEN TESTS\nprint('ok')"
    assert strip_hidden_tests(src) == "assert f(1) == 2\nprint('ok')"


def _toy_notebook():
    from nbformat.v4 import new_code_cell, new_notebook

    sol = new_code_cell("def f(x):\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION")
    sol.metadata["nbgrader"] = {"solution": True, "grade": False, "grade_id": "f", "locked": False}
    test = new_code_cell("assert f(1) == 2\n### BEGIN HIDDEN TESTS\nassert f(5) == 6\n### END HIDDEN TESTS")
    test.metadata["nbgrader"] = {"solution": False, "grade": True, "grade_id": "f-test", "points": 2, "locked": True}
    sol.outputs, sol.execution_count = [], 3
    return new_notebook(cells=[sol, test])


def test_student_version_and_grading_on_a_toy_notebook(tmp_path):
    nb = _toy_notebook()
    student = student_version(nb)
    assert "return x + 1" not in student.cells[0].source and "f(5)" not in student.cells[1].source
    assert student.cells[0].execution_count is None
    assert student.cells[1].metadata["nbgrader"]["points"] == 2  # metadata kept for nbgrader
    assert [r.passed for r in grade(execute(nb, tmp_path))] == [True]
    failed = grade(execute(student, tmp_path))
    assert [r.passed for r in failed] == [False] and "NotImplementedError" in failed[0].error


def test_release_never_overwrites_a_learners_work(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    nbformat.write(_toy_notebook(), src / "01_x.ipynb")
    assert release(src, out) == [out / "01_x.ipynb"]
    (out / "01_x.ipynb").write_text((out / "01_x.ipynb").read_text().replace("YOUR CODE HERE", "my work"))
    assert release(src, out) == []
    assert "my work" in (out / "01_x.ipynb").read_text()
    with pytest.raises(FileNotFoundError, match="no notebooks"):
        release(tmp_path / "empty", out)


def test_grade_ids_are_unique_across_the_course():
    seen = {}
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
            if gid:
                assert gid not in seen, f"grade_id {gid!r} is in both {seen[gid]} and {path.name}"
                seen[gid] = path.name


@pytest.mark.slow
@pytest.mark.parametrize("path", WITH_EXERCISES, ids=[p.stem for p in WITH_EXERCISES])
def test_every_exercise_fails_in_the_student_version(path):
    student = student_version(nbformat.read(path, as_version=4))
    results = grade(execute(student, path.parent))
    assert results, f"{path.name} has no graded cells"
    passing = [r.grade_id for r in results if r.passed]
    assert not passing, f"{path.name}: these tests pass without the learner's work: {passing}"


@pytest.mark.slow
def test_autograde_full_zero_and_partial_marks(tmp_path):
    """Three submissions of chapter 00: the solutions, the untouched release, one exercise done."""
    from ar_lab.exercises import autograde, strip_solutions

    source_path = NOTEBOOKS / "00_start_here.ipynb"
    source = nbformat.read(source_path, as_version=4)
    student = student_version(source)
    partial = student_version(source)
    solved = next(c for c in source.cells if nbgrader_meta_id(c) == "ch00-to-tokens")
    for cell in partial.cells:
        if nbgrader_meta_id(cell) == "ch00-to-tokens":
            cell.source = solved.source  # this learner did exercise 1 only
    cheater = student_version(source)
    for cell in cheater.cells:  # edits a locked test cell to pass: must be undone by the grader
        if nbgrader_meta_id(cell) == "ch00-tokens-per-char-tests":
            cell.source = "pass"
    for name, nb in [("ada", source), ("bob", student), ("cy", partial), ("dee", cheater)]:
        (tmp_path / "submitted" / name).mkdir(parents=True)
        nbformat.write(nb, tmp_path / "submitted" / name / source_path.name)
    graded = {g.student: g for g in autograde(tmp_path / "submitted", NOTEBOOKS, tmp_path / "grades")}
    total = graded["ada"].max_score
    assert total > 0 and graded["ada"].score == total
    assert graded["bob"].score == 0 and not any(r.passed for r in graded["bob"].results)
    assert 0 < graded["cy"].score < total
    assert [r.passed for r in graded["cy"].results] == [True, False]
    assert graded["dee"].score == 0
    csv_text = (tmp_path / "grades" / "grades.csv").read_text()
    assert "cy,00_start_here.ipynb,ch00-to-tokens-tests,1.0,1.0" in csv_text
    feedback = (tmp_path / "grades" / "feedback" / "cy" / "00_start_here.txt").read_text()
    assert "[passed] ch00-to-tokens-tests" in feedback and "[FAILED] ch00-tokens-per-char-tests" in feedback
    assert "not implemented yet" in feedback
    assert strip_solutions(solved.source) != solved.source


def nbgrader_meta_id(cell):
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
