"""A notebook's budget: what a learner reads and does in one sitting, measured from the file.

A chapter is a lesson only if it fits a sitting (ARCHITECTURE.md, "How a claim is checked"). This
module measures a notebook the way a learner meets it:

- **words**: prose a learner reads, the markdown cells plus the Markdown that cells render
  (``say``'s sentences, in the committed outputs);
- **code lines**: non-blank, non-comment lines of the code cells a learner sees, magics left
  out; a cell JupyterLab shows collapsed (``metadata.jupyter.source_hidden``) is not read;
- **machinery lines**: the visible lines inside ``claim``, ``timed_claim`` and ``say`` calls,
  the proof that a sentence is true rather than the experiment;
- **exercises**: graded answer cells (nbgrader ``solution`` cells);
- **minutes**, by a stated method (``METHOD``): prose at 150 words a minute (technical reading
  with figures), code at 15 lines a minute (read it and run it), and each exercise 5 minutes
  plus one minute per line of the reference solution (reading the task and testing an answer,
  then writing it). The exercise estimate comes from the solution's length, not from a timed
  learner.

``python -m ar_lab.course.budget [NOTEBOOK ...]`` prints the table (every notebook in
``notebooks/`` by default); ``tests/test_budget.py`` fails a notebook past its budget.
"""

from __future__ import annotations

import argparse
import ast
import math
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat

from ar_lab.base.errors import BadValue

MAX_WORDS = 2500
MAX_CODE_LINES = 350
MAX_EXERCISES = 4
MAX_MINUTES = 90
MAX_MACHINERY_SHARE = 0.03  # of the visible code lines, over the whole course
MACHINERY_CALLS = ("claim", "timed_claim", "say")

WORDS_PER_MINUTE = 150
CODE_LINES_PER_MINUTE = 15
EXERCISE_BASE_MINUTES = 5
EXERCISE_MINUTES_PER_LINE = 1.0
METHOD = (
    f"prose at {WORDS_PER_MINUTE} words a minute, code at {CODE_LINES_PER_MINUTE} lines a "
    f"minute, and each exercise {EXERCISE_BASE_MINUTES} minutes plus "
    f"{EXERCISE_MINUTES_PER_LINE:g} a line of its reference solution"
)

