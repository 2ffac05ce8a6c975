"""A verdict the learner's kernel cannot change: each graded test run again, in a fresh kernel, with
the learner's answer in a process of its own whose ``ar_lab`` lacks what the exercise forbids.

    python -m ar_lab.course.grading COURSE_FOLDER ASSIGNMENT [--student ID ...] [--timeout S]

Run it from the instructor's side after ``nbgrader autograde ASSIGNMENT``. For each notebook of
``source/<assignment>/`` (the instructor's, trusted) this builds a *judge notebook*: the notebook
cut to its graded test cells and the cells they need (``cells.cut``), every solution cell replaced
by handles on the learner's names (``sandbox.answer``), a cell before each test that starts the
test's answer process and one after it that fails the test if the learner's code asked for a
forbidden reference. For each autograded submission it writes the *answer programs* (per test: the
submission's answer cells up to the test and the cells they need, no test cell, and the references
those answers' exercises forbid, ``forbidden.FORBIDDEN``) and runs the judge notebook in a fresh
kernel (nbclient, the course's time limit per cell), reading each test's verdict with nbgrader's
rule (an error or output on stderr fails). The learner's code never runs in the judge's process, and
the reference never exists in the learner's (see ``ar_lab.course.grading.sandbox``): patched
checkers, input transformers, exception handlers, forked children, reloaded or copied modules and
tables computed from the reference change nothing.

Every answer process runs in the grading sandbox (``ar_lab.course.grading.jail``): it writes only in
a scratch folder and sees neither the course folder nor the real package; without bubblewrap the
command refuses (exit 2) unless ``AR_LAB_SANDBOX=off``. The course's time limit and gradebook are
read as nbgrader reads them (``course_settings``).

Which tests can be judged this way is settled first, by the instructor's own solution: the source
notebook is judged as a submission. A test that the instructor's solution does not pass there keeps
the kernel's verdict ("kernel verdict only", listed with the reason).

In nbgrader's gradebook, a test the kernel passed and the fresh run fails gets ``manual_score = 0``
(a grade's score is its manual score when there is one) and a comment on the exercise's answer cell
saying why; ``nbgrader export`` and ``generate_feedback`` show both. A score the kernel gave 0 is
never raised; a zero this command set is lifted again when a later run passes (after ``autograde
--force``, say); a manual score someone else set is left alone. One line is printed per change.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import nbformat

from ar_lab.course.grading import jail
from ar_lab.course.grading.cells import as_python, cut, names
from ar_lab.course.grading.exercises import CellResult, execute, grade, nbgrader_meta
from ar_lab.course.grading.forbidden import FORBIDDEN
from ar_lab.course.grading.sandbox import PROGRAMS

COMMENT = "ar_lab grading:"  # how a comment (and the zero beside it) written by this command starts
# the judge notebook's own mark on a test cell (nbgrader's metadata is dropped)
_GRADE_ID = "ar_lab_grade_id"


@dataclass
class Plan:
    """One source notebook's judge: the notebook, the tests it judges, the kernel-only ones."""

    notebook: str
    source: nbformat.NotebookNode  # the instructor's notebook
    judge: nbformat.NotebookNode
    tests: list[str]  # the test grade_ids judged in a fresh kernel
    kernel_only: dict[str, str]  # grade_id -> why the kernel's verdict stands
    answers: dict[str, str]  # test grade_id -> the grade_id of its answer cell (where comments go)


def _stub_source(source: str) -> str:
    """A solution cell's stand-in in the judge: its imports as written, a handle for every other
    name it binds."""
    imports = _imports(source)
    imported = set().union(*(names(i)[0] for i in imports))
    handles = [f"{n} = answer({n!r})" for n in sorted(names(source)[0] - imported)]
    return "\n".join(["from ar_lab.course.grading.sandbox import answer", *imports, *handles])


def _is_test(cell) -> bool:
    meta = nbgrader_meta(cell)
    return bool(meta.get("grade")) and not meta.get("solution") and cell.cell_type == "code"


