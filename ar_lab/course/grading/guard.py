"""The delegation guard of a learner's own notebook: while a graded test runs, the references its
exercise forbids raise when the learner's code calls them.

``checks.no_delegation`` opens a ``Gate``: for the block's length each forbidden reference runs a
stand-in that raises ``Delegated`` when the call is the learner's and runs the reference when it is
the test's. A Python function (an ar_lab function, method or constructor, and the private helpers
only the forbidden references reach, ``private_helpers``) gets the stand-in as its own code, so
every route to it is caught: an import, a default argument, a saved method, a copy of its module's
dict, a thread. A builtin (PyTorch's C functions, ``torch.ops.aten`` operators) is swapped by name,
wherever a module or the learner's namespace binds it.

Whose call is it? Walking up from the call, library frames (the standard library, site-packages,
``ar_lab``) are skipped; the first other frame decides: the learner's functions (and any notebook
code but the test cell's own) make it the learner's, the test cell's code makes it the test's (a
test computes its reference values inside the block). With only library code above it, a call is the
learner's on a thread started during the block, and not on one that was already running (the
kernel's).

This is feedback for a learner at work, not the grade's guarantee: a builtin captured before the
test, or the reference's code copied (``exec`` of its source, a reloaded module), escapes it. The
grade comes from ``python -m ar_lab.course.grading``, where the learner's answer runs in a process
whose ``ar_lab`` lacks the references altogether (``ar_lab.course.grading.sandbox``)."""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from ar_lab.base.errors import BadValue
from ar_lab.course.grading.library import is_library


def forbidden(reference: str | Callable) -> tuple[str, Any, Any]:
    """(name, object, owning class or None) of a reference to forbid: an object, a dotted name such
    as ``"ar_lab.engine.sampling.filter_top_p"`` or ``"ar_lab.model.cache.KVCache.update"``, or
    ``"aten::name"`` for a PyTorch operator (the ``torch.ops.aten.name`` packet)."""
    if not isinstance(reference, str):
        name = (
            f"{getattr(reference, '__module__', '?')}."
            f"{getattr(reference, '__qualname__', repr(reference))}"
        )
        return name, reference, None
    if reference.startswith("aten::"):
        import torch

        op = reference.removeprefix("aten::")
        if not op.isidentifier() or not hasattr(torch.ops.aten, op):
            raise BadValue(
                f"no reference named {reference!r} to forbid: torch.ops.aten has no operator "
                f"{op!r}",
                arg="reference",
            )
        return f"torch.ops.aten.{op}", getattr(torch.ops.aten, op), None
    parts = reference.split(".")
    # the longest importable module prefix, then attributes
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        owner = None
        try:
            for attr in parts[cut:]:
                owner, obj = obj, getattr(obj, attr)
        except AttributeError as e:
            raise BadValue(
                f"no reference named {reference!r} to forbid: {e}", arg="reference"
            ) from None
        return reference, obj, owner if isinstance(owner, type) else None
    raise BadValue(
        f"no reference named {reference!r} to forbid: no module to import", arg="reference"
    )


def _private_names(code, module: dict, cls: type | None) -> list:
    """The private functions (one leading underscore) that ``code`` names (nested code included):
    from its module's namespace, or, in a method of ``cls``, from that class and its subclasses in
    the module."""
    found, stack = [], [code]
    while stack:
        c = stack.pop()
        # nested functions, comprehensions
        stack += [k for k in c.co_consts if hasattr(k, "co_names")]
        for name in c.co_names:
            if not name.startswith("_") or name.startswith("__"):
                continue
            helper = module.get(name)
            if inspect.isfunction(helper):
                candidates = [(helper, None)]
            # self._name: on the class, or an override in a subclass of it here
            elif cls is not None:
                subs = [
                    k
                    for k in module.values()
                    if isinstance(k, type) and issubclass(k, cls) and k is not cls
                ]
                kinds = [cls, *subs]
                candidates = [
                    (next((vars(b)[name] for b in k.__mro__ if name in vars(b)), None), k)
                    for k in kinds
                ]
                # a static or class method
                candidates = [(getattr(h, "__func__", h), k) for h, k in candidates]
            else:
                candidates = []
            found += [
                (h, k)
                for h, k in candidates
                if inspect.isfunction(h) and h.__module__ == module.get("__name__")
            ]
    return found


def _reached(roots: list, module: dict) -> dict:
    """code -> (function, class) of every private function reached from ``roots`` [(function,
    class)]."""
    reached, todo = {}, list(roots)
    while todo:
        fn, cls = todo.pop()
        for helper, owner in _private_names(fn.__code__, module, cls):
            if helper.__code__ not in reached:
                reached[helper.__code__] = (helper, owner)
                todo.append((helper, owner))
    return reached


