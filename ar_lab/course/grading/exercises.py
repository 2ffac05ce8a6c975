"""Exercises in nbgrader's format: the student versions learners open, and a course folder for
nbgrader.

The notebooks in ``notebooks/`` are the *source* versions: solution regions between
``### BEGIN SOLUTION`` / ``### END SOLUTION`` in cells marked ``solution``, and
autograded test cells (``grade: true``, a unique ``grade_id``, ``points``,
``locked``) that may hold hidden tests between ``### BEGIN HIDDEN TESTS`` /
``### END HIDDEN TESTS``.

Learners need no gradebook: ``release`` writes the student versions (what ``make lab``
opens), the same notebooks nbgrader's ``generate_assignment`` produces: solutions
replaced by the stub, hidden tests removed, outputs cleared, cells locked and
checksummed. It never writes into the source folder and never replaces a notebook that
is already in the target folder (it may hold a learner's work).

Instructors grade with nbgrader itself: ``course`` lays out an nbgrader course folder
(``source/<chapter>/<chapter>.ipynb`` and an ``nbgrader_config.py``, whose ``SandboxedExecute`` runs
each submission's kernel in the grading sandbox, ``ar_lab.course.grading.jail``); after ``nbgrader
autograde``, ``python -m ar_lab.course.grading`` judges each test again with the learner's answer in
a process of its own (``ar_lab.course.grading.sandbox``). INSTRUCTORS.md walks through the commands
run from there.

    python -m ar_lab.course.grading.exercises release [--chapter 04 ...] [--out course]
    python -m ar_lab.course.grading.exercises course DIR [--chapter 06 ...] [--timeout 120]
        [--overwrite]

``execute`` and ``grade`` run a notebook and score its graded cells as nbgrader's
autograder does; the tests use them to prove that every student version fails.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

from ar_lab.base.errors import BadValue
from ar_lab.course.grading import lab_settings

ROOT = Path(__file__).resolve().parents[3]
NOTEBOOKS = ROOT / "notebooks"
CODE_STUB = "# YOUR CODE HERE\nraise NotImplementedError()"
MARKDOWN_STUB = "YOUR ANSWER HERE"
COURSE_ID = "ar_lab"
_SOLUTION = re.compile(
    r"^([ \t]*)### BEGIN SOLUTION[^\n]*\n.*?^[ \t]*### END SOLUTION[^\n]*(\n|$)", re.M | re.S
)
_HIDDEN = re.compile(
    r"^[ \t]*### BEGIN HIDDEN TESTS[^\n]*\n.*?^[ \t]*### END HIDDEN TESTS[^\n]*(\n|$)", re.M | re.S
)


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


def _is_locked(meta: dict) -> bool:
    """nbgrader's rule: solution cells are editable, graded cells locked, others as marked."""
    if meta.get("solution"):
        return False
    return bool(meta.get("grade") or meta.get("locked"))


def cell_checksum(cell) -> str:
    """nbgrader's checksum of a cell (``nbgrader.utils.compute_checksum``): how it spots edited
    cells."""
    meta = nbgrader_meta(cell)
    parts = [
        cell.source,
        cell.cell_type,
        str(bool(meta.get("grade"))),
        str(bool(meta.get("solution"))),
    ]
    parts += [str(_is_locked(meta)), meta["grade_id"]]
    if meta.get("grade"):
        parts.append(str(float(meta["points"])))
    md5 = hashlib.md5()
    for part in parts:
        md5.update(part.encode("utf-8"))
    return md5.hexdigest()


def _lock(cell) -> None:
    """nbgrader's LockCells: answers cannot be deleted; tests cannot be deleted or edited."""
    meta = nbgrader_meta(cell)
    if meta.get("solution"):
        cell.metadata["deletable"] = False
    elif meta.get("grade") or _is_locked(meta):
        cell.metadata["deletable"] = False
        cell.metadata["editable"] = False


