"""Timing: one place for device sync, timers, the steady clock and a machine description.

Every measurement in the course (benchmarks, chapter 04's timings, chapter 05's roofline,
chapter 07's speculative speedups) times work through these functions, so they all wait
for the device the same way and describe the machine the same way. Figures that are
compared are timed in turns with ``interleaved``, so a shared machine's drift hits all alike.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadType, BadValue

Name = TypeVar("Name")  # what names the sides ``interleaved`` compares: a string, a tuple, ...


def default_device() -> torch.device:
    """``cuda`` when a GPU is present, else the CPU (every notebook runs on either)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def checked_device(device: torch.device | str, *, present: bool = True) -> torch.device:
    """``device`` as a ``torch.device`` ar_lab can compute on here: the CPU, or a CUDA GPU torch
    sees.

    One check for every function that takes a device, so "mps", "banana" or "cuda" on a
    machine without a GPU all give the same message instead of an error from deep in torch.
    ``present=False`` accepts "cuda" without a GPU (for questions such as which dtype it would use).
    """
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise BadValue(
            f"device must be like 'cpu' or 'cuda', got {device!r}", arg="device"
        ) from None
    if d.type not in ("cpu", "cuda"):
        raise BadValue(
            f"device must be like 'cpu' or 'cuda', got {str(d)!r} (ar_lab runs on a CPU or a "
            "CUDA GPU)",
            arg="device",
        )
    if d.type == "cuda" and present:
        if not torch.cuda.is_available():
            raise BadValue(
                f"device {str(d)!r} asked for, but torch sees no CUDA GPU here: use 'cpu'",
                arg="device",
            )
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise BadValue(
                f"device {str(d)!r} asked for, but torch sees {torch.cuda.device_count()} CUDA "
                "GPU(s)",
                arg="device",
            )
    return d


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait until ``device`` has finished the work queued on it (a no-op on the CPU).

    A GPU runs asynchronously: without this, a timer measures how fast Python queued the
    kernels, not how long they took.
    """
    if device is None:
        return
    # A torch.device (what model.device gives, in timed loops) needs no check; a string is checked
    # once here.
    if (device if isinstance(device, torch.device) else checked_device(device)).type == "cuda":
        torch.cuda.synchronize(device)


def time_call(
    fn: Callable[[], object],
    *,
    repeats: int = 5,
    warmup: int = 1,
    device: torch.device | str | None = None,
) -> list[float]:
    """Seconds per call of ``fn()``, for each of ``repeats`` calls after ``warmup`` calls.

    On CUDA the time is read from CUDA events recorded around the call (GPU time, not
    launch time); elsewhere from ``time.perf_counter``.
    """
    if not callable(fn):
        raise BadType(
            f"time_call times a function of no arguments (fn), e.g. lambda: model(x); got {fn!r}",
            arg="fn",
        )
    positive_int("repeats", repeats)
    positive_int("warmup", warmup, minimum=0)
    on_cuda = device is not None and checked_device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def interleaved(
    runs: dict[Name, Callable[[], object]],
    rounds: int,
    *,
    warmup: int = 0,
    rotate: bool = True,
    clock: Callable[[], float] | None = None,
    device: torch.device | str | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[Name, list[float]]:
    """Seconds of each call of every function in ``runs``, called in turns: one call of each per
    round.

    The load on a shared machine drifts from second to second; taking turns lets the drift
    hit every side alike, where timing all of one side and then all of the other would not.
    ``warmup`` untimed rounds run first. With ``rotate`` each round starts one side later than
    the round before (A B C, B C A, C A B, ...), so no side always follows the same one; without
    it every round keeps the given order (for pairs where one call must follow another).
    ``clock`` is read around each call, with ``device`` synchronised before and after it (e.g.
    ``steady_clock(device)``, or ``time.perf_counter`` for the wall clock); ``None`` times as
    ``time_call`` does (CUDA events on a CUDA device, else ``time.perf_counter``). ``progress``
    is called with each round's index (from 0, warm-up rounds included) before it runs.
    """
    if not isinstance(runs, dict) or not runs:
        raise BadValue(
            f"runs must be a non-empty dict {{name: function of no arguments}}, got {runs!r}",
            arg="runs",
        )
    for name, fn in runs.items():
        if not callable(fn):
            raise BadType(
                f"runs[{name!r}] must be a function of no arguments, e.g. lambda: model(x); got "
                f"{fn!r}",
                arg="runs",
            )
    positive_int("rounds", rounds)
    positive_int("warmup", warmup, minimum=0)
    if clock is not None and not callable(clock):
        raise BadType(
            f"clock must be a function returning seconds, e.g. time.perf_counter; got {clock!r}",
            arg="clock",
        )
    device = None if device is None else checked_device(device)
    names = list(runs)
    times: dict[Name, list[float]] = {name: [] for name in names}
    for r in range(warmup + rounds):
        if progress is not None:
            progress(r)
        first = r % len(names) if rotate else 0
        for name in names[first:] + names[:first]:
            if r < warmup:
                runs[name]()
            elif clock is None:
                times[name].append(time_call(runs[name], repeats=1, warmup=0, device=device)[0])
            else:
                synchronize(device)
                t0 = clock()
                runs[name]()
                synchronize(device)
                times[name].append(clock() - t0)
    return times


def median(values: list[float]) -> float:
    values = list(values)
    if not values:
        raise BadValue(
            "no values to take the median of (did the measurement run zero times?)", arg="values"
        )
    return statistics.median(values)


def steady_clock(device: torch.device | str = "cpu") -> Callable[[], float]:
    """The clock to time decoding with on ``device``: CPU time of this process when torch
    computes on the CPU with one thread, else the wall clock.

    One thread's CPU time is the wall-clock time the work takes on a quiet machine, and
    other processes cannot inflate it by taking the CPU away (they only delay it); they still can by
    competing for caches and memory bandwidth (appendix A1 measures both). On a GPU,
    or with several threads, only the wall clock measures the work.
    """
    if checked_device(device, present=False).type == "cpu" and torch.get_num_threads() == 1:
        return time.process_time
    return time.perf_counter


def device_name(device: torch.device | str) -> str:
    """The GPU's name, or the CPU's model name as the operating system reports it."""
    device = checked_device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return name


def _version() -> str | None:
    """This package's installed version (read from its metadata: importing ``ar_lab`` here would
    make a cycle, since every module imports this one)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ar_lab")
    except PackageNotFoundError:
        return None


def machine(device: torch.device | str = "cpu") -> dict:
    """What a measurement ran on: device, threads, versions and the date (stored with results)."""
    device = checked_device(device)
    return {
        "device": {
            "type": device.type,
            "name": device_name(device),
            "threads": torch.get_num_threads(),  # CPU threads the measurements ran with
            "cpus": os.cpu_count(),
            # runnable processes, averaged over the last minute (Unix): above the core count, the
            # measurement shared the cores with other work
            "load_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda if device.type == "cuda" else None,
            "ar_lab": _version(),
        },
        "date": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
    }


def machine_line(described: dict | torch.device | str = "cpu") -> str:
    """``machine()`` in one line, for the header of a benchmark's table: of a stored description
    (a dict ``machine`` returned), or of this machine running on a device."""
    m = described if isinstance(described, dict) else machine(described)
    d, v = m["device"], m["versions"]
    return (
        f"{d['name']} ({d['type']}, {d['threads']} of {d['cpus']} threads); torch {v['torch']}, "
        f"python {v['python']}"
    )