def _public_roots(module: dict) -> list:
    """The module's public functions and the methods of its classes, as [(function, class)]."""
    roots = []
    for name, obj in module.items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.get("__name__"):
            continue
        if inspect.isfunction(obj):
            roots.append((obj, None))
        elif isinstance(obj, type):
            for attr, member in vars(obj).items():
                member = getattr(member, "__func__", getattr(member, "fget", member))
                if inspect.isfunction(member) and (
                    not attr.startswith("_") or attr.startswith("__")
                ):
                    roots.append((member, obj))
    return roots


def private_helpers(functions: list, seen: set) -> list:
    """The private helpers of the forbidden ar_lab ``functions`` [(function, class)]: what they
    reach, directly or through other helpers, and no public function or method of their module that
    is not forbidden does. So a forbid list names public references only, and renaming an internal
    function changes no verdict; a helper that an allowed function shares (an argument check, say)
    stays allowed. [(function, name, class)]"""
    found = []
    for module_name in {fn.__module__ for fn, _ in functions}:
        module = sys.modules[module_name].__dict__
        ours = [(fn, cls) for fn, cls in functions if fn.__module__ == module_name]
        allowed = [(fn, cls) for fn, cls in _public_roots(module) if fn.__code__ not in seen]
        shared = _reached(allowed, module)
        for code, (fn, owner) in _reached(ours, module).items():
            if code not in shared and code not in seen:
                found.append((fn, f"{fn.__module__}.{fn.__qualname__}", owner))
    return found


def _functions(name: str, obj: Any, owner: type | None) -> tuple[list, list]:
    """What a forbidden reference is made of: ([(Python function, name, its class or None)], and
    [(class, attribute, name)]: a constructor or forward the class inherits, swapped on the class
    itself)."""
    if isinstance(obj, type):
        found, inherited = [], []
        for attr in ("__init__", "forward"):
            fn = getattr(obj, attr, None)
            if not inspect.isfunction(fn) or fn is object.__init__:
                continue
            if attr in vars(obj):
                found.append((fn, f"{name}.{attr}", obj))
            else:
                inherited.append((obj, attr, f"{name}.{attr}"))
        return found, inherited
    raw = inspect.getattr_static(owner, name.rsplit(".", 1)[-1]) if owner is not None else obj
    # a property's getter, a static or class method
    fn = getattr(raw, "fget", None) or getattr(raw, "__func__", raw)
    return ([(fn, name, owner)] if inspect.isfunction(fn) else []), []


def _bindings(obj: Any, attr: str, spaces: list[dict]) -> list[tuple[dict, str]]:
    """Every module that binds ``obj`` as ``attr``, and each of ``spaces`` (the learner's) under any
    name: [(namespace, name)]."""
    modules = [getattr(m, "__dict__", None) for m in list(sys.modules.values())]
    found = [
        (space, attr)
        for space in modules
        if isinstance(space, dict) and attr and space.get(attr) is obj
    ]
    return found + [
        (space, k) for space in spaces for k, v in list(space.items()) if v is obj and k != attr
    ]


def _trampoline(fn: types.FunctionType, key: str) -> types.CodeType | None:
    """Code that, as ``fn.__code__``, calls the global ``key`` with ``fn``'s arguments (its free
    variables kept, so the swap is allowed; None if they cannot be). Compiled as this file's, so it
    is library code."""
    free = fn.__code__.co_freevars
    lines = [f"def outer({', '.join(free)}):", "    def inner(*args, **kwargs):"]
    lines += [f"        ({', '.join(free)},)"] if free else []
    lines += [f"        return {key}(*args, **kwargs)", "    return inner"]
    outer = compile("\n".join(lines), __file__, "exec").co_consts[0]
    code = next(c for c in outer.co_consts if isinstance(c, types.CodeType))
    return (
        code.replace(co_name=fn.__name__, co_qualname=fn.__qualname__)
        if code.co_freevars == free
        else None
    )


