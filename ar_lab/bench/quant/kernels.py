"""The quantized kernels alone (chapter 09): one matrix times one vector in each weight format, on
matrices that fit in a cache (``kernel_timings``), then streaming several times the largest cache
from main memory (``kernels_from_memory``, sized by ``streamed_bytes``); ``bf16_dot_instructions``
says whether this CPU has the bfloat16 dot-product instructions the fast paths rely on."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadValue
from ar_lab.base.timing import interleaved, median

# CPU flags (as Linux names them) of instructions that multiply bfloat16 pairs and add into float32:
# x86 AVX512-BF16 (vdpbf16ps), x86 AMX-BF16 (tile products), Arm's BF16 extension (bfdot).
BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def _kernel_calls(
    w: torch.Tensor, x: torch.Tensor
) -> dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor]]:
    """name -> (one matrix-vector product of ``w`` and ``x``, the matrix it stands for)."""
    from ar_lab.engine.quant import QuantizedLinear, quantize_int4, quantize_int8

    int8, int4 = QuantizedLinear(quantize_int8(w)), QuantizedLinear(quantize_int4(w, 32))
    wb, zero, q8 = (
        w.bfloat16(),
        torch.zeros(w.shape[0], dtype=torch.bfloat16),
        quantize_int8(w),
    )  # q8: float32 scales, what the kernel's float32 path takes
    return {
        "fp32 addmv": (lambda: torch.mv(w, x), w),
        "bf16 mv": (lambda: torch.mv(wb, x.bfloat16()), wb.float()),
        # see quant.bf16_addmv
        "bf16 addmv": (lambda: torch.addmv(zero, wb, x.bfloat16()), wb.float()),
        "int8 kernel": (lambda: int8.matmul(x[None])[0], int8.quantized().dequantize()),
        "int8 kernel, fp32 input": (
            lambda: torch.ops.aten._weight_int8pack_mm(x[None], q8.q, q8.scale)[0],
            q8.dequantize(),
        ),
        "int8 dequantize + mv": (
            lambda: torch.mv(q8.q.float() * q8.scale[:, None], x),
            q8.dequantize(),
        ),
        "int4 kernel": (lambda: int4.matmul(x[None])[0], int4.quantized().dequantize()),
    }


def kernel_timings(shapes=((1024, 256), (4096, 1024)), repeats: int = 30) -> list[dict]:
    """One (out, in) matrix times one vector, per shape: microseconds per call (median of
    interleaved calls), speed relative to float32 ``mv``, and the largest error relative to the
    product with the matrix the call stands for (its dequantized weights)."""
    rows = []
    for n_out, n_in in shapes:
        torch.manual_seed(0)
        w, x = torch.randn(n_out, n_in), torch.randn(n_in)
        calls = _kernel_calls(w, x)
        with torch.inference_mode():
            times = interleaved(
                {name: fn for name, (fn, _) in calls.items()}, repeats, clock=time.perf_counter
            )
            for name, (fn, matrix) in calls.items():
                want = matrix @ x
                err = float((fn().float() - want).abs().max() / want.abs().max())
                us = 1e6 * median(times[name])
                rows.append({"shape": [n_out, n_in], "call": name, "us": us, "rel_error": err})
        base = rows[-len(calls)]["us"]  # fp32 addmv, the first call
        for r in rows[-len(calls) :]:
            r["x_fp32"] = base / r["us"]
    return rows


def bf16_dot_instructions(cpuinfo: str | None = None) -> list[str] | None:
    """Which of ``BF16_DOT_FLAGS`` this CPU lists (``/proc/cpuinfo``, or the text given), or None
    where the flags cannot be read. Without any, a bfloat16 product widens every value to float32 (a
    16-bit shift) before a float32 multiply-add: the arithmetic of fp32 plus a conversion per
    weight."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            flags.update(value.split())
    return [f for f in BF16_DOT_FLAGS if f in flags] if flags else None


