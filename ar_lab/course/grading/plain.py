"""Plain values: what crosses between the grading step's judge and an answer process by value
(``ar_lab.course.grading.channel``; anything else crosses as a handle).

``encode`` turns a value into data read back without running code: numbers, strings, bytes, tensors,
lists, tuples, dicts, sets, NumPy arrays and scalars, and the dataclasses of ``ar_lab`` itself (a
config, sampling parameters). Anything else raises ``NotPlain``. ``decode`` gives the value back.
``exposable`` says what the judge never lets cross even as a handle (its modules, frames, shell,
file and process functions).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

_TAG = "__ar_lab_plain__"


class NotPlain(TypeError):
    """A value that cannot cross by value (it crosses as a handle)."""


class NotAValue(ValueError):
    """Encoded data that names something no decode may build (a class outside ar_lab's
    dataclasses)."""


def _dataclass(value: Any) -> dict:
    """A dataclass of ar_lab's own (a config, sampling parameters, a model's shape), field by
    field."""
    import dataclasses

    kind = type(value)
    fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return {_TAG: "dataclass", "class": f"{kind.__module__}:{kind.__qualname__}", "fields": fields}


def encode(value: Any) -> Any:
    """``value`` as plain data; raises ``NotPlain``."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str, complex):
        return value
    # as a tensor: pickle writes b"" as a call of bytes(), which weights_only refuses
    if kind is bytes:
        return {
            _TAG: "bytes",
            "t": torch.frombuffer(bytearray(value), dtype=torch.uint8) if value else torch.zeros(0),
        }
    if isinstance(value, torch.Tensor):
        if (
            kind not in (torch.Tensor, torch.nn.Parameter)
            or value.layout != torch.strided
            or value.is_quantized
        ):
            raise NotPlain(f"a {kind.__name__} with layout {value.layout}")
        return {
            _TAG: "tensor",
            "t": value.detach().to("cpu", copy=True),
            "grad": value.requires_grad,
        }
    if kind in (list, tuple):
        return kind(encode(v) for v in value)
    if kind in (set, frozenset):
        try:
            # one order in every process (a string's hash changes between processes)
            items = sorted(value)
        except TypeError:
            items = list(value)
        return {_TAG: kind.__name__, "v": [encode(v) for v in items]}
    if hasattr(kind, "__dataclass_fields__") and kind.__module__.split(".")[0] == "ar_lab":
        return _dataclass(value)
    if kind is torch.Size:
        return {_TAG: "size", "v": tuple(value)}
    if kind is torch.dtype:
        return {_TAG: "dtype", "v": str(value).removeprefix("torch.")}
    if kind is torch.device:
        return {_TAG: "device", "v": str(value)}
    if kind is dict and all(type(k) in (str, int) for k in value):
        return {k: encode(v) for k, v in value.items()}
    if kind.__module__ == "numpy":
        import numpy as np

        if isinstance(value, np.ndarray) and value.dtype != object:
            return {_TAG: "ndarray", "t": torch.from_numpy(value.copy())}
        if isinstance(value, np.generic) and not isinstance(value, np.object_):
            return {_TAG: "npscalar", "dtype": str(value.dtype), "v": value.item()}
    raise NotPlain(f"a {kind.__module__}.{kind.__qualname__}")


def decode(plain: Any) -> Any:
    """The value ``encode`` encoded (a fresh copy each time)."""
    if type(plain) in (list, tuple):
        return type(plain)(decode(v) for v in plain)
    if type(plain) is not dict:
        return plain
    tag = plain.get(_TAG)
    if tag is None:
        return {k: decode(v) for k, v in plain.items()}
    if tag == "tensor":
        t = plain["t"].clone()
        return (
            t.requires_grad_() if plain["grad"] and (t.is_floating_point() or t.is_complex()) else t
        )
    if tag == "size":
        return torch.Size(plain["v"])
    if tag == "dtype":
        dtype = getattr(torch, str(plain["v"]), None)
        if not isinstance(dtype, torch.dtype):  # torch.load, say: a message names no function
            raise NotAValue(f"an encoded dtype names torch.{plain['v']}, which is not a dtype")
        return dtype
    if tag == "device":
        return torch.device(str(plain["v"]))
    if tag == "bytes":
        return bytes(plain["t"].to(torch.uint8).tolist())
    if tag in ("set", "frozenset"):
        return (set if tag == "set" else frozenset)(decode(plain["v"]))
    if tag == "dataclass":
        return _rebuild_dataclass(plain["class"], decode(plain["fields"]))
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
        raise NotAValue(f"an encoded value names {name}, which is not one of ar_lab's dataclasses")
    out = object.__new__(kind)
    for field, value in fields.items():
        object.__setattr__(out, field, value)
    return out


