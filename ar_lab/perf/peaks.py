"""The two roofs of chapter 05's roofline, measured on this machine now.

The compute roof is the fastest dense matmul (``measure_matmul_peak``); the
bandwidth slope is the fastest stream through a buffer far larger than the caches
(``measure_bandwidth``, over the kernels of ``streaming_kernels``). ``measure_peaks``
measures both in the form a roofline result stores them. Each roof is the fastest
repeat: the best this machine demonstrably did for this program; the medians are
reported beside them. ``stream_probe`` and ``matmul_probe`` are chapter 05's exercise (one
``c = a + b`` stream, one matmul, each returning its count and its fastest time). On a CPU
the numbers are fp32, on CUDA bf16 (fp16 before compute capability 8.0: ``default_dtype``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadValue
from ar_lab.base.timing import checked_device, default_device, interleaved, steady_clock, time_call


def checked_peaks(peaks, where: str = "peaks", *, arg: str = "peaks") -> dict:
    """``peaks`` if it holds both roofs as positive finite numbers (the form ``measure_peaks``
    returns); else a BadValue for the argument ``arg`` (``where``, which the message names, must
    contain it)."""
    if not isinstance(peaks, dict):
        raise BadValue(
            f"{where} must be a dict like measure_peaks() returns, got {type(peaks).__name__}",
            arg=arg,
        )
    for k in ("matmul_flops_per_s", "bandwidth_bytes_per_s"):
        v = peaks.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise BadValue(f"{where}.{k} must be a positive number, got {v!r}", arg=arg)
    return peaks


def default_dtype(device: torch.device | str) -> torch.dtype:
    """fp32 on CPU (what its matmul kernels are fastest at); bf16 on a GPU (its tensor cores), fp16
    on a present GPU of compute capability below 8.0 (a T4, a V100: tensor cores for fp16, none for
    bf16, which runs there far below the datasheet's 16-bit roof)."""
    d = checked_device(device, present=False)
    if d.type != "cuda":
        return torch.float32
    if torch.cuda.is_available() and torch.cuda.get_device_capability(d) < (8, 0):
        return torch.float16
    return torch.bfloat16


def cache_bytes() -> int | None:
    """The largest CPU cache this machine reports (usually the L3), or None if unknown."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return max(sizes) if sizes else None


def measure_matmul_peak(
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    *,
    size: int | None = None,
    repeats: int = 5,
) -> dict:
    """Dense square matmul FLOP/s (2 n^3 FLOPs per n x n product): the compute roof.

    The roof is the *fastest* repeat (the best the machine demonstrably did: on a shared
    machine the slower repeats measure the neighbours); the median is reported beside it.
    """
    device = default_device() if device is None else checked_device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    size = (8192 if device.type == "cuda" else 2048) if size is None else positive_int("size", size)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    out = torch.empty(size, size, device=device, dtype=dtype)
    times = time_call(lambda: torch.mm(a, b, out=out), repeats=repeats, warmup=2, device=device)
    flops = 2.0 * size**3
    return {
        "flops_per_s": flops / min(times),
        "flops_per_s_median": flops / statistics.median(times),
        "size": size,
        "times": times,
    }


def stream_probe(
    n: int,
    repeats: int = 5,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[int, float]:
    """``c = a + b`` over three arrays of ``n`` random values: (bytes one call moves, seconds of its
    fastest call).

    The bytes are every array read or written once (STREAM's count: 3 n values). Chapter 05's
    learner writes this probe; this one stands in until theirs passes its test, and is what the test
    times theirs beside. On a CPU a write may cost a read too (the line is fetched before it is
    written), which the count leaves out, so a read-only stream can go faster than this one's
    figure.
    """
    device = default_device() if device is None else checked_device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    g = torch.Generator(device=device).manual_seed(0)
    a, b, c = (
        torch.rand(positive_int("n", n), device=device, dtype=dtype, generator=g) for _ in range(3)
    )
    times = time_call(lambda: torch.add(a, b, out=c), repeats=repeats, warmup=1, device=device)
    return 3 * a.nbytes, min(times)


def matmul_probe(
    m: int, k: int, n: int, repeats: int = 5, *, device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[int, float]:
    """An (m, k) by (k, n) matmul: (FLOPs of one product, 2 m k n; seconds of its fastest call).

    Chapter 05's learner writes this probe; this one stands in until theirs passes its test."""
    device = default_device() if device is None else checked_device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    g = torch.Generator(device=device).manual_seed(0)
    sizes = [positive_int(name, v) for name, v in (("m", m), ("k", k), ("n", n))]
    a = torch.rand(sizes[0], sizes[1], device=device, dtype=dtype, generator=g)
    b = torch.rand(sizes[1], sizes[2], device=device, dtype=dtype, generator=g)
    out = torch.empty(sizes[0], sizes[2], device=device, dtype=dtype)
    times = time_call(lambda: torch.mm(a, b, out=out), repeats=repeats, warmup=1, device=device)
    return 2 * m * k * n, min(times)


def default_buffer_bytes(device: torch.device | str) -> int:
    """A streaming buffer far larger than the caches: 4 GiB on a GPU; max(1 GiB, 4 x L3) on a
    CPU."""
    if checked_device(device, present=False).type == "cuda":
        return 4 * 2**30
    return max(2**30, 4 * (cache_bytes() or 0))


def measure_bandwidth(
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    *,
    nbytes: int | None = None,
    repeats: int = 5,
) -> dict:
    """Streaming memory bandwidth (bytes/s) over one buffer of ``nbytes`` (far larger than the
    caches).

    Four kernels, each touching the whole buffer once per call, counted the way
    STREAM counts them (bytes the program asks to read plus bytes it writes):
    ``copy`` (second half = first half), ``add`` (last third = first + second third),
    ``read`` (sum of everything) and ``matvec`` (the buffer as a matrix times a vector
    of ones: a read-only stream through the BLAS library's best-tuned loop, which on a
    single CPU core often pulls more bandwidth than the others). The bandwidth roof is
    the fastest repeat of the fastest kernel: the best this memory system demonstrably
    delivered to this program (medians are reported beside it).
    """
    device = default_device() if device is None else checked_device(device)
    kernels, buffer_bytes = streaming_kernels(device, dtype, nbytes=nbytes)
    by_kernel, by_kernel_median, times_by_kernel = {}, {}, {}
    for name, (fn, moved) in kernels.items():
        times = time_call(fn, repeats=repeats, warmup=1, device=device)
        by_kernel[name] = moved / min(times)
        by_kernel_median[name] = moved / statistics.median(times)
        times_by_kernel[name] = times
    best = max(by_kernel, key=by_kernel.get)
    return {
        "bytes_per_s": by_kernel[best],
        "kernel": best,
        "by_kernel": by_kernel,
        "by_kernel_median": by_kernel_median,
        "times": times_by_kernel,
        "buffer_bytes": buffer_bytes,
    }


def streaming_kernels(
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    *,
    nbytes: int | None = None,
) -> tuple[dict[str, tuple[Callable[[], object], int]], int]:
    """The bandwidth kernels over one fresh buffer: ({name: (function, bytes moved per call)},
    buffer bytes)."""
    device = default_device() if device is None else checked_device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    nbytes = default_buffer_bytes(device) if nbytes is None else positive_int("nbytes", nbytes)
    item = torch.empty((), dtype=dtype).element_size()
    n = (nbytes // item) // 6 * 6  # divisible into halves and thirds
    if n < 6:
        raise BadValue(f"nbytes={nbytes} is too small for a bandwidth measurement", arg="nbytes")
    buf = torch.ones(n, device=device, dtype=dtype)  # written once: the pages are really there
    half, third = buf.view(2, n // 2), buf.view(3, n // 3)
    cols = min(4096, n)
    matrix, ones = (
        buf[: n // cols * cols].view(-1, cols),
        torch.ones(cols, device=device, dtype=dtype),
    )
    kernels = {
        "copy": (lambda: half[1].copy_(half[0]), n * item),
        "add": (lambda: torch.add(third[0], third[1], out=third[2]), n * item),
        "read": (lambda: buf.sum(), n * item),
        "matvec": (lambda: torch.mv(matrix, ones), matrix.numel() * item),
    }
    return kernels, n * item


# the smallest read reads_from_memory times: 1 MiB takes long enough that a call's overhead
MIN_READ_BYTES = 2**20
# does not set its rate, and fits in every CPU's L2 or L3 (a smaller buffer cannot tell a cache from
# memory)


def reads_from_memory(
    nbytes: int,
    *,
    reference: int | None = None,
    repeats: int = 5,
    device: torch.device | str | None = None,
) -> dict:
    """Whether reading ``nbytes`` streams from main memory on this machine, measured rather than
    taken from the cache size it reports (a virtual machine may report its host socket's whole L3,
    which other cores and tenants share): one matrix-vector product over ``nbytes``
    (``streaming_kernels``' "matvec") beside one over a ``reference`` buffer (by default twice as
    many bytes and at least 1 GiB), in turns (``interleaved``: a busy spell slows both), the fastest
    of ``repeats`` calls each, on one thread on a CPU and timed by its CPU time (``steady_clock``:
    the time other processes take is not counted). A buffer that a cache holds reads faster than the
    reference; one that comes from memory reads at its rate.

    Returns {"bytes_per_s", "reference_bytes_per_s", "reference_bytes", "from_memory"}:
    ``from_memory`` when the first rate is at most 15 % above the reference's. A neighbour on a
    shared host can slow either read for a whole measurement, so the verdict is the majority of up
    to three such measurements (it stops when two agree) and the rates are those of the last
    measurement, which agrees with it. ``nbytes`` must be at least ``MIN_READ_BYTES`` (below, a
    call's fixed cost sets its rate, which then looks as slow as memory), and ``reference`` at least
    twice ``nbytes`` (a buffer the same size reads at the same rate wherever it comes from): a
    ``BadValue`` otherwise.
    """
    nbytes = positive_int("nbytes", nbytes, minimum=MIN_READ_BYTES)
    repeats = positive_int("repeats", repeats)
    if reference is None:
        reference = max(2 * nbytes, 2**30)
    reference = positive_int("reference", reference, minimum=2 * nbytes)
    device = default_device() if device is None else checked_device(device)
    sizes = {"buffer": nbytes, "reference": reference}
    kernels = {
        name: streaming_kernels(device, nbytes=size)[0]["matvec"] for name, size in sizes.items()
    }
    runs = {name: fn for name, (fn, _) in kernels.items()}
    votes = []
    while max(votes.count(True), votes.count(False)) < 2:
        times = _one_thread_turns(runs, repeats, device)
        rate = {name: moved / min(times[name]) for name, (_, moved) in kernels.items()}
        votes.append(rate["buffer"] <= 1.15 * rate["reference"])
    return {
        "bytes_per_s": rate["buffer"],
        "reference_bytes_per_s": rate["reference"],
        "reference_bytes": reference,
        "from_memory": votes[-1],
    }


def _one_thread_turns(runs: dict, repeats: int, device: torch.device) -> dict:
    """``interleaved`` turns of ``runs`` by their CPU time, on one thread on a CPU."""
    threads = torch.get_num_threads()
    try:
        if device.type == "cpu":
            torch.set_num_threads(1)
        return interleaved(runs, repeats, warmup=1, clock=steady_clock(device), device=device)
    finally:
        torch.set_num_threads(threads)


def measure_peaks(
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    *,
    matmul_size: int | None = None,
    buffer_bytes: int | None = None,
) -> dict:
    """Both roofs, measured now: {"matmul_flops_per_s", "bandwidth_bytes_per_s", ...} (the JSON's
    "peaks")."""
    mm = measure_matmul_peak(device, dtype, size=matmul_size)
    bw = measure_bandwidth(device, dtype, nbytes=buffer_bytes)
    return {
        "matmul_flops_per_s": mm["flops_per_s"],
        "matmul_flops_per_s_median": mm["flops_per_s_median"],
        "matmul_size": mm["size"],
        "bandwidth_bytes_per_s": bw["bytes_per_s"],
        "bandwidth_kernel": bw["kernel"],
        "bandwidth_by_kernel": bw["by_kernel"],
        "bandwidth_buffer_bytes": bw["buffer_bytes"],
    }
