"""The package's layout rules (ARCHITECTURE.md, "Layout rules"), read from the source with ``ast``.

No import cycle inside ``ar_lab``; every module in a layer folder, and imports pointing down
the layers only (base < model < engine < perf < course < bench); no module imports another
module's ``_private`` name; no module over 400 code lines and no function over 70 code lines
outside data tables (code lines: not blank, not comment-only, not in a docstring, so wrapping
prose never counts and never needs squeezing); ARCHITECTURE.md names every folder of the
package and every module of the engine and course layers.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ar_lab"
# the maintainers' guide to these rules and the layers
ARCHITECTURE = PACKAGE.parent / "ARCHITECTURE.md"
# Size caps in code lines (``code_lines``): what a reader must follow, not how prose is wrapped.
MAX_MODULE_CODE_LINES = 400
MAX_FUNCTION_CODE_LINES = 70
# Modules that are data tables rather than logic (the quiz questions).
DATA_TABLES = {"ar_lab.course.views.quiz_bank"}
# The layer folders, lowest first. A module may import its own layer and any lower one; bench
# (the benchmarks on top) may import anything, and so may the package's ``__init__`` (the public
# API), which no layer below bench may import.
LAYERS = ("base", "model", "engine", "perf", "course", "bench")


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def resolve(current: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(package: Path = PACKAGE) -> dict[str, list[tuple[str, str | None, int]]]:
    """module -> [(imported module, imported name or None, line)] for imports inside the package."""
    mods = modules(package)
    root = package.name
    out: dict[str, list[tuple[str, str | None, int]]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [
                    (a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == root
                ]
            elif isinstance(node, ast.ImportFrom):
                target = resolve(name, node, path.name == "__init__.py")
                if target.split(".")[0] != root:
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    found.append(
                        (sub, None, node.lineno) if sub in mods else (target, a.name, node.lineno)
                    )
        out[name] = found
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle's first sighting, by depth-first search (enough to name one)."""
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> modules it imports, where importing ``a.b`` also runs the package ``a``'s
    ``__init__`` only if ``a`` is a subpackage (its own edge), as Python does."""
    mods = modules(package)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, found in imports(package).items():
        for target, _name, _line in found:
            if target in mods and target != mod:
                graph[mod].add(target)
    return graph


def layer_rank(module: str, root: str) -> int | None:
    """Position of ``module``'s layer in ``LAYERS`` (the package itself ranks with bench, on top);
    None for a module outside the layer folders."""
    if module == root:
        return len(LAYERS) - 1
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def layer_violations(package: Path = PACKAGE) -> list[str]:
    """Every module outside the layer folders, and every import (a lazy one inside a function too)
    from a lower layer to a higher one, or to a module outside the layers."""
    root = package.name

    def where(module: str, rank: int | None) -> str:
        return "the public API" if module == root else "no layer" if rank is None else LAYERS[rank]

    bad = []
    for mod, found in imports(package).items():
        if mod == root:
            continue
        own = layer_rank(mod, root)
        if own is None:
            bad.append(f"{mod} lives outside the layer folders ({', '.join(LAYERS)})")
            continue
        for target, _name, line in found:
            rank = layer_rank(target, root)
            if rank is None or rank > own:
                bad.append(f"{mod}:{line} ({LAYERS[own]}) imports {target} ({where(target, rank)})")
    return bad


def private_imports(package: Path = PACKAGE) -> list[str]:
    bad = []
    for mod, found in imports(package).items():
        for target, name, line in found:
            if (
                name is not None
                and name.startswith("_")
                and not name.startswith("__")
                and target != mod
            ):
                bad.append(f"{mod}:{line} imports {target}.{name}")
    return bad


def docstring_lines(tree: ast.AST) -> set[int]:
    """The line numbers of the module's, classes' and functions' docstrings."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                found.update(range(first.lineno, first.end_lineno + 1))
    return found


def code_lines(text: str, tree: ast.AST) -> set[int]:
    """The numbers of the lines that hold code: not blank, not comment-only, not in a docstring."""
    docs = docstring_lines(tree)
    return {
        number
        for number, line in enumerate(text.splitlines(), 1)
        if number not in docs and line.strip() and not line.lstrip().startswith("#")
    }


