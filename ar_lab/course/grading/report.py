"""A submissions report for the instructor: what in a learner's answers no test can judge.

nbgrader's tests judge what an answer computes, not how. An answer that starts a thread, reads
its own source (``inspect``), runs strings (``exec``/``eval``), reloads or swaps modules
(``importlib``, ``sys.modules``), hooks IPython, reads files outside the assignment, reaches into
the package's private names or its grader, or monkeypatches an imported module can pass a test
without doing the exercise. This module scans the solution cells of every submission
statically (``ast``, nothing is run) and prints one line per thing a person should look at.

    # scans submitted/<student>/<assignment>/*.ipynb
    python -m ar_lab.course.grading.report COURSE_FOLDER

``scan_notebook`` gives the flags of one notebook; ``scan_course`` / ``format_report`` the report
over a course folder. The course's own solutions give no flags (tests/test_report.py checks it).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

PACKAGE = Path(__file__).resolve().parents[2]
ROOT_NAME = PACKAGE.name
# The grader: a solution has no reason to import (or call) any of it.
GRADER = tuple(
    f"{ROOT_NAME}.course.{m}"
    for m in (
        "checkers.checks",
        "checkers.model_checks",
        "checkers.quant_checks",
        "checkers.kv_checks",
        "checkers.paged_checks",
        "checkers.grammar_checks",
        "checkers.mistakes",
        "grading",
    )
)
# Resolved dotted names (a name and everything under it) -> the kind of flag.
DOTTED = {
    "threads": (
        "threading",
        "_thread",
        "concurrent.futures",
        "multiprocessing",
        "torch.multiprocessing",
    ),
    "inspect": ("inspect", "sys._getframe", "traceback.extract_stack"),
    "dynamic-code": (
        "exec",
        "eval",
        "compile",
        "builtins.exec",
        "builtins.eval",
        "builtins.compile",
    ),
    "importlib": ("importlib", "__import__", "builtins.__import__"),
    "interpreter": (
        "sys.modules",
        "sys.settrace",
        "sys.setprofile",
        "sys.meta_path",
        "sys.path_hooks",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "builtins",
        "__builtins__",
    ),
    "ipython-hook": ("get_ipython", "IPython.get_ipython", "IPython.core", "sys.excepthook"),
    "file-read": (
        "open",
        "io.open",
        "os.open",
        "os.listdir",
        "os.scandir",
        "os.walk",
        "glob",
        "shutil",
        "numpy.load",
        "numpy.loadtxt",
        "numpy.genfromtxt",
        "numpy.fromfile",
        "numpy.memmap",
        "torch.load",
        "json.load",
        "pickle.load",
        "joblib.load",
        "safetensors",
        "pandas.read_csv",
        "pandas.read_pickle",
        "pandas.read_json",
        "pandas.read_parquet",
        "linecache",
    ),
    "shell": ("subprocess", "os.system", "os.popen", "os.execv", "os.execvp", "pty"),
}
# Attribute names flagged on any object (a Path's read_text, an IPython shell's hooks, a function's
# code).
ATTRIBUTES = {
    "read_text": "file-read",
    "read_bytes": "file-read",
    "iterdir": "file-read",
    "rglob": "file-read",
    "input_transformers_cleanup": "ipython-hook",
    "input_transformers_post": "ipython-hook",
    "ast_transformers": "ipython-hook",
    "set_custom_exc": "ipython-hook",
    "register_magic_function": "ipython-hook",
    "showtraceback": "ipython-hook",
    "run_cell": "ipython-hook",
    "user_ns": "ipython-hook",
    "__code__": "function-internals",
    "__globals__": "function-internals",
    "__defaults__": "function-internals",
    "__kwdefaults__": "function-internals",
    "__closure__": "function-internals",
    "f_back": "inspect",
    "f_globals": "inspect",
    "f_locals": "inspect",
    "tb_frame": "inspect",
}
FILE_CALL_ATTRIBUTES = {"read_text", "read_bytes", "iterdir", "rglob"}
# Line magics that only time or display; any other magic or shell escape is flagged ("magic").
SAFE_MAGICS = {
    "time",
    "timeit",
    "matplotlib",
    "capture",
    "precision",
    "pprint",
    "who",
    "whos",
    "prun",
}
KINDS = (*DOTTED, "function-internals", "internal-import", "grader-import", "monkeypatch",
         "magic", "parse-error", "unreadable")
_MAGIC = re.compile(r"^(\s*)(?:[A-Za-z_][\w, ]*=\s*)?([!%]{1,2})\s*(\w*)")
_HELP = re.compile(r"^\s*[\w.]+\?{1,2}\s*$")


@dataclass(frozen=True)
class Flag:
    """One thing to look at: where (notebook, cell id or index, grade_id, line in the cell) and
    what."""

    notebook: str
    cell: str
    grade_id: str | None
    line: int
    kind: str
    source: str
    detail: str = ""

    def format(self) -> str:
        grade = f" ({self.grade_id})" if self.grade_id else ""
        detail = f"  [{self.detail}]" if self.detail else ""
        return (
            f"{self.notebook} cell {self.cell}{grade} line {self.line}: {self.kind}: "
            f"{self.source}{detail}"
        )


def solution_cells(nb) -> list[tuple[int, dict]]:
    """(index, cell) of the code cells a learner answers in: nbgrader ``solution: true`` (it stays
    in a submitted copy, where the markers are gone) or holding a ``### BEGIN SOLUTION`` region."""
    found = []
    for i, cell in enumerate(nb.get("cells", [])):
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.get("cell_type") == "code" and (
            meta.get("solution") or "### BEGIN SOLUTION" in cell.get("source", "")
        ):
            found.append((i, cell))
    return found


