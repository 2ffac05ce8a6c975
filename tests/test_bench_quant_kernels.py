"""Chapter 09's streaming kernels (each reads the same bytes from main memory) and the CPU's bf16
flags."""

import pytest

from ar_lab.bench.quant import bf16_dot_instructions, kernels_from_memory, streamed_bytes


def test_streaming_kernels_read_the_same_bytes_and_their_ratios_add_up():
    rows = {r["call"]: r for r in kernels_from_memory(2**20, repeats=2)}
    assert list(rows) == ["fp32 mv", "bf16 mv", "int8 kernel", "int4 kernel"]
    assert [rows[c]["bytes_per_weight"] for c in ("fp32 mv", "bf16 mv")] == [4.0, 2.0]
    # 4 bits + a bf16 scale and zero per 32
    assert rows["int4 kernel"]["bytes_per_weight"] == pytest.approx(0.625)
    for r in rows.values():
        assert r["bytes"] <= 2**20 * 1.01 and r["gb_per_s"] > 0
        assert r["per_weight_vs_fp32"] == pytest.approx(r["byte_ratio"] * r["per_byte_vs_fp32"])


def test_streamed_bytes_is_a_multiple_of_the_cache_within_its_cap():
    assert streamed_bytes(100 * 2**20, times=3, most=2**30) == 300 * 2**20
    assert streamed_bytes(500 * 2**20, times=3, most=800 * 2**20) == 800 * 2**20


@pytest.mark.parametrize(
    "cpuinfo, found",
    [("flags : fpu avx512f avx512_bf16 amx_bf16", ["avx512_bf16", "amx_bf16"]),
     ("flags : fpu avx2 avx512f", []), ("Features : fp asimd bf16", ["bf16"]), ("", None)],
)
def test_bf16_dot_flags_are_read_from_cpuinfo(cpuinfo, found):
    assert bf16_dot_instructions(cpuinfo) == found
