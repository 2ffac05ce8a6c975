"""Plain values: what a grading record holds (``ar_lab.course.record``), and how a replay compares them.

``encode`` turns a value into data ``torch.load(..., weights_only=True)`` reads back without running
code: numbers, strings, bytes, tensors, lists, tuples, dicts, sets, NumPy arrays and scalars, and the
dataclasses of ``ar_lab`` itself (a config, sampling parameters). Anything else raises ``NotPlain``. What
a test *passes* to the learner's code (``argument=True``) may also be a model (kept as a fingerprint of
its class and weights) or a random generator (its state): those are compared, never handed back.
``decode`` gives the value back; ``same`` says whether a live argument is the one recorded.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

_TAG = "__ar_lab_record__"


class NotPlain(TypeError):
    """A value a record cannot hold as plain data."""


class NotAValue(ValueError):
    """Encoded data that names something no replay may build (a model, a class outside ar_lab)."""


def _fingerprint(module: torch.nn.Module) -> str:
    """A hash of a model's class and state (names, dtypes, shapes, bytes): the same model, or not."""
    digest = hashlib.sha256(f"{type(module).__module__}.{type(module).__qualname__}".encode())
    for name, t in module.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _dataclass(value: Any, argument: bool) -> dict:
    """A dataclass of ar_lab's own (a config, sampling parameters, a model's shape), field by field."""
    import dataclasses

    kind = type(value)
    fields = {f.name: encode(getattr(value, f.name), argument=argument) for f in dataclasses.fields(value)}
    return {_TAG: "dataclass", "class": f"{kind.__module__}:{kind.__qualname__}", "fields": fields}


def encode(value: Any, *, argument: bool = False) -> Any:
    """``value`` as plain data ``torch.load(weights_only=True)`` reads back; raises ``NotPlain``. An ``argument``
    (what the test passes in, compared but never handed back) may also be a model: its fingerprint is kept."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str, complex):
        return value
    if kind is bytes:  # as a tensor: pickle writes b"" as a call of bytes(), which weights_only refuses
        return {_TAG: "bytes", "t": torch.frombuffer(bytearray(value), dtype=torch.uint8) if value else torch.zeros(0)}
    if isinstance(value, torch.Tensor):
        if kind not in (torch.Tensor, torch.nn.Parameter) or value.layout != torch.strided or value.is_quantized:
            raise NotPlain(f"a {kind.__name__} with layout {value.layout}")
        return {_TAG: "tensor", "t": value.detach().to("cpu", copy=True), "grad": value.requires_grad}
    if kind in (list, tuple):
        return kind(encode(v, argument=argument) for v in value)
    if argument and isinstance(value, torch.nn.Module) and kind.__module__.split(".")[0] in ("ar_lab", "torch"):
        return {_TAG: "module", "v": _fingerprint(value)}  # a model the test made (not one of the learner's class)
    if argument and kind is torch.Generator and value.device.type == "cpu":
        return {_TAG: "generator", "state": value.get_state()}
    if kind in (set, frozenset):
        try:
            items = sorted(value)  # one order in every process (a string's hash changes between processes)
        except TypeError:
            items = list(value)
        return {_TAG: kind.__name__, "v": [encode(v, argument=argument) for v in items]}
    if hasattr(kind, "__dataclass_fields__") and kind.__module__.split(".")[0] == "ar_lab":
        return _dataclass(value, argument)
    if kind is torch.Size:
        return {_TAG: "size", "v": tuple(value)}
    if kind is torch.dtype:
        return {_TAG: "dtype", "v": str(value).removeprefix("torch.")}
    if kind is dict and all(type(k) in (str, int) for k in value):
        return {k: encode(v, argument=argument) for k, v in value.items()}
    if kind.__module__ == "numpy":
        import numpy as np

        if isinstance(value, np.ndarray) and value.dtype != object:
            return {_TAG: "ndarray", "t": torch.from_numpy(value.copy())}
        if isinstance(value, np.generic) and not isinstance(value, np.object_):
            return {_TAG: "npscalar", "dtype": str(value.dtype), "v": value.item()}
    raise NotPlain(f"a {kind.__module__}.{kind.__qualname__}")


def decode(plain: Any) -> Any:
    """The value ``encode`` recorded (a fresh copy each time)."""
    if type(plain) in (list, tuple):
        return type(plain)(decode(v) for v in plain)
    if type(plain) is not dict:
        return plain
    tag = plain.get(_TAG)
    if tag is None:
        return {k: decode(v) for k, v in plain.items()}
    if tag == "tensor":
        t = plain["t"].clone()
        return t.requires_grad_() if plain["grad"] and (t.is_floating_point() or t.is_complex()) else t
    if tag == "size":
        return torch.Size(plain["v"])
    if tag == "dtype":
        return getattr(torch, plain["v"])
    if tag == "bytes":
        return bytes(plain["t"].to(torch.uint8).tolist())
    if tag in ("set", "frozenset"):
        return (set if tag == "set" else frozenset)(decode(plain["v"]))
    if tag == "dataclass":
        return _rebuild_dataclass(plain["class"], decode(plain["fields"]))
    if tag == "module":
        raise NotAValue("a record hands back a model, which only an argument's fingerprint may name")
    import numpy as np

    if tag == "ndarray":
        return plain["t"].numpy().copy()
    return np.dtype(plain["dtype"]).type(plain["v"])


def _rebuild_dataclass(name: str, fields: dict) -> Any:
    import dataclasses
    import importlib

    module, _, qualname = name.partition(":")
    kind = importlib.import_module(module) if module.split(".")[0] == "ar_lab" else None
    for part in qualname.split(".") if kind is not None else ():
        kind = getattr(kind, part, None)
    if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
        raise NotAValue(f"a recorded value names {name}, which is not one of ar_lab's dataclasses")
    out = object.__new__(kind)
    for field, value in fields.items():
        object.__setattr__(out, field, value)
    return out


def same(recorded: Any, value: Any) -> bool:
    """Is ``value`` (a live argument) what ``recorded`` (an encoded one) holds? Tensors: same dtype and
    shape, and equal values (floating point within 1e-5 relative: another process may round differently)."""
    try:
        live = encode(value, argument=True)
    except NotPlain:
        return False
    return same_plain(recorded, live)


def same_plain(a: Any, b: Any) -> bool:
    """Two encoded values are equal (see ``same``)."""
    if type(a) is not type(b):
        return False
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same_plain(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is dict:
        return a.keys() == b.keys() and all(same_plain(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_floating_point() or a.is_complex():
            return torch.allclose(a, b, rtol=1e-5, atol=1e-7, equal_nan=True)
        return torch.equal(a, b)
    return a == b or (isinstance(a, float) and a != a and b != b)
