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


def release(src: Path = ROOT / "notebooks", out: Path = ROOT / "course", overwrite: bool = False) -> list[Path]:
    """Write the student version of every notebook in ``src`` to ``out``.

    A notebook that already exists in ``out`` is kept (it may hold a learner's work)
    unless ``overwrite``. Returns the paths written.
    """
    notebooks = sorted(Path(src).glob("*.ipynb"))
    if not notebooks:
        raise FileNotFoundError(f"no notebooks in {src}")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ar_lab.exercises", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rel = sub.add_parser("release", help="write the student versions of notebooks/ to course/")
    rel.add_argument("--src", type=Path, default=ROOT / "notebooks")
    rel.add_argument("--out", type=Path, default=ROOT / "course")
    rel.add_argument("--overwrite", action="store_true", help="replace notebooks already in --out")
    val = sub.add_parser("validate", help="run a notebook and report each graded cell")
    val.add_argument("notebook", type=Path)
    val.add_argument("--invert", action="store_true", help="succeed only if every graded cell fails")
    args = parser.parse_args(argv)
    if args.cmd == "release":
        written = release(args.src, args.out, args.overwrite)
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