def student_version(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook a learner opens, as nbgrader's ``generate_assignment`` writes it.

    Solutions become stubs, hidden tests go, outputs are cleared; answer and test cells
    are locked against deletion (tests against editing too) and carry nbgrader's checksum.
    """
    out = copy.deepcopy(nb)
    for cell in out.cells:
        meta = nbgrader_meta(cell)
        if "### BEGIN SOLUTION" in cell.source and not meta.get("solution"):
            raise BadValue(
                "a solution region is in a cell of nb not marked as a solution: "
                f"{cell.source[:60]!r}",
                arg="nb",
            )
        _lock(cell)
        if meta.get("solution"):
            cell.source = strip_solutions(cell.source, cell.cell_type)
        if meta.get("grade") and cell.cell_type == "code":
            cell.source = strip_hidden_tests(cell.source)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("collapsed", None)
            cell.metadata.pop("scrolled", None)
        if meta.get("grade") or meta.get("solution") or _is_locked(meta):
            meta["checksum"] = cell_checksum(cell)
            meta["cell_type"] = cell.cell_type
    return out


def graded_cells(nb: nbformat.NotebookNode) -> list[tuple[int, dict]]:
    return [(i, nbgrader_meta(c)) for i, c in enumerate(nb.cells) if nbgrader_meta(c).get("grade")]


def exercises_only(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """``nb`` cut to its answer and test cells and the cells they need (``cells.cut``): what the
    checks that run every exercise with a wrong answer execute, instead of the chapter's
    experiments."""
    from ar_lab.course.grading.cells import cut

    return cut(
        nb, lambda c: bool(nbgrader_meta(c).get("solution") or nbgrader_meta(c).get("grade"))
    )


def _folder(name: str, value) -> Path:
    """``value`` as a folder path; an empty string (the current folder, by accident) or a non-path
    is refused."""
    if not isinstance(value, (str, Path)) or not str(value).strip():
        raise BadValue(f"{name} must be a folder path (a str or Path), got {value!r}", arg=name)
    return Path(value)


_APPENDIX = re.compile(r"[Aa]\d")  # an appendix: A1


def _chapters(chapters) -> list[str] | None:
    """``chapters`` as a list: None (every chapter), one chapter ("04" or 4) or a non-empty list of
    them."""
    if chapters is None:
        return None
    if isinstance(chapters, (str, int)) and not isinstance(chapters, bool):
        return [chapters]  # one chapter, not the characters of "04"
    if not isinstance(chapters, (list, tuple)) or not chapters:
        raise BadValue(
            "chapters must be a chapter (e.g. '04'), a non-empty list of them or None (all), "
            f"got {chapters!r}",
            arg="chapters",
        )
    return list(chapters)


def select_notebooks(src: Path, chapters: list[str] | str | None = None) -> list[Path]:
    """The source notebooks in ``src``: all of them (``chapters=None``), or the chapters named by
    number ("04", "6", 4): one, or a list of them."""
    src, chapters = _folder("src", src), _chapters(chapters)
    if not src.is_dir():
        raise FileNotFoundError(f"no folder {src}")
    patterns = ["*.ipynb"]
    if chapters is not None:
        for chapter in chapters:
            if not (str(chapter).isdigit() and int(chapter) <= 99 or _APPENDIX.fullmatch(
                    str(chapter))):
                raise BadValue(
                    f"a chapter is a number such as 04 (or an appendix such as A1), got "
                    f"{chapter!r} in chapters", arg="chapters"
                )
        # a chapter and its parts (07b_...), or an appendix
        patterns = [f"{str(chapter).upper()}_*.ipynb" if _APPENDIX.fullmatch(str(chapter))
                    else f"{int(chapter):02d}[_a-z]*.ipynb" for chapter in chapters]
    found = []
    for pattern in patterns:
        matches = sorted(src.glob(pattern))
        if not matches:
            raise FileNotFoundError(f"no notebook matching {pattern} in {src}")
        found += [m for m in matches if m not in found]
    return found


def _refuse_source_folder(target: Path, *sources: Path, arg: str) -> None:
    """Raise if ``target`` (the argument ``arg`` names) resolves (symlinks, ``..``) into a source
    folder."""
    resolved = target.resolve()
    for src in sources:
        src = src.resolve()
        if resolved == src or src in resolved.parents:
            raise BadValue(
                f"{target} ({arg}) is in the source folder {src}: choose another folder", arg=arg
            )


GLOSSARY = "glossary.md"  # the course's glossary, beside the chapters that link to it


def release(
    src: Path = NOTEBOOKS, out: Path = ROOT / "course", *, chapters: list[str] | None = None
) -> list[Path]:
    """Write the student version of every notebook in ``src`` (or of ``chapters``) to ``out``.

    A notebook already in ``out`` is kept as it is: it may hold a learner's work. To get a
    fresh copy, rename or delete it first. Returns the paths written. ``chapters``: one chapter
    ("04") or a list of them; None releases every notebook.
    """
    src, out = _folder("src", src), _folder("out", out)
    notebooks = select_notebooks(src, chapters)
    _refuse_source_folder(out, src, NOTEBOOKS, arg="out")
    written = []
    for path in notebooks:
        target = out / path.name
        # a symlink too: it may point anywhere, the source included
        if target.exists() or target.is_symlink():
            continue
        out.mkdir(parents=True, exist_ok=True)
        nbformat.write(student_version(nbformat.read(path, as_version=4)), target)
        written.append(target)
    if notebooks:  # the learner's JupyterLab settings: nbgrader's menus and pages off
        lab_settings.write(out)
    glossary = src / GLOSSARY
    # the chapters link to it
    if notebooks and glossary.is_file() and not (out / GLOSSARY).exists():
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(glossary, out / GLOSSARY)
        written.append(out / GLOSSARY)
    return written


NBGRADER_CONFIG = '''\
"""nbgrader configuration for the ar_lab course
(written by `python -m ar_lab.course.grading.exercises course`).

Run nbgrader's commands from this folder; INSTRUCTORS.md walks through them. `course`
never replaces this file once it exists, so edit it freely.
"""

from nbgrader.api import Gradebook
from nbgrader.converters import Autograde
from nbgrader.nbgraderformat import MetadataValidator
from nbgrader.preprocessors import (
    CheckCellMetadata,
    ClearOutput,
    Execute,
    OverwriteCells,
    OverwriteKernelspec,
)
from nbgrader.preprocessors.base import NbGraderPreprocessor

from ar_lab.course.grading.jail import SandboxedKernelManager


class SandboxedExecute(Execute):
    """nbgrader's Execute, with each submission's kernel in ar_lab's sandbox (bubblewrap;
    INSTRUCTORS.md): it writes nowhere but a scratch folder of its own and sees neither this course
    folder nor the repository's notebooks. Without bubblewrap every submission is reported with the
    reason, unless AR_LAB_SANDBOX=off.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("kernel_manager_class", SandboxedKernelManager)
        super().__init__(*args, **kwargs)


