"""A verdict the learner's kernel cannot change: each graded test run again, in a fresh kernel, on what the
learner's code returned during ``nbgrader autograde``.

    python -m ar_lab.course.grading COURSE_FOLDER ASSIGNMENT [--student ID ...] [--timeout S]

Run it from the instructor's side after ``nbgrader autograde ASSIGNMENT``. While autograde ran, every
graded test recorded its calls to the learner's code beside the graded notebook
(``autograded/<student>/<assignment>/.ar_lab_grading/``, see ``ar_lab.course.record``). For each notebook
of ``source/<assignment>/`` (the instructor's, trusted) this builds a *replay notebook*: the notebook cut
to its graded test cells and the cells they need (``cells.cut``), every solution cell replaced by
``replay_stub`` objects bound to the names it binds, and after each test a cell that checks the whole
record was replayed. It runs that once per submission in a fresh kernel (nbclient, the course's time
limit per cell) and reads each test's verdict with nbgrader's rule (an error or output on stderr fails).
The learner's code never runs there: patched checkers, input transformers and exception handlers in the
learner's kernel change nothing, and a missing or unreadable record fails its test.

Which tests can be judged this way is settled first, by the instructor's own solution: the source
notebook runs with recording on, then its records are replayed. A test whose record is not plain data
(its calls pass a model or return an object of the learner's class) or whose replay of the instructor's
solution does not pass keeps the kernel's verdict ("kernel verdict only", listed).

In nbgrader's gradebook, a test the kernel passed and the fresh run fails gets ``manual_score = 0`` (a
grade's score is its manual score when there is one) and a comment on the exercise's answer cell saying
why; ``nbgrader export`` and ``generate_feedback`` show both. A score the kernel gave 0 is never raised;
a zero this command set is lifted again when a later run passes (after ``autograde --force``, say); a
manual score someone else set is left alone. One line is printed per change.
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import nbformat

from ar_lab.course.cells import cut, names
from ar_lab.course.exercises import CellResult, execute, grade, nbgrader_meta
from ar_lab.course.record import FOLDER, NO_VALUES, RECORD, REPLAY, ReplayMismatch, cell_key, load

COMMENT = "ar_lab grading:"  # how a comment (and the zero beside it) written by this command starts
_GRADE_ID = "ar_lab_grade_id"  # the replay notebook's own mark on a test cell (nbgrader's metadata is dropped)


@dataclass
class Plan:
    """One source notebook's replay: the notebook, each replayable test's record key, the kernel-only ones."""

    notebook: str
    replay: nbformat.NotebookNode
    keys: dict[str, str]  # grade_id -> record key, for the tests judged in a fresh kernel
    kernel_only: dict[str, str]  # grade_id -> why the kernel's verdict stands
    answers: dict[str, str]  # test grade_id -> the grade_id of its answer cell (where comments go)


def _stub_source(source: str) -> str:
    """A solution cell's stand-in: its imports as written, and a replay stub for every other name it binds."""
    from IPython.core.inputtransformer2 import TransformerManager

    code = TransformerManager().transform_cell(source)
    imports, imported = [], set()
    for node in ast.parse(code).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(ast.get_source_segment(code, node))
            imported |= names(imports[-1])[0]
    stubs = [f"{n} = replay_stub({n!r})" for n in sorted(names(source)[0] - imported)]
    return "\n".join(["from ar_lab.course.record import replay_stub", *imports, *stubs])


