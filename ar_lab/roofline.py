"""Prefill against decode: a FLOP and byte model per phase, measured machine peaks, the roofline.

Generation has two phases with opposite bottlenecks:

* **prefill** runs the whole prompt through the model in one parallel pass. Every
  weight that is read from memory is used for all T prompt tokens, so there are many
  FLOPs per byte moved: prefill is *compute-bound* and sets the time to first token
  (TTFT).
* **decode** produces one token per forward pass. Every weight (and the whole KV
  cache) is still read from memory, but used for one token's arithmetic (B tokens in
  a batch of B): decode is *memory-bound* and sets the time per output token (TPOT).

The roofline model (Williams, Waterman & Patterson, CACM 2009) makes this
quantitative: a kernel that does F FLOPs while moving Q bytes has arithmetic
intensity I = F / Q, and on a machine with peak compute P (FLOP/s) and memory
bandwidth W (bytes/s) it can reach at most min(P, I x W) FLOP/s. The *ridge point*
I = P / W separates the memory-bound side (left) from the compute-bound side.

This module holds three things, all device-aware (CPU: fp32, wall clock; CUDA:
bf16, CUDA events after synchronisation), with the device chosen automatically:

1. the analytic model: ``prefill_cost`` and ``decode_cost`` from a ``GPTConfig``;
2. the machine peaks, measured in this process: ``measure_matmul_peak`` (dense
   matmul FLOP/s) and ``measure_bandwidth`` (streaming copy / add / read of a buffer
   far larger than the caches);
3. measurements on a model: ``measure_prefill`` and ``measure_decode`` (time per
   forward pass -> achieved FLOP/s and bytes/s), and ``run_roofline`` which gathers
   peaks and points in the JSON-ready dict that ``python -m ar_lab.bench roofline``
   writes and chapter 05 plots (``plot_roofline``). GPU reference runs produced by
   the same command drop into ``data/`` as ``roofline_<name>.json`` and are found by
   ``reference_files``.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ar_lab.cache import KVCache, kv_cache_bytes
from ar_lab.model import GPTConfig

SCHEMA = "ar_lab.roofline/1"
DATA_DIR = Path(__file__).resolve().parent.parent / "data"


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


# --- 1. the analytic model -----------------------------------------------------------


def parameter_count(cfg: GPTConfig) -> int:
    """Parameters of ``GPT(cfg)`` (the tied embedding / output matrix counted once)."""
    d, L = cfg.n_embd, cfg.n_layer
    qkv = (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim
    per_layer = (d * qkv + qkv) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 2 * (2 * d)  # + 2 LayerNorms
    return cfg.vocab_size * d + cfg.block_size * d + L * per_layer + 2 * d  # + final LayerNorm


def matmul_parameters(cfg: GPTConfig) -> int:
    """Weights that multiply every token's activations: the four projections per layer and the output head.

    Each such weight costs one multiply and one add per token: 2 FLOPs. Biases,
    LayerNorms and the embedding lookups are left out (a few FLOPs per value, not per
    weight), as are the position embeddings, which are read but not multiplied.
    """
    d = cfg.n_embd
    qkv = (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim
    return cfg.n_layer * (d * qkv + d * d + 2 * (d * 4 * d)) + cfg.vocab_size * d


def kv_bytes_per_token(cfg: GPTConfig, bytes_per_value: int = 4) -> int:
    """Bytes of keys and values one position adds to the cache (all layers)."""
    return kv_cache_bytes(cfg.n_layer, cfg.kv_heads, cfg.head_dim, 1, 1, bytes_per_value)


@dataclass(frozen=True)
class PhaseCost:
    """FLOPs and bytes of one forward pass: ``batch`` sequences, ``tokens`` new tokens each.

    ``context`` is the number of positions the last new token attends to (the cache
    length after the pass).
    """

    phase: str  # "prefill" or "decode"
    batch: int
    tokens: int
    context: int
    matmul_flops: float
    attention_flops: float
    weight_bytes: float
    kv_bytes: float
    activation_bytes: float

    @property
    def flops(self) -> float:
        return self.matmul_flops + self.attention_flops

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: FLOPs per byte moved to or from memory."""
        return self.flops / self.bytes

    def time_at(self, peak_flops: float, bandwidth: float) -> float:
        """Roofline time estimate: the slower of doing the FLOPs and moving the bytes."""
        return max(self.flops / peak_flops, self.bytes / bandwidth)

    def bound(self, peak_flops: float, bandwidth: float) -> str:
        """``"compute"`` or ``"memory"``: which roof limits this pass on that machine."""
        return "compute" if self.intensity >= ridge_point(peak_flops, bandwidth) else "memory"

    def to_dict(self) -> dict:
        return {**asdict(self), "flops": self.flops, "bytes": self.bytes, "intensity": self.intensity}