class DropBadGraderMetadata(NbGraderPreprocessor):
    """Stands in for nbgrader's DeduplicateIds when autograde sanitizes a submission.

    A learner who copies a graded cell copies its nbgrader metadata. DeduplicateIds
    empties the metadata of all but the last copy, which then fails nbgrader's schema
    check and stops autograde for the whole class (jupyter/nbgrader#1083); a cell pasted
    from another notebook fails that learner's submission. Here the nbgrader metadata of
    such cells (extra copies, ids this notebook does not have, metadata nbgrader's
    validator rejects) is removed: the cell runs as ordinary code and earns nothing.
    OverwriteCells then restores the locked tests and puts back a graded cell that is missing.
    """

    def preprocess(self, nb, resources):
        info = resources["nbgrader"]
        with Gradebook(info["db_url"]) as gb:
            notebook = gb.find_notebook(info["notebook"], info["assignment"])
            known = {cell.name for cell in notebook.source_cells}
        validator, seen = MetadataValidator(), set()
        for cell in reversed(nb.cells):  # the last copy keeps its metadata, as with DeduplicateIds
            meta = cell.metadata.get("nbgrader")
            if meta is None:
                continue
            grade_id = meta.get("grade_id")
            try:
                validator.validate_cell(cell)
                problem = (
                    "duplicated" if grade_id in seen else "unknown" if grade_id not in known else ""
                )
            except Exception as error:  # whatever nbgrader would reject
                problem = f"invalid ({error})"
            if problem:
                self.log.warning(
                    "%s nbgrader metadata removed from a cell (grade_id %s)", problem, grade_id
                )
                del cell.metadata["nbgrader"]
            seen.add(grade_id)
        return nb, resources


