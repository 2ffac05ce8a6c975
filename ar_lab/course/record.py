"""Record a graded test's calls to the learner's code in the kernel; replay them in a fresh process.

A graded test runs in the learner's kernel, where a solution cell can patch the checkers, transform
the test's code or swallow its error. So while grading is on (``AR_LAB_RECORD=1``, which the course
folder's ``nbgrader_config.py`` sets for the kernels ``nbgrader autograde`` starts), every
``no_delegation`` block of a test cell records what the *test's* code exchanged with the learner's
callables: each outermost call's arguments, its result (or the exception it raised), the tensors it
changed in place and PyTorch's random state where the call moved it, and the random state when the
block started. The record goes to ``.ar_lab_grading/<key>.pt`` beside the notebook (``key``: a hash
of the test cell's code), as plain values only (``ar_lab.course.plain``) read back with
``torch.load(..., weights_only=True)``. A value that is not plain (an instance of the learner's class,
an optimizer) makes the record "kernel verdict only": it says so and holds nothing else. From the first
test on, the random state each cell starts with is noted too (``cell-starts.pt``), so that a cell that
draws a test's inputs starts the same in the fresh run, which skips the cells no test needs.

``python -m ar_lab.course.grading`` (the instructor's side) then runs the instructor's test cells in a
fresh kernel with ``AR_LAB_REPLAY`` naming that folder: every solution cell is replaced by
``replay_stub`` objects bound to the same names, which check that the test calls them with the
recorded arguments and hand back the recorded results, in order; each block restores the recorded
random state where it starts. The learner's code never runs there, so the comparison with the
reference values is the instructor's. Normal notebook runs (neither variable set) record nothing.
"""

from __future__ import annotations

import builtins
import hashlib
import inspect
import linecache
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ar_lab.course.library import is_library
from ar_lab.course.plain import NotPlain, decode, encode, same, same_plain

RECORD = "AR_LAB_RECORD"  # "1": record the graded tests' calls (set for the kernels autograde starts)
REPLAY = "AR_LAB_REPLAY"  # a folder of records: replay them (set by the grading command's fresh kernel)
FOLDER = ".ar_lab_grading"
FORMAT = 1
NO_VALUES = "this test's record holds no values: "  # a kernel-only record, why follows
_CO_GENERATORS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


class ReplayMismatch(AssertionError):
    """The fresh run of a test does not match what its record says the kernel's run did."""


class RecordedError(Exception):
    """Stands in for an exception of a type the replay cannot rebuild (named in its message)."""


def recording() -> bool:
    return os.environ.get(RECORD) == "1"


def replaying() -> bool:
    return bool(os.environ.get(REPLAY))


def cell_key(source: str) -> str:
    """The name of a test cell's record: a hash of its code (trailing spaces and blank ends ignored)."""
    text = "\n".join(line.rstrip() for line in source.strip().splitlines())
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def file_key(filename: str) -> str:
    """``cell_key`` of the code compiled from ``filename`` (a notebook cell, as IPython caches it)."""
    return cell_key("".join(linecache.getlines(filename)))


# --- the kernel's side ---------------------------------------------------------------------------


def _parameters(code) -> list[tuple[str, int]]:
    """(name, inspect.Parameter kind) of a function's parameters, from its code object."""
    n_pos, n_kw = code.co_argcount, code.co_kwonlyargcount
    names = code.co_varnames
    out = [(n, 0 if i < code.co_posonlyargcount else 1) for i, n in enumerate(names[:n_pos])]
    at = n_pos + n_kw
    if code.co_flags & inspect.CO_VARARGS:
        out.append((names[at], 2))
        at += 1
    out += [(n, 3) for n in names[n_pos:n_pos + n_kw]]
    if code.co_flags & inspect.CO_VARKEYWORDS:
        out.append((names[at], 4))
    return out


def _raised(frame) -> bool:
    """At a profile ``return`` event: is the frame left by an exception (not by a return statement)?"""
    import dis

    op = dis.opname[frame.f_code.co_code[frame.f_lasti]]
    return op not in ("RETURN_VALUE", "RETURN_CONST")


def _changed(recorded: dict, live: Any) -> bool:
    """Has the call changed this tensor, model or generator argument since it was recorded?"""
    if isinstance(live, torch.Tensor):  # compared in place: no copy for the (usual) unchanged tensor
        return live.dtype != recorded["t"].dtype or not torch.equal(live.detach().cpu(), recorded["t"])
    return not same_plain(recorded, encode(live, argument=True))


