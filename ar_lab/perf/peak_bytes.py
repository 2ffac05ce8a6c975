"""Peak bytes of the tensors a call creates, counted exactly rather than read from the process.

The resident set size of a process moves with the allocator's caching, other threads and the page
cache, so "attention over T positions needs a T x T matrix" cannot be read from it on a shared
machine. ``PeakBytes`` is a ``TorchDispatchMode`` (PyTorch's documented hook under every tensor
operation): it sees each operation's outputs, counts every storage that is new (not one of the
operation's inputs' — a view, an in-place or ``out=`` result shares its input's storage and costs
nothing) once, at its size in bytes, and subtracts it when the storage is freed (a
``weakref.finalize`` on the storage, whose Python object PyTorch keeps for as long as the storage
lives). ``peak`` is the most bytes alive at once.

What it counts: the tensors that pass through the dispatcher, on any device, the meta device
included (shapes only, no arithmetic: the same count for a length that would not fit in memory).
What it does not see: a fused kernel's scratch inside one operation (SDPA's CPU kernel keeps its
tiles in buffers of its own), tensors made before the block (the inputs), and a storage resized
after it was first seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # where PyTorch's docs place it

from ar_lab.base.errors import BadType


def _tensors(obj):
    """The tensors in an operation's arguments or results (nested in tuples, lists and dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _storage(t: torch.Tensor):
    """The tensor's storage, or None for a layout without one (sparse, nested)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class PeakBytes(TorchDispatchMode):
    """``with PeakBytes() as tracker: ...``: ``tracker.peak`` is the most bytes of storages created
    in the block that were alive at once, ``tracker.live`` those still alive (e.g. the results the
    block kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        # id(storage) -> its bytes, for the storages made inside the block and alive now
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {id(s) for s in map(_storage, _tensors((args, kwargs))) if s is not None}
        for s in map(_storage, _tensors(out)):
            if s is not None and id(s) not in inputs:
                self._count(s)
        return out

    def _count(self, storage) -> None:
        key = id(storage)
        if key in self._sizes:  # already counted (an output that aliases an earlier one)
            return
        self._sizes[key] = size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key)


def peak_bytes(fn: Callable[[], object]) -> int:
    """The most bytes of tensors that ``fn()`` (a function of no arguments) held alive at once while
    it ran, its result included: ``peak_bytes(lambda: q @ k.mT)`` is the bytes of one score matrix.
    """
    if not callable(fn):
        raise BadType(
            f"fn must be a function of no arguments, e.g. lambda: attention(q, k, v); got {fn!r}",
            arg="fn",
        )
    with PeakBytes() as tracker:
        fn()
    return tracker.peak