_WORD = re.compile(r"[A-Za-z0-9][\w'-]*")
_SOLUTION = re.compile(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", re.S)


def count_words(text: str) -> int:
    return len(_WORD.findall(text))


def _rendered_markdown(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        md = out.get("data", {}).get("text/markdown")
        if md:
            parts.append("".join(md) if isinstance(md, list) else md)
    return "\n".join(parts)


def is_hidden(cell) -> bool:
    """A code cell JupyterLab shows collapsed: its source is not on the learner's path."""
    return bool(cell.get("metadata", {}).get("jupyter", {}).get("source_hidden"))


def _code_body(source: str) -> str:
    return "\n".join(
        "" if line.lstrip().startswith(("%", "!")) else line for line in source.split("\n")
    )


def code_lines(source: str) -> int:
    """Non-blank lines that are not comments (magics and shell escapes left out)."""
    return sum(
        1
        for line in _code_body(source).split("\n")
        if line.strip() and not line.strip().startswith("#")
    )


def machinery_lines(source: str) -> int:
    """Lines inside calls of ``claim``, ``timed_claim`` or ``say`` (a cell that does not parse has
    none)."""
    body = _code_body(source)
    try:
        tree = ast.parse(body)
    except SyntaxError:
        return 0
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in MACHINERY_CALLS:
                lines.update(range(node.lineno, node.end_lineno + 1))
    text = body.split("\n")
    return sum(1 for n in lines if text[n - 1].strip() and not text[n - 1].strip().startswith("#"))


def solution_lines(source: str) -> int:
    regions = _SOLUTION.findall(source) or [source]
    return sum(code_lines(r) for r in regions)


@dataclass(frozen=True)
class Budget:
    name: str
    words: int
    code_lines: int
    machinery_lines: int
    exercises: int
    exercise_minutes: float

    @property
    def minutes(self) -> int:
        """The sitting by ``METHOD``, rounded up to whole minutes."""
        return math.ceil(
            self.words / WORDS_PER_MINUTE
            + self.code_lines / CODE_LINES_PER_MINUTE
            + self.exercise_minutes
        )

    def over(self) -> list[str]:
        """What is past the budget, one phrase per limit (empty when it fits)."""
        limits = [
            ("words", self.words, MAX_WORDS),
            ("visible code lines", self.code_lines, MAX_CODE_LINES),
            ("graded exercises", self.exercises, MAX_EXERCISES),
            ("minutes", self.minutes, MAX_MINUTES),
        ]
        return [f"{got} {what} (at most {most})" for what, got, most in limits if got > most]


def measure(path: str | Path) -> Budget:
    """The budget of one notebook, from its committed sources and outputs."""
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    words = code = machinery = exercises = 0
    exercise_minutes = 0.0
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            words += count_words(cell.source)
            continue
        if cell.cell_type != "code":
            continue
        words += count_words(_rendered_markdown(cell))
        if cell.get("metadata", {}).get("nbgrader", {}).get("solution"):
            exercises += 1
            exercise_minutes += EXERCISE_BASE_MINUTES + EXERCISE_MINUTES_PER_LINE * solution_lines(
                cell.source
            )
        if is_hidden(cell):
            continue
        code += code_lines(cell.source)
        machinery += machinery_lines(cell.source)
    return Budget(path.stem, words, code, machinery, exercises, exercise_minutes)


def section_headings(path: str | Path) -> list[str]:
    """The titles of the notebook's ``## `` sections (after its opening cell)."""
    nb = nbformat.read(Path(path), as_version=4)
    found = []
    for cell in nb.cells[1:]:
        if cell.cell_type == "markdown":
            found += [m.strip() for m in re.findall(r"^## (.+)$", cell.source, re.M)]
    return found


TABLE_START = (
    "<!-- sitting table: written by `python -m ar_lab.course.budget --write` from the notebooks -->"
)
TABLE_END = "<!-- end of sitting table -->"
DOCUMENTS = ("README.md", "INSTRUCTORS.md")  # each holds the table between the two markers


def sitting_table(rows: list[Budget]) -> str:
    """The Markdown table of every notebook's sitting, with the method under it."""
    lines = [
        "| notebook | minutes | words of prose | lines of code to read | graded exercises |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| `{b.name}` | {b.minutes} | {b.words:,} | {b.code_lines} | {b.exercises} |" for b in rows
    ]
    lines.append("")
    lines.append(
        f"Minutes by a stated method: {METHOD} (the exercise estimate comes from the solution's "
        "length, not from timed learners)."
    )
    return "\n".join(lines)


def write_tables(root: Path, rows: list[Budget]) -> list[Path]:
    """Replace the table between the markers in README.md and INSTRUCTORS.md; returns the files
    changed."""
    block = f"{TABLE_START}\n{sitting_table(rows)}\n{TABLE_END}"
    changed = []
    for name in DOCUMENTS:
        path = root / name
        text = path.read_text()
        if TABLE_START not in text or TABLE_END not in text:
            raise BadValue(
                f"{path} (under root) has no sitting table markers ({TABLE_START!r} ... "
                f"{TABLE_END!r})",
                arg="root",
            )
        head, rest = text.split(TABLE_START, 1)
        new = head + block + rest.split(TABLE_END, 1)[1]
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ar_lab.course.budget", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "notebooks", nargs="*", type=Path, help="notebooks to measure (default: notebooks/*.ipynb)"
    )
    parser.add_argument(
        "--write",
        action="store_true",
        help="also write the sitting table into README.md and INSTRUCTORS.md (from every notebook)",
    )
    args = parser.parse_args(argv)
    if args.write and args.notebooks:
        parser.error("--write measures every notebook in notebooks/: give no notebooks with it")
    paths = args.notebooks or sorted(Path("notebooks").glob("*.ipynb"))
    if not paths:
        parser.error("no notebooks given and none in notebooks/")
    for p in paths:
        if not p.is_file():
            parser.error(f"no notebook {p}")
    rows = [measure(p) for p in paths]
    print(f"{'notebook':36} {'words':>6} {'code':>5} {'mach.':>5} {'ex.':>3} {'min':>4}  over")
    for b in rows:
        print(
            f"{b.name:36} {b.words:6} {b.code_lines:5} {b.machinery_lines:5} {b.exercises:3} "
            f"{b.minutes:4}  " + ("; ".join(b.over()) or "-")
        )
    code, mach = sum(b.code_lines for b in rows), sum(b.machinery_lines for b in rows)
    print(f"machinery: {mach} of {code} visible code lines ({mach / max(code, 1):.1%}; at most "
          f"{MAX_MACHINERY_SHARE:.0%})")
    print(f"minutes: {METHOD}")
    if args.write:
        for path in write_tables(Path("."), rows):
            print(f"wrote the sitting table into {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