def judge_notebook(
    source: nbformat.NotebookNode,
) -> tuple[nbformat.NotebookNode, list[str], dict[str, str]]:
    """(the judge notebook, its tests' grade_ids in order, test grade_id -> its answer's grade_id)
    of ``source``."""
    tests, answers, answer = [], {}, None
    for cell in source.cells:
        meta = nbgrader_meta(cell)
        if meta.get("solution"):
            answer = meta.get("grade_id")
        elif _is_test(cell):
            tests.append(meta["grade_id"])
            answers[meta["grade_id"]] = answer
    # and what answers read
    nb = cut(source, lambda c: _is_test(c) or bool(nbgrader_meta(c).get("solution")))
    learner = set().union(
        *(names(c.source)[0] for c in nb.cells if nbgrader_meta(c).get("solution"))
    )
    cells, pending, switched = [], list(tests), False
    for cell in nb.cells:
        meta = nbgrader_meta(cell)
        # runs the learner's code
        uses = not meta.get("solution") and bool(names(cell.source)[1] & learner)
        # the test's answer process, started here
        if pending and not switched and (uses or _is_test(cell)):
            start = (
                "from ar_lab.course.grading.sandbox import answer_process\nanswer_process("
                f"{pending.pop(0)!r})"
            )
            cells.append(nbformat.v4.new_code_cell(start))
            switched = True
        fresh = nbformat.v4.new_code_cell(
            _stub_source(cell.source) if meta.get("solution") else cell.source
        )
        fresh["id"] = cell.get("id", fresh["id"])
        cells.append(fresh)
        if _is_test(cell):
            fresh.metadata[_GRADE_ID] = meta["grade_id"]
            check = (
                "from ar_lab.course.grading.sandbox import answers_checked\nanswers_checked("
                f"{meta['grade_id']!r})"
            )
            cells.append(
                nbformat.v4.new_code_cell(
                    check, metadata={_GRADE_ID: meta["grade_id"] + " (answers)"}
                )
            )
            switched = False
    # the last answer process and the fork server end before the kernel does (it would wait)
    cells.append(nbformat.v4.new_code_cell(
        "from ar_lab.course.grading.sandbox import shutdown\nshutdown()"
    ))
    out = copy.deepcopy(source)
    out.cells = cells
    return out, tests, answers


def _imports(source: str) -> list[str]:
    """The import statements at the top level of a cell, as Python."""
    code = as_python(source)
    nodes = ast.parse(code).body
    return [
        ast.get_source_segment(code, n)
        for n in nodes
        if isinstance(n, (ast.Import, ast.ImportFrom))
    ]


def answer_programs(submission: nbformat.NotebookNode, source: nbformat.NotebookNode,
                    tests: list[str]) -> dict[str, dict]:
    """Test grade_id -> what its answer process runs: the instructor's imports that the learner's
    cells need, then the learner's cells before the test (answer cells, and code cells that are not
    the instructor's ``source`` ones: added or edited), as Python; ``needs``: the other names those
    cells read (the judge binds them to its values); ``forbid``: the references the test's exercise
    forbids."""
    programs = {}
    position = {nbgrader_meta(c).get("grade_id"): i for i, c in enumerate(submission.cells)}
    instructor = {
        c.source.strip() for c in source.cells if c.cell_type == "code" and not nbgrader_meta(c)
    }
    # What the judge may bind for the learner: names the instructor's cells bind, never the shell's
    # own (get_ipython, In, Out, open, exit: handles on those would reach the judge's shell).
    given = set().union(*(names(c.source)[0] for c in source.cells
                          if c.cell_type == "code" and not nbgrader_meta(c).get("solution")))
    for test in tests:
        before = [c for c in submission.cells[:position.get(test, len(submission.cells))]
                  if c.cell_type == "code" and not _is_test(c)]
        learner = [
            c
            for c in before
            if nbgrader_meta(c).get("solution") or c.source.strip() not in instructor
        ]
        bound, read = set(), set()
        for c in learner:
            b, r = names(c.source)
            read |= r - bound
            bound |= b
        imports = [
            i
            for c in before
            if c not in learner
            for i in _imports(c.source)
            if names(i)[0] & (read - bound)
        ]
        imported = set().union(*(names(i)[0] for i in imports))
        forbid = sorted(FORBIDDEN.get(test.removesuffix("-tests"), ()))
        programs[test] = {"cells": imports + [as_python(c.source) for c in learner],
                          "needs": sorted((read - bound - imported) & given), "forbid": forbid}
    return programs


def verdicts(executed: nbformat.NotebookNode) -> dict[str, CellResult]:
    """Test grade_id -> its fresh verdict: the test cell and the cell checking its answer process
    both passed."""
    marked = copy.deepcopy(executed)
    for cell in marked.cells:
        if _GRADE_ID in cell.metadata:
            cell.metadata["nbgrader"] = {
                "grade": True,
                "grade_id": cell.metadata[_GRADE_ID],
                "points": 0,
            }
    out: dict[str, CellResult] = {}
    for result in grade(marked):
        grade_id = result.grade_id.removesuffix(" (answers)")
        if grade_id not in out or (out[grade_id].passed and not result.passed):
            out[grade_id] = result
    return out


