"""The delegation guard's watch: while a graded test runs, every call is seen, whatever route it took.

``checks.no_delegation`` forbids the package's reference for an exercise (and PyTorch's ready-made
kernels) to the learner's code. Swapping the names a learner might use is not enough: a reference
captured earlier (a default argument, a saved ``Class.method``, a copy of a module's dict), reached
through ``torch._C`` or ``torch.ops.aten``, or called on another thread keeps working. So the guard
watches calls instead: a profile hook (``sys.setprofile``, and ``threading.setprofile`` for threads
started in the block) sees every Python function entered and every C function called, and checks
them against the forbidden code objects and builtins. A Python function whose code is a copy of a
forbidden one (``importlib.reload`` of the module, ``exec`` of ``inspect.getsource``: same name, same
arguments, names and constants, compiled outside a notebook cell) counts as it.

Whose call is it? Walking up from the call, library frames (the standard library, site-packages,
``ar_lab``) are skipped; the first other frame decides: the learner's functions (and any notebook
code but the test cell's own) make it the learner's, the test cell's code makes it the test's (a
test computes its reference values inside the block). A thread the learner left running when the
block starts (one not started by the kernel) could call a reference where no hook sees it, so
the block refuses to start until it is stopped.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
from collections.abc import Callable
from typing import Any

from ar_lab.base.errors import BadValue
from ar_lab.course.library import is_library


def forbidden(reference: str | Callable) -> tuple[str, Any, Any]:
    """(name, object, owning class or None) of a reference to forbid: an object, a dotted name such as
    ``"ar_lab.engine.sampling.filter_top_p"`` or ``"ar_lab.model.cache.KVCache.update"``, or
    ``"aten::name"`` for a PyTorch operator (the ``torch.ops.aten.name`` packet)."""
    if not isinstance(reference, str):
        name = f"{getattr(reference, '__module__', '?')}.{getattr(reference, '__qualname__', repr(reference))}"
        return name, reference, None
    if reference.startswith("aten::"):
        import torch

        op = reference.removeprefix("aten::")
        if not op.isidentifier() or not hasattr(torch.ops.aten, op):
            raise BadValue(f"no reference named {reference!r} to forbid: torch.ops.aten has no operator {op!r}",
                           arg="reference")
        return f"torch.ops.aten.{op}", getattr(torch.ops.aten, op), None
    parts = reference.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        owner = None
        try:
            for attr in parts[cut:]:
                owner, obj = obj, getattr(obj, attr)
        except AttributeError as e:
            raise BadValue(f"no reference named {reference!r} to forbid: {e}", arg="reference") from None
        return reference, obj, owner if isinstance(owner, type) else None
    raise BadValue(f"no reference named {reference!r} to forbid: no module to import", arg="reference")


def _private_names(code, module: dict, cls: type | None) -> list:
    """The private functions (one leading underscore) that ``code`` names (nested code included): from its
    module's namespace, or, in a method of ``cls``, from that class and its subclasses in the module."""
    found, stack = [], [code]
    while stack:
        c = stack.pop()
        stack += [k for k in c.co_consts if hasattr(k, "co_names")]  # nested functions, comprehensions
        for name in c.co_names:
            if not name.startswith("_") or name.startswith("__"):
                continue
            helper = module.get(name)
            if inspect.isfunction(helper):
                candidates = [(helper, None)]
            elif cls is not None:  # self._name: on the class, or an override in a subclass of it here
                subs = [k for k in module.values() if isinstance(k, type) and issubclass(k, cls) and k is not cls]
                kinds = [cls, *subs]
                candidates = [(next((vars(b)[name] for b in k.__mro__ if name in vars(b)), None), k) for k in kinds]
                candidates = [(getattr(h, "__func__", h), k) for h, k in candidates]  # a static or class method
            else:
                candidates = []
            found += [(h, k) for h, k in candidates if inspect.isfunction(h) and h.__module__ == module.get("__name__")]
    return found


def _reached(roots: list, module: dict) -> dict:
    """code -> (function, class) of every private function reached from ``roots`` [(function, class)]."""
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
                if inspect.isfunction(member) and (not attr.startswith("_") or attr.startswith("__")):
                    roots.append((member, obj))
    return roots


def private_helpers(functions: list, seen: set) -> list:
    """The private helpers of the forbidden ar_lab ``functions`` [(function, class)]: what they reach, directly
    or through other helpers, and no public function or method of their module that is not forbidden does.
    So a forbid list names public references only, and renaming an internal function changes no verdict;
    a helper that an allowed function shares (an argument check, say) stays allowed. [(code, name, class)]"""
    found = []
    for module_name in {fn.__module__ for fn, _ in functions}:
        module = sys.modules[module_name].__dict__
        ours = [(fn, cls) for fn, cls in functions if fn.__module__ == module_name]
        allowed = [(fn, cls) for fn, cls in _public_roots(module) if fn.__code__ not in seen]
        shared = _reached(allowed, module)
        for code, (fn, owner) in _reached(ours, module).items():
            if code not in shared and code not in seen:
                found.append((code, f"{fn.__module__}.{fn.__qualname__}", owner))
    return found