def replay_notebook(source: nbformat.NotebookNode) -> tuple[nbformat.NotebookNode, dict[str, str], dict[str, str]]:
    """(the replay notebook, test grade_id -> record key, test grade_id -> its answer's grade_id) of ``source``."""
    keys, answers, answer = {}, {}, None
    for cell in source.cells:
        meta = nbgrader_meta(cell)
        if meta.get("solution"):
            answer = meta.get("grade_id")
        elif meta.get("grade") and cell.cell_type == "code":
            keys[meta["grade_id"]], answers[meta["grade_id"]] = cell_key(cell.source), answer
    nb = cut(source, lambda c: bool(nbgrader_meta(c).get("grade")) and not nbgrader_meta(c).get("solution"))
    cells = []
    for cell in nb.cells:
        meta = nbgrader_meta(cell)
        fresh = nbformat.v4.new_code_cell(cell.source)
        fresh["id"] = cell.get("id", fresh["id"])
        if meta.get("solution"):
            fresh.source = _stub_source(cell.source)
        cells.append(fresh)
        if meta.get("grade"):
            fresh.metadata[_GRADE_ID] = meta["grade_id"]
            check = f"from ar_lab.course.record import replay_finished\nreplay_finished({keys[meta['grade_id']]!r})"
            cells.append(nbformat.v4.new_code_cell(check, metadata={_GRADE_ID: meta["grade_id"] + " (record)"}))
    starts = nbformat.v4.new_code_cell("from ar_lab.course.record import replay_cell_starts\nreplay_cell_starts()")
    out = copy.deepcopy(source)
    out.cells = [starts, *cells]
    return out, keys, answers


def verdicts(executed: nbformat.NotebookNode) -> dict[str, CellResult]:
    """Test grade_id -> its fresh verdict: the test cell and the cell checking its record both passed."""
    marked = copy.deepcopy(executed)
    for cell in marked.cells:
        if _GRADE_ID in cell.metadata:
            cell.metadata["nbgrader"] = {"grade": True, "grade_id": cell.metadata[_GRADE_ID], "points": 0}
    out: dict[str, CellResult] = {}
    for result in grade(marked):
        grade_id = result.grade_id.removesuffix(" (record)")
        if grade_id not in out or (out[grade_id].passed and not result.passed):
            out[grade_id] = result
    return out


def _environment(**changes: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (RECORD, REPLAY)}
    env.update({k: v for k, v in changes.items() if v is not None})
    return env


def plan(path: Path, *, timeout: int) -> Plan:
    """Which tests of the source notebook ``path`` the fresh run can judge: run it with recording on, then
    replay the instructor's own records; a test whose record is not plain or whose replay fails is kernel-only."""
    source = nbformat.read(path, as_version=4)
    replay, keys, answers = replay_notebook(source)
    kernel_only = {}
    with tempfile.TemporaryDirectory(prefix="ar_lab_plan_") as tmp:
        execute(source, Path(tmp), timeout=timeout, env=_environment(**{RECORD: "1"}))
        records = Path(tmp) / FOLDER
        for grade_id, key in keys.items():
            try:
                load(records / f"{key}.pt")
            except ReplayMismatch as e:
                kernel_only[grade_id] = str(e).removeprefix(NO_VALUES)
        with tempfile.TemporaryDirectory(prefix="ar_lab_replay_") as cwd:
            fresh = verdicts(execute(replay, Path(cwd), timeout=timeout, env=_environment(**{REPLAY: str(records)})))
    for grade_id in keys:
        if grade_id not in kernel_only and not fresh[grade_id].passed:
            kernel_only[grade_id] = f"the instructor's solution does not pass its replay ({fresh[grade_id].error})"
    judged = {g: k for g, k in keys.items() if g not in kernel_only}
    return Plan(path.stem, replay, judged, kernel_only, answers)


def judge(p: Plan, submission: Path, *, timeout: int, own_records: bool = False) -> dict[str, CellResult]:
    """The fresh verdicts of the tests ``p`` judges, for the autograded submission folder ``submission``."""
    if own_records:  # records handed in with the submission are not the kernel's
        why = f"the submission brought its own {FOLDER} folder: its records are not the kernel's"
        return {g: CellResult(g, 0, False, why) for g in p.keys}
    with tempfile.TemporaryDirectory(prefix="ar_lab_replay_") as cwd:
        env = _environment(**{REPLAY: str((submission / FOLDER).resolve())})
        fresh = verdicts(execute(p.replay, Path(cwd), timeout=timeout, env=env))
    return {g: fresh[g] for g in p.keys}


