"""A notebook cut to the cells a few chosen ones need: the chosen cells and, before them, every code
cell that defines (or changes) a name they read, transitively.

The checks that run the exercises with wrong answers (the student version, a delegating answer)
need the exercises and their tests, not the chapter's experiments: cutting the rest makes those
runs a few seconds instead of a whole chapter. The cut reads names from the code (Python's ``ast``
after IPython's magics are turned into calls), so it follows the notebook as it is edited.
What it cannot see (a method that changes an object in place, such as ``records.append``) is
why the runs that use it check the *reason* each graded cell failed: a cell the cut left out
shows as a ``NameError``, never as the expected failure.
"""

from __future__ import annotations

import ast
import builtins
import copy
from collections.abc import Callable

import nbformat

from ar_lab.base.errors import BadType, BadValue

_BUILTINS = frozenset(dir(builtins))


def as_python(source: str) -> str:
    """A cell's source as Python: IPython's ``%magic`` and ``!shell`` lines become calls."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source)


def _python(source: str) -> ast.Module:
    """The cell's code as a Python tree (``as_python``)."""
    try:
        return ast.parse(as_python(source))
    except SyntaxError as e:
        raise BadValue(
            f"a code cell's source does not parse as Python (line {e.lineno}): {source[:80]!r}",
            arg="source",
        ) from None


class _Names(ast.NodeVisitor):
    """The names a statement binds or changes at the top level, and every name it reads from
    outside.

    A function, lambda, class body or comprehension is its own scope: its parameters and the names
    it assigns are local, so reading them there is no dependency (``[p for p in ps]`` reads ``ps``
    only).
    """

    def __init__(self, top: bool = True) -> None:
        self.top = top
        self.bound: set[str] = set()  # bound or changed at the top level (the cell's globals)
        # assigned anywhere in this scope (its locals, inside a function)
        self.stored: set[str] = set()
        self.read: set[str] = set()

    def _scope(
        self, node: ast.AST, name: str | None, parameters: ast.arguments | None, body
    ) -> None:
        if name is not None:
            self._bind(name)
        inner = _Names(top=False)
        if parameters is not None:
            for default in parameters.defaults + [
                d for d in parameters.kw_defaults if d is not None
            ]:
                self.visit(default)  # defaults are evaluated outside, when the function is defined
            every = parameters.posonlyargs + parameters.args + parameters.kwonlyargs
            every += [a for a in (parameters.vararg, parameters.kwarg) if a is not None]
            inner.stored.update(a.arg for a in every)
        for child in body:
            inner.visit(child)
        self.read |= inner.read - inner.stored

    def _bind(self, name: str) -> None:
        self.stored.add(name)
        if self.top:
            self.bound.add(name)

    def visit_FunctionDef(self, node):
        for d in node.decorator_list:
            self.visit(d)
        self._scope(node, node.name, node.args, node.body)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        for part in node.decorator_list + node.bases + [k.value for k in node.keywords]:
            self.visit(part)
        self._scope(node, node.name, None, node.body)

    def visit_Lambda(self, node):
        self._scope(node, None, node.args, [node.body])

    def visit_ListComp(self, node):
        # the first iterable is evaluated outside the comprehension
        self.visit(node.generators[0].iter)
        first = ast.comprehension(target=node.generators[0].target, iter=ast.Constant(None),
                                  ifs=node.generators[0].ifs, is_async=0)
        parts = [first, *node.generators[1:]]
        parts += [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        self._scope(node, None, None, parts)

    visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_ListComp

    def visit_Import(self, node):
        for a in node.names:
            self._bind((a.asname or a.name).split(".")[0])

    visit_ImportFrom = visit_Import

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load):
            self.read.add(node.id)
        else:
            self._bind(node.id)

    def _changed(self, target: ast.AST) -> None:
        """``x.a = ...``, ``x[k] = ...``, ``del x[k]``: the statement changes ``x``."""
        while isinstance(target, (ast.Attribute, ast.Subscript)):
            target = target.value
        if isinstance(target, ast.Name) and self.top:
            self.bound.add(target.id)

    def visit_Attribute(self, node):
        if not isinstance(node.ctx, ast.Load):
            self._changed(node)
        self.generic_visit(node)

    visit_Subscript = visit_Attribute

    def visit_Global(self, node):
        self.bound.update(node.names)  # a function that rebinds a global changes it when called


