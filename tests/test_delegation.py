"""No graded exercise can be passed by calling the package (or PyTorch's ready-made kernel).

Every graded test runs the learner's code inside ``ar_lab.course.checkers.checks.no_delegation``,
which makes the package's reference for that exercise raise when the learner's code calls it. Here
each chapter's exercises (``exercises_only``: answers, tests and the cells they need) are executed
with every solution replaced by an answer that only delegates (``tests/delegating_answers.py``):
every graded test must fail, and say why. The source versions passing and the student versions
failing are proven by nbval and test_exercises.
"""

import copy
import re
import sys
from pathlib import Path

import nbformat
import pytest

from ar_lab.course.grading import judge as grading
from ar_lab.course.grading.exercises import (
    execute,
    exercises_only,
    grade,
    graded_cells,
    nbgrader_meta,
)
from ar_lab.course.grading.forbidden import FORBIDDEN
from ar_lab.course.grading.judge import Plan, judge_notebook
from tests.conftest import one_thread_env

sys.path.insert(0, str(Path(__file__).resolve().parent))
from delegating_answers import DELEGATING, NO_REFERENCE, ROUTES  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
WITH_EXERCISES = [
    p for p in sorted(NOTEBOOKS.glob("*.ipynb")) if graded_cells(nbformat.read(p, as_version=4))
]


def solutions(nb) -> list:
    return [c for c in nb.cells if nbgrader_meta(c).get("solution") and c.cell_type == "code"]


def test_every_exercise_has_a_delegating_answer_or_no_reference():
    ids = {
        nbgrader_meta(c)["grade_id"]
        for p in WITH_EXERCISES
        for c in solutions(nbformat.read(p, as_version=4))
    }
    assert ids == set(DELEGATING) | NO_REFERENCE, (
        f"exercises without a delegating answer: {sorted(ids - set(DELEGATING) - NO_REFERENCE)}; "
        f"answers for no exercise: {sorted(set(DELEGATING) | NO_REFERENCE) - ids}"
    )


def test_every_graded_test_runs_the_learners_code_under_no_delegation():
    unguarded = []
    for path in WITH_EXERCISES:
        for cell in nbformat.read(path, as_version=4).cells:
            gid = nbgrader_meta(cell).get("grade_id", "")
            if nbgrader_meta(cell).get("grade") and gid.removesuffix("-tests") not in NO_REFERENCE:
                if "with no_delegation(" not in cell.source:
                    unguarded.append(gid)
    assert not unguarded, f"graded tests that a delegating answer could pass: {unguarded}"


def test_each_graded_test_names_its_own_forbid_list_and_every_list_is_used():
    """The forbid lists live in the course layer (ar_lab.course.grading.forbidden); a test cell
    names its own."""
    named = {}
    for path in WITH_EXERCISES:
        for cell in nbformat.read(path, as_version=4).cells:
            if nbgrader_meta(cell).get("grade"):
                gid = nbgrader_meta(cell)["grade_id"].removesuffix("-tests")
                for key in re.findall(r'forbid="([^"]+)"', cell.source):
                    assert key == gid, f"{gid}'s test forbids what {key} forbids"
                    named[key] = path.name
                assert "forbid=[" not in cell.source, (
                    f"{gid}: its forbid list belongs in ar_lab/course/grading/forbidden.py")
    assert set(named) == set(FORBIDDEN), (
        f"forbid lists no test names: {sorted(set(FORBIDDEN) - set(named))}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("path", WITH_EXERCISES, ids=[p.stem for p in WITH_EXERCISES])
def test_a_delegating_answer_fails_every_graded_test(path):
    nb = nbformat.read(path, as_version=4)
    for cell in solutions(nb):
        gid = nbgrader_meta(cell)["grade_id"]
        if gid in DELEGATING:
            cell.source = DELEGATING[gid].strip()
    executed = execute(exercises_only(nb), path.parent, env=one_thread_env())  # not the experiments
    results = {r.grade_id: r for r in grade(executed)}
    guarded = {
        gid: r for gid, r in results.items() if gid.removesuffix("-tests") not in NO_REFERENCE
    }
    for cell in executed.cells:  # what the learner sees: the verdict, not the checkers' frames
        for out in (o for o in cell.get("outputs", []) if o.get("output_type") == "error"):
            shown = "\n".join(out["traceback"])
            assert (
                shown.startswith("\N{HEAVY BALLOT X} Delegated:") and "ar_lab/course" not in shown
            ), (
                f"{path.name} {nbgrader_meta(cell).get('grade_id')}: a failing test shows "
                f"{shown[:300]!r}"
            )
    passing = [gid for gid, r in guarded.items() if r.passed]
    assert not passing, f"{path.name}: a delegating answer passes {passing}"
    unexplained = {
        gid: r.error[:200]
        for gid, r in guarded.items()
        if "ready-made implementation" not in r.error
    }
    assert not unexplained, (
        f"{path.name}: these failed without naming the delegation: {unexplained}"
    )


# the notebooks that hold a routed exercise
ROUTE_CHAPTERS = sorted(
    p
    for p in WITH_EXERCISES
    if set(ROUTES)
    & {
        meta["grade_id"].removesuffix("-tests")
        for _, meta in graded_cells(nbformat.read(p, as_version=4))
    }
)


@pytest.mark.slow
@pytest.mark.parametrize("path", ROUTE_CHAPTERS, ids=[p.stem for p in ROUTE_CHAPTERS])
def test_delegating_by_a_route_the_kernels_gate_misses_finds_a_stub_in_the_grading_step(
    path, tmp_path
):
    """A thread, a default argument, an aten operator, a C function, a route around a public name, a
    copy of a private helper's source: judged as the grading step judges (the answer in a process
    whose ar_lab lacks the references), each routed answer's test fails, and the error names the
    withheld reference."""
    source = exercises_only(nbformat.read(path, as_version=4))
    submission, routed = copy.deepcopy(source), []
    for cell in solutions(submission):
        gid = nbgrader_meta(cell)["grade_id"]
        if gid in ROUTES:
            cell.source = ROUTES[gid].strip()
            routed.append(f"{gid}-tests")
    nbformat.write(submission, tmp_path / path.name)
    judge, tests, answers = judge_notebook(source)
    fresh = grading.judge(Plan(path.stem, source, judge, tests, {}, answers), tmp_path, timeout=120)
    passing = [gid for gid in routed if fresh[gid].passed]
    assert not passing, (
        f"{path.name}: an answer by another route passes the grading step's test {passing}"
    )
    unexplained = {
        gid: fresh[gid].error[:300] for gid in routed if "withheld" not in fresh[gid].error
    }
    assert not unexplained, (
        f"{path.name}: these failed without naming the withheld reference: {unexplained}"
    )
