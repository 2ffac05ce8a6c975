"""Tensors lent between the grading step's two processes (``ar_lab.course.grading.channel``):
a tensor crosses as a copy, and what the other side writes into that copy in place goes back
into the original with its next message, so a test runs as it would in one process.

Each side keeps a ``Ledger``. The sender numbers each tensor it lends (the same tensor sent
again keeps its number, so it arrives as the same copy: tied weights stay tied) and keeps an
alias of it (``detach``: the same storage) for as long as the receiver holds the copy: a write
into a copy of a temporary of the sender's, such as a tensor of ``model.state_dict()``, lands
in the parameter that temporary shares its storage with.

The receiver sends back, with each message, every copy written since the last one, including
a copy its code has dropped already (the loop variable of ``for name, p in
model.named_parameters(): p.copy_(...)``, the buffer of ``cache.k[layer][:, :, a:b] = k``):
the write is seen through an alias that shares the copy's storage and version counter. A write
through ``.data`` bumps no version counter, and ``p.data = x`` changes no storage the alias
sees, so a copy that requires grad (a parameter, where both are idioms) is held for the
channel's life and compared with a snapshot of it. The receiver names the copies it no longer
holds, and the sender lets their aliases go.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any

import torch


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bytes (a NaN equal to itself)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class _Copy:
    """This side's copy of a tensor the other side lent: the copy (weakly; held, with a snapshot
    of it, if it requires grad: see the module's docstring), an alias of it (the same storage and
    version counter) and the version last sent or received."""

    __slots__ = ("ref", "held", "alias", "version", "snapshot")

    def __init__(self, copy: torch.Tensor):
        self.ref = weakref.ref(copy)
        self.held = copy if copy.requires_grad else None
        self.alias = copy.detach()
        self.version = copy._version
        self.snapshot = copy.detach().clone() if copy.requires_grad else None


class Ledger:
    """One side's record of the tensors it lent and of the copies it holds."""

    def __init__(self):
        self.count = itertools.count(1)
        self.lent: dict[int, weakref.ref] = {}  # number -> a tensor of this side's, sent as a copy
        self.kept: dict[int, torch.Tensor] = {}  # number -> its alias, while the copy is held
        self.numbers: dict[int, tuple] = {}  # id(a lent tensor) -> (weakref to it, its number)
        self.borrowed: dict[int, _Copy] = {}  # the other side's number -> this side's copy
        self.forgotten: list[int] = []  # the other side's numbers whose copies are gone here

    # -- the sender's side

    def lend(self, value: torch.Tensor) -> dict:
        """How ``value`` crosses, besides its data: ``lent`` (its number), ``view`` (``view``)."""
        ref, number = self.numbers.get(id(value), (lambda: None, 0))
        if ref() is not value:  # the same tensor sent again keeps its number: the same copy
            number = next(self.count)
            self.lent[number] = weakref.ref(value)
            self.numbers[id(value)] = (self.lent[number], number)
        self.kept[number] = value.detach()
        return {"lent": number, "view": self.view(value)}

    def view(self, value: torch.Tensor) -> list | None:
        """Where ``value`` lies in a copy this side holds of a tensor of the other side's, when it
        is a view of one: [the copy's number, storage offset, size, stride] (the other side then
        makes the same view of its original), else None."""
        pointer = value.untyped_storage().data_ptr()
        for number, held in self.borrowed.items():
            copy = held.ref()
            if copy is not None and copy is not value \
                    and copy.untyped_storage().data_ptr() == pointer:
                return [number, value.storage_offset(), list(value.shape), list(value.stride())]
        return None

    def take_back(self, returns: Any) -> None:
        """Apply what the other side sent back (``returns``): its writes into the copies, into the
        originals (an original already gone: the storage it shared), then let go of the aliases
        of the copies it no longer holds."""
        changed, forgotten = returns if type(returns) is tuple and len(returns) == 2 else ({}, [])
        for number, copy in changed.items() if type(changed) is dict else ():
            original = self.lent.get(number, lambda: None)()
            original = self.kept.get(number) if original is None else original
            if original is not None and isinstance(copy, torch.Tensor) \
                    and original.shape == copy.shape:
                with torch.no_grad():
                    original.copy_(copy)
        for number in forgotten if type(forgotten) is list else ():
            self.kept.pop(number, None)

    # -- the receiver's side

    def borrow(self, value: torch.Tensor, number: Any, view: Any) -> torch.Tensor:
        """The tensor the other side lent as ``number`` (``value``: its data as it came): a view
        of a tensor of this side's comes back as the same view of it, the same tensor again as
        the same copy, brought up to date."""
        if type(number) is not int:
            return value
        original = None
        if type(view) is list and len(view) == 4:
            original = self.lent.get(view[0], lambda: None)()
            original = self.kept.get(view[0]) if original is None else original
        if original is not None and original.is_contiguous() and original.dtype == value.dtype:
            with contextlib.suppress(RuntimeError):
                out = original.as_strided(view[2], view[3], original.storage_offset() + view[1])
                self._forget(number)
                return out
        if value.is_inference():  # made in inference mode: no write into it can go back
            self._forget(number)
            return value
        held = self.borrowed.get(number)
        copy = held.ref() if held is not None else None
        if copy is not None and copy.shape == value.shape and copy.dtype == value.dtype:
            with torch.no_grad():
                copy.copy_(value)
            value = copy
        self.borrowed[number] = _Copy(value)
        return value

    def _forget(self, number: int) -> None:
        if number not in self.borrowed:
            self.forgotten.append(number)

    def returns(self) -> tuple[dict, list]:
        """What goes back with this side's next message: (number -> the copy, for each copy
        written in place since it came or last went back; the numbers of the copies no longer
        held). A copy the code dropped goes back one last time if it was written: in one process
        that write would have landed in the original."""
        changed, alive = {}, {}
        for number, held in self.borrowed.items():
            copy = held.ref()
            now = held.alias if copy is None else copy.detach()  # after ``p.data = x``: x
            written = now._version != held.version
            if held.snapshot is not None and not written:
                written = not _same(now, held.snapshot)
            if written:
                changed[number] = now
                if held.snapshot is not None:
                    held.snapshot = now.clone()
            if copy is None:
                self.forgotten.append(number)
                continue
            held.alias, held.version = now, now._version
            alive[number] = held
        self.borrowed = alive
        forgotten = [n for n in dict.fromkeys(self.forgotten) if n not in alive]
        self.forgotten = []
        return changed, forgotten
