"""Grading an instructor can trust: nbgrader's own commands, run from a course folder `course` lays
out.

The end-to-end tests run the commands INSTRUCTORS.md shows (the ``nbgrader ...`` strings
below; tests/test_instructors.py checks the guide against them) on one chapter with
hostile submissions. Each is graded correctly or reported, none stops the others, none
earns points it should not. Scores are read from nbgrader's gradebook and its CSV export.
"""

import copy
import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from ar_lab.base.errors import BadValue
from ar_lab.course.grading.exercises import (
    NOTEBOOKS,
    course,
    graded_cells,
    nbgrader_config,
    nbgrader_meta,
    student_version,
)
from tests.conftest import one_thread_env
from tests.raising import raises

ASSIGNMENT = "00_start_here"  # the fastest chapter with exercises (a few seconds per run)
TIMEOUT = 10  # seconds per cell in the test's course folder: what an infinite loop costs

# The commands INSTRUCTORS.md shows, run here as written (with .venv's nbgrader).
GENERATE = "nbgrader generate_assignment {assignment}"
AUTOGRADE = "nbgrader autograde {assignment}"
REGRADE = "nbgrader autograde {assignment} --student {student} --force"
FEEDBACK = "nbgrader generate_feedback {assignment}"
EXPORT = "nbgrader export"