def python_source(source: str) -> tuple[str, list[tuple[int, str]]]:
    """``source`` with IPython syntax made parseable, line numbers kept: each magic or shell line
    becomes ``pass``. Returns it and [(line, magic name)] for the magics that are not SAFE_MAGICS;
    a cell magic whose body is not Python (``%%bash``) gives an empty source."""
    lines, magics = source.splitlines(), []
    for n, text in enumerate(lines):
        match = _MAGIC.match(text)
        if match:
            indent, sigil, name = match.groups()
            if sigil.startswith("!") or name not in SAFE_MAGICS:
                magics.append((n + 1, "!" if sigil.startswith("!") else sigil + name))
            if sigil == "%%" and n == 0 and name not in SAFE_MAGICS:
                return "", magics
            lines[n] = indent + "pass"
        elif _HELP.match(text):
            lines[n] = text[: len(text) - len(text.lstrip())] + "pass"
    return "\n".join(lines), magics


def aliases(trees: list[ast.AST]) -> dict[str, str]:
    """Name -> the dotted name it was imported as, over every cell of the notebook (the learner's
    answers use names the notebook's other cells import)."""
    names = {"np": "numpy", "pd": "pandas"}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    names[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0]
                    )
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, its root resolved through the imports."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([names.get(node.id, node.id), *reversed(parts)])


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def name_kinds(name: str) -> list[str]:
    """The kinds of flag a resolved dotted name (used or imported) calls for."""
    kinds = [kind for kind, prefixes in DOTTED.items() if _under(name, prefixes)]
    if _under(name, GRADER):
        kinds.append("grader-import")
    elif _under(name, (ROOT_NAME,)) and any(
        p.startswith("_") and not p.endswith("__") for p in name.split(".")
    ):
        kinds.append("internal-import")
    return kinds