def forward_cost(
    cfg: GPTConfig, batch: int, tokens: int, past: int, bytes_per_value: int = 4, phase: str = ""
) -> PhaseCost:
    """The cost of feeding ``tokens`` new tokens per sequence after ``past`` cached ones.

    FLOPs: 2 per matmul weight per token, plus attention: each new token at absolute
    position p compares its query with p + 1 keys (2 x head_dim FLOPs per key per
    head) and mixes as many values (the same again): 4 x n_embd x (p + 1) per layer.
    Only the causal (unmasked) part is counted; kernels that do not skip masked blocks
    do up to twice the attention work in prefill.

    Bytes: every weight once per forward pass (the position table only for the rows
    used; the token table is read whole by the tied output head), the new keys/values
    written and the whole cache (past + new) read once per sequence, and activations:
    each matmul reads its input and writes its output once per token (norms, GELU and
    residual adds that a fused kernel would keep in registers are not counted).
    """
    _positive_int("batch", batch)
    _positive_int("tokens", tokens)
    if not isinstance(past, int) or past < 0:
        raise ValueError(f"past must be an int >= 0, got {past!r}")
    _positive_int("bytes_per_value", bytes_per_value)
    if past + tokens > cfg.block_size:
        raise ValueError(f"{past + tokens} positions exceed the context window of {cfg.block_size} (block_size)")
    d, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    qkv = (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim
    n = batch * tokens  # tokens through the model
    keys = tokens * past + tokens * (tokens + 1) // 2  # sum over new tokens of the positions each attends to
    matmul_flops = 2 * matmul_parameters(cfg) * n
    attention_flops = 4 * d * L * batch * keys
    weights = parameter_count(cfg) - cfg.block_size * d + tokens * d
    kv = batch * (past + 2 * tokens) * kv_bytes_per_token(cfg, 1)
    per_layer_values = (d + qkv) + (d + d) + (d + 4 * d) + (4 * d + d)  # in + out of the four matmuls
    activations = n * (L * per_layer_values + d + (d + V))  # + embedding out, head in + logits out
    return PhaseCost(
        phase=phase or ("decode" if tokens == 1 and past > 0 else "prefill"),
        batch=batch,
        tokens=tokens,
        context=past + tokens,
        matmul_flops=float(matmul_flops),
        attention_flops=float(attention_flops),
        weight_bytes=float(weights * bytes_per_value),
        kv_bytes=float(kv * bytes_per_value),
        activation_bytes=float(activations * bytes_per_value),
    )


def prefill_cost(cfg: GPTConfig, prompt_len: int, batch: int = 1, bytes_per_value: int = 4) -> PhaseCost:
    """One forward pass over a ``prompt_len``-token prompt (per sequence), cache empty before."""
    return forward_cost(cfg, batch, prompt_len, 0, bytes_per_value, phase="prefill")


def decode_cost(cfg: GPTConfig, context: int, batch: int = 1, bytes_per_value: int = 4) -> PhaseCost:
    """One decode step: one new token per sequence, which attends to ``context`` positions (itself included)."""
    _positive_int("context", context)
    return forward_cost(cfg, batch, 1, context - 1, bytes_per_value, phase="decode")


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """The arithmetic intensity (FLOP/byte) where the bandwidth slope meets the compute roof."""
    if not (peak_flops > 0 and bandwidth > 0):
        raise ValueError(f"peak_flops and bandwidth must be > 0, got {peak_flops} and {bandwidth}")
    return peak_flops / bandwidth


def attainable_flops(intensity, peak_flops: float, bandwidth: float):
    """The roofline: min(peak, intensity x bandwidth); works on floats and tensors/arrays."""
    ridge_point(peak_flops, bandwidth)
    if isinstance(intensity, int | float):
        return min(peak_flops, intensity * bandwidth)
    return (intensity * bandwidth).clip(max=peak_flops)


# The seed arithmetic with nothing but a parameter count: 2 FLOPs per parameter per
# token, and every parameter read once per decode step.


def approx_prefill_flops(n_params: float, prompt_len: int) -> float:
    """2 x parameters x prompt tokens (attention and the rest left out)."""
    return 2.0 * n_params * prompt_len


def approx_decode_bytes(n_params: float, bytes_per_param: float = 2.0) -> float:
    """Bytes one decode step reads: all the weights (fp16/bf16: 2 bytes each; KV cache left out)."""
    return float(n_params) * bytes_per_param


def approx_ttft(n_params: float, prompt_len: int, peak_flops: float) -> float:
    """Time to first token if prefill ran at ``peak_flops``."""
    return approx_prefill_flops(n_params, prompt_len) / peak_flops


def approx_tpot(n_params: float, bandwidth: float, bytes_per_param: float = 2.0) -> float:
    """Time per output token if a decode step streamed the weights at ``bandwidth``."""
    return approx_decode_bytes(n_params, bytes_per_param) / bandwidth


# --- 2. the machine, measured ------------------------------------------------------


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str) -> torch.dtype:
    """fp32 on CPU (what its matmul kernels are fastest at); bf16 on a GPU (its tensor cores)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
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


def time_fn(fn: Callable[[], object], device: torch.device | str, repeats: int = 5, warmup: int = 1) -> list[float]:
    """Seconds per call of ``fn()`` (``repeats`` calls after ``warmup``).

    On CUDA the GPU runs asynchronously: the time is read from CUDA events recorded
    around the call, after synchronising, so it is GPU time, not launch time.
    """
    _positive_int("repeats", repeats)
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return times
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def measure_matmul_peak(
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    size: int | None = None,
    repeats: int = 5,
) -> dict:
    """Dense square matmul FLOP/s (2 n^3 FLOPs per n x n product): the compute roof.

    The roof is the *fastest* repeat (the best the machine demonstrably did: on a shared
    machine the slower repeats measure the neighbours); the median is reported beside it.
    """
    device = default_device() if device is None else torch.device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    size = (8192 if device.type == "cuda" else 2048) if size is None else _positive_int("size", size)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    out = torch.empty(size, size, device=device, dtype=dtype)
    times = time_fn(lambda: torch.mm(a, b, out=out), device, repeats, warmup=2)
    flops = 2.0 * size**3
    return {
        "flops_per_s": flops / min(times),
        "flops_per_s_median": flops / statistics.median(times),
        "size": size,
        "times": times,
    }


def default_buffer_bytes(device: torch.device | str) -> int:
    """A streaming buffer far larger than the caches: 4 GiB on a GPU; max(1 GiB, 4 x L3) on a CPU."""
    if torch.device(device).type == "cuda":
        return 4 * 2**30
    return max(2**30, 4 * (cache_bytes() or 0))


def measure_bandwidth(
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    nbytes: int | None = None,
    repeats: int = 5,
) -> dict:
    """Streaming memory bandwidth (bytes/s) over one buffer of ``nbytes`` (far larger than the caches).

    Four kernels, each touching the whole buffer once per call, counted the way
    STREAM counts them (bytes the program asks to read plus bytes it writes):
    ``copy`` (second half = first half), ``add`` (last third = first + second third),
    ``read`` (sum of everything) and ``matvec`` (the buffer as a matrix times a vector
    of ones: a read-only stream through the BLAS library's best-tuned loop, which on a
    single CPU core often pulls more bandwidth than the others). The bandwidth roof is
    the fastest repeat of the fastest kernel: the best this memory system demonstrably
    delivered to this program (medians are reported beside it).
    """
    device = default_device() if device is None else torch.device(device)
    kernels, buffer_bytes = streaming_kernels(device, dtype, nbytes)
    by_kernel, by_kernel_median, times_by_kernel = {}, {}, {}
    for name, (fn, moved) in kernels.items():
        times = time_fn(fn, device, repeats, warmup=1)
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
    device: torch.device | str | None = None, dtype: torch.dtype | None = None, nbytes: int | None = None
) -> tuple[dict[str, tuple[Callable[[], object], int]], int]:
    """The bandwidth kernels over one fresh buffer: ({name: (function, bytes moved per call)}, buffer bytes)."""
    device = default_device() if device is None else torch.device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    nbytes = default_buffer_bytes(device) if nbytes is None else _positive_int("nbytes", nbytes)
    item = torch.empty((), dtype=dtype).element_size()
    n = (nbytes // item) // 6 * 6  # divisible into halves and thirds
    if n < 6:
        raise ValueError(f"nbytes={nbytes} is too small for a bandwidth measurement")
    buf = torch.ones(n, device=device, dtype=dtype)  # written once: the pages are really there
    half, third = buf.view(2, n // 2), buf.view(3, n // 3)
    cols = min(4096, n)
    matrix, ones = buf[: n // cols * cols].view(-1, cols), torch.ones(cols, device=device, dtype=dtype)
    kernels = {
        "copy": (lambda: half[1].copy_(half[0]), n * item),
        "add": (lambda: torch.add(third[0], third[1], out=third[2]), n * item),
        "read": (lambda: buf.sum(), n * item),
        "matvec": (lambda: torch.mv(matrix, ones), matrix.numel() * item),
    }
    return kernels, n * item


def measure_peaks(
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    matmul_size: int | None = None,
    buffer_bytes: int | None = None,
) -> dict:
    """Both roofs, measured now: {"matmul_flops_per_s", "bandwidth_bytes_per_s", ...} (the JSON's "peaks")."""
    mm = measure_matmul_peak(device, dtype, matmul_size)
    bw = measure_bandwidth(device, dtype, buffer_bytes)
    return {
        "matmul_flops_per_s": mm["flops_per_s"],
        "matmul_flops_per_s_median": mm["flops_per_s_median"],
        "matmul_size": mm["size"],
        "bandwidth_bytes_per_s": bw["bytes_per_s"],
        "bandwidth_kernel": bw["kernel"],
        "bandwidth_by_kernel": bw["by_kernel"],
        "bandwidth_buffer_bytes": bw["buffer_bytes"],
    }


# --- 3. measurements on a model ----------------------------------------------------


@dataclass
class Point:
    """One measured forward pass: its analytic cost and the measured seconds."""

    cost: PhaseCost
    times: list[float]
    mode: str = "eager"  # "eager", or "cuda graph" (the pass replayed as one captured CUDA graph)
    note: str = ""  # why a requested CUDA graph fell back to eager, if it did

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)

    @property
    def flops_per_s(self) -> float:
        return self.cost.flops / self.seconds

    @property
    def bytes_per_s(self) -> float:
        return self.cost.bytes / self.seconds

    def to_dict(self) -> dict:
        return {
            **self.cost.to_dict(),
            "seconds": self.seconds,
            "times": self.times,
            "flops_per_s": self.flops_per_s,
            "bytes_per_s": self.bytes_per_s,
            "mode": self.mode,
            **({"note": self.note} if self.note else {}),
        }