def nbgrader(folder: Path, command: str, **fields) -> subprocess.CompletedProcess:
    """Run one of the commands above in ``folder`` with this interpreter's nbgrader."""
    args = shlex.split(command.format(**fields))
    assert args[0] == "nbgrader"
    # nbgrader runs `alembic` by name when it opens the gradebook: the venv's bin must be on PATH,
    # as it is once .venv is activated.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = one_thread_env(dict(os.environ, PATH=path))
    return subprocess.run(
        [sys.executable, "-m", "nbgrader", *args[1:]],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


# --- the course folder (fast) ---------------------------------------------------------------


def test_course_lays_out_an_nbgrader_course_folder(tmp_path):
    folder = tmp_path / "grading"
    written = course(folder, chapters=["0", "06"], timeout=7)
    source = folder / "source" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
    assert source.read_bytes() == (NOTEBOOKS / f"{ASSIGNMENT}.ipynb").read_bytes()
    assert (folder / "source" / "06_sampling" / "06_sampling.ipynb").exists()
    assert (
        folder
        / "source"
        / "06b_beam_search_and_constraints"
        / "06b_beam_search_and_constraints.ipynb"
    ).exists()
    assert sorted(p.name for p in written) == [  # a chapter and its parts
        "00_start_here.ipynb",
        "06_sampling.ipynb",
        "06b_beam_search_and_constraints.ipynb",
        "nbgrader_config.py",
    ]
    config = (folder / "nbgrader_config.py").read_text()
    compile(config, "nbgrader_config.py", "exec")
    assert config == nbgrader_config(timeout=7)
    settings = [
        'c.CourseDirectory.course_id = "ar_lab"',
        "c.Execute.timeout = 7",
        "add_missing_cells = True",
    ]
    for setting in settings:
        assert setting in config
    # autograde's kernels run as nbgrader starts them: the course's step is after
    assert "os.environ" not in config
    assert course(folder, chapters=["0"]) == []  # unchanged: nothing to write


def test_course_keeps_what_is_there_unless_told(tmp_path):
    folder = tmp_path / "grading"
    course(folder, chapters=["0"])
    source = folder / "source" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
    source.write_text(source.read_text().replace("to_tokens", "my_edit"))
    (folder / "nbgrader_config.py").write_text("c = get_config()  # the instructor's own\n")
    with pytest.raises(FileExistsError, match="--overwrite"):
        course(folder, chapters=["0", "6"])
    assert not (folder / "source" / "06_sampling").exists()  # refused before writing anything
    assert course(folder, chapters=["0"], overwrite=True) == [source]
    assert source.read_bytes() == (NOTEBOOKS / f"{ASSIGNMENT}.ipynb").read_bytes()
    assert "the instructor's own" in (folder / "nbgrader_config.py").read_text()


def test_course_never_writes_into_the_source_notebooks(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(NOTEBOOKS)
    for folder in [
        NOTEBOOKS,
        NOTEBOOKS / "grading",
        NOTEBOOKS / ".." / "notebooks",
        link,
        link / "sub",
    ]:
        with raises(BadValue, "folder"):  # the source folder itself
            course(folder, chapters=["0"])
    inside = tmp_path / "grading" / "source" / ASSIGNMENT
    inside.parent.mkdir(parents=True)
    inside.symlink_to(NOTEBOOKS)  # source/<chapter>/ pointing at notebooks/
    with raises(BadValue, "folder"):
        course(tmp_path / "grading", chapters=["0"])
    with raises(BadValue, "timeout"):
        course(tmp_path / "other", timeout=0)


def test_course_command_line(tmp_path, capsys):
    from ar_lab.course.grading.exercises import main

    assert main(["course", str(tmp_path / "g"), "--chapter", "00", "--timeout", "30"]) == 0
    assert "c.Execute.timeout = 30" in (tmp_path / "g" / "nbgrader_config.py").read_text()
    for bad in [
        ["--chapter", "abc"],
        ["--chapter", "42"],
        ["--timeout", "0"],
        ["--src", str(tmp_path / "nope")],
    ]:
        assert main(["course", str(tmp_path / "h"), *bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error" in err and "Traceback" not in err


# --- nbgrader's own commands, end to end (slow) -------------------------------------------------


def _exercises(source):
    """[(solution grade_id, test grade_id, points)] in notebook order."""
    solutions = [
        nbgrader_meta(c)["grade_id"] for c in source.cells if nbgrader_meta(c).get("solution")
    ]
    tests = [(meta["grade_id"], float(meta["points"])) for _, meta in graded_cells(source)]
    assert len(solutions) == len(tests) >= 2, "the test needs a chapter with two exercises or more"
    return [(s, t, p) for s, (t, p) in zip(solutions, tests, strict=True)]


def _index(nb, grade_id):
    return next(i for i, c in enumerate(nb.cells) if nbgrader_meta(c).get("grade_id") == grade_id)


def _submissions(source, released):
    """Student -> (notebook or raw text, file name). Exercise 1 and 2 are the chapter's first
    two."""
    (sol1, test1, _), (sol2, test2, _) = _exercises(source)[:2]

    def edit(nb, grade_id, text):
        nb = copy.deepcopy(nb)
        nb.cells[_index(nb, grade_id)].source = text
        return nb

    def solved(nb, *grade_ids):
        for grade_id in grade_ids:
            nb = edit(nb, grade_id, source.cells[_index(source, grade_id)].source)
        return nb

    deleted = solved(released, sol2)
    del deleted.cells[_index(deleted, test1)]
    duplicated = solved(released, sol1)
    copies = [copy.deepcopy(duplicated.cells[_index(duplicated, test1)]) for _ in range(2)]
    # what a copy-paste in JupyterLab gives: same metadata, new cell id
    for n, cell in enumerate(copies):
        cell["id"] = f"copy-{n}"
    at = _index(duplicated, test1) + 1
    duplicated.cells[at:at] = copies
    meddled = solved(released, sol1, sol2)  # with a test cell's nbgrader metadata rewritten,
    meddled.cells[_index(meddled, test2)].metadata["nbgrader"]["schema_version"] = 2
    other = nbformat.read(NOTEBOOKS / "06_sampling.ipynb", as_version=4)
    foreign = copy.deepcopy(other.cells[graded_cells(other)[0][0]])
    foreign.source, foreign["id"] = "pass", "pasted"
    meddled.cells.append(foreign)  # and a test cell pasted from another chapter, made to pass
    name = f"{ASSIGNMENT}.ipynb"
    return {
        "complete": (source, name),
        "empty": (released, name),
        "partial": (solved(released, sol1), name),
        "loop": (edit(solved(released, sol2), sol1, "while True:\n    pass"), name),
        "exits": (edit(solved(released, sol2), sol1, "import os\nos._exit(1)"), name),
        "deleted": (deleted, name),
        "duplicated": (duplicated, name),
        "edited": (edit(released, test1, "pass"), name),
        "meddled": (meddled, name),
        "corrupt": ("this is not a notebook {", name),
        "renamed": (source, f"{ASSIGNMENT} (1).ipynb"),
    }


def _scores(folder):
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{folder / 'gradebook.db'}") as gb:
        out = {}
        for student in gb.students:
            sub = gb.find_submission(ASSIGNMENT, student.id)
            grades = {g.name: g.score for nb in sub.notebooks for g in nb.grades}
            out[student.id] = (sub.score, sub.max_score, sub.needs_manual_grade, grades)
        return out


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Lay out the course, release, grade every submission once, regrade the renamed one, feedback,
    export."""
    from ar_lab.course.grading.exercises import exercises_only

    root = tmp_path_factory.mktemp("graded")
    # the chapter cut to its exercises: eleven autograde runs of the experiments would add minutes
    cut = root / "cut"
    cut.mkdir()
    nbformat.write(exercises_only(nbformat.read(NOTEBOOKS / f"{ASSIGNMENT}.ipynb", as_version=4)),
                   cut / f"{ASSIGNMENT}.ipynb")
    folder = root / "grading"
    course(folder, src=cut, chapters=[ASSIGNMENT[:2]], timeout=TIMEOUT)
    assert nbgrader(folder, GENERATE, assignment=ASSIGNMENT).returncode == 0
    source = nbformat.read(folder / "source" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb", as_version=4)
    released = nbformat.read(folder / "release" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb", as_version=4)
    for student, (nb, name) in _submissions(source, released).items():
        target = folder / "submitted" / student / ASSIGNMENT / name
        target.parent.mkdir(parents=True)
        target.write_text(nb if isinstance(nb, str) else json.dumps(nb))
    autograde = nbgrader(folder, AUTOGRADE, assignment=ASSIGNMENT)
    first = _scores(folder)
    # The guide's step for a submission under another name: rename it, regrade that student.
    submitted = folder / "submitted" / "renamed" / ASSIGNMENT
    (submitted / f"{ASSIGNMENT} (1).ipynb").rename(submitted / f"{ASSIGNMENT}.ipynb")
    regrade = nbgrader(folder, REGRADE, assignment=ASSIGNMENT, student="renamed")
    feedback = nbgrader(folder, FEEDBACK, assignment=ASSIGNMENT)
    export = nbgrader(folder, EXPORT)
    return dict(folder=folder, source=source, released=released, autograde=autograde, first=first,
                regrade=regrade, feedback=feedback, export=export, final=_scores(folder))


@pytest.mark.slow
def test_nbgrader_release_is_the_student_version(graded):
    assert graded["released"] == student_version(graded["source"])


@pytest.mark.slow
def test_every_submission_is_graded_or_reported_and_none_stops_the_others(graded):
    (_, test1, p1), (_, test2, p2) = _exercises(graded["source"])[:2]
    total = sum(p for _, _, p in _exercises(graded["source"]))
    scores = graded["first"]
    log = graded["autograde"].stdout + graded["autograde"].stderr
    reported = set(
        re.findall(rf"error processing assignment '{ASSIGNMENT}' for student '(\w+)'", log)
    )
    assert graded["autograde"].returncode != 0 and reported == {"exits", "corrupt", "renamed"}, log[
        -3000:
    ]
    expected = {
        "complete": total,
        "empty": 0,
        "partial": p1,
        "loop": p2,  # the loop is interrupted after TIMEOUT s: it costs exercise 1 only
        "deleted": p2,  # the deleted test is put back and run: exercise 1 undone, so no points
        "duplicated": p1,  # counted once, not three times
        "edited": 0,  # the test edited to `pass` is restored from the gradebook
        "meddled": p1 + p2,  # the rewritten test is put back and run; the pasted one earns nothing
    }
    assert set(scores) == set(expected) | reported
    for student, points in expected.items():
        score, max_score, needs_manual, _ = scores[student]
        assert (score, max_score, needs_manual) == (points, total, False), student
    for student in reported:  # no points, and flagged for the instructor
        score, max_score, needs_manual, _ = scores[student]
        assert (score, max_score, needs_manual) == (0, total, True), student
    assert scores["duplicated"][3] == {test1: p1, test2: 0}
    assert set(scores["meddled"][3]) == {test for _, test, _ in _exercises(graded["source"])}


@pytest.mark.slow
def test_graded_notebooks_run_the_instructors_tests(graded):
    (_, test1, _), (_, test2, _) = _exercises(graded["source"])[:2]
    official = graded["source"].cells[_index(graded["source"], test1)].source
    autograded = graded["folder"] / "autograded"
    edited = nbformat.read(autograded / "edited" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb", as_version=4)
    assert edited.cells[_index(edited, test1)].source == official  # hidden tests included
    deleted = nbformat.read(
        autograded / "deleted" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb", as_version=4
    )
    assert official in deleted.cells[_index(deleted, test1)].source
    loop = nbformat.read(autograded / "loop" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb", as_version=4)
    errors = [
        o.get("ename")
        for c in loop.cells
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert "CellTimeoutError" in errors


@pytest.mark.slow
def test_renamed_submission_regraded_then_feedback_and_export(graded):
    folder, total = graded["folder"], sum(p for _, _, p in _exercises(graded["source"]))
    assert graded["regrade"].returncode == 0, graded["regrade"].stderr[-3000:]
    assert graded["final"]["renamed"][:3] == (total, total, False)
    assert graded["feedback"].returncode == 0, graded["feedback"].stderr[-3000:]
    for student, (_, _, needs_manual, _) in graded["final"].items():
        html = folder / "feedback" / student / ASSIGNMENT / f"{ASSIGNMENT}.html"
        # a reported submission has no feedback yet
        assert html.exists() == (not needs_manual), student
    assert graded["export"].returncode == 0, graded["export"].stderr[-3000:]
    with open(folder / "grades.csv") as f:
        rows = {row["student_id"]: row for row in csv.DictReader(f)}
    assert set(rows) == set(graded["final"])
    for student, (score, max_score, _, _) in graded["final"].items():
        assert (float(rows[student]["score"]), float(rows[student]["max_score"])) == (
            score,
            max_score,
        )


@pytest.mark.slow
def test_release_matches_nbgrader_generate_assignment_for_every_chapter(tmp_path):
    """nbgrader's generate_assignment (no gradebook needed) against ``release``, whole notebooks."""
    from ar_lab.course.grading.exercises import release

    # both read the same files, whatever happens to notebooks/ meanwhile
    snapshot = tmp_path / "notebooks"
    snapshot.mkdir()
    for path in NOTEBOOKS.glob("*.ipynb"):
        shutil.copyfile(path, snapshot / path.name)
    course(tmp_path / "grading", src=snapshot)
    result = nbgrader(tmp_path / "grading", "nbgrader generate_assignment * --no-db")
    assert result.returncode == 0, result.stderr[-3000:]
    ours = release(snapshot, tmp_path / "course")
    assert len(ours) == len(list(NOTEBOOKS.glob("*.ipynb")))
    for path in ours:
        theirs = tmp_path / "grading" / "release" / path.stem / path.name
        assert nbformat.read(path, as_version=4) == nbformat.read(theirs, as_version=4), path.name