def long_functions(package: Path = PACKAGE, limit: int = MAX_FUNCTION_CODE_LINES) -> list[str]:
    bad = []
    for mod, path in modules(package).items():
        if mod in DATA_TABLES:
            continue
        text = path.read_text()
        tree = ast.parse(text)
        code = code_lines(text, tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = sum(node.lineno <= number <= node.end_lineno for number in code)
                if n > limit:
                    bad.append(f"{mod}.{node.name} ({n} code lines, line {node.lineno})")
    return bad


def long_modules(package: Path = PACKAGE, limit: int = MAX_MODULE_CODE_LINES) -> list[str]:
    bad = []
    for mod, path in modules(package).items():
        text = path.read_text()
        if mod not in DATA_TABLES and (n := len(code_lines(text, ast.parse(text)))) > limit:
            bad.append(f"{mod} ({n} code lines)")
    return bad


def test_no_import_cycle_inside_the_package():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_no_layer_imports_a_higher_layer():
    bad = layer_violations()
    assert not bad, f"imports against the layer order {' < '.join(LAYERS)}: " + "; ".join(bad)


def test_no_module_imports_another_modules_private_names():
    bad = private_imports()
    assert not bad, "private names imported across modules: " + "; ".join(bad)


def test_no_module_over_the_size_limit():
    bad = long_modules()
    assert not bad, (
        f"modules over {MAX_MODULE_CODE_LINES} code lines (split them by idea): " + ", ".join(bad)
    )


def test_no_function_over_the_length_limit():
    bad = long_functions()
    limit = MAX_FUNCTION_CODE_LINES
    assert not bad, f"functions over {limit} code lines (name their phases): " + ", ".join(bad)


def named_in(text: str, name: str) -> bool:
    """``name`` (e.g. ``decoder.py``, ``serving/``) appears in ``text`` not as the tail of a longer
    name (``quant.py`` is not named by ``kv_quant.py``)."""
    tail = "" if name.endswith("/") else r"(?![\w-])"  # a folder may be followed by a file in it
    return re.search(rf"(?<![\w.-]){re.escape(name)}{tail}", text) is not None


def documented_names(
    package: Path = PACKAGE, detailed: tuple[str, ...] = ("engine", "course")
) -> list[str]:
    """What ARCHITECTURE.md must name: every folder of the package (``base/``) and, in the
    ``detailed`` layers, every module file (``decoder.py``) and subpackage (``serving/``), relative
    to its layer."""
    folders = sorted(p for p in package.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    wanted = [f"{p.name}/" for p in folders]
    for layer in detailed:
        for path in sorted((package / layer).rglob("*.py")):
            rel = path.relative_to(package / layer)
            if rel.name != "__init__.py":
                wanted.append(rel.as_posix())
            elif rel.parent != Path("."):
                wanted.append(f"{rel.parent.as_posix()}/")
    return wanted


def test_the_architecture_guide_names_every_folder_and_every_engine_and_course_module():
    assert ARCHITECTURE.is_file(), (
        f"{ARCHITECTURE.name} is missing: the maintainers' guide to the package's layout"
    )
    text = ARCHITECTURE.read_text()
    assert set(f"{layer}/" for layer in LAYERS) <= set(documented_names()), (
        "a layer folder is missing on disk"
    )
    missing = [name for name in documented_names() if not named_in(text, name)]
    assert not missing, (
        f"{ARCHITECTURE.name} does not name these (describe them there): {', '.join(missing)}"
    )
    limits = [f"{MAX_MODULE_CODE_LINES} code lines", f"{MAX_FUNCTION_CODE_LINES} code lines"]
    assert all(limit in text for limit in limits), (
        f"{ARCHITECTURE.name} should state the limits {limits}"
    )


# --- the checks themselves catch what they are for --------------------------------------


def write_package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "pkg"
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_the_checks_find_a_planted_cycle_a_private_import_and_long_code(tmp_path):
    pkg = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg.b import helper\n",
            "b.py": "from pkg import c\n",
            "c.py": "from pkg.a import helper as h\nfrom pkg.d import _secret\n",
            "d.py": "def _secret():\n    pass\n\n\ndef long():\n" + "    x = 1\n" * 90,
            # long in lines but not in code: a docstring, comments and blank lines do not count
            "f.py": 'def prose():\n    """Words\n' + "    words\n" * 80 + '    """\n'
            + "    # a comment\n\n" * 40 + "    return 1\n",
            "sub/__init__.py": "",
            "sub/e.py": "from ..d import _secret\n",
        },
    )
    found = cycles(import_graph(pkg))
    assert found and set(found[0]) == {"pkg.a", "pkg.b", "pkg.c"}
    assert private_imports(pkg) == [
        "pkg.c:2 imports pkg.d._secret",
        "pkg.sub.e:1 imports pkg.d._secret",
    ]
    assert long_functions(pkg) == ["pkg.d.long (91 code lines, line 5)"]
    assert long_modules(pkg, limit=50) == ["pkg.d (93 code lines)"]