c = get_config()  # noqa: F821 - provided by nbgrader when it loads this file
c.CourseDirectory.course_id = "{course_id}"
# Seconds a cell may run. A cell still running is interrupted and fails: an infinite
# loop costs that exercise, not the class.
c.Execute.timeout = {timeout}
# A deleted graded cell is put back and run: it earns its points only if the code passes it.
c.OverwriteCells.add_missing_cells = True
c.Autograde.sanitize_preprocessors = [
    ClearOutput, DropBadGraderMetadata, OverwriteKernelspec, OverwriteCells, CheckCellMetadata,
]
# Each submission runs in a sandbox (above): nbgrader's own steps, with SandboxedExecute for
# Execute.
c.Autograde.autograde_preprocessors = [
    SandboxedExecute if step is Execute else step
    for step in Autograde.class_traits()["autograde_preprocessors"].default()
]
'''


def nbgrader_config(*, timeout: int = 120, course_id: str = COURSE_ID) -> str:
    """The text of the course folder's ``nbgrader_config.py``."""
    return NBGRADER_CONFIG.replace("{course_id}", course_id).replace("{timeout}", str(timeout))


def course(
    folder: Path,
    *,
    src: Path = NOTEBOOKS,
    chapters: list[str] | None = None,
    timeout: int = 120,
    overwrite: bool = False,
) -> list[Path]:
    """Lay out an nbgrader course folder: ``source/<chapter>/<chapter>.ipynb`` and
    ``nbgrader_config.py``.

    A source notebook already there that differs from ``src``'s is an error unless
    ``overwrite`` (nothing is written then); an existing ``nbgrader_config.py`` is kept.
    ``timeout`` is the seconds one cell may run when nbgrader executes a submission.
    Returns the paths written.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
        raise BadValue(
            f"timeout must be a whole number of seconds >= 1, got {timeout!r}", arg="timeout"
        )
    folder, src = _folder("folder", folder), _folder("src", src)
    notebooks = select_notebooks(src, chapters)
    _refuse_source_folder(folder, src, NOTEBOOKS, arg="folder")
    targets = {path: folder / "source" / path.stem / path.name for path in notebooks}
    for target in targets.values():
        _refuse_source_folder(target, src, NOTEBOOKS, arg="folder")
    changed = [t for p, t in targets.items() if t.exists() and t.read_bytes() != p.read_bytes()]
    if changed and not overwrite:
        names = ", ".join(str(t) for t in changed)
        raise FileExistsError(
            f"{names} already exist(s) and differ(s) from {src}: pass --overwrite to replace"
        )
    written = []
    for path, target in targets.items():
        if target.exists() and target.read_bytes() == path.read_bytes():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        written.append(target)
    config = folder / "nbgrader_config.py"
    if not config.exists():
        config.write_text(nbgrader_config(timeout=timeout))
        written.append(config)
    return written


@dataclass
class CellResult:
    grade_id: str
    points: float
    passed: bool
    error: str  # the error name and message when it failed


def execute(
    nb: nbformat.NotebookNode, cwd: Path, *, timeout: int = 120, env: dict[str, str] | None = None
) -> nbformat.NotebookNode:
    """Run every cell, continuing past errors as nbgrader's autograder does (``env``: the kernel's
    environment, by default this process's)."""
    from nbclient import NotebookClient

    nb = copy.deepcopy(nb)
    # "immediate": the kernel is stopped without waiting for its own exit (a second a run: its
    # results are in already; a process it started ends when the kernel's end of the pipe closes)
    client = NotebookClient(
        nb, timeout=timeout, allow_errors=True, resources={"metadata": {"path": str(cwd)}},
        shutdown_kernel="immediate",
    )
    # the kernel provisioner refuses env=None
    client.execute(**({} if env is None else {"env": env}))
    return nb


def grade(executed: nbformat.NotebookNode) -> list[CellResult]:
    """Per graded cell: passed when it raised no error and wrote nothing to stderr (nbgrader's
    rule)."""
    results = []
    for i, meta in graded_cells(executed):
        outputs = executed.cells[i].get("outputs", [])
        errors = [o for o in outputs if o.get("output_type") == "error"]
        stderr = [
            o for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stderr"
        ]
        if errors:
            message = f"{errors[0]['ename']}: {errors[0]['evalue']}"
        else:
            message = f"stderr: {stderr[0]['text'].strip()}" if stderr else ""
        points = float(meta.get("points", 0))
        results.append(CellResult(meta["grade_id"], points, not (errors or stderr), message))
    return results


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        self.exit(2, f"{self.prog}: error: {message}\n")


def _folder_arg(text: str) -> Path:
    """A command-line folder; an empty one is refused (it would write into the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("give a folder path, got an empty string")
    return Path(text)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m ar_lab.course.grading.exercises", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(
        dest="cmd", metavar="{release,course}", required=True, parser_class=_Parser
    )
    rel = sub.add_parser("release", help="write the student versions of notebooks/ to course/")
    rel.add_argument(
        "--src", type=_folder_arg, default=NOTEBOOKS, help="source notebooks (default: notebooks/)"
    )
    rel.add_argument(
        "--out", type=_folder_arg, default=ROOT / "course", help="target folder (default: course/)"
    )
    rel.add_argument(
        "--chapter", action="append", help="release only this chapter (e.g. 04); repeatable"
    )
    crs = sub.add_parser("course", help="lay out an nbgrader course folder in DIR")
    crs.add_argument("dir", type=_folder_arg, metavar="DIR")
    crs.add_argument(
        "--src", type=_folder_arg, default=NOTEBOOKS, help="source notebooks (default: notebooks/)"
    )
    crs.add_argument("--chapter", action="append", help="only this chapter (e.g. 06); repeatable")
    crs.add_argument(
        "--timeout", type=int, default=120, help="seconds a cell may run when grading (default 120)"
    )
    crs.add_argument(
        "--overwrite", action="store_true", help="replace source notebooks already in DIR/source"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "release":
            written = release(args.src, args.out, chapters=args.chapter)
            notebooks = [p for p in written if p.suffix == ".ipynb"]
            kept = len(select_notebooks(args.src, args.chapter)) - len(notebooks)
            note = (
                f"; kept {kept} already there (a learner's work is never replaced)" if kept else ""
            )
            glossary = " and the glossary" if len(written) > len(notebooks) else ""
            print(f"wrote {len(notebooks)} student notebook(s){glossary} to {args.out}{note}")
        else:
            options = dict(
                src=args.src, chapters=args.chapter, timeout=args.timeout, overwrite=args.overwrite
            )
            written = course(args.dir, **options)
            print(
                f"wrote {len(written)} file(s) in {args.dir}; run nbgrader's commands from there "
                "(INSTRUCTORS.md)"
            )
            if args.dir / "nbgrader_config.py" not in written:
                print(
                    f"kept the existing {args.dir / 'nbgrader_config.py'} (its time limit is "
                    "c.Execute.timeout)"
                )
    except (ValueError, OSError) as error:
        print(
            f"python -m ar_lab.course.grading.exercises {args.cmd}: error: {error}", file=sys.stderr
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
