"""Exercises in nbgrader's format: student versions and validation.

The notebooks in ``notebooks/`` are the *source* versions: solution regions between
``### BEGIN SOLUTION`` / ``### END SOLUTION`` in cells marked ``solution``, and
autograded test cells (``grade: true``, a unique ``grade_id``, ``points``,
``locked``) that may hold hidden tests between ``### BEGIN HIDDEN TESTS`` /
``### END HIDDEN TESTS``. Instructors can hand the same notebooks to nbgrader.

``student_version`` does what nbgrader's ``generate_assignment`` does to a notebook:
replaces each solution region with the stub ``# YOUR CODE HERE`` /
``raise NotImplementedError()``, removes hidden tests and clears outputs, keeping
the nbgrader metadata. ``validate`` executes a notebook and reports each graded
cell, with nbgrader's ``validate`` / ``validate --invert`` semantics.

    python -m ar_lab.exercises release            # notebooks/ -> course/ (student versions)
    python -m ar_lab.exercises validate NB.ipynb [--invert]
    python -m ar_lab.exercises autograde SUBMISSIONS/ [--out grades/]

``autograde`` does what nbgrader's ``autograde`` does: in each submitted notebook the
graded (locked) test cells are restored from the source version, hidden tests
included, so a learner cannot edit or see them; then it runs the notebook and scores
each graded cell, writing ``grades.csv`` and one feedback file per submission.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
CODE_STUB = "# YOUR CODE HERE\nraise NotImplementedError()"
MARKDOWN_STUB = "YOUR ANSWER HERE"
_SOLUTION = re.compile(r"^([ \t]*)### BEGIN SOLUTION[^\n]*\n.*?^[ \t]*### END SOLUTION[^\n]*(\n|$)", re.M | re.S)
_HIDDEN = re.compile(r"^[ \t]*### BEGIN HIDDEN TESTS[^\n]*\n.*?^[ \t]*### END HIDDEN TESTS[^\n]*(\n|$)", re.M | re.S)


def nbgrader_meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def _stub(match: re.Match, stub: str) -> str:
    indent = match.group(1)
    return "".join(f"{indent}{line}\n" for line in stub.splitlines())


def strip_solutions(source: str, cell_type: str = "code") -> str:
    """Replace every solution region (or, with no markers, the whole cell) with the stub."""
    stub = CODE_STUB if cell_type == "code" else MARKDOWN_STUB
    if "### BEGIN SOLUTION" not in source:
        return stub
    return _SOLUTION.sub(lambda m: _stub(m, stub), source).rstrip("\n")


def strip_hidden_tests(source: str) -> str:
    return _HIDDEN.sub("", source).rstrip("\n")


def student_version(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook a learner opens: solutions and hidden tests removed, outputs cleared."""
    out = copy.deepcopy(nb)
    for cell in out.cells:
        meta = nbgrader_meta(cell)
        if meta.get("solution"):
            cell.source = strip_solutions(cell.source, cell.cell_type)
        if meta.get("grade") and cell.cell_type == "code":
            cell.source = strip_hidden_tests(cell.source)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return out


def graded_cells(nb: nbformat.NotebookNode) -> list[tuple[int, dict]]:
    return [(i, nbgrader_meta(c)) for i, c in enumerate(nb.cells) if nbgrader_meta(c).get("grade")]


