"""Assert an ar_lab error by what it means, not by how it is worded (ARCHITECTURE.md, "the error
style").

``raises(BadValue, "top_k")`` passes when the block raises that type (or a subclass) carrying ``arg
== "top_k"``, and the message names the argument. A message's words may then improve without
touching a test, and an error that names another argument fails. Match the wording
(``pytest.raises(..., match=...)``) only where the wording is the point: a message that must tell
the learner what to do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from ar_lab.base.errors import ArLabError


def check_error(error: BaseException, kind: type[BaseException], arg: str | None) -> None:
    """Fail unless ``error`` is a ``kind`` from ar_lab naming ``arg`` (in ``.arg`` and in its
    message)."""
    assert isinstance(error, kind), f"expected {kind.__name__}, got {type(error).__name__}: {error}"
    assert isinstance(error, ArLabError), (
        f"{type(error).__name__} is not an ar_lab error (ArLabError): {error}"
    )
    assert error.arg == arg, (
        f"the error names the argument {error.arg!r}, expected {arg!r}: {error}"
    )
    if arg is not None:
        assert arg in str(error), f"the message does not name the argument {arg!r}: {error}"


@contextlib.contextmanager
def raises(kind: type[BaseException], arg: str | None) -> Iterator[pytest.ExceptionInfo]:
    """``pytest.raises(kind)`` that also checks the argument the error names (``check_error``)."""
    with pytest.raises(kind) as info:
        yield info
    check_error(info.value, kind, arg)


@contextlib.contextmanager
def delegated(to: str = "") -> Iterator[pytest.ExceptionInfo]:
    """``pytest.raises(Delegated)`` whose ``reference`` (what the learner's code reached) contains
    ``to``."""
    from ar_lab.course.checkers.checks import Delegated

    with pytest.raises(Delegated) as info:
        yield info
    assert info.value.reference is not None and to in info.value.reference, (
        info.value.reference,
        str(info.value),
    )


@contextlib.contextmanager
def mistaken(named: str) -> Iterator[pytest.ExceptionInfo]:
    """``pytest.raises(CheckFailed)`` for an answer the checker recognised as a named mistake: its
    ``mistake`` (the mistake's description, the key of a ``*_mistakes`` table) contains
    ``named``."""
    from ar_lab.course.checkers.checks import CheckFailed

    with pytest.raises(CheckFailed) as info:
        yield info
    assert info.value.mistake is not None and named in info.value.mistake, (
        info.value.mistake,
        str(info.value),
    )


def fails_naming(named: str, check, *args, **kwargs) -> str:
    """Run ``check(*args, **kwargs)``, which must fail naming the mistake ``named`` (``mistaken``);
    its message."""
    with mistaken(named) as info:
        check(*args, **kwargs)
    return str(info.value)