def _run(p: Plan, submission: nbformat.NotebookNode, *, timeout: int) -> dict[str, CellResult]:
    """The fresh verdicts of ``p``'s tests for ``submission`` (a notebook): the judge run once in a
    new folder."""
    tests = p.tests
    with tempfile.TemporaryDirectory(prefix="ar_lab_judge_") as cwd:
        (Path(cwd) / PROGRAMS).write_text(json.dumps(answer_programs(submission, p.source, tests)))
        fresh = verdicts(execute(p.judge, Path(cwd), timeout=timeout))
    missing = CellResult("", 0, False, "the test did not run in the fresh kernel")
    return {t: fresh.get(t, missing) for t in tests}


def plan(path: Path, *, timeout: int) -> Plan:
    """Which tests of the source notebook ``path`` the fresh run can judge: the instructor's
    solution judged as a submission; a test it does not pass keeps the kernel's verdict."""
    source = nbformat.read(path, as_version=4)
    judge, tests, answers = judge_notebook(source)
    fresh = _run(Plan(path.stem, source, judge, tests, {}, answers), source, timeout=timeout)
    kernel_only = {t: f"the instructor's solution does not pass it in the fresh run ({_why(r)})"
                   for t, r in fresh.items() if not r.passed}
    return Plan(
        path.stem, source, judge, [t for t in tests if t not in kernel_only], kernel_only, answers
    )


def judge(p: Plan, submission: Path, *, timeout: int) -> dict[str, CellResult]:
    """The fresh verdicts of the tests ``p`` judges, for the autograded submission folder
    ``submission``."""
    return _run(p, nbformat.read(submission / f"{p.notebook}.ipynb", as_version=4), timeout=timeout)


def _why(result: CellResult) -> str:
    return result.error.strip().splitlines()[0][:300] if result.error.strip() else "it failed"


def record_verdicts(
    gb, assignment: str, student: str, p: Plan, fresh: dict[str, CellResult]
) -> list[str]:
    """Write the fresh verdicts of one submission notebook into nbgrader's gradebook ``gb``; one
    line per change."""
    lines = []
    for grade_id, result in fresh.items():
        g = gb.find_grade(grade_id, p.notebook, assignment, student)
        answer = p.answers.get(grade_id)
        comment = gb.find_comment(answer, p.notebook, assignment, student) if answer else None
        ours = comment is not None and (comment.manual_comment or "").startswith(COMMENT)
        where = f"{student} {assignment} {grade_id}"
        if not result.passed and g.manual_score is None and (g.auto_score or 0) > 0:
            g.manual_score = 0.0
            if comment is not None:
                comment.manual_comment = (
                    f"{COMMENT} the test `{grade_id}` failed when run again outside your "
                    "notebook's kernel, with your answer in a process without the package's "
                    f"reference: {_why(result)}"
                )
            lines.append(f"{where}: {g.auto_score:g} -> 0 points (fresh run: {_why(result)})")
        elif result.passed and ours and g.manual_score == 0:
            g.manual_score, comment.manual_comment = None, None
            lines.append(
                f"{where}: back to autograde's {g.auto_score:g} points (the fresh run passes now)"
            )
    gb.db.commit()
    return lines


class Settings(NamedTuple):
    timeout: int | None  # seconds a cell may run; None: no limit
    gradebook: str  # the gradebook's URL
    confined: bool  # whether autograde ran each submission in the sandbox (SandboxedExecute)


def course_settings(folder: Path) -> Settings:
    """The course folder ``folder``'s settings as nbgrader reads them: nbgrader's own application
    loads the configuration (Jupyter's config folders, then the course folder's
    ``nbgrader_config.py``; of two assignments the last wins) and its ``Execute`` reads
    ``c.Execute.timeout`` (``1e3`` is 1000 s, ``60 * 5`` 300 s, None no limit). A limit of 0 or
    less, or a configuration nbgrader cannot load, is a ``ValueError``."""
    import logging

    from nbgrader.apps.autogradeapp import AutogradeApp
    from nbgrader.preprocessors import Execute
    from traitlets import TraitError

    app = AutogradeApp(raise_config_file_errors=True, log_level=logging.ERROR)
    try:
        app.initialize([], root=str(Path(folder).resolve()))
        timeout = Execute(parent=app).timeout
    except (TraitError, SyntaxError, NameError, ImportError, TypeError, AttributeError) as error:
        raise ValueError(
            f"nbgrader cannot read the course's configuration ({folder / 'nbgrader_config.py'}): "
            f"{type(error).__name__}: {error}"
        ) from None
    if timeout is not None and timeout <= 0:
        raise ValueError(
            f"c.Execute.timeout is {timeout} in the course's configuration: give the seconds a "
            "cell may run (>= 1), or None for no limit"
        )
    steps = app.config.get("Autograde", {}).get("autograde_preprocessors", [])
    confined = any(
        getattr(step, "__name__", str(step)).endswith("SandboxedExecute") for step in steps
    )
    return Settings(timeout, app.coursedir.db_url, confined)


