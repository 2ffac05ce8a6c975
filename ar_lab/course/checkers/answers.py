"""What a graded test reads from a learner: an answer that is there, and values of the kind the
exercise states.

A hook of the package runs the package's own version when it is handed None
(``speculative_generate``'s ``iteration=`` and ``accept=``, ``serve``'s ``step=`` and ``policy=``);
so does an answer that *is* the package's function, or a thin wrapper of it (``functools.partial``,
``functools.wraps``, a bound method). A graded test handed one would grade the package and give its
points. ``require_answer`` refuses all three with ``NoAnswer`` ("no answer yet") before anything
runs: ``checks.no_delegation`` calls it for every learner object of every graded test, and the
checkers that hand a learner's callable to such a hook call it too. In the grading step the
learner's answer is a handle on a name in the answer process (``channel.Remote``): it is missing
when that name holds None (every answer is a function or a class, which are true) or is not defined
at all.

What a check reads back is checked for its kind before its value, so a value that only converts to
the right one (``"0.0077"`` for seconds, ``1000.0`` for a count of bytes, ``True`` for 1) fails
instead of being read as what it resembles: ``whole_number`` (an int: not a bool, a float or a str)
and ``real_number`` (a finite int or float: not a bool, a str, NaN or infinity, nor a tensor).
Tensors have ``checks.check_dtype`` and ``checks.check_shape``.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from typing import Any

from ar_lab.course.checkers.verdicts import CheckFailed, NoAnswer


def package_origin(answer: Any) -> str | None:
    """``module.qualname`` of the ar_lab function or class ``answer`` is, or wraps thinly (a
    ``functools.partial``, a ``functools.wraps`` wrapper, a bound method, a static or class method);
    None if it is not ar_lab's."""
    seen: set[int] = set()
    while id(answer) not in seen:
        seen.add(id(answer))
        if isinstance(answer, functools.partial):
            answer = answer.func
        elif inspect.ismethod(answer) or isinstance(answer, (staticmethod, classmethod)):
            answer = answer.__func__
        else:
            try:
                inner = inspect.getattr_static(answer, "__wrapped__", None)
            # an object whose attributes cannot be looked at: not a wrapper of ours
            except Exception:
                inner = None
            if inner is None:
                break
            answer = inner
    module = getattr(answer, "__module__", None) if callable(answer) else None
    if isinstance(module, str) and (module == "ar_lab" or module.startswith("ar_lab.")):
        return f"{module}.{getattr(answer, '__qualname__', getattr(answer, '__name__', '?'))}"
    return None


def _missing(answer: Any) -> bool:
    from ar_lab.course.grading.channel import Remote

    if isinstance(answer, Remote):  # the grading step: a name in the learner's answer process
        try:
            return not answer
        except NameError:  # the learner's cells never defined it
            return True
    return answer is None


def require_answer(exercise: str, *answers: Any) -> None:
    """Fail with ``NoAnswer`` unless each of ``answers`` is the learner's own: None, ar_lab's own
    function or class, or a thin wrapper of one, is no answer yet (``package_origin``)."""
    from ar_lab.course.grading.channel import Remote

    for answer in answers:
        if _missing(answer):
            raise NoAnswer(
                f"{exercise}: no answer yet: your answer is None (or not defined), and a hook "
                "given None runs ar_lab's own version in its place\nHint: define it yourself "
                "where the exercise says `raise NotImplementedError()`"
            )
        origin = None if isinstance(answer, Remote) else package_origin(answer)
        if origin is not None:
            raise NoAnswer(
                f"{exercise}: no answer yet: your answer is ar_lab's own `{origin}`, a "
                "ready-made implementation of what the exercise asks you to write\nHint: write "
                "it yourself; the package's is what your answer is checked against",
                origin,
            )


def is_whole(got: Any) -> bool:
    """An int or a numpy integer; not a bool, a float that happens to be whole, a str or a
    tensor."""
    return isinstance(got, numbers.Integral) and not isinstance(got, bool)


def is_real(got: Any) -> bool:
    """A finite int or float (or a numpy number); not a bool, a str, NaN, infinity or a tensor."""
    return isinstance(got, numbers.Real) and not isinstance(got, bool) and math.isfinite(got)


def whole_number(what: str, got: Any, hint: str = "") -> int:
    """``got`` if it is an int (``is_whole``: a count is whole); else fail the check saying what
    came."""
    if is_whole(got):
        return int(got)
    raise CheckFailed(f"{what}: expected an int, got {_kind(got)}"
                      + "\nHint: " + (hint or "return a Python int (int(...) of a whole number)"))


def real_number(what: str, got: Any, hint: str = "") -> float:
    """``got`` as a float if it is a finite int or float (``is_real``); else fail the check saying
    what came."""
    if is_real(got):
        return float(got)
    raise CheckFailed(
        f"{what}: expected a finite float, got {_kind(got)}"
        + "\nHint: "
        + (hint or "return a Python float (float(...), or .item() of a one-value tensor)")
    )


def _kind(got: Any) -> str:
    return f"a {type(got).__name__} of shape {tuple(got.shape)}" if hasattr(got, "shape") else \
        f"{type(got).__name__} {got!r}"
