"""Exercise checkers: when something is wrong, say what, where, and what was expected.

Every checker raises ``CheckFailed`` (an ``AssertionError``, so nbgrader counts it as a
failed test) with a message a learner can act on, and prints a short confirmation
when the check passes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class CheckFailed(AssertionError):
    pass


def _fail(what: str, detail: str, hint: str = "") -> None:
    msg = f"{what}: {detail}"
    if hint:
        msg += f"\nHint: {hint}"
    raise CheckFailed(msg)


def _not_implemented(what: str, fn: Callable, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        _fail(what, "not implemented yet", "replace `raise NotImplementedError()` with your code")


def check_shape(what: str, got: Any, shape: tuple[int, ...], hint: str = "") -> None:
    if not isinstance(got, torch.Tensor):
        _fail(what, f"expected a tensor of shape {tuple(shape)}, got {type(got).__name__}", hint)
    if tuple(got.shape) != tuple(shape):
        _fail(what, f"expected shape {tuple(shape)}, got {tuple(got.shape)}", hint)


def check_close(what: str, got: Any, expected: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-4, hint: str = ""):
    expected = torch.as_tensor(expected)
    got_t = torch.as_tensor(got) if not isinstance(got, torch.Tensor) else got
    check_shape(what, got_t, tuple(expected.shape), hint)
    got_t, expected = got_t.detach().float().cpu(), expected.detach().float().cpu()
    if not torch.allclose(got_t, expected, atol=atol, rtol=rtol, equal_nan=False):
        diff = (got_t - expected).abs()
        where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.ndim else ()
        _fail(
            what,
            f"values differ; largest difference {diff.max().item():.3g} at index {where}: "
            f"expected {expected[where].item():.6g}, got {got_t[where].item():.6g}",
            hint,
        )


def check_equal(what: str, got: Any, expected: Any, hint: str = "") -> None:
    if isinstance(got, torch.Tensor) or isinstance(expected, torch.Tensor):
        ok = torch.equal(torch.as_tensor(got), torch.as_tensor(expected))
    else:
        ok = got == expected
    if not ok:
        _fail(what, f"expected {expected!r}, got {got!r}", hint)


def check_cases(name: str, fn: Callable, cases: Iterable[tuple[tuple, Any]], hint: str = "") -> None:
    """Call ``fn(*args)`` for each (args, expected) case; report the first failing one."""
    for args, expected in cases:
        shown = ", ".join(repr(a) if not isinstance(a, torch.Tensor) else f"tensor{tuple(a.shape)}" for a in args)
        got = _not_implemented(f"{name}({shown})", fn, *args)
        if isinstance(expected, torch.Tensor):
            check_close(f"{name}({shown})", got, expected, hint=hint)
        else:
            check_equal(f"{name}({shown})", got, expected, hint=hint)


def passed(message: str = "All checks passed.") -> None:
    print(f"✔ {message}")
