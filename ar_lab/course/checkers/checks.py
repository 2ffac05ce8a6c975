"""Exercise checkers: when something is wrong, say what, where, and what was expected.

Every checker raises ``CheckFailed`` (an ``AssertionError``, so nbgrader counts it as a
failed test) with a message a learner can act on, and prints a short confirmation
when the check passes.

An exercise asks the learner to *write* a piece the package already has. ``no_delegation``
(and ``own_work``) run the learner's code while the package's reference for that exercise (and e.g.
PyTorch's fused attention, where attention is the exercise) is made to raise, so an
answer that only calls the reference fails with a message that says to write it out.

nbgrader scores a test cell 0 when it writes anything to stderr, so a library's warning about a
correct answer (``float(loss)`` on a tensor that requires grad) would cost its points:
``no_delegation`` (every graded test runs the learner's code inside it) shows warnings raised
while it runs on stdout instead (``warnings_as_notes``).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ar_lab.course.checkers.answers import require_answer

# the verdicts every checker raises (re-exported here)
from ar_lab.course.checkers.verdicts import (
    CheckFailed,
    Delegated,
)

# Exercise name -> (its test passed, the learner's objects it ran): what ``yours_or_ours`` reads.
# One kernel, one record per exercise; re-running a test cell replaces its entry.
_VERDICTS: dict[str, tuple[bool, tuple]] = {}


def _fail(what: str, detail: str, hint: str = "", mistake: str | None = None) -> None:
    msg = f"{what}: {detail}"
    if hint:
        msg += f"\nHint: {hint}"
    raise CheckFailed(msg, mistake)


def verdict(what: str, detail: str, hint: str = "", mistake: str | None = None) -> CheckFailed:
    """The ``CheckFailed`` a checker raises: "what: detail", the hint on a line of its own, the
    mistake named (for the grading report)."""
    return CheckFailed(f"{what}: {detail}" + (f"\nHint: {hint}" if hint else ""), mistake)


def run_answer(what: str, fn: Callable, *args, hint: str = "", **kwargs) -> Any:
    """``fn(*args, **kwargs)`` (the learner's code): an exception other than NotImplementedError
    (a stub) or a verdict becomes a short verdict naming it."""
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as e:
        raise verdict(what, f"your code raised {type(e).__name__}: {e}", hint) from e


def _unanswered(what: str) -> None:
    """The verdict on an exercise whose stub still raises NotImplementedError."""
    _fail(what, "not implemented yet", "replace `raise NotImplementedError()` with your code")


def _not_implemented(what: str, fn: Callable, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        _unanswered(what)


@contextlib.contextmanager
def warnings_as_notes(exercise: str = "this exercise") -> Iterator[list]:
    """Warnings raised while the block runs are printed on stdout as notes instead of on stderr.

    A warning is advice, not a wrong answer; but nbgrader counts any stderr output of a graded
    cell as a failure, so a correct answer that makes a library warn (``float(loss)`` of a tensor
    that requires grad, ``torch.tensor(t)`` of a tensor) would lose its points. The filters in
    force still decide which warnings are raised at all; each distinct one is noted once, also
    when the block fails.
    """
    with warnings.catch_warnings(record=True) as caught:
        try:
            yield caught
        finally:
            seen = set()
            for w in caught:
                first_line = (str(w.message).strip().splitlines() or [""])[0]
                text = f"{w.category.__name__}: {first_line}"
                if text not in seen:
                    seen.add(text)
                    print(
                        f"note: a warning while checking {exercise} (it does not affect the "
                        f"grade): {text}"
                    )


@contextlib.contextmanager
def no_delegation(
    *learner: Callable, forbid: str | Iterable[str | Callable] = (), exercise: str = "this exercise"
) -> Iterator[list]:
    """While the block runs, the ``forbid`` references raise ``Delegated`` when the learner's code
    calls them.

    ``learner``: the learner's functions or classes (their code, nested functions and methods
    included, counts as theirs); with none, every call raises. ``forbid``: functions, methods or
    classes (a class: its constructor and ``forward``), as objects or dotted names
    (``"ar_lab.engine.sampling.filter_top_p"``, ``"ar_lab.model.cache.KVCache.update"``), or a
    PyTorch operator as ``"aten::name"`` (every ``torch.ops.aten.name`` overload); or, as one
    string, a graded exercise's id (``"ch07-accept"``): the list ``ar_lab.course.grading.forbidden``
    keeps for that exercise.

    The references run a stand-in for the block's length (``guard.Gate``): a Python function as its
    own code, so every route to it is caught (an import, a default argument, a saved method, a
    thread); a builtin by name, wherever it is bound. A call is the learner's when the nearest
    notebook code above it is not the test cell's own: the test computes its reference values inside
    the block. A learner whose code caught the error is caught too. Warnings raised in the block go
    to stdout (``warnings_as_notes``), so they do not fail a graded cell. A builtin captured before
    the block, or a copy of the reference's code, escapes it: this is a learner's feedback; the
    grade's guarantee is the grading step's (``ar_lab.course.grading.sandbox``). An answer that is
    None, or ar_lab's own function (or a thin wrapper of it), fails at once with
    ``answers.NoAnswer``: a hook given None would run the package's version.
    """
    from ar_lab.course.grading.channel import Remote
    from ar_lab.course.grading.guard import Gate, forbidden

    # None, or ar_lab's own function, is no answer yet: before anything runs
    require_answer(exercise, *learner)
    # the grading step's judge: the learner's code
    if learner and all(isinstance(f, Remote) for f in learner):
        # runs in its answer process, where the references do not exist
        _VERDICTS[exercise] = (False, learner)
        with warnings_as_notes(exercise):
            yield []
        _VERDICTS[exercise] = (True, learner)
        return
    if isinstance(forbid, str):
        from ar_lab.course.grading.forbidden import references

        forbid = references(forbid)
    forbid = [forbidden(ref) for ref in forbid]
    for name, obj, _ in forbid:
        for f in learner:
            if f is obj or getattr(f, "func", getattr(f, "__wrapped__", f)) is obj:
                raise Delegated(
                    f"{exercise}: your answer is `{name}` itself, a ready-made implementation of "
                    "what the exercise asks you to write: write the computation yourself.",
                    name,
                )
            if isinstance(f, type) and isinstance(obj, type) and issubclass(f, obj):
                raise Delegated(
                    f"{exercise}: your class `{f.__name__}` is built on `{name}`, a ready-made "
                    "implementation of what the exercise asks you to write: subclass "
                    "torch.nn.Module and write it yourself.",
                    name,
                )
    gate = Gate(forbid, learner, exercise, Delegated)
    _VERDICTS[exercise] = (False, learner)  # until the block has passed
    try:
        with gate, warnings_as_notes(exercise):
            yield gate.calls
    except Exception as e:  # e.g. the learner's thread died on Delegated and their code then failed
        if isinstance(e, NotImplementedError) and not gate.calls:
            _unanswered(exercise)  # the stub, untouched: one verdict, not a traceback
        if gate.calls and not isinstance(e, Delegated):
            raise Delegated(
                f"{exercise}: your code called `{gate.calls[0]}`, a ready-made implementation of "
                "what the exercise asks you to write, and then failed: write the computation "
                "yourself.",
                gate.calls[0],
            ) from e
        raise
    if gate.calls:
        raise Delegated(
            f"{exercise}: your code called `{gate.calls[0]}`, a ready-made implementation of "
            "what the exercise asks you to write (and caught the error): write the computation "
            "yourself.",
            gate.calls[0],
        )
    _VERDICTS[exercise] = (True, learner)


def exercise_passed(exercise: str, *yours: Any) -> bool:
    """True if ``exercise``'s graded test passed in this kernel, run on exactly the objects
    ``yours`` (a function redefined since its test ran is not the one that passed)."""
    ok, tested = _VERDICTS.get(exercise, (False, ()))
    return (
        ok and len(tested) == len(yours) and all(a is b for a, b in zip(tested, yours, strict=True))
    )


def yours_or_ours(
    exercise: str, yours: Any, ours: Any, *, name: str | None = None, tested: tuple | None = None,
    whose: str = "ar_lab's",
) -> Any:
    """``yours`` if ``exercise``'s graded test passed on it in this kernel, else ``ours``; prints
    which.

    What a cell after an exercise calls, so the learner's piece runs the chapter's experiment once
    it passes, and a learner who is stuck still reaches the end of the chapter with the package's
    piece. ``yours`` may be a tuple of the objects the test ran (e.g. a quantizer and its
    dequantizer): ``ours`` is then the matching tuple. ``tested``: the objects the test ran, when
    what the cell uses is made from them (a model loaded in the answer cell); ``yours`` is then a
    function without arguments that returns it, called only once the test has passed (before, it may
    not exist). ``whose``: how the printed line names ``ours`` (e.g. "PyTorch's" where the stand-in
    is torch's own).
    """
    checked = tested if tested is not None else yours if isinstance(yours, tuple) else (yours,)
    name = name or exercise
    if exercise_passed(exercise, *checked):
        print(f"▶ this runs on your {name} (its test passed)")
        return yours() if tested is not None else yours
    ran = exercise in _VERDICTS
    why = (
        "does not pass its test yet"
        if ran and _VERDICTS[exercise][0] is False
        else (
            "changed since its test passed: run its test cell again"
            if ran
            else "has not been tested: run its test cell"
        )
    )
    print(f"▷ your {name} {why}: this runs on {whose}")
    return ours


def own_work(what: str, fn: Callable, *args, forbidden: Iterable[str | Callable] = (), **kwargs):
    """``fn(*args, **kwargs)`` (the learner's code) with the ``forbidden`` references made to raise
    (see ``no_delegation``), however the learner's code reaches them."""
    with no_delegation(fn, forbid=forbidden, exercise=what):
        return _not_implemented(what, fn, *args, **kwargs)


def check_shape(what: str, got: Any, shape: tuple[int, ...], hint: str = "") -> None:
    if not isinstance(got, torch.Tensor):
        _fail(what, f"expected a tensor of shape {tuple(shape)}, got {type(got).__name__}", hint)
    if tuple(got.shape) != tuple(shape):
        _fail(what, f"expected shape {tuple(shape)}, got {tuple(got.shape)}", hint)


def check_close(
    what: str,
    got: Any,
    expected: torch.Tensor,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    hint: str = "",
):
    expected = torch.as_tensor(expected)
    got_t = torch.as_tensor(got) if not isinstance(got, torch.Tensor) else got
    check_shape(what, got_t, tuple(expected.shape), hint)
    got_t, expected = got_t.detach().float().cpu(), expected.detach().float().cpu()
    if not torch.allclose(got_t, expected, atol=atol, rtol=rtol, equal_nan=False):
        diff = (got_t - expected).abs()
        where = (
            tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
            if diff.ndim
            else ()
        )
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


def check_dtype(what: str, got: Any, dtype: torch.dtype, why: str = "", hint: str = "") -> None:
    """``got`` is a tensor of ``dtype``, where the exercise's spec names one: equal values of
    another dtype (a float 0/1 mask for a bool one) pass ``check_equal`` but fail later (``~mask``,
    ``masked_fill``). ``why``: what the other dtype breaks, said in the message."""
    if not isinstance(got, torch.Tensor):
        _fail(what, f"expected a tensor of dtype {dtype}, got {type(got).__name__}", hint)
    if got.dtype != dtype:
        _fail(what, f"expected dtype {dtype}, got {got.dtype}" + (f": {why}" if why else ""), hint)


def check_log_prob(what: str, got: Any, expected: Any, atol: float = 1e-4, hint: str = "") -> None:
    """A log-probability (a sum of many logs) equals ``expected``; a 0 or -inf where ``expected`` is
    finite is named for what it is: probabilities multiplied, the product underflowed (0.1 ** 400 is
    0 in float64)."""
    value, want = float(torch.as_tensor(got).detach().double()), float(expected)
    if value in (0.0, float("-inf")) and math.isfinite(want) and want != 0.0:
        _fail(
            what,
            f"expected {want:.6g}, got {value}: you multiply probabilities and the product "
            "underflows (to 0, whose log is -inf): add log-probabilities instead",
            hint,
        )
    check_close(what, torch.as_tensor(value), expected, atol=atol, hint=hint)


def check_cases(
    name: str,
    fn: Callable,
    cases: Iterable[tuple[tuple, Any]],
    hint: str = "",
    forbidden: Iterable = (),
) -> None:
    """Call ``fn(*args)`` for each (args, expected) case; report the first failing one.

    ``forbidden``: the package's references for this exercise, made to raise while ``fn`` runs
    (see ``own_work``); compute the expected values before the call, not inside it.
    """
    forbidden = tuple(forbidden)
    for args, expected in cases:
        shown = ", ".join(
            repr(a) if not isinstance(a, torch.Tensor) else f"tensor{tuple(a.shape)}" for a in args
        )
        try:
            got = own_work(f"{name}({shown})", fn, *args, forbidden=forbidden)
        except CheckFailed:
            raise
        except Exception as e:  # an expected value exists, so any exception is a wrong answer
            raise CheckFailed(
                f"{name}({shown}): your code raised {type(e).__name__}: {e}"
                + (f"\nHint: {hint}" if hint else "")
            ) from e
        if isinstance(expected, torch.Tensor):
            check_close(f"{name}({shown})", got, expected, hint=hint)
        else:
            check_equal(f"{name}({shown})", got, expected, hint=hint)


def passed(message: str = "All checks passed.") -> None:
    print(f"✔ {message}")


# --- checkers that explain where two computations part ---------------------------------


def first_mismatch(
    got: torch.Tensor, expected: torch.Tensor, dim: int = 0, atol: float = 1e-5, rtol: float = 1e-4
):
    """The first index along ``dim`` (a position, a training step) where ``got`` and ``expected``
    differ, or None."""
    bad = ~torch.isclose(
        got.detach().float().cpu(), expected.detach().float().cpu(), atol=atol, rtol=rtol
    )
    per_index = bad.movedim(dim, 0).reshape(bad.shape[dim], -1).any(dim=1)
    hits = per_index.nonzero()
    return int(hits[0]) if len(hits) else None


def _rms(t: torch.Tensor) -> float:
    return t.pow(2).mean().sqrt().item()


def check_matches(
    what: str,
    got: Any,
    expected: torch.Tensor,
    *,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    dim: int | None = None,
    dim_name: str = "position",
    mistakes: dict[str, torch.Tensor] | None = None,
    hint: str = "",
) -> None:
    """``check_close`` that explains a difference: the known mistake it matches (``mistakes``: a
    description -> the output that mistake gives, e.g. from
    ``ar_lab.course.checkers.model_checks``), a wrong overall size, and the first index along
    ``dim`` that differs (``dim_name``: what that index is)."""
    expected = torch.as_tensor(expected).detach().float().cpu()
    check_shape(what, got, tuple(expected.shape), hint)
    got = got.detach().float().cpu()
    if not torch.isfinite(got).all():
        _fail(what, f"{int((~torch.isfinite(got)).sum())} of its values are NaN or infinite", hint)
    if torch.allclose(got, expected, atol=atol, rtol=rtol):
        return
    for mistake, output in (mistakes or {}).items():
        output = output.detach().float().cpu()
        if output.shape == got.shape and torch.allclose(got, output, atol=atol, rtol=rtol):
            _fail(what, f"your output is what {mistake} gives", hint, mistake)
    found = []
    ratio = _rms(got) / max(_rms(expected), 1e-12)
    if not 0.8 <= ratio <= 1.25:
        found.append(
            f"its values are {ratio:.3g}x the expected size (root mean square {_rms(got):.3g}, "
            f"expected {_rms(expected):.3g})"
        )
    if dim is not None and got.ndim:
        k = first_mismatch(got, expected, dim, atol, rtol)
        agree = (
            f" ({dim_name} 0 agrees)"
            if k == 1
            else f" ({dim_name}s 0 to {k - 1} agree)"
            if k
            else ""
        )
        found.append(f"the first {dim_name} that differs is {k}{agree}")
    diff = (got - expected).abs()
    where = (
        tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.ndim else ()
    )
    found.append(
        f"largest difference {diff.max().item():.3g} at index {where}: "
        f"expected {expected[where].item():.6g}, got {got[where].item():.6g}"
    )
    _fail(what, "values differ: " + "; ".join(found), hint)


def check_sequence(what: str, got: Sequence, expected: Sequence, hint: str = "") -> None:
    """Two token lists are equal; otherwise say where they first part and how many agree before."""
    got, expected = [int(t) for t in got], [int(t) for t in expected]
    k = next(
        (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
        min(len(got), len(expected)),
    )
    if got == expected:
        return
    if k == min(len(got), len(expected)):
        agree = f" (the first {k} agree)" if k else ""
        _fail(what, f"expected {len(expected)} tokens, got {len(got)}{agree}", hint)
    agree = {0: "the very first token: none agree", 1: "token 0 agrees"}.get(
        k, f"tokens 0 to {k - 1} agree"
    )
    _fail(what, f"token {k} differs: expected {expected[k]}, got {got[k]} ({agree})", hint)


def check_same_names(
    what: str, module: torch.nn.Module, reference: torch.nn.Module, hint: str = ""
) -> None:
    """``module`` has ``reference``'s state-dict names and shapes, so the reference's weights load
    into it."""
    mine = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    ref = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    missing, extra = sorted(set(ref) - set(mine)), sorted(set(mine) - set(ref))
    problems = [f"missing {missing[:4]}"] if missing else []
    problems += [f"unexpected {extra[:4]}"] if extra else []
    problems += [
        f"`{k}` has shape {mine[k]}, expected {ref[k]}"
        for k in ref
        if k in mine and mine[k] != ref[k]
    ][:2]
    if problems:
        _fail(
            what,
            "its parameters do not have the course model's names and shapes: "
            + "; ".join(problems),
            hint,
        )


def _first_different_parameter(
    model: torch.nn.Module, other: torch.nn.Module, atol: float, rtol: float
):
    theirs = other.state_dict()
    for name, value in model.state_dict().items():
        same = name in theirs and torch.allclose(
            value.float().cpu(), theirs[name].float().cpu(), atol=atol, rtol=rtol
        )
        if not same:
            return name
    return None


def check_parameters(
    what: str,
    model: torch.nn.Module,
    expected: torch.nn.Module,
    *,
    atol: float = 1e-6,
    rtol: float = 1e-4,
    mistakes: dict[str, torch.nn.Module] | None = None,
    hint: str = "",
) -> None:
    """Every parameter of ``model`` (after training, say) equals ``expected``'s; otherwise name the
    known mistake it matches (``mistakes``: a description -> a model that mistake gives) or the
    first that differs."""
    name = _first_different_parameter(model, expected, atol, rtol)
    if name is None:
        return
    for mistake, other in (mistakes or {}).items():
        if _first_different_parameter(model, other, atol, rtol) is None:
            _fail(what, f"your parameters are what {mistake} gives", hint, mistake)
    a, b = model.state_dict()[name].float().cpu(), expected.state_dict().get(name)
    size = (
        f"largest difference {(a - b.float().cpu()).abs().max().item():.3g}"
        if b is not None
        else "missing"
    )
    _fail(what, f"parameter `{name}` is the first that differs ({size})", hint)