def _model_bytes_per_value(model) -> int:
    return next(model.parameters()).element_size()


def _random_tokens(model, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=g).to(model.device)


def _cuda_graph(step: Callable[[], object], device: torch.device) -> Callable[[], None]:
    """Capture ``step`` as one CUDA graph (after warm-up on the capture stream); return its replay."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    return graph.replay


@torch.inference_mode()
def measure_forward(
    model,
    tokens: int,
    past: int = 0,
    batch: int = 1,
    repeats: int = 3,
    phase: str = "",
    cuda_graph: bool = False,
) -> Point:
    """Time one forward pass of ``tokens`` new tokens per sequence after ``past`` cached positions.

    The cache stands for ``past`` earlier positions: its buffers are filled with random
    keys and values rather than computed by a prefill (the time of a pass does not
    depend on the values, and a batch-64 prefill just to fill it would cost more than
    the measurement). Every timed pass rolls the cache back to ``past`` first, so every
    repeat is the same pass. ``tokens`` > 1 after a cached prefix is what a prompt-cache
    hit or the verification pass of speculative decoding runs.

    ``cuda_graph=True`` (CUDA only; ignored on a CPU) captures the pass once and times
    replays of the graph: the GPU then runs the same kernels without Python launching
    each of them, which is what a small-batch decode step on a fast GPU needs to be
    limited by memory rather than by launches. If capture fails, the pass is timed
    eagerly and ``Point.note`` says why.
    """
    fn, cost, mode, note = prepare_forward(model, tokens, past, batch, phase, cuda_graph)
    return Point(cost, time_fn(fn, model.device, repeats, warmup=1 if tokens > 1 else 2), mode, note)


@torch.inference_mode()
def prepare_forward(
    model, tokens: int, past: int = 0, batch: int = 1, phase: str = "", cuda_graph: bool = False
) -> tuple[Callable[[], None], PhaseCost, str, str]:
    """The pass ``measure_forward`` times, ready to call: (function, cost, mode, note)."""
    _positive_int("tokens", tokens)
    _positive_int("batch", batch)
    cost = forward_cost(model.config, batch, tokens, past, _model_bytes_per_value(model), phase)
    cache = KVCache.for_model(model, batch_size=batch, max_len=past + tokens)
    model.eval()
    g = torch.Generator(device=model.device).manual_seed(0)
    for buf in cache.k + cache.v:
        buf.normal_(generator=g)
    cache.length = past
    idx = _random_tokens(model, batch, tokens, seed=1)

    @torch.inference_mode()
    def step():
        cache.truncate(past)
        model(idx, cache)

    fn, mode, note = step, "eager", ""
    if cuda_graph and model.device.type == "cuda":
        try:
            fn, mode = _cuda_graph(step, model.device), "cuda graph"
        except RuntimeError as e:  # capture is beta in PyTorch: fall back, and say so
            note = f"CUDA graph capture failed, timed eagerly: {e}"
    return fn, cost, mode, note


def measure_prefill(model, prompt_len: int, batch: int = 1, repeats: int = 3, cuda_graph: bool = False) -> Point:
    """Time one prefill pass: ``batch`` prompts of ``prompt_len`` tokens into an empty KV cache."""
    _positive_int("prompt_len", prompt_len)
    return measure_forward(model, prompt_len, 0, batch, repeats, "prefill", cuda_graph)


def measure_decode(model, context: int, batch: int = 1, repeats: int = 5, cuda_graph: bool = False) -> Point:
    """Time one decode step at ``context``: ``batch`` new tokens, each attending to ``context`` positions."""
    _positive_int("context", context)
    return measure_forward(model, 1, context - 1, batch, repeats, "decode", cuda_graph)


def fastest_threads(model, context: int = 64, candidates: Sequence[int] | None = None, repeats: int = 3) -> dict:
    """Time a batch-1 decode step with each CPU thread count in ``candidates`` (default: 1 and all).

    A decode step is hundreds of small kernels, each split across the threads and
    joined again. On a quiet machine more threads pull more bandwidth; on a busy one a
    thread that has lost its core makes every join wait, and one thread can win by
    far. Returns {"seconds": {threads: median seconds}, "best": threads}; the thread
    count is restored (set it yourself with ``torch.set_num_threads``).
    """
    original = torch.get_num_threads()
    candidates = list(candidates) if candidates else sorted({1, original})
    seconds = {}
    try:
        for t in candidates:
            torch.set_num_threads(_positive_int("threads", t))
            seconds[t] = measure_decode(model, context, 1, repeats).seconds
    finally:
        torch.set_num_threads(original)
    return {"seconds": seconds, "best": min(seconds, key=seconds.get)}


# --- configs and the full run --------------------------------------------------------

# Random-init configs for the roofline (speed does not depend on training). "small":
# ~100 M parameters, the chapter-05 notebook's model; "cpu": ~300 M parameters (1.2 GB
# in fp32, several times the largest CPU cache); "gpu": ~6.4 B parameters (13 GB in
# bf16), big enough that a decode step is memory traffic, not kernel launches.
CONFIGS: dict[str, GPTConfig] = {
    "small": GPTConfig(block_size=512, n_layer=8, n_head=16, n_embd=1024),
    "cpu": GPTConfig(block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpu": GPTConfig(block_size=4096, n_layer=32, n_head=32, n_embd=4096),
}


def build_model(cfg: GPTConfig, device: torch.device | str | None = None, dtype: torch.dtype | None = None, seed=0):
    """A randomly initialised ``GPT(cfg)``, created directly on ``device`` in ``dtype``.

    No full-precision or CPU copy is made first: a 6 B-parameter model in bf16 needs
    13 GB on the GPU, not 26 GB of fp32 on the way there.
    """
    from ar_lab.model import GPT

    device = default_device() if device is None else torch.device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = GPT(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def environment(device: torch.device | str) -> dict:
    import ar_lab

    device = torch.device(device)
    return {
        "device": {
            "type": device.type,
            "name": device_name(device),
            "threads": torch.get_num_threads(),  # CPU threads the measurements ran with
            "cpus": os.cpu_count(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda if device.type == "cuda" else None,
            "ar_lab": ar_lab.__version__,
        },
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
    }


def run_roofline(
    model,
    prompt_lens: Sequence[int] = (16, 64, 256),
    decode_batches: Sequence[int] = (1, 4, 16, 64),
    decode_context: int = 128,
    decode_contexts: Sequence[int] = (),
    peaks: dict | None = None,
    matmul_size: int | None = None,
    buffer_bytes: int | None = None,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
    cuda_graph: bool = False,
) -> dict:
    """Measure the peaks (unless given) and the prefill/decode points; return the JSON-ready result.

    Prefill at each of ``prompt_lens`` (batch 1); decode at ``decode_context`` for each
    of ``decode_batches``, and at batch 1 for each of ``decode_contexts``.
    """
    device, dtype = model.device, next(model.parameters()).dtype
    say = progress or (lambda _msg: None)
    if peaks is None:
        say("measuring the peaks")
        peaks = measure_peaks(device, dtype, matmul_size, buffer_bytes)
    points = []
    for t in prompt_lens:
        say(f"prefill {t} tokens")
        points.append(measure_prefill(model, t, 1, repeats, cuda_graph))
    for b in decode_batches:
        say(f"decode batch {b} at context {decode_context}")
        points.append(measure_decode(model, decode_context, b, max(repeats, 3), cuda_graph))
    for c in decode_contexts:
        say(f"decode batch 1 at context {c}")
        points.append(measure_decode(model, c, 1, max(repeats, 3), cuda_graph))
    result = {
        "schema": SCHEMA,
        **environment(device),
        "dtype": str(dtype).removeprefix("torch."),
        "model": {
            "config": model.config.to_dict(),
            "parameters": model.num_parameters(),
            "weight_bytes": sum(p.nbytes for p in model.parameters()),
        },
        "peaks": peaks,
        "ridge_point": ridge_point(peaks["matmul_flops_per_s"], peaks["bandwidth_bytes_per_s"]),
        "points": [p.to_dict() for p in points],
    }
    result["key_figures"] = key_figures(result)
    return result


def decode_bandwidth_fraction(
    model,
    context: int = 64,
    pairs: int = 25,
    threads: Sequence[int] | None = None,
    buffer_bytes: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """How close a batch-1 decode step comes to the streaming bandwidth, measured side by side.

    First every streaming kernel is measured once and the fastest is kept. Then, for
    each way of running the step (on a CPU: each thread count in ``threads``, default 1
    and all; on CUDA: eager and as a CUDA graph), ``pairs`` times: one call of that
    kernel is timed and immediately after it one decode step at ``context``, so a shared
    machine's changing load hits both sides alike. The figure is the step's
    bytes/s at its median time over the kernel's bytes/s at its median time; the
    quartiles and range of the per-pair ratios show the noise. ``of_roof`` divides by
    the kernel's *fastest* call instead (the roof drawn on the plot: a conservative
    ratio). ``best`` names the variant with the highest figure (``best_threads`` /
    ``cuda_graph`` say how to run it).
    """
    _positive_int("pairs", pairs)
    device, dtype = model.device, next(model.parameters()).dtype
    say = progress or (lambda _msg: None)
    original = torch.get_num_threads()
    if device.type == "cuda":
        variants = {"eager": (original, False), "cuda graph": (original, True)}
    else:
        ts = sorted({_positive_int("threads", t) for t in threads}) if threads else sorted({1, original})
        variants = {f"{t} thread{'s' if t > 1 else ''}": (t, False) for t in ts}
    kernels, _ = streaming_kernels(device, dtype, buffer_bytes)
    rates = {}
    for name, (fn, moved) in kernels.items():
        rates[name] = moved / min(time_fn(fn, device, repeats=5, warmup=1))  # its best call, as for the roof
    kernel = max(rates, key=rates.get)
    probe, probe_bytes = kernels[kernel]
    steps = {}
    for name, (t, graph) in variants.items():
        torch.set_num_threads(t)
        fn, cost, mode, note = prepare_forward(model, 1, context - 1, 1, "decode", graph)
        steps[name] = (fn, mode, note)
    samples = {name: [] for name in variants}  # (probe seconds, step seconds)
    try:
        # One variant after the other (switching thread counts between pairs would time
        # one variant's kernel against the other's still-spinning worker threads).
        for name, (t, _graph) in variants.items():
            torch.set_num_threads(t)
            fn = steps[name][0]
            time_fn(fn, device, repeats=1, warmup=2)  # the first calls after a switch are slower
            time_fn(probe, device, repeats=1, warmup=1)
            for _ in range(pairs):
                t_probe = time_fn(probe, device, repeats=1, warmup=0)[0]
                t_step = time_fn(fn, device, repeats=1, warmup=0)[0]
                samples[name].append((t_probe, t_step))
            say(f"{name}: {_fraction(samples[name], cost.bytes, probe_bytes):.0%} of the streaming bandwidth")
    finally:
        torch.set_num_threads(original)
    by_variant = {}
    for name, (t, graph) in variants.items():
        fr = sorted(cost.bytes / b / (probe_bytes / a) for a, b in samples[name])
        step_rate = cost.bytes / statistics.median(b for _, b in samples[name])
        by_variant[name] = {
            "fraction": _fraction(samples[name], cost.bytes, probe_bytes),
            "pair_quartiles": statistics.quantiles(fr, n=4, method="inclusive") if len(fr) > 1 else fr * 3,
            "pair_range": [fr[0], fr[-1]],
            "of_roof": step_rate / (probe_bytes / min(a for a, _ in samples[name])),
            "decode_bytes_per_s": step_rate,
            "bandwidth_bytes_per_s": probe_bytes / statistics.median(a for a, _ in samples[name]),
            "threads": t,
            "cuda_graph": graph,
            "mode": steps[name][1],
            **({"note": steps[name][2]} if steps[name][2] else {}),
            "pairs": [{"probe_seconds": a, "decode_seconds": b} for a, b in samples[name]],
        }
    best = max(by_variant, key=lambda n: by_variant[n]["fraction"])
    return {
        "context": context,
        "decode_bytes": cost.bytes,
        "kernel": kernel,
        "kernel_bytes": probe_bytes,
        "kernel_rates": rates,
        "by_variant": by_variant,
        "best": best,
        "best_threads": by_variant[best]["threads"],
        "cuda_graph": by_variant[best]["cuda_graph"],
        "fraction": by_variant[best]["fraction"],
        "fraction_of_roof": by_variant[best]["of_roof"],
    }


def _fraction(samples: list[tuple[float, float]], step_bytes: float, probe_bytes: float) -> float:
    """(step bytes / median step seconds) / (probe bytes / median probe seconds)."""
    step = statistics.median(b for _, b in samples)
    probe = statistics.median(a for a, _ in samples)
    return (step_bytes / step) / (probe_bytes / probe)


def key_figures(result: dict) -> dict:
    """Decode at batch 1: fraction of the measured bandwidth; largest prefill: fraction of the matmul peak."""
    peaks = result["peaks"]
    decode = [p for p in result["points"] if p["phase"] == "decode" and p["batch"] == 1]
    prefill = [p for p in result["points"] if p["phase"] == "prefill"]
    out = {}
    if decode:
        best = min(decode, key=lambda p: p["context"])  # the weights dominate at the shortest context
        out["decode_bandwidth_fraction"] = best["bytes_per_s"] / peaks["bandwidth_bytes_per_s"]
        out["decode_context"] = best["context"]
    if prefill:
        big = max(prefill, key=lambda p: p["tokens"] * p["batch"])
        out["prefill_compute_fraction"] = big["flops_per_s"] / peaks["matmul_flops_per_s"]
        out["prefill_tokens"] = big["tokens"]
    return out


# --- results on disk -----------------------------------------------------------------

_REQUIRED = ("schema", "device", "dtype", "versions", "date", "peaks", "points")


def load_result(path: str | Path) -> dict:
    """Read a roofline JSON file written by ``python -m ar_lab.bench roofline --json PATH``."""
    import json

    path = Path(path)
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    missing = [k for k in _REQUIRED if k not in result] if isinstance(result, dict) else list(_REQUIRED)
    if missing:
        raise ValueError(f"{path} is not a roofline result: missing {missing}")
    if result["schema"] != SCHEMA:
        raise ValueError(f"{path} has schema {result['schema']!r}; this version of ar_lab reads {SCHEMA!r}")
    for k in ("matmul_flops_per_s", "bandwidth_bytes_per_s"):
        if not (isinstance(result["peaks"].get(k), int | float) and result["peaks"][k] > 0):
            raise ValueError(f"{path}: peaks.{k} must be a positive number")
    for i, p in enumerate(result["points"]):
        for k in ("phase", "batch", "tokens", "context", "intensity", "flops_per_s", "seconds"):
            if k not in p:
                raise ValueError(f"{path}: point {i} has no {k!r}")
    return result


def reference_files(data_dir: str | Path = DATA_DIR, device_type: str | None = None) -> list[Path]:
    """The roofline results shipped in ``data_dir`` (``roofline_*.json``), optionally only one device type."""
    out = []
    for path in sorted(Path(data_dir).glob("roofline_*.json")):
        if device_type is None or load_result(path)["device"]["type"] == device_type:
            out.append(path)
    return out


def summary_rows(result: dict) -> list[list]:
    """Rows for a table: phase, batch, tokens, context, ms, FLOP/byte, GFLOP/s, GB/s, % of the roof."""
    peaks = result["peaks"]
    rows = []
    for p in result["points"]:
        roof = attainable_flops(p["intensity"], peaks["matmul_flops_per_s"], peaks["bandwidth_bytes_per_s"])
        rows.append(
            [
                p["phase"],
                p["batch"],
                p["tokens"],
                p["context"],
                round(p["seconds"] * 1e3, 2),
                round(p["intensity"], 1),
                round(p["flops_per_s"] / 1e9, 1),
                round(p["bytes_per_s"] / 1e9, 1),
                f"{p['flops_per_s'] / roof:.0%}",
            ]
        )
    return rows


SUMMARY_HEADERS = ["phase", "batch", "tokens", "context", "ms", "FLOP/byte", "GFLOP/s", "GB/s", "of roof"]


# --- the plot ------------------------------------------------------------------------


def plot_roofline(
    ax,
    result: dict,
    label: str | None = None,
    color: str | None = None,
    roof_color: str = "black",
    points: bool = True,
    annotate: bool = True,
):
    """Draw ``result``'s measured roofs (compute roof, bandwidth slope, ridge) and its points on a log-log ``ax``.

    Prefill points are circles, decode points triangles; with ``annotate`` each is
    labelled with its prompt length (T=) or batch size (B=), and the ridge with its
    intensity.
    """
    from ar_lab.plots import COLORS

    peak, bw = result["peaks"]["matmul_flops_per_s"], result["peaks"]["bandwidth_bytes_per_s"]
    ridge = ridge_point(peak, bw)
    intensities = [p["intensity"] for p in result["points"]] or [ridge]
    lo = min(min(intensities), ridge) / 4
    hi = max(max(intensities), ridge) * 4
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    name = label or result["device"]["name"]
    roof_label = f"roofs of {name}: {format_si(peak, 'FLOP/s')}, {format_si(bw, 'B/s')}"
    ax.plot(xs, [attainable_flops(x, peak, bw) for x in xs], color=roof_color, lw=1.8, label=roof_label)
    ax.axvline(ridge, color=roof_color, ls=":", lw=1)
    if annotate:
        ax.annotate(
            f"ridge {ridge:.0f} FLOP/B",
            (ridge, peak),
            xytext=(4, 5),
            textcoords="offset points",
            fontsize=8.5,
            color=roof_color,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("achieved FLOP/s")
    if points:
        for phase, marker in (("prefill", "o"), ("decode", "^")):
            pts = [p for p in result["points"] if p["phase"] == phase]
            if not pts:
                continue
            c = color or COLORS[phase]
            ax.scatter(
                [p["intensity"] for p in pts],
                [p["flops_per_s"] for p in pts],
                marker=marker,
                s=40,
                color=c,
                zorder=3,
                label=f"{phase} ({name})",
            )
            if annotate:
                for p in pts:
                    text = f"T={p['tokens']}" if phase == "prefill" else f"B={p['batch']}"
                    if phase == "decode" and len({q["context"] for q in pts}) > 1:
                        text += f", L={p['context']}"
                    offset = (-6, 6) if phase == "prefill" else (6, -11)  # prefill labels above, decode below
                    ax.annotate(
                        text,
                        (p["intensity"], p["flops_per_s"]),
                        xytext=offset,
                        textcoords="offset points",
                        fontsize=7.5,
                        color=c,
                        ha="right" if phase == "prefill" else "left",
                    )
    return ax


def format_si(value: float, unit: str) -> str:
    """1.3e11, "FLOP/s" -> "130 GFLOP/s"."""
    if value == 0 or not math.isfinite(value):
        return f"{value} {unit}"
    prefixes = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, "")]
    for scale, p in prefixes:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {p}{unit}"
    return f"{value:.3g} {unit}"
