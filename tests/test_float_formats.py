"""FP8, MXFP4 and NVFP4 (ar_lab.engine.float_formats): every stored value is one the format holds,
the rounding is to the nearest such value, the scales are what the specifications say."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_lab.base.errors import BadValue
from ar_lab.engine.float_formats import (
    E2M1_VALUES,
    FORMATS,
    formats_compared,
    fp8,
    mxfp4,
    nvfp4,
    round_e2m1,
    rounded,
    rounded_model,
)
from ar_lab.model.gpt import GPT, GPTConfig
from tests.raising import raises

GRID = torch.tensor(E2M1_VALUES)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=40))
def test_e2m1_rounds_to_the_nearest_value_and_saturates(xs):
    x = torch.tensor(xs, dtype=torch.float32)
    got = round_e2m1(x)
    a = x.abs().clamp(max=6)
    distance = (a[:, None] - GRID[None, :]).abs()
    best = distance.min(1).values
    assert torch.all((got.abs() - a).abs() == best)  # no value of the grid is nearer
    assert torch.all((got == 0) | (got.sign() == x.sign()))


def test_e2m1_ties_go_to_the_even_mantissa():
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert torch.equal(round_e2m1(midpoints), want)
    assert torch.equal(round_e2m1(-midpoints), -want)


def weight(out=32, n_in=64, seed=0):
    w = torch.randn(out, n_in, generator=torch.Generator().manual_seed(seed))
    w[0, 3] = 9.0  # an outlier: its block's scale follows it
    return w


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
def test_fp8_stores_values_the_format_holds_with_a_scale_per_row(kind):
    w = weight()
    r = fp8(w, kind)
    dtype = torch.float8_e4m3fn if kind == "e4m3" else torch.float8_e5m2
    scale = w.abs().amax(1, keepdim=True) / torch.finfo(dtype).max
    coded = r.values / scale
    torch.testing.assert_close(coded.to(dtype).float(), coded, rtol=1e-6, atol=0)
    assert torch.allclose(r.values.abs().amax(1), w.abs().amax(1))  # the row maximum is exact
    assert r.bits_per_weight == 8 + 32 / 64


def test_mxfp4_blocks_share_a_power_of_two_and_hold_e2m1_values():
    w = weight()
    r = mxfp4(w)
    v, orig = r.values.view(32, 2, 32), w.view(32, 2, 32)
    top = orig.abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(top)) - 2)  # OCP MX: 2^(floor(log2 max) - emax)
    coded = v / scale
    assert torch.isin(coded.abs(), GRID).all()
    assert ((top / scale >= 4) & (top / scale < 8)).all()  # the block max lands in [4, 8)
    assert r.bits_per_weight == 4.25


def test_nvfp4_block_scales_are_e4m3_numbers_under_one_tensor_scale():
    w = weight()
    r = nvfp4(w)
    v, orig = r.values.view(32, 4, 16), w.view(32, 4, 16)
    top = orig.abs().amax(-1, keepdim=True)
    tensor_scale = float(top.max()) / (6 * 448)
    block = (top / 6 / tensor_scale).to(torch.float8_e4m3fn).float()
    coded = v / (block * tensor_scale)
    assert torch.allclose(coded.abs(), round_e2m1(coded).abs(), atol=1e-5)
    assert torch.isin(round_e2m1(coded).abs(), GRID).all()
    assert r.bits_per_weight == 4.5


def test_formats_compared_and_rounded_model():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=64)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    table = formats_compared(model)
    assert list(table) == list(FORMATS)
    # at 8 bits the integers' even spacing wins on Gaussian-like weights; E5M2 has the fewest
    # mantissa bits of all
    assert table["int8"]["relative_rms"] < table["fp8 e4m3"]["relative_rms"]
    assert table["fp8 e4m3"]["relative_rms"] < table["fp8 e5m2"]["relative_rms"]
    assert table["fp8 e5m2"]["relative_rms"] < table["int4"]["relative_rms"]
    for fmt in FORMATS:
        new = rounded_model(model, fmt)
        w = new.blocks[0].mlp.fc.weight
        assert torch.equal(w, rounded(model.blocks[0].mlp.fc.weight, fmt).values)
        assert torch.equal(new.wte.weight, model.wte.weight)  # only the block layers change
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bad_input():
    with raises(BadValue, "kind"):
        fp8(weight(), "e3m4")
    with raises(BadValue, "weight"):
        mxfp4(torch.randn(4, 48))  # 32 does not divide 48
    with raises(BadValue, "fmt"):
        rounded(weight(), "fp6")
    with raises(BadValue, "weight"):
        nvfp4(torch.full((4, 32), float("nan")))