def release(
    src: Path = ROOT / "notebooks", out: Path = ROOT / "course", overwrite: bool = False, chapter: str | None = None
) -> list[Path]:
    """Write the student version of every notebook in ``src`` (or one ``chapter``, e.g. "04") to ``out``.

    A notebook that already exists in ``out`` is kept (it may hold a learner's work)
    unless ``overwrite``. Returns the paths written.
    """
    pattern = "*.ipynb" if chapter is None else f"{int(chapter):02d}_*.ipynb"
    notebooks = sorted(Path(src).glob(pattern))
    if not notebooks:
        raise FileNotFoundError(f"no notebooks matching {pattern} in {src}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in notebooks:
        target = out / path.name
        if target.exists() and not overwrite:
            continue
        nbformat.write(student_version(nbformat.read(path, as_version=4)), target)
        written.append(target)
    return written


@dataclass
class CellResult:
    grade_id: str
    points: float
    passed: bool
    error: str  # the error name and message when it failed


def execute(nb: nbformat.NotebookNode, cwd: Path, timeout: int = 300) -> nbformat.NotebookNode:
    """Run every cell (continuing past errors, as nbgrader's autograder does)."""
    from nbclient import NotebookClient

    nb = copy.deepcopy(nb)
    NotebookClient(nb, timeout=timeout, allow_errors=True, resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def grade(executed: nbformat.NotebookNode) -> list[CellResult]:
    """Per graded cell: passed when its execution raised no error."""
    results = []
    for i, meta in graded_cells(executed):
        errors = [o for o in executed.cells[i].get("outputs", []) if o.get("output_type") == "error"]
        message = f"{errors[0]['ename']}: {errors[0]['evalue']}" if errors else ""
        results.append(CellResult(meta["grade_id"], float(meta.get("points", 0)), not errors, message))
    return results


def validate(path: Path, invert: bool = False) -> tuple[bool, list[CellResult]]:
    """nbgrader validate semantics: every graded cell passes (or, inverted, every one fails)."""
    path = Path(path)
    results = grade(execute(nbformat.read(path, as_version=4), path.parent))
    ok = all((not r.passed) if invert else r.passed for r in results)
    return ok, results


@dataclass
class GradedSubmission:
    student: str
    notebook: str
    results: list[CellResult]

    @property
    def score(self) -> float:
        return sum(r.points for r in self.results if r.passed)

    @property
    def max_score(self) -> float:
        return sum(r.points for r in self.results)


def restore_tests(submitted: nbformat.NotebookNode, source: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Put the source's graded cells (with hidden tests) back into a submission, by grade_id."""
    originals = {nbgrader_meta(c)["grade_id"]: c for c in source.cells if nbgrader_meta(c).get("grade")}
    out = copy.deepcopy(submitted)
    found = set()
    for cell in out.cells:
        gid = nbgrader_meta(cell).get("grade_id")
        if gid in originals:
            cell.source = originals[gid].source
            found.add(gid)
    missing = sorted(set(originals) - found)
    if missing:
        raise ValueError(f"the submission lacks the graded cells {missing}: it is not from this chapter's release")
    return out


def autograde(
    submissions: Path, src: Path = ROOT / "notebooks", out: Path | None = None, timeout: int = 300
) -> list[GradedSubmission]:
    """Grade SUBMISSIONS/<student>/<notebook>.ipynb against the source notebooks in ``src``.

    Writes ``out/grades.csv`` (student, notebook, grade_id, points, max points) and
    ``out/feedback/<student>/<notebook>.txt``; returns the graded submissions.
    """
    import csv

    submissions = Path(submissions)
    out = Path(out) if out is not None else submissions.parent / "grades"
    paths = sorted(submissions.glob("*/*.ipynb"))
    if not paths:
        raise FileNotFoundError(f"no submissions found: expected {submissions}/<student>/<notebook>.ipynb")
    graded = []
    for path in paths:
        source_path = Path(src) / path.name
        if not source_path.exists():
            raise FileNotFoundError(f"{path}: no source notebook {source_path.name} in {src}")
        source = nbformat.read(source_path, as_version=4)
        restored = restore_tests(nbformat.read(path, as_version=4), source)
        results = grade(execute(restored, Path(src), timeout))
        graded.append(GradedSubmission(path.parent.name, path.name, results))
    (out / "feedback").mkdir(parents=True, exist_ok=True)
    with open(out / "grades.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "notebook", "grade_id", "score", "max_score"])
        for g in graded:
            for r in g.results:
                writer.writerow([g.student, g.notebook, r.grade_id, r.points if r.passed else 0, r.points])
    for g in graded:
        lines = [f"{g.notebook}: {g.score:g} / {g.max_score:g} points", ""]
        for r in g.results:
            status = "passed" if r.passed else "FAILED"
            lines.append(f"[{status}] {r.grade_id} ({r.points if r.passed else 0:g}/{r.points:g})")
            if r.error:
                lines.append("    " + r.error.replace("\n", "\n    "))
        target = out / "feedback" / g.student / g.notebook.replace(".ipynb", ".txt")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n".join(lines) + "\n")
    return graded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ar_lab.exercises", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rel = sub.add_parser("release", help="write the student versions of notebooks/ to course/")
    rel.add_argument("--src", type=Path, default=ROOT / "notebooks")
    rel.add_argument("--out", type=Path, default=ROOT / "course")
    rel.add_argument("--overwrite", action="store_true", help="replace notebooks already in --out")
    rel.add_argument("--chapter", default=None, help="release only this chapter (e.g. 04)")
    val = sub.add_parser("validate", help="run a notebook and report each graded cell")
    val.add_argument("notebook", type=Path)
    val.add_argument("--invert", action="store_true", help="succeed only if every graded cell fails")
    auto = sub.add_parser("autograde", help="grade SUBMISSIONS/<student>/<notebook>.ipynb")
    auto.add_argument("submissions", type=Path)
    auto.add_argument("--src", type=Path, default=ROOT / "notebooks")
    auto.add_argument("--out", type=Path, default=None, help="default: grades/ beside SUBMISSIONS")
    args = parser.parse_args(argv)
    if args.cmd == "autograde":
        for g in autograde(args.submissions, args.src, args.out):
            print(f"{g.student:<20} {g.notebook:<40} {g.score:g} / {g.max_score:g}")
        out = args.out or args.submissions.parent / "grades"
        print(f"per-exercise scores: {out / 'grades.csv'}; feedback: {out / 'feedback'}")
        return 0
    if args.cmd == "release":
        written = release(args.src, args.out, args.overwrite, args.chapter)
        kept = len(list(Path(args.out).glob("*.ipynb"))) - len(written)
        print(f"wrote {len(written)} student notebook(s) to {args.out}" + (f"; kept {kept} existing" if kept else ""))
        return 0
    ok, results = validate(args.notebook, args.invert)
    for r in results:
        print(f"{'PASS' if r.passed else 'FAIL'}  {r.grade_id:<28} {r.points:g} pt  {r.error[:100]}")
    print("OK" if ok else "NOT OK", "(inverted: every graded cell must fail)" if args.invert else "")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