# -- what never crosses, even as a handle
# -----------------------------------------------------------------


class Unexposed(PermissionError):
    """An object of the grading step's judge (its shell, a module, a frame, a builtin that reads or
    writes files, an object of IPython or Jupyter) that a handle would have handed to the answer
    process (``ar_lab.course.grading.channel``); ``args[1]`` names it."""


# What the judge never hands out as a handle: objects of the modules that run code, reach files,
# processes, the interpreter or the judge's own shell and kernel (a handle's public attributes and
# calls would reach them).
_UNEXPOSED = {
    "IPython",
    "ipykernel",
    "jupyter_client",
    "jupyter_core",
    "nbclient",
    "nbformat",
    "zmq",
    "traitlets",
    "tornado",
    "asyncio",
    "os",
    "posix",
    "sys",
    "subprocess",
    "shutil",
    "pathlib",
    "io",
    "_io",
    "importlib",
    "runpy",
    "code",
    "codeop",
    "pickle",
    "_pickle",
    "marshal",
    "ctypes",
    "socket",
    "_socket",
    "threading",
    "_thread",
    "multiprocessing",
    "inspect",
    "gc",
    "signal",
    "tempfile",
    "sqlite3",
    "_sqlite3",
    "nbgrader",
    "site",
    "pty",
    "fcntl",
    "mmap",
    "resource",
    "sysconfig",
    "glob",
    "fnmatch",
    "zipfile",
    "tarfile",
}


def _owner(obj: Any) -> str:
    """The top-level module an object belongs to: a function's or class's own, a method's
    function's, else its type's."""
    if inspect.ismethod(obj):
        obj = obj.__func__
    if inspect.isbuiltin(obj) and obj.__self__ is not None and not inspect.ismodule(obj.__self__):
        obj = obj.__self__  # a method of an object written in C: the object's
    module = (
        getattr(obj, "__module__", None)
        if (inspect.isroutine(obj) or isinstance(obj, type))
        else None
    )
    if inspect.isbuiltin(obj) and inspect.ismodule(obj.__self__):
        module = obj.__self__.__name__  # open, exec: builtins; os.system: posix
    return str(module or type(obj).__module__ or "").split(".")[0]


def exposable(obj: Any) -> None:
    """Raise ``Unexposed`` unless ``obj`` may be handed to the answer process as a handle: no
    module, frame, code object, traceback or generator, no function that runs code or touches files
    (a builtin of the ``builtins``/``os`` modules: ``open``, ``exec``, ``getattr``), nothing of
    ``_UNEXPOSED``'s modules."""
    what = obj.__name__ if inspect.ismodule(obj) else type(obj).__qualname__
    if inspect.ismodule(obj):
        raise Unexposed(
            f"a module ({obj.__name__}) of the judge's is not handed to your code", f"module {what}"
        )
    if inspect.isframe(obj) or inspect.iscode(obj) or inspect.istraceback(obj):
        raise Unexposed(
            f"an interpreter object ({what}) of the judge's is not handed to your code", what
        )
    if inspect.isbuiltin(obj) and (obj.__self__ is None or inspect.ismodule(obj.__self__)) \
            and _owner(obj) not in {"torch", "math", "_operator", "operator", "numpy"}:
        raise Unexposed(
            f"the judge's builtin {obj.__name__} is not handed to your code",
            f"builtin {obj.__name__}",
        )
    owner = _owner(obj)
    if owner in _UNEXPOSED:
        raise Unexposed(
            f"an object of {owner} ({what}) in the judge is not handed to your code",
            f"{owner} {what}",
        )
