"""Tests assert what an error means (its type and the argument it names), not how it is worded.

ARCHITECTURE.md, "Errors have types": a message may be reworded without touching a test, so the
tests that read message text are the few where the wording is the point (a checker's verdict, the
values a message lists). This file counts them across tests/ and keeps them under ``LIMIT``; a
``match=`` fed by a parametrized table of fragments counts once per row.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent
LIMIT = 100
# what an error is called
ERROR_NAMES = {"e", "err", "error", "exc", "info", "excinfo", "raised", "caught"}


def _message_of_error(node: ast.AST) -> bool:
    """``str(info.value)``, ``str(e)``, ``str(error)``...: the text of a caught error."""
    if not (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "str"
        and len(node.args) == 1
    ):
        return False
    arg = node.args[0]
    if isinstance(arg, ast.Attribute) and arg.attr == "value":
        arg = arg.value
    return isinstance(arg, ast.Name) and arg.id in ERROR_NAMES


def _parametrized_rows(function: ast.FunctionDef | ast.AsyncFunctionDef | None, name: str) -> int:
    """How many rows a ``pytest.mark.parametrize`` of ``function`` gives ``name`` (1 if none
    does)."""
    for deco in function.decorator_list if function is not None else []:
        if (
            isinstance(deco, ast.Call)
            and getattr(deco.func, "attr", None) == "parametrize"
            and len(deco.args) >= 2
        ):
            names, rows = deco.args[0], deco.args[1]
            spelled = names.value if isinstance(names, ast.Constant) else ""
            listed = (
                [e.value for e in names.elts] if isinstance(names, ast.Tuple | ast.List) else []
            )
            if name in [n.strip() for n in spelled.split(",")] + listed and isinstance(
                rows, ast.List | ast.Tuple
            ):
                return len(rows.elts)
    return 1


def _reads_message(node: ast.AST) -> ast.AST | None:
    """The expression whose text ``node`` matches against a message, or None: ``match=...``,
    ``info.match(...)`` or ``... in str(error)``."""
    if isinstance(node, ast.Call):
        for kw in node.keywords:
            if kw.arg == "match":
                return kw.value
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr == "match"
            and getattr(func.value, "id", "") in ERROR_NAMES
        ):
            return node.args[0] if node.args else func
    if isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
        if any(_message_of_error(c) for c in node.comparators):
            return node.left
    return None


def message_matches(path: Path) -> dict[int, int]:
    """Line -> how many assertions there match message text. A match reading a parameter of a
    parametrized test counts once per row; a helper function that matches a text it is given counts
    at each of its calls instead."""
    tree = ast.parse(path.read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]

    def enclosing(node):
        inside = [f for f in functions if f.lineno <= node.lineno <= (f.end_lineno or f.lineno)]
        return max(inside, key=lambda f: f.lineno) if inside else None

    def rows(node, names: list[str]) -> int:
        function = enclosing(node)
        return max([_parametrized_rows(function, n) for n in names] or [1])

    found: dict[int, int] = {}
    helpers: set[str] = set()
    for node in ast.walk(tree):
        text = _reads_message(node)
        if text is None:
            continue
        function = enclosing(node)
        given = {a.arg for a in function.args.args} if function is not None else set()
        if isinstance(text, ast.Name) and text.id in given and not function.name.startswith("test"):
            helpers.add(function.name)  # counted where it is called
            continue
        names = [text.id] if isinstance(text, ast.Name) else []
        found[node.lineno] = found.get(node.lineno, 0) + rows(node, names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in helpers:
            names = [
                a.id
                for a in [*node.args, *(k.value for k in node.keywords)]
                if isinstance(a, ast.Name)
            ]
            found[node.lineno] = found.get(node.lineno, 0) + rows(node, names)
    return found


def test_few_assertions_read_message_text():
    counts = {}
    for path in sorted(TESTS.glob("*.py")):
        # the counter, and the helper naming the rule
        if path.name in {Path(__file__).name, "raising.py"}:
            continue
        if found := sum(message_matches(path).values()):
            counts[path.name] = found
    total = sum(counts.values())
    assert total < LIMIT, f"{total} assertions match message text (limit {LIMIT}): {counts}"


def test_the_counter_sees_each_form(tmp_path):
    planted = tmp_path / "test_planted.py"
    planted.write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('bad, why', [(1, 'a'), (2, 'b'), (3, 'c')])\n"
        "def test_a(bad, why):\n"
        "    with pytest.raises(ValueError, match='top_k'):\n"
        "        pass\n"
        "    with pytest.raises(ValueError, match=why):\n"
        "        pass\n"
        "    with pytest.raises(ValueError) as info:\n"
        "        pass\n"
        "    assert 'top_k' in str(info.value)\n"
        "    assert 'x' in str(path)\n"
        "    info.match('NaN')\n"
        "def names(fragment, fn):\n"
        "    with pytest.raises(ValueError) as e:\n"
        "        fn()\n"
        "    assert fragment in str(e.value)\n"
        "def test_b():\n"
        "    names('top_k', int)\n"
        "    names('top_p', int)\n"
    )
    assert message_matches(planted) == {4: 1, 6: 3, 10: 1, 12: 1, 18: 1, 19: 1}
