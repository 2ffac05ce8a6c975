"""The errors ar_lab raises on purpose, each naming the argument at fault.

Every one subclasses the built-in a caller already catches (``ValueError`` for a bad value,
``TypeError`` for the wrong kind of object, ``RuntimeError`` for a state the call cannot go on
from), so existing ``except ValueError`` handlers keep working, and ``ArLabError`` catches them all.
``arg`` is the name of the argument to change (``"top_k"``, ``"prompt"``, ``"cache"``), or None when
no single argument is at fault; the message names it too, shows what was given and says what to
pass. Tests assert the type and ``arg``; the wording is free to improve.

- ``BadValue``: a value of the right kind out of range, of the wrong shape, empty, or not finite.
- ``BadType``: an object of the wrong kind (a str where token ids go, a float where a count goes).
- ``ContextFull``: more positions than the context window or the KV cache holds.
- Elsewhere, for what they name: ``CheckpointError`` (``model/checkpoint.py``), ``CacheMismatch``
  (``engine/sides.py``), ``NotLean`` (``engine/lean.py``), ``OutOfBlocks`` (``engine/paged.py``),
  ``StepError`` (``engine/serving/step.py``).
"""

from __future__ import annotations

from collections.abc import Callable


class ArLabError(Exception):
    """An error ar_lab raised on purpose; ``arg`` names the argument at fault (None: no single
    one)."""

    def __init__(self, message: str, *, arg: str | None = None) -> None:
        super().__init__(message)
        self.arg = arg

    def __reduce__(self):  # keep ``arg`` through pickling (worker processes, multiprocessing)
        return _rebuild, (type(self), str(self), self.arg)


def _rebuild(kind: type[ArLabError], message: str, arg: str | None) -> ArLabError:
    error = kind.__new__(kind)
    ArLabError.__init__(error, message, arg=arg)
    return error


class BadValue(ArLabError, ValueError):
    """A value of the right kind but not one the call accepts (out of range, wrong shape, empty,
    NaN)."""


class BadType(ArLabError, TypeError):
    """An object of the wrong kind for the argument."""


class ContextFull(BadValue):
    """More positions than the model's context window or the KV cache can hold."""


def named(arg: str, check: Callable[[], object]) -> None:
    """Run ``check``; a BadValue it raises comes back naming ``arg``, the argument (a list, an
    option) the checked value came from, as the message's first word."""
    try:
        check()
    except BadValue as error:
        raise type(error)(f"{arg}: {error}", arg=arg) from None