def kernels_from_memory(
    nbytes: int, *, repeats: int = 5, n_in: int = 4096, group_size: int = 32
) -> list[dict]:
    """The four decode kernels, each streaming the same ``nbytes`` (make it several times the
    largest cache, so that every call reads main memory): per call, microseconds (median of
    interleaved calls), weights and bytes read, GB/s, and per byte and per weight against fp32's
    ``mv``.

    The bytes are one buffer read as each format: fp32 rows, bf16 rows, int8 rows (plus a bfloat16
    scale per row), and int4 in the CPU kernel's packed layout followed by its bfloat16 scales and
    zeros (one pair per ``group_size`` weights), so no format's copy is held beside another's. Every
    byte lies in [0x30, 0x3F]: read as fp32 or bf16 it is a normal number (no subnormals, which some
    CPUs compute slowly), as int8 a small positive one. Values do not change these kernels' speed;
    only the bytes do.
    """
    from ar_lab.engine.quant import INT4_GROUP_SIZES

    positive_int("repeats", repeats)
    positive_int("n_in", n_in, 2 * group_size)
    if group_size not in INT4_GROUP_SIZES or n_in % group_size:
        raise BadValue(
            f"group_size must be one of {INT4_GROUP_SIZES} and divide n_in={n_in}, got "
            f"{group_size}",
            arg="group_size",
        )
    # fp32 rows, a multiple of 64
    rows = positive_int("nbytes", nbytes, 64 * 4 * n_in) // (64 * 4 * n_in) * 64
    size = rows * 4 * n_in
    g = torch.Generator().manual_seed(0)
    block = torch.randint(0x30, 0x40, (4 * n_in,), dtype=torch.uint8, generator=g)
    buf = block.repeat(rows)  # (size,) bytes
    # packed weights + scales fit in size
    int4_rows = size // (n_in // 2 + 4 * n_in // group_size) // 64 * 64
    packed = buf[: int4_rows * n_in // 2].view(int4_rows, n_in // 2)  # two 4-bit weights per byte
    zs = buf[packed.numel() : packed.numel() + 4 * int4_rows * n_in // group_size]
    scales_and_zeros = zs.view(torch.bfloat16).view(n_in // group_size, int4_rows, 2)
    int8_scales = torch.full((4 * rows,), 0.01, dtype=torch.bfloat16)
    x = torch.randn(n_in, generator=g)
    xb = x.bfloat16()
    w32, w16, w8 = (
        buf.view(dtype).view(-1, n_in) for dtype in (torch.float32, torch.bfloat16, torch.int8)
    )
    aten = torch.ops.aten
    calls = {  # name -> (the call, weights it multiplies, bytes it reads)
        "fp32 mv": (lambda: torch.mv(w32, x), w32.numel(), size),
        "bf16 mv": (lambda: torch.mv(w16, xb), w16.numel(), size),
        "int8 kernel": (
            lambda: aten._weight_int8pack_mm(xb[None], w8, int8_scales),
            w8.numel(),
            size + 8 * rows,
        ),
        "int4 kernel": (
            lambda: aten._weight_int4pack_mm_for_cpu(
                xb[None], packed, group_size, scales_and_zeros
            ),
            2 * packed.numel(),
            packed.numel() + zs.numel(),
        ),
    }
    with torch.inference_mode():
        times = interleaved(
            {k: fn for k, (fn, _, _) in calls.items()}, repeats, warmup=1, clock=time.perf_counter
        )
    out = []
    for name, (_, weights, nread) in calls.items():
        seconds = median(times[name])
        out.append(
            {
                "call": name,
                "us": 1e6 * seconds,
                "weights": weights,
                "bytes": nread,
                "bytes_per_weight": nread / weights,
                "gb_per_s": nread / seconds / 1e9,
            }
        )
    fp32 = out[0]
    for r in out:
        r["per_byte_vs_fp32"] = r["gb_per_s"] / fp32["gb_per_s"]
        # fewer bytes per weight than fp32
        r["byte_ratio"] = fp32["bytes_per_weight"] / r["bytes_per_weight"]
        r["per_weight_vs_fp32"] = r["byte_ratio"] * r["per_byte_vs_fp32"]  # = (weights/s) / fp32's
    return out


def streamed_bytes(cache: int | None = None, *, times: int = 3, most: int = 2**30) -> int:
    """Bytes for ``kernels_from_memory``: ``times`` the largest CPU cache
    (``ar_lab.perf.peaks.cache_bytes``; 32 MiB where the machine does not say), at most ``most``."""
    from ar_lab.perf.peaks import cache_bytes

    cache = cache_bytes() if cache is None else cache
    return min(times * (cache or 32 * 2**20), most)
