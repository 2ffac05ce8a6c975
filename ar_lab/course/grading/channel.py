"""The two processes of a graded test, talking: the judge (the instructor's test) and the answer
process (the learner's cells, ``ar_lab.course.grading.sandbox``).

The two talk over a pair of pipes (``Channel``). Plain values (``plain.encode``: numbers, tensors,
lists, dicts, ar_lab's dataclasses) cross by value; anything else stays in the process that made it
and the other side holds a ``Remote`` handle, whose calls, public attributes, items, length and
iteration go back to it. The test calls the learner's functions and builds and uses the learner's
classes through handles; the learner's code uses what the test hands it (a model, a server) the same
way. A request from the answer process for a private attribute, or one that reaches a forbidden
reference in the judge, is refused (and the test fails: ``Channel.refused``). A tensor crosses as a
copy whose in-place changes (a cache written into, say) go back to the original with the next
message; one tensor sent again arrives as the same copy (tied weights stay tied), and a view of a
copy comes back as the same view of the original (a cache's returned prefix shares the buffer):
``lending``, which also takes back a write into a copy the code has dropped, one through ``.data``,
and one into a temporary of the sender's that shares the original's storage (``state_dict()``'s
tensors). A random generator handed over is copied once, and the states of both copies, torch's
global random state, grad mode and the thread count travel with every message, so the two processes
draw and compute as one would. Only plain data is ever unpickled (``_PlainUnpickler``: tensors as
dtype, shape and bytes): the learner's process cannot run code in the judge's.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import pickle
import struct
import sys
import weakref
from typing import Any

import torch

from ar_lab.course.grading import plain
from ar_lab.course.grading.lending import Ledger

_TAG = "__ar_lab_sandbox__"
_OPS = {"call", "getattr", "setattr", "getitem", "len", "list", "next", "bool"}  # either side asks
# what only the judge may ask (the answer process serves them)
_JUDGE_OPS = {"run", "bind", "name", "close"}
# the private attributes a handle reads: a function's or a class's name
_NAMES = {"__name__", "__qualname__"}
WITHHELD = "is withheld while this exercise is graded: the exercise asks you to write it yourself"


class AnswerRaised(Exception):
    """The learner's code raised an exception of a class the judge cannot rebuild (one it defined,
    say)."""


class AnswerGone(RuntimeError):
    """The answer process ended, or broke the protocol, before it replied."""


class Refused(PermissionError):
    """A request from the answer process that the judge does not serve (a private name, a forbidden
    reference)."""

# "channel", "process", "folder": the answer process now running (sandbox.start)
CURRENT: dict[str, Any] = {}


def current() -> Channel:
    if "channel" not in CURRENT:
        raise AnswerGone("no answer process is running: answer_process(...) starts one")
    return CURRENT["channel"]


# -- the channel
# ----------------------------------------------------------------------------------------


class Remote:
    """A handle on an object of the other process: calls, public attributes, items, ``len``,
    iteration and truth go there. ``name``: a name in the answer's namespace (the judge's handle on
    the learner's answer, resolved in whichever answer process is running when it is used)."""

    __slots__ = ("_channel", "_id", "_kind", "_name", "_module")

    def __init__(self, channel: Channel | None, id: int | None, kind: str, name: str | None = None,
                 module: bool = False):
        for slot, value in (
            ("_channel", channel),
            ("_id", id),
            ("_kind", kind),
            ("_name", name),
            ("_module", module),
        ):
            object.__setattr__(self, slot, value)

    def _ask(self, op: str, *args: Any) -> Any:
        channel = self._channel or current()
        return channel.request(op, self, *args)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") and name not in _NAMES:
            raise AttributeError(
                f"{self._kind} of the other process: its private attribute {name!r} is not shared"
            )
        return self._ask("getattr", name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            raise AttributeError(
                f"{self._kind} of the other process: its private attribute {name!r} is not shared"
            )
        self._ask("setattr", name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._ask("call", args, kwargs)

    def __getitem__(self, key: Any) -> Any:
        return self._ask("getitem", key)

    def __len__(self) -> int:
        return self._ask("len")

    def __iter__(self):
        return iter(self._ask("list"))

    def __next__(self) -> Any:  # next(model.parameters()): the other side's iterator moves on
        return self._ask("next")

    def __bool__(self) -> bool:
        return self._ask("bool")

    def __repr__(self) -> str:
        return (
            f"<{self._name or self._kind}, in the answer process>"
            if self._name
            else f"<{self._kind}, remote>"
        )


class RemoteModule(torch.nn.Module):
    """A ``torch.nn.Module`` of the other process set as a layer of a module here (the test hands
    the learner's model its own blocks, say): calling it runs the other's ``forward``; iteration,
    ``len``, items and public attributes it does not hold itself go there too. It holds no
    parameters here."""

    def __init__(self, remote: Remote):
        super().__init__()
        object.__setattr__(self, "_remote", remote)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._remote(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") and name not in _NAMES:
                raise
            return getattr(self._remote, name)

    def __iter__(self):
        return iter(self._remote)

    def __len__(self) -> int:
        return len(self._remote)

    def __getitem__(self, key: Any) -> Any:
        return self._remote[key]

    def __repr__(self) -> str:
        return f"<{self._remote._kind}, remote>"


def _exception(module: str, qualname: str, message: str) -> BaseException:
    """The learner's exception, rebuilt in the judge: a builtin or ar_lab class by name, else
    ``AnswerRaised``."""
    import builtins

    kind = getattr(builtins, qualname, None) if module == "builtins" else None
    if kind is None and module.split(".")[0] == "ar_lab" and module in sys.modules:
        kind = getattr(sys.modules[module], qualname, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        error = kind.__new__(kind)
        Exception.__init__(error, message)
        return error
    return AnswerRaised(f"{qualname}: {message}")


def _tensor_bytes(obj: Any) -> tuple | None:
    """How ``Channel._send`` pickles a tensor: its dtype's name, shape and bytes (a CPU copy,
    contiguous)."""
    if not isinstance(obj, torch.Tensor):
        return None
    t = obj.detach().to("cpu").contiguous()
    return (
        str(t.dtype).removeprefix("torch."),
        tuple(t.shape),
        t.reshape(-1).view(torch.uint8).numpy().tobytes(),
    )


class _PlainUnpickler(pickle.Unpickler):
    """Reads what ``Channel._send`` pickled: containers, strings and numbers, and tensors rebuilt
    from their dtype, shape and bytes (``_tensor_bytes``). No class is ever looked up, so no code
    can run."""

    def persistent_load(self, pid: Any) -> torch.Tensor:
        dtype = getattr(torch, pid[0], None) if type(pid) is tuple and len(pid) == 3 else None
        if (
            not isinstance(dtype, torch.dtype)
            or type(pid[2]) is not bytes
            or type(pid[1]) is not tuple
        ):
            raise pickle.UnpicklingError(f"not a tensor: {str(pid)[:80]}")
        shape = torch.Size(pid[1])
        if not pid[2]:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(pid[2]), dtype=torch.uint8).view(dtype).reshape(shape)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "complex"):
            return complex
        raise pickle.UnpicklingError(f"a message names {module}.{name}: only plain data may cross")


class Channel:
    """One side of the pipe pair between the judge and an answer process (see the module's
    docstring).

    ``request`` sends a request and serves the other side's requests (its callbacks) until the reply
    comes; ``serve`` (the answer process) serves until told to close. ``refuse``: objects no request
    from the other side may reach (the judge's forbidden references); ``refused`` lists what was
    refused."""

    def __init__(self, read_fd: int, write_fd: int, *, refuse: tuple = (), judge: bool = True):
        self.reader, self.writer = os.fdopen(read_fd, "rb"), os.fdopen(write_fd, "wb")
        self.objects: dict[int, Any] = {}  # id -> the objects handed to the other side (kept alive)
        # id -> a generator of this side's that the other side uses
        self.owned: dict[int, weakref.ref] = {}
        # the other side's id -> this side's copy of its generator
        self.copies: dict[int, torch.Generator] = {}
        self.known: dict = {}  # the random states both sides know (see _states)
        self.ledger = Ledger()  # tensors lent as copies, and copies held: their writes go back
        self.refuse = {id(obj): name for name, obj in refuse}
        self.refused: list[str] = []
        self.judge = judge
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}

    # plain data both ways; handles for the rest
    def _out(self, value: Any) -> Any:
        if isinstance(value, RemoteModule):
            value = value._remote
        if isinstance(value, Remote) and value._channel is self:
            return {_TAG: "yours", "id": value._id}
        if isinstance(value, Remote):
            return {_TAG: "name", "name": value._name}
        if type(value) is torch.Generator and value.device.type == "cpu":
            theirs = next((gid for gid, g in self.copies.items() if g is value), None)
            if theirs is not None:
                return {_TAG: "generator", "gid": theirs, "yours": True}
            self.owned[id(value)] = weakref.ref(value)
            return {_TAG: "generator", "gid": id(value), "state": value.get_state()}
        if type(value) in (list, tuple):
            return type(value)(self._out(v) for v in value)
        # an OrderedDict too
        if isinstance(value, dict) and all(type(k) in (str, int) for k in value):
            return {k: self._out(v) for k, v in value.items()}
        try:
            data = plain.encode(value)
        except plain.NotPlain:
            # the judge hands the answer process its test's objects, nothing of its own machinery
            if self.judge:
                plain.exposable(value)
            self.objects[id(value)] = value
            kind = type(value).__qualname__
            return {
                _TAG: "mine",
                "id": id(value),
                "kind": kind,
                "module": isinstance(value, torch.nn.Module),
            }
        if isinstance(value, torch.Tensor):  # lent: the copy's in-place changes come back (lending)
            return {_TAG: "value", "v": data, **self.ledger.lend(value)}
        return {_TAG: "value", "v": data}

    def _in(self, data: Any) -> Any:
        if type(data) in (list, tuple):
            return type(data)(self._in(v) for v in data)
        if type(data) is not dict:
            return data
        tag = data.get(_TAG)
        if tag is None:
            return {k: self._in(v) for k, v in data.items()}
        if tag == "yours":
            if data["id"] not in self.objects:
                raise AnswerGone("a handle on an object this process never handed out")
            return self.objects[data["id"]]
        if tag == "mine":
            return Remote(self, data["id"], str(data["kind"]), module=data.get("module") is True)
        if tag == "name":
            if (
                self.judge
                or not isinstance(data["name"], str)
                or data["name"] not in self.namespace
            ):
                raise NameError(f"name {data['name']!r} is not defined (by your answer cells)")
            return self.namespace[data["name"]]
        if tag == "generator":
            if data.get("yours"):
                g = self.owned.get(data["gid"], lambda: None)()
                if g is None:
                    raise AnswerGone("a generator this process no longer holds")
                return g
            if data["gid"] not in self.copies:
                self.copies[data["gid"]] = torch.Generator()
                self.copies[data["gid"]].set_state(data["state"])
            return self.copies[data["gid"]]
        value = plain.decode(data["v"])
        if not isinstance(value, torch.Tensor):
            return value
        return self.ledger.borrow(value, data.get("lent"), data.get("view"))

    def _states(self) -> dict:
        """The random states that changed since both sides last knew them: torch's global one and
        each shared generator's (``("sender", id)``: one of the sender's; ``("receiver", id)``: a
        copy of the receiver's)."""
        live = {gid: g for gid, ref in self.owned.items() if (g := ref()) is not None}
        current = {"rng": torch.get_rng_state()}
        current |= {("sender", gid): g.get_state() for gid, g in live.items()}
        current |= {("receiver", gid): g.get_state() for gid, g in self.copies.items()}
        changed = {
            k: v
            for k, v in current.items()
            if k not in self.known or not torch.equal(v, self.known[k])
        }
        self.known.update(changed)
        return changed

    def _send(self, message: tuple) -> None:
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, protocol=4)
        pickler.persistent_id = _tensor_bytes
        state = (torch.is_grad_enabled(), torch.get_num_threads(), self._states(),
                 self.ledger.returns())
        pickler.dump((*state, message))
        data = buffer.getvalue()
        try:
            self.writer.write(struct.pack("<Q", len(data)) + data)
            self.writer.flush()
        except BrokenPipeError:
            raise AnswerGone("the answer process ended") from None

    def _receive(self) -> tuple:
        head = self.reader.read(8)
        if len(head) < 8:
            raise AnswerGone("the answer process ended")
        data = self.reader.read(struct.unpack("<Q", head)[0])
        grad, threads, states, returns, message = _PlainUnpickler(io.BytesIO(data)).load()
        torch.set_grad_enabled(bool(grad))
        if (
            type(threads) is int
            and threads != torch.get_num_threads()
            and 0 < threads <= (os.cpu_count() or 1)
        ):
            # the two sides compute on as many threads, as in one process
            torch.set_num_threads(threads)
        self.ledger.take_back(returns)  # what the other side wrote in place into its copies
        for key, state in states.items():
            if key == "rng":
                torch.set_rng_state(state)
                self.known["rng"] = state
                continue
            side, gid = key
            g = self.copies.get(gid) if side == "sender" else self.owned.get(gid, lambda: None)()
            if g is not None:
                g.set_state(state)
                self.known[("receiver" if side == "sender" else "sender", gid)] = state
        return message

    def request(self, op: str, target: Any, *args: Any) -> Any:
        self._send(("request", op, self._out((target, *args))))
        while True:
            message = self._receive()
            if message[0] == "request":
                self._serve(*message[1:])
                continue
            _, ok, value = message
            if ok:
                return self._in(value)
            raise _exception(*value)

    def _serve(self, op: str, payload: Any) -> None:
        try:
            if op not in _OPS and not (op in _JUDGE_OPS and not self.judge):
                raise Refused(f"no request {op!r} is served here")
            target, *args = self._in(payload)
            result = self._apply(op, target, args)
            ok, value = True, self._out(result)
        except BaseException as e:  # the other side gets it back (a learner's SystemExit too)
            if isinstance(e, KeyboardInterrupt):
                raise
            if isinstance(e, plain.Unexposed) and self.judge:
                self.refused.append(str(e.args[1]))
            ok, value = False, (type(e).__module__, type(e).__qualname__, str(e))
        self._send(("reply", ok, value))

    def _apply(self, op: str, target: Any, args: list) -> Any:
        if op == "run":
            exec(compile(args[0], "<answer cell>", "exec"), self.namespace)
            return None
        if op == "bind":
            self.namespace.update(args[0])
            return None
        self._check(target, op)
        if (
            op in ("getattr", "setattr")
            and (not isinstance(args[0], str) or args[0].startswith("_"))
            and not (op == "getattr" and args[0] in _NAMES)
        ):
            raise Refused(f"{type(target).__qualname__}: its private attributes are not shared")
        if op == "getattr":
            result = getattr(target, args[0])
        elif op == "setattr":
            value = args[1]
            if isinstance(target, torch.nn.Module) and isinstance(value, Remote) and value._module:
                # a layer of the other side's, set in a module of this one
                value = RemoteModule(value)
            result = setattr(target, args[0], value)
        elif op == "call":
            result = target(*args[0], **args[1])
        elif op == "getitem":
            result = target[args[0]]
        elif op == "len":
            result = len(target)
        elif op == "list":
            result = list(target)
        elif op == "next":
            result = next(target)
        else:
            result = bool(target)
        self._check(result, "")
        return result

    def _check(self, obj: Any, op: str) -> None:
        """Refuse (and note) a forbidden reference reached from the other side: the object itself, a
        bound method of it, or a call of an instance of a forbidden class (its ``forward``) or of
        its bound forward."""
        owner = getattr(obj, "__self__", None)
        calls_instance = op == "call" and (
            not inspect.isroutine(obj)
            or (getattr(obj, "__name__", "") == "forward" and owner is not None)
        )
        kinds = type(owner if inspect.ismethod(obj) else obj).__mro__ if calls_instance else ()
        for candidate in (obj, getattr(obj, "__func__", None), *kinds):
            if candidate is not None and id(candidate) in self.refuse:
                name = self.refuse[id(candidate)]
                self.refused.append(name)
                raise Refused(f"`{name}` {WITHHELD}")

    def serve(self) -> None:
        """The answer process's loop: serve the judge's requests until it closes the channel."""
        while True:
            message = self._receive()
            if message[0] != "request":
                raise AnswerGone("a reply when no request was made")
            if message[1] == "close":
                return
            self._serve(*message[1:])

    def close(self) -> None:
        try:
            self._send(("request", "close", self._out((None,))))
        except (OSError, AnswerGone):
            pass
        for end in (self.reader, self.writer):
            # a writer still holding what a dead process did not read
            with contextlib.suppress(OSError):
                end.close()