def _targets(name: str, obj: Any, owner: type | None):
    """What a forbidden reference looks like to the profile hook: ([(function, name, class that self must be)],
    [(builtin, name)]). A class: its constructor and ``forward``; a method: its code, on instances of its
    class; an aten operator: the builtin of the packet and of every overload; a builtin: itself."""
    import torch

    functions, builtins = [], []  # functions: (function, name, class that self must be)
    if isinstance(obj, torch._ops.OpOverloadPacket):
        builtins.append((obj._op, name))
        builtins += [(getattr(obj, o)._op, f"{name}.{o}") for o in obj.overloads()]
    elif isinstance(obj, type):
        for method in ("__init__", "forward"):
            fn = getattr(obj, method, None)
            if hasattr(fn, "__code__") and fn is not object.__init__:
                functions.append((fn, f"{name}.{method}", obj))
    elif isinstance(obj, property) and obj.fget is not None:  # read on an instance of its class
        functions.append((obj.fget, name, owner))
    elif hasattr(obj, "__code__"):
        functions.append((obj, name, owner))
    elif hasattr(getattr(obj, "__func__", None), "__code__"):  # a bound or class method
        functions.append((obj.__func__, name, owner))
    else:
        builtins.append((obj, name))
    return functions, builtins


def _fingerprint(code) -> tuple:
    """What a copy of a function's code keeps, wherever and however it was compiled again: its arguments,
    local names, the globals and attributes it uses and its constants (nested code by name). The bytecode
    itself is not kept: the same source compiles to different instructions in a module and in ``exec``."""
    consts = tuple(c.co_qualname if hasattr(c, "co_qualname") else repr(c) for c in code.co_consts)
    return code.co_argcount, code.co_kwonlyargcount, code.co_varnames, code.co_names, consts


def learner_threads() -> list[str]:
    """Threads other than this one that the kernel did not start: not daemons (the kernel's are), or
    running notebook code."""
    here, found = threading.get_ident(), []
    frames = sys._current_frames()
    for t in threading.enumerate():
        if t.ident == here or t.ident not in frames:
            continue
        frame, ours = frames[t.ident], False
        while frame is not None and not ours:
            ours = not is_library(frame.f_code.co_filename)
            frame = frame.f_back
        if ours or not t.daemon:
            found.append(t.name)
    return found


class Watch:
    """The profile hook of one ``no_delegation`` block: a context manager; ``calls`` lists what was caught."""

    def __init__(self, forbid: list[tuple[str, Any, Any]], learner_codes: set | None, exercise: str, error: type):
        self.codes: dict = {}  # code object -> (name, class that self must be, or None)
        self.builtins: dict = {}  # builtin -> name
        self.copies: dict = {}  # qualname -> [(bytecode, name)]: a reloaded or exec'd copy of a forbidden function
        functions = []
        for name, obj, owner in forbid:
            found, builtins = _targets(name, obj, owner)
            functions += found
            self.builtins.update(builtins)
        codes = [(fn.__code__, label, cls) for fn, label, cls in functions]
        ours = [(fn, cls) for fn, _, cls in functions if getattr(fn, "__module__", "").startswith("ar_lab.")]
        for code, label, cls in codes + private_helpers(ours, {code for code, _, _ in codes}):  # with their helpers
            self.codes[code] = (label, cls)
            self.copies.setdefault(code.co_qualname, []).append((_fingerprint(code), label))
        self.learner_codes, self.exercise, self.error = learner_codes, exercise, error
        self.calls: list[str] = []
        self.active = False

    def _learners(self, frame) -> bool:
        """Is the call made from ``frame`` the learner's? (See the module's docstring.)"""
        if self.learner_codes is None:
            return True  # no learner named: every call inside the block is refused
        own_thread = threading.get_ident() == self.thread
        while frame is not None:
            code = frame.f_code
            if code in self.learner_codes:
                return True
            if not is_library(code.co_filename):
                return code.co_filename != self.test_file
            frame = frame.f_back
        return not own_thread  # only library code above it, on a thread the test did not start

    def _hit(self, name: str):
        self.calls.append(name)
        raise self.error(
            f"{self.exercise}: your code called `{name}`, a ready-made implementation of what the exercise "
            "asks you to write: replace that call with your own tensor operations.",
            name,
        )

    def _copy_of(self, code) -> str | None:
        for print_, label in self.copies.get(code.co_qualname, ()):
            filename = code.co_filename
            if (is_library(filename) or filename.startswith("<")) and _fingerprint(code) == print_:
                return f"{label} (a copy of its code)"
        return None

    def profile(self, frame, event: str, arg) -> None:
        if not self.active:
            return
        outer = self.previous[0]
        if outer is not None:  # an enclosing block's watch (a check inside a test's block) keeps watching
            outer(frame, event, arg)
        if event == "call":
            code = frame.f_code
            hit = self.codes.get(code)
            if hit is not None:
                name, cls = hit
                if cls is not None and not isinstance(frame.f_locals.get("self"), cls):
                    return
                if self._learners(frame.f_back):
                    self._hit(name)
            elif code.co_qualname in self.copies and (copy := self._copy_of(code)) and self._learners(frame.f_back):
                self._hit(copy)
        elif event == "c_call":
            try:
                name = self.builtins.get(arg)
            except TypeError:  # an unhashable callable
                return
            if name is not None and self._learners(frame):
                self._hit(name)

    def __enter__(self) -> Watch:
        left = learner_threads()
        if left:
            raise self.error(
                f"{self.exercise}: a thread your code started is still running ({', '.join(left)}); a graded test "
                "runs with none of yours alive: stop it (join it, or shut the pool down) and run the tests again."
            )
        frame = sys._getframe(1)
        while frame is not None and is_library(frame.f_code.co_filename):
            frame = frame.f_back
        self.test_file = frame.f_code.co_filename if frame is not None else None
        self.thread = threading.get_ident()
        self.previous = sys.getprofile(), getattr(threading, "getprofile", lambda: threading._profile_hook)()
        self.active = True
        sys.setprofile(self.profile)
        threading.setprofile(self.profile)
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        sys.setprofile(self.previous[0])
        threading.setprofile(self.previous[1])