class Gate:
    """The stand-ins of one ``no_delegation`` block: a context manager; ``calls`` lists what was
    caught."""

    def __init__(
        self, forbid: list[tuple[str, Any, Any]], learner: tuple, exercise: str, error: type
    ):
        import torch

        # the notebook's
        spaces = [vars(m) for m in (sys.modules.get("__main__"),) if m is not None]
        spaces += [
            g
            for f in learner
            if isinstance(g := getattr(getattr(f, "func", f), "__globals__", None), dict)
        ]
        self.spaces = spaces
        self.functions: dict[int, tuple] = {}  # id -> (Python function, name): its code is swapped
        # (class or namespace, attribute, name): swapped by name
        self.places: list[tuple[Any, str, str]] = []
        ours = []  # (ar_lab function, its class): whose private helpers come with them
        for name, obj, owner in forbid:
            functions, inherited = _functions(name, obj, owner)
            self.functions.update({id(fn): (fn, label) for fn, label, _ in functions})
            ours += [(fn, cls) for fn, _, cls in functions if fn.__module__.startswith("ar_lab.")]
            self.places += inherited
            if isinstance(obj, torch._ops.OpOverloadPacket):  # torch.ops.aten.name
                self.places.append((vars(torch.ops.aten), name.rsplit(".", 1)[-1], name))
            elif not functions and not isinstance(obj, type) and owner is None:  # a builtin
                self.places += [
                    (m, attr, name)
                    for m, attr in _bindings(obj, getattr(obj, "__name__", ""), spaces)
                ]
        for fn, name, _ in private_helpers(ours, {fn.__code__ for fn, _ in ours}):
            self.functions.setdefault(id(fn), (fn, name))
        self.learner_codes = set().union(*(_codes(f) for f in learner)) if learner else None
        self.exercise, self.error = exercise, error
        self.calls: list[str] = []
        self.undo: list[Callable] = []

    def _learners(self, frame) -> bool:
        """Is the call made from ``frame`` the learner's? (See the module's docstring.)"""
        if self.learner_codes is None:
            return True  # no learner named: every call inside the block is refused
        while frame is not None:
            code = frame.f_code
            if code in self.learner_codes:
                return True
            if not is_library(code.co_filename):
                return code.co_filename != self.test_file
            frame = frame.f_back
        # library code only, on a thread started in the block
        return threading.get_ident() not in self.threads

    def _stand_in(self, original: Callable, name: str) -> Callable:
        gate = self

        @functools.wraps(original, updated=())
        def stand_in(*args, **kwargs):
            # (a swapped function's own frame is library code)
            if gate.active and gate._learners(sys._getframe(1)):
                gate.calls.append(name)
                raise gate.error(
                    f"{gate.exercise}: your code called `{name}`, a ready-made implementation of "
                    "what the exercise asks you to write: replace that call with your own "
                    "tensor operations.",
                    name,
                )
            return original(*args, **kwargs)

        return stand_in

    def _swap_code(self, fn: types.FunctionType, name: str) -> None:
        key = f"__ar_lab_stand_in_{id(self)}_{id(fn)}__"
        code = _trampoline(fn, key)
        if code is None:  # (not seen in practice) swapped by name instead
            for owner, attr in _bindings(fn, fn.__name__, self.spaces):
                self._swap_name(owner, attr, name)
            return
        original = types.FunctionType(
            fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
        )
        original.__kwdefaults__, original.__qualname__ = fn.__kwdefaults__, fn.__qualname__
        fn.__globals__[key] = self._stand_in(original, name)
        fn.__code__, saved = code, fn.__code__
        self.undo.append(lambda: (setattr(fn, "__code__", saved), fn.__globals__.pop(key, None)))

    def _swap_name(self, owner: Any, attr: str, name: str) -> None:
        raw = inspect.getattr_static(owner, attr) if isinstance(owner, type) else owner[attr]
        stand_in = self._stand_in(raw, name)
        # torch.ops.aten.name.default, ...
        for overload in raw.overloads() if hasattr(raw, "overloads") else ():
            setattr(
                stand_in, overload, self._stand_in(getattr(raw, overload), f"{name}.{overload}")
            )
        # a constructor or forward the class inherits: its own, for the block
        if isinstance(owner, type):
            setattr(owner, attr, stand_in)
            self.undo.append(lambda: delattr(owner, attr))
        else:
            saved = owner[attr]
            owner[attr] = stand_in
            self.undo.append(lambda: owner.__setitem__(attr, saved))

    def __enter__(self) -> Gate:
        frame = sys._getframe(1)
        while frame is not None and is_library(frame.f_code.co_filename):
            frame = frame.f_back
        self.test_file = frame.f_code.co_filename if frame is not None else None
        # the test's and the kernel's: not the learner's
        self.threads = {t.ident for t in threading.enumerate()}
        self.active = True
        try:
            for fn, name in self.functions.values():
                self._swap_code(fn, name)
            for owner, attr, name in self.places:
                self._swap_name(owner, attr, name)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        while self.undo:
            self.undo.pop()()


def _codes(obj: Any) -> set:
    """Every code object of a learner's function, class or object (nested functions and methods
    included)."""
    obj = getattr(obj, "func", obj)  # a functools.partial
    obj = getattr(obj, "__func__", obj)  # a bound method
    if not isinstance(obj, type) and not hasattr(obj, "__code__"):
        obj = type(obj)  # an instance (e.g. the learner's nn.Module): its class's methods
    if not isinstance(obj, type):
        found, todo = set(), [obj.__code__]
        while todo:
            code = todo.pop()
            found.add(code)
            todo += [c for c in code.co_consts if hasattr(c, "co_code") and c not in found]
        return found
    found = set()
    for klass in obj.__mro__:
        if klass.__module__.split(".")[0] in ("builtins", "torch", "ar_lab"):
            continue  # library classes it builds on are not the learner's code
        for value in vars(klass).values():
            value = getattr(value, "fget", None) or getattr(value, "__func__", None) or value
            if hasattr(value, "__code__"):
                found |= _codes(value)
    return found