def _literal_path(node: ast.AST | None) -> str | None:
    """The path a file call reads when the source spells it: "x", Path("x"), Path("a") / "b"."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
        return node.value if isinstance(node.value, str) else node.value.decode(errors="replace")
    if isinstance(node, ast.Call) and node.args:
        return _literal_path(node.args[0])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        left, right = _literal_path(node.left), _literal_path(node.right)
        return f"{left}/{right}" if left is not None and right is not None else None
    return None


class _Scanner(ast.NodeVisitor):
    """Walks one cell's tree and collects (line, kind, detail)."""

    def __init__(self, names: dict[str, str]):
        self.names, self.found, self.parents = names, [], {}

    def add(self, node: ast.AST, kind: str, detail: str = "") -> None:
        self.found.append((node.lineno, kind, detail))

    def scan(self, tree: ast.AST) -> list[tuple[int, str, str]]:
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
        self.visit(tree)
        return self.found

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            for kind in name_kinds(a.name):
                self.add(node, kind, a.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for a in node.names:
            full = f"{module}.{a.name}"
            kinds = set(name_kinds(full)) | set(name_kinds(module))
            if (
                _under(module, (ROOT_NAME,))
                and a.name.startswith("_")
                and "grader-import" not in kinds
            ):
                kinds.add("internal-import")
            for kind in sorted(kinds):
                self.add(node, kind, full)

    def _chain(self, node: ast.AST) -> None:
        parent = self.parents.get(node)
        if isinstance(parent, ast.Attribute) and parent.value is node:
            return  # only whole chains: a.b.c, not a.b
        name = dotted(node, self.names)
        if name is None:
            return
        for kind in name_kinds(name):
            if kind == "file-read" and isinstance(node.ctx, ast.Store):
                continue  # replacing torch.load is a monkeypatch, flagged as one
            detail = name
            if kind == "file-read" and isinstance(parent, ast.Call) and parent.func is node:
                detail = self._path_detail(parent.args[0] if parent.args else None)
            self.add(node, kind, detail)

    def _path_detail(self, arg: ast.AST | None) -> str:
        path = _literal_path(arg)
        return f"reads {path!r}" if path is not None else "path not literal"

    def visit_Name(self, node: ast.Name) -> None:
        self._chain(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        kind = ATTRIBUTES.get(node.attr)
        if kind == "file-read":
            self.add(node, kind, self._path_detail(node.value))
        elif kind:
            self.add(node, kind, node.attr)
        elif (
            node.attr == "register"
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "events"
        ):
            self.add(node, "ipython-hook", "events.register")
        self._chain(node)
        self.generic_visit(node)

    def _imported_root(self, node: ast.AST) -> str | None:
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return (
            self.names.get(node.id)
            if isinstance(node, ast.Name) and node.id in self.names
            else None
        )

    def _targets(self, node: ast.AST, targets) -> None:
        for target in targets:
            for t in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                root = self._imported_root(t) if isinstance(t, ast.Attribute) else None
                if root is not None:
                    self.add(node, "monkeypatch", f"sets an attribute of {root}")

    def visit_Assign(self, node: ast.Assign) -> None:
        self._targets(node, node.targets)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._targets(node, [node.target])
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._targets(node, [node.target])
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        self._targets(node, node.targets)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (
            isinstance(func, ast.Name)
            and func.id in ("setattr", "delattr", "getattr")
            and len(node.args) >= 2
        ):
            attr = node.args[1]
            attr_name = (
                attr.value
                if isinstance(attr, ast.Constant) and isinstance(attr.value, str)
                else None
            )
            if attr_name in ATTRIBUTES:
                self.add(node, ATTRIBUTES[attr_name], attr_name)
            root = self._imported_root(node.args[0])
            if func.id != "getattr" and root is not None:
                self.add(node, "monkeypatch", f"{func.id} on {root}")
        self.generic_visit(node)


def _parse(source: str) -> ast.AST | None:
    try:
        return ast.parse(python_source(source)[0])
    except (SyntaxError, ValueError):
        return None


def scan_cell(source: str, names: dict[str, str]) -> list[tuple[int, str, str]]:
    """(line, kind, detail) for one cell's source: its magics, its parse error or what its tree
    holds."""
    code, magics = python_source(source)
    found = [(line, "magic", name) for line, name in magics]
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError) as e:
        line = getattr(e, "lineno", None) or 1
        return found + [(line, "parse-error", f"cannot parse: {getattr(e, 'msg', e)}")]
    return found + _Scanner(names).scan(tree)


def scan_notebook(notebook, name: str | None = None) -> list[Flag]:
    """The flags in one notebook's solution cells (``notebook``: a path or an nbformat dict), one
    per (cell, line, kind), in cell and line order. ``name`` labels them (default: the file
    name)."""
    if not isinstance(notebook, dict):
        path = Path(notebook)
        name = name or path.name
        try:
            notebook = nbformat.read(path, as_version=4)
        except Exception as e:  # a broken file is something to look at too, not a crash
            return [Flag(name, "-", None, 0, "unreadable", "", f"{type(e).__name__}: {e}")]
    name = name or "notebook"
    code = [c.get("source", "") for c in notebook.get("cells", []) if c.get("cell_type") == "code"]
    trees = [t for source in code if (t := _parse(source)) is not None]
    names = aliases(trees)
    flags = []
    for index, cell in solution_cells(notebook):
        source = cell.get("source", "")
        lines = source.splitlines()
        grade_id = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        seen = set()
        for line, kind, detail in sorted(scan_cell(source, names)):
            if (line, kind) in seen:
                continue
            seen.add((line, kind))
            text = lines[line - 1].strip() if 0 < line <= len(lines) else ""
            flags.append(
                Flag(name, str(cell.get("id") or index), grade_id, line, kind, text, detail)
            )
    return flags


def submissions(course: Path) -> list[tuple[str, str, Path]]:
    """(student, assignment, notebook) for every ``submitted/<student>/<assignment>/*.ipynb``."""
    return [
        (nb.parent.parent.name, nb.parent.name, nb)
        for nb in sorted((Path(course) / "submitted").glob("*/*/*.ipynb"))
        if ".ipynb_checkpoints" not in nb.parts
    ]


def scan_course(course: Path) -> dict[tuple[str, str], list[Flag]]:
    """(student, assignment) -> the flags of that submission's notebooks (an empty list: nothing to
    see)."""
    report: dict[tuple[str, str], list[Flag]] = {}
    for student, assignment, path in submissions(course):
        report.setdefault((student, assignment), []).extend(scan_notebook(path))
    return report


def format_report(report: dict[tuple[str, str], list[Flag]]) -> str:
    """One header per student and assignment, one line per flag under it, then a count line."""
    out = []
    for (student, assignment), flags in sorted(report.items()):
        out.append(
            f"{student} / {assignment}: "
            + (f"{len(flags)} flag{'s' * (len(flags) != 1)}" if flags else "ok")
        )
        out += [f"  {flag.format()}" for flag in flags]
    total = sum(len(f) for f in report.values())
    flagged = sum(bool(f) for f in report.values())
    students = len({s for s, _ in report})
    out.append(
        f"{total} flag{'s' * (total != 1)} in {flagged} of {len(report)} submissions "
        f"({students} student{'s' * (students != 1)})"
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ar_lab.course.grading.report",
        description="Flag what no test can judge in the solution cells of an nbgrader course "
        "folder's submissions.",
    )
    parser.add_argument(
        "folder", type=Path, help="nbgrader course folder (holds submitted/<student>/<assignment>/)"
    )
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"error: no folder {args.folder}", file=sys.stderr)
        return 2
    report = scan_course(args.folder)
    if not report:
        print(
            f"error: no submissions in {args.folder} (expected "
            "submitted/<student>/<assignment>/*.ipynb)",
            file=sys.stderr,
        )
        return 2
    print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