def _writable_gradebook(url: str) -> None:
    """Refuse a gradebook that is missing or that the verdicts cannot be written into (read-only
    file or folder)."""
    import sqlite3

    if not url.startswith("sqlite:///"):
        return  # another database: nbgrader's Gradebook reports what is wrong with it
    path = Path(url.removeprefix("sqlite:///"))
    if not path.is_file():
        raise FileNotFoundError(
            f"no gradebook at {path}: run `nbgrader generate_assignment` and `nbgrader "
            "autograde` from the course folder first"
        )
    if (
        not path.stat().st_mode & 0o222
        or not os.access(path, os.W_OK)
        or not os.access(path.parent, os.W_OK)
    ):
        raise PermissionError(
            f"the gradebook {path} is read-only: the grading step writes its verdicts there"
        )
    try:  # a read-only file system, a lock held elsewhere
        with contextlib.closing(sqlite3.connect(path, timeout=10)) as db:
            db.execute("BEGIN IMMEDIATE")
            db.rollback()
    except sqlite3.Error as error:
        raise PermissionError(f"the gradebook {path} cannot be written: {error}") from None


def grade_assignment(folder: Path, assignment: str, *, students: list[str] | None = None,
                     timeout: int | None = None, out=print) -> int:
    """Judge every autograded submission of ``assignment`` in the course folder ``folder`` in fresh
    kernels and record the verdicts in its gradebook (see the module's docstring). Returns the
    number of scores changed."""
    from nbgrader.api import Gradebook

    folder = Path(folder)
    sources = sorted((folder / "source" / assignment).glob("*.ipynb"))
    if not sources:
        raise FileNotFoundError(
            f"no notebook in {folder / 'source' / assignment}: is {folder} a course folder?"
        )
    autograded = folder / "autograded"
    found = (
        sorted(p.parent.name for p in autograded.glob(f"*/{assignment}"))
        if autograded.is_dir()
        else []
    )
    missing = sorted(set(students or []) - set(found))
    if not found or missing:
        raise FileNotFoundError(
            f"no autograded submission of {assignment} for {', '.join(missing) or 'anyone'} in "
            f"{autograded}: run `nbgrader autograde {assignment}` first"
        )
    jail.require()
    limit, url, confined = course_settings(folder)
    if jail.enabled() and not confined:
        out(
            f"warning: {folder / 'nbgrader_config.py'} does not run autograde's kernels in the "
            "sandbox (it predates it?): remove it and run `make grading-course` again "
            "(INSTRUCTORS.md)"
        )
    timeout = timeout or limit
    _writable_gradebook(url)
    changed = 0
    with Gradebook(url) as gb:
        for path in sources:
            p = plan(path, timeout=timeout)
            for grade_id, why in p.kernel_only.items():
                out(f"kernel verdict only: {assignment} {grade_id} ({why})")
            for student in students or found:
                submission = autograded / student / assignment
                if not (submission / path.name).exists():
                    continue  # not graded (autograde reported it): nbgrader already gave it 0
                lines = record_verdicts(
                    gb, assignment, student, p, judge(p, submission, timeout=timeout)
                )
                changed += len(lines)
                for line in lines:
                    out(line)
    out(
        f"judged {len(students or found)} submission(s) of {assignment} in fresh kernels; "
        f"{changed} score(s) changed"
    )
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ar_lab.course.grading", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("folder", type=Path, metavar="COURSE_FOLDER")
    parser.add_argument("assignment", metavar="ASSIGNMENT")
    parser.add_argument("--student", action="append", help="only this student (repeatable)")
    parser.add_argument(
        "--timeout",
        type=int,
        help="seconds a cell may run (default: the course's c.Execute.timeout, read as nbgrader "
        "reads it)",
    )
    args = parser.parse_args(argv)
    from sqlalchemy.exc import SQLAlchemyError  # nbgrader's database layer

    if args.timeout is not None and args.timeout < 1:
        parser.error(f"--timeout must be a whole number of seconds >= 1, got {args.timeout}")
    try:
        grade_assignment(args.folder, args.assignment, students=args.student, timeout=args.timeout)
    except (OSError, ValueError, jail.SandboxMissing, SQLAlchemyError) as error:
        print(f"python -m ar_lab.course.grading: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