def _why(result: CellResult) -> str:
    return result.error.strip().splitlines()[0][:300] if result.error.strip() else "it failed"


def record_verdicts(gb, assignment: str, student: str, p: Plan, fresh: dict[str, CellResult]) -> list[str]:
    """Write the fresh verdicts of one submission notebook into nbgrader's gradebook ``gb``; one line per change."""
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
                comment.manual_comment = (f"{COMMENT} the test `{grade_id}` failed when run again outside your "
                                          f"notebook's kernel, on the values your code returned there: {_why(result)}")
            lines.append(f"{where}: {g.auto_score:g} -> 0 points (fresh run: {_why(result)})")
        elif result.passed and ours and g.manual_score == 0:
            g.manual_score, comment.manual_comment = None, None
            lines.append(f"{where}: back to autograde's {g.auto_score:g} points (the fresh run passes now)")
    gb.db.commit()
    return lines


def _timeout(folder: Path) -> int:
    """The course's time limit per cell (``c.Execute.timeout`` in its nbgrader_config.py), else 120 s."""
    config = folder / "nbgrader_config.py"
    found = re.search(r"^c\.Execute\.timeout\s*=\s*(\d+)", config.read_text(), re.M) if config.exists() else None
    return int(found.group(1)) if found else 120


def grade_assignment(folder: Path, assignment: str, *, students: list[str] | None = None,
                     timeout: int | None = None, out=print) -> int:
    """Judge every autograded submission of ``assignment`` in the course folder ``folder`` in fresh kernels and
    record the verdicts in its gradebook (see the module's docstring). Returns the number of scores changed."""
    from nbgrader.api import Gradebook

    folder = Path(folder)
    sources = sorted((folder / "source" / assignment).glob("*.ipynb"))
    if not sources:
        raise FileNotFoundError(f"no notebook in {folder / 'source' / assignment}: is {folder} a course folder?")
    autograded = folder / "autograded"
    found = sorted(p.parent.name for p in autograded.glob(f"*/{assignment}")) if autograded.is_dir() else []
    missing = sorted(set(students or []) - set(found))
    if not found or missing:
        raise FileNotFoundError(f"no autograded submission of {assignment} for {', '.join(missing) or 'anyone'} in "
                                f"{autograded}: run `nbgrader autograde {assignment}` first")
    timeout = timeout or _timeout(folder)
    changed = 0
    with Gradebook(f"sqlite:///{(folder / 'gradebook.db').resolve()}") as gb:
        for path in sources:
            p = plan(path, timeout=timeout)
            for grade_id, why in p.kernel_only.items():
                out(f"kernel verdict only: {assignment} {grade_id} ({why})")
            for student in students or found:
                submission = autograded / student / assignment
                if not (submission / path.name).exists():
                    continue  # not graded (autograde reported it): nbgrader already gave it 0
                own = (folder / "submitted" / student / assignment / FOLDER).exists()
                lines = record_verdicts(gb, assignment, student, p, judge(p, submission, timeout=timeout,
                                                                          own_records=own))
                changed += len(lines)
                for line in lines:
                    out(line)
    out(f"judged {len(students or found)} submission(s) of {assignment} in fresh kernels; {changed} score(s) changed")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ar_lab.course.grading", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, metavar="COURSE_FOLDER")
    parser.add_argument("assignment", metavar="ASSIGNMENT")
    parser.add_argument("--student", action="append", help="only this student (repeatable)")
    parser.add_argument("--timeout", type=int, help="seconds a cell may run (default: the course's c.Execute.timeout)")
    args = parser.parse_args(argv)
    if args.timeout is not None and args.timeout < 1:
        parser.error(f"--timeout must be a whole number of seconds >= 1, got {args.timeout}")
    try:
        grade_assignment(args.folder, args.assignment, students=args.student, timeout=args.timeout)
    except (OSError, ValueError) as error:
        print(f"python -m ar_lab.course.grading: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