def _visit(node: ast.AST) -> _Names:
    visitor = _Names()
    visitor.visit(node)
    return visitor


def _flow(statements: list[ast.stmt], bound: set[str], read: set[str]) -> None:
    """Walk ``statements`` in the order they run, adding to ``bound`` what they bind and to ``read``
    what they read before binding it. A loop's target is bound before its body runs, ``with ... as
    x`` before the block; a branch is walked as if it ran (a name a branch may bind counts as bound
    after it)."""

    def expr(*nodes) -> None:
        for node in nodes:
            if node is not None:
                v = _visit(node)
                read.update(v.read - bound)
                bound.update(v.bound)

    for st in statements:
        if isinstance(st, (ast.For, ast.AsyncFor)):
            expr(st.iter, st.target)
            _flow(st.body + st.orelse, bound, read)
        elif isinstance(st, (ast.With, ast.AsyncWith)):
            for item in st.items:
                expr(item.context_expr, item.optional_vars)
            _flow(st.body, bound, read)
        elif isinstance(st, (ast.If, ast.While)):
            expr(st.test)
            _flow(st.body + st.orelse, bound, read)
        elif isinstance(st, ast.Try) or type(st).__name__ == "TryStar":
            _flow(st.body, bound, read)
            for handler in st.handlers:
                expr(handler.type)
                if handler.name:
                    bound.add(handler.name)
                _flow(handler.body, bound, read)
            _flow(st.orelse + st.finalbody, bound, read)
        else:
            expr(st)


def names(source: str) -> tuple[set[str], set[str]]:
    """(bound, read): the names a code cell binds or changes at its top level, and those it reads
    from earlier cells (a name the cell binds before it reads it, in the order its code runs, is its
    own)."""
    bound: set[str] = set()
    read: set[str] = set()
    _flow(_python(source).body, bound, read)
    return bound, read - _BUILTINS


def changes(source: str) -> set[str]:
    """The names whose objects a code cell changes in place at its top level: ``x.a = ...``,
    ``x[k] = ...``, ``x.a.b += ...`` (a method call such as ``x.append`` is not seen)."""
    out: set[str] = set()
    for node in ast.walk(_python(source)):
        if isinstance(node, (ast.Attribute, ast.Subscript)) and not isinstance(node.ctx, ast.Load):
            root = node
            while isinstance(root, (ast.Attribute, ast.Subscript)):
                root = root.value
            if isinstance(root, ast.Name):
                out.add(root.id)
    return out


def cut(
    nb: nbformat.NotebookNode, keep: Callable[[nbformat.NotebookNode], bool]
) -> nbformat.NotebookNode:
    """A copy of ``nb`` with the cells ``keep`` selects, the code cells they depend on, and the
    first code cell (the chapter's set-up: imports, seeds, threads), in their order; Markdown and
    the rest go.

    A kept cell depends on every earlier code cell that binds or changes a name it reads (all of
    them, not only the last: an earlier binding may be what a later change works on), transitively.
    """
    if not isinstance(nb, nbformat.NotebookNode) or "cells" not in nb:
        raise BadType(
            f"cut needs a notebook (nbformat.read(...)) as nb, got {type(nb).__name__}", arg="nb"
        )
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    bound, read = {}, {}
    for i in code:
        try:
            bound[i], read[i] = names(nb.cells[i].source)
        except BadValue as e:  # the notebook is what the caller changes: name it, and the cell
            raise BadValue(f"nb, cell {i}: {e}", arg="nb") from None
    wanted = {i for i in code if keep(nb.cells[i])} | set(code[:1])
    todo = sorted(wanted)
    while todo:
        i = todo.pop()
        for j in code:
            if j >= i:
                break
            if j not in wanted and bound[j] & read[i]:
                wanted.add(j)
                todo.append(j)
    out = copy.deepcopy(nb)
    out.cells = [out.cells[i] for i in sorted(wanted)]
    return out