def test_code_lines_leave_out_blank_lines_comments_and_docstrings():
    text = (
        '"""Module\ndocstring."""\n\nimport os  # a trailing comment\n# a comment\n\n\n'
        'class A:\n    """Doc."""\n\n    x = """a string, not a docstring\n    """\n'
    )
    assert sorted(code_lines(text, ast.parse(text))) == [4, 8, 11, 12]


def test_the_guide_check_finds_an_unnamed_module_and_is_not_fooled_by_a_longer_name(tmp_path):
    pkg = write_package(
        tmp_path,
        {
            **{f"{layer}/__init__.py": "" for layer in LAYERS},
            "engine/quant.py": "",
            "engine/kv_quant.py": "",
            "engine/serving/__init__.py": "",
            "engine/serving/server.py": "",
            "course/checks.py": "",
        },
    )
    assert documented_names(pkg) == [f"{layer}/" for layer in sorted(LAYERS)] + [
        "kv_quant.py", "quant.py", "serving/", "serving/server.py", "checks.py"]
    folders = "`base/` `bench/` `course/` `engine/` `model/` `perf/`"
    text = f"{folders}: `kv_quant.py`, `engine/serving/server.py`, model_checks.py"
    assert [n for n in documented_names(pkg) if not named_in(text, n)] == ["quant.py", "checks.py"]


@pytest.mark.parametrize(
    "text", ["from pkg.d import helper\n", "import pkg.d\n", "from pkg import d\n"]
)
def test_the_checks_pass_a_clean_package(tmp_path, text):
    pkg = write_package(
        tmp_path, {"__init__.py": "", "a.py": text, "d.py": "def helper():\n    pass\n"}
    )
    assert cycles(import_graph(pkg)) == []
    assert private_imports(pkg) == []
    assert long_functions(pkg) == []


LAYERED = {
    "__init__.py": "from pkg.engine.generate import generate\n",
    "base/__init__.py": "",
    "base/args.py": "",
    "model/__init__.py": "",
    "model/gpt.py": "from pkg.base.args import check\n",
    "engine/__init__.py": "",
    "bench/__init__.py": "",
}


def test_the_layer_check_catches_upward_imports_and_stray_modules(tmp_path):
    pkg = write_package(
        tmp_path,
        {
            **LAYERED,
            "model/train.py": "import math\n\n\ndef fit():\n    from pkg.engine.prompts import "
            "eval_mode\n",
            "model/top.py": "from pkg.engine import prompts\nfrom .. import generate\n",
            "engine/prompts.py": "",
            "engine/generate.py": "",
            "helpers.py": "",
            "util/x.py": "from pkg.model import gpt\n",
        },
    )
    assert layer_violations(pkg) == [
        "pkg.helpers lives outside the layer folders (base, model, engine, perf, course, bench)",
        "pkg.model.top:1 (model) imports pkg.engine.prompts (engine)",
        "pkg.model.top:2 (model) imports pkg (the public API)",
        # the lazy import inside fit()
        "pkg.model.train:5 (model) imports pkg.engine.prompts (engine)",
        "pkg.util.x lives outside the layer folders (base, model, engine, perf, course, bench)",
    ]


@pytest.mark.parametrize(
    "text",
    [
        "from pkg.model.gpt import GPT\n",
        "import pkg.model.gpt\n",
        "from pkg.model import gpt\n",
        "from ..model import gpt\n",
        "from . import other\n",
        "def f():\n    from pkg.base.args import check\n",
    ],
)
def test_the_layer_check_passes_downward_imports(tmp_path, text):
    files = {
        **LAYERED,
        "engine/generate.py": text,
        "engine/other.py": "",
        "bench/run.py": "import pkg\n",
    }
    assert layer_violations(write_package(tmp_path, files)) == []