class CellRecord:
    """What one test cell exchanged with the learner's code, in order (see the module's docstring)."""

    def __init__(self, key: str, path: Path):
        self.key, self.path = key, path
        self.events: list[dict] = []
        self.kernel_only: str | None = None
        self.pending: dict[int, tuple] = {}  # id(frame) -> (event, live tensor arguments, random state)

    def give_up(self, why: str) -> None:
        self.kernel_only, self.events, self.pending = why, [], {}

    def enter(self) -> None:
        if self.kernel_only is None:
            self.events.append({"kind": "enter", "rng": torch.get_rng_state()})

    def call(self, frame) -> None:
        """A learner's callable entered from the test's code: note its arguments."""
        code = frame.f_code
        if self.kernel_only is not None:
            return
        if code.co_flags & _CO_GENERATORS:
            return self.give_up(f"`{code.co_name}` is a generator or coroutine")
        params = _parameters(code)
        local = frame.f_locals
        try:
            args = {name: encode(local[name], argument=True) for name, _ in params}
        except NotPlain as e:
            return self.give_up(f"an argument of `{code.co_name}` is {e}")
        mutable = (torch.Tensor, torch.nn.Module, torch.Generator)
        tensors = {name: local[name] for name, _ in params if isinstance(local[name], mutable)}
        event = {"kind": "call", "name": code.co_name, "params": params, "args": args}
        self.pending[id(frame)] = (event, tensors, torch.get_rng_state())

    def returned(self, frame, value: Any, error: BaseException | None) -> None:
        """The call ``frame`` ran ended: note its result (or ``error``, the exception it raised, if the frame
        was left by one), the tensor arguments it changed, and the random state if the call moved it."""
        event, tensors, rng = self.pending.pop(id(frame), (None, None, None))
        if event is None or self.kernel_only is not None:
            return
        try:
            if _raised(frame):
                event["raised"] = (type(error).__module__, type(error).__qualname__, str(error)) if error else None
            else:
                event["value"] = encode(value)
            event["changed"] = {
                name: encode(t, argument=True) for name, t in tensors.items() if _changed(event["args"][name], t)
            }
        except NotPlain as e:
            return self.give_up(f"`{event['name']}` returned {e}")
        changed = [name for name in event["changed"] if isinstance(tensors[name], torch.nn.Module)]
        if changed:
            return self.give_up(f"`{event['name']}` changed the model passed to it as `{changed[0]}`")
        after = torch.get_rng_state()
        event["rng"] = None if torch.equal(after, rng) else after
        self.events.append(event)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"format": FORMAT, "key": self.key, "kernel_only": self.kernel_only, "events": self.events}
        torch.save(data, self.path)
        torch.save({"format": FORMAT, "starts": dict(_STARTS)}, self.path.parent / STARTS)


_CELLS: dict[str, tuple[int, CellRecord]] = {}  # a test cell's compiled file name -> (its run, its record)
_STARTS: dict[str, torch.Tensor] = {}  # a cell's key -> PyTorch's random state when it last started
STARTS = "cell-starts.pt"  # where they are saved, beside the records


def _run() -> int:
    """IPython's execution count (a cell run again starts a new record), or 0 outside IPython."""
    return getattr(_shell(), "execution_count", 0)


def _shell():
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


def _cell_starts(info) -> None:
    """IPython's ``pre_run_cell``, while recording: PyTorch's random state as each cell starts, by its code.
    A cell that draws a test's inputs at random (chapter 02's q, k, v) can then start in the fresh run where
    it started in the kernel, though the fresh run skips cells before it."""
    if recording():
        _STARTS[cell_key(info.raw_cell)] = torch.get_rng_state()


def cell_record(test_file: str) -> CellRecord:
    """The record of this run of the test cell compiled as ``test_file``, saved in ``./.ar_lab_grading/``.
    The first one also starts noting each later cell's random state (``_cell_starts``)."""
    shell = _shell()
    if shell is not None and _cell_starts not in shell.events.callbacks["pre_run_cell"]:
        shell.events.register("pre_run_cell", _cell_starts)
    run, found = _CELLS.get(test_file, (None, None))
    if found is None or run != _run():
        key = file_key(test_file)
        found = CellRecord(key, Path.cwd() / FOLDER / f"{key}.pt")
        _CELLS[test_file] = (_run(), found)
    return found


def forget() -> None:
    """Drop the records and replays held in this process (tests call it between runs of the same code)."""
    _CELLS.clear()
    _STARTS.clear()
    _REPLAY.clear()


# --- the fresh process's side --------------------------------------------------------------------


