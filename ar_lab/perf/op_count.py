"""The PyTorch operations a pass of a model calls, counted as they run (chapter 04).

A decode step of a small model is a chain of short operations, each paying Python and dispatch
before any arithmetic, so how many a step calls, and what surrounds each, sets much of its time.
``count_ops(fn)`` records every PyTorch function ``fn()`` calls (a ``TorchFunctionMode`` sees torch
functions, tensor methods and operators alike; calls made inside a recorded one are not recorded
again) and sorts them in two:

- ``computing``: the calls that compute or write something (a new tensor, an in-place update, a
  result written into ``out=``): each runs at least one kernel on the device;
- the others: views (``view``, ``transpose``, ``select``, a slice), which only describe memory that
  exists, and reads of a tensor's attributes (``.shape``, ``.device``).

``pass_ops(model, positions)`` counts one forward pass over ``positions`` tokens without a cache;
``decode_step_ops(model, lean=...)`` one cached decode step, through ``GPT.forward`` or through
``ar_lab.engine.lean`` (what ``generate(..., lean=...)`` runs). The counts depend on the model's
code and on the PyTorch version, not on the machine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadType
from ar_lab.engine.lean import for_model
from ar_lab.model.cache import KVCache


class OpCount(NamedTuple):
    calls: Counter  # every PyTorch function called: name -> times
    computing: Counter  # those that computed or wrote something (each at least one kernel)


_IN_PLACE_OPERATORS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"})


def _storages(values) -> set[int]:
    return {
        t.untyped_storage().data_ptr() for t in tree_leaves(values) if isinstance(t, torch.Tensor)
    }


def _computes(name: str, args, kwargs: dict, result) -> bool:
    """Did the call compute or write? In place (``add_``, ``x[i] = v``) or into ``out=``: yes.
    Otherwise yes if it returned a tensor on new memory; a view shares its input's memory, an
    attribute read returns none."""
    in_place = (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE_OPERATORS
    if in_place or kwargs.get("out") is not None:
        return True
    made = _storages(result)
    return bool(made - _storages((args, kwargs)))


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()
        self.computing: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", repr(func))
        self.calls[name] += 1
        if _computes(name, args, kwargs, result):
            self.computing[name] += 1
        return result


def count_ops(fn: Callable[[], object]) -> OpCount:
    """The PyTorch calls ``fn()`` makes, and those of them that compute (see the module's
    docstring)."""
    if not callable(fn):
        raise BadType(
            f"fn must be a function of no arguments, e.g. lambda: model(idx); got {fn!r}", arg="fn"
        )
    with torch.inference_mode(), _Recorder() as recorder:
        fn()
    return OpCount(recorder.calls, recorder.computing)


def pass_ops(model, positions: int = 1) -> OpCount:
    """The operations of one forward pass of ``model`` over ``positions`` tokens, without a
    cache."""
    positive_int("positions", positions)
    idx = torch.zeros(1, positions, dtype=torch.long, device=next(model.parameters()).device)
    return count_ops(lambda: model(idx))


def decode_step_ops(model, *, lean: bool = True) -> OpCount:
    """The operations of one cached decode step (the second token of a sequence), through
    ``ar_lab.engine.lean`` (``lean=True``) or through ``GPT.forward`` (``lean=False``)."""
    cache = KVCache.for_model(model, max_len=2)
    idx = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
    if lean:
        engine = for_model(model)
        with torch.inference_mode():
            engine.step(0, cache)  # the first step sets up the engine's working memory
        return count_ops(lambda: engine.step(0, cache))
    with torch.inference_mode():
        model(idx, cache)
    return count_ops(lambda: model(idx, cache))


def library_kernels(fn: Callable[[], object]) -> list[str]:
    """The library operators (``aten::`` names) ``fn()`` runs, as PyTorch's profiler records them:
    for a compiled graph, what it still calls in the library (the code it generated itself shows as
    none). The profiler's own start and stop lines on stderr are dropped."""
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 2)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    return sorted({e.name for e in prof.events() if e.name.startswith("aten::")})