def load(path: Path) -> dict:
    """A record file, read without running pickled code; raises ``ReplayMismatch`` if it is not one."""
    try:
        data = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise ReplayMismatch(f"no record of this test's calls ({path.name}): the test did not run to its record "
                             "in the kernel, or the record was removed") from None
    except Exception as e:  # a corrupt file, or one holding objects that are not plain data
        raise ReplayMismatch(f"the record {path.name} cannot be read as plain data: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("events"), list):
        raise ReplayMismatch(f"{path.name} is not a record of this course's grading (format {FORMAT})")
    if data["kernel_only"] is not None:
        raise ReplayMismatch(NO_VALUES + data["kernel_only"])
    return data


class _Replay:
    def __init__(self, folder: Path):
        self.folder = folder
        self.records: dict[str, tuple[list, list]] = {}  # key -> (events, [position])

    def events(self, key: str) -> tuple[list, list]:
        if key not in self.records:
            self.records[key] = (load(self.folder / f"{key}.pt")["events"], [0])
        return self.records[key]

    def next(self, key: str, kind: str, what: str) -> dict:
        events, at = self.events(key)
        if at[0] >= len(events) or events[at[0]].get("kind") != kind:
            found = "nothing more" if at[0] >= len(events) else f"a {events[at[0]].get('kind')}"
            raise ReplayMismatch(f"{what} is event {at[0]} of this test, but its record has {found} there: "
                                 "the kernel's run of the test was not this one")
        at[0] += 1
        return events[at[0] - 1]


_REPLAY: dict[str, _Replay] = {}


def _replay() -> _Replay:
    folder = os.environ[REPLAY]
    return _REPLAY.setdefault(folder, _Replay(Path(folder)))


def replay_enter(test_file: str) -> None:
    """A block of the test cell ``test_file`` starts: restore the random state its record holds."""
    torch.set_rng_state(_replay().next(file_key(test_file), "enter", "a no_delegation block")["rng"])


def _test_file() -> str:
    frame = sys._getframe(2)
    while frame is not None and is_library(frame.f_code.co_filename):
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else "<no notebook code>"


def _rebuild(module: str, name: str, message: str) -> BaseException:
    kind = getattr(builtins, name, None) if module == "builtins" else None
    if module == "ar_lab.course.checks":  # loaded: the test that raised it imported it
        kind = getattr(sys.modules.get(module), name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message)
        except Exception:
            pass
    return RecordedError(f"{module}.{name}: {message}")


class ReplayStub:
    """Stands in for a learner's callable named ``name``: each call is checked against the next call in the
    test cell's record (same arguments as passed) and gets its recorded result or exception."""

    def __init__(self, name: str):
        self.__name__ = self.__qualname__ = name

    def __repr__(self) -> str:
        return f"<recorded answer {self.__name__}>"

    def __call__(self, *args, **kwargs):
        event = _replay().next(file_key(_test_file()), "call", f"a call of `{self.__name__}`")
        kinds = [inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                 inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD]
        unset = object()
        signature = inspect.Signature([
            inspect.Parameter(n, kinds[k], default=unset if kinds[k] not in (kinds[2], kinds[4]) else inspect._empty)
            for n, k in event["params"]
        ])
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError as e:
            raise ReplayMismatch(f"`{self.__name__}` gets arguments its recorded call does not take: {e}") from None
        for name, value in bound.items():
            if not same(event["args"][name], value):
                raise ReplayMismatch(f"`{self.__name__}` gets another `{name}` than in the kernel's run of the test "
                                     "(a cell the test takes its inputs from was changed, or the record is not "
                                     "this test's)")
        for name, plain in event["changed"].items():  # tensors changed in place, generators moved on
            if isinstance(bound.get(name), torch.Generator):
                bound[name].set_state(plain["state"])
            elif name in bound:
                with torch.no_grad():
                    bound[name].copy_(decode(plain))
        if event["rng"] is not None:
            torch.set_rng_state(event["rng"])
        if "raised" in event:
            if event["raised"] is None:
                raise RecordedError(f"`{self.__name__}` raised an exception the record could not name")
            raise _rebuild(*event["raised"])
        return decode(event["value"])


def replay_cell_starts() -> None:
    """In the fresh kernel (the replay notebook's first cell): start each later cell whose code the kernel
    ran with the random state it started with there (a missing or unreadable file leaves the state alone)."""
    try:
        starts = torch.load(Path(os.environ[REPLAY]) / STARTS, weights_only=True)["starts"]
    except Exception:
        return

    def restore(info) -> None:
        state = starts.get(cell_key(info.raw_cell))
        if isinstance(state, torch.Tensor):
            torch.set_rng_state(state)

    _shell().events.register("pre_run_cell", restore)


def replay_stub(name: str) -> ReplayStub:
    return ReplayStub(name)


def replay_finished(key: str) -> None:
    """After a test cell's fresh run: its record exists and every recorded event was replayed."""
    events, at = _replay().events(key)
    if at[0] != len(events):
        raise ReplayMismatch(f"the test's fresh run made {at[0]} of the {len(events)} calls its record holds: "
                             "the kernel's run of the test was not this one")
