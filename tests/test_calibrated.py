"""GPTQ and AWQ (ar_lab.engine.calibrated): GPTQ's Cholesky feedback equals re-solving least
squares after every column; AWQ's folds leave the model's function unchanged; both beat round to
nearest on what they optimise. What each recovers of the course model's int4 loss on the whole
validation text is chapter 09b's check (and python -m ar_lab.bench quant's table)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_lab.base.errors import BadType, BadValue
from ar_lab.engine.calibrated import (
    LayerStats,
    awq_scales,
    awq_search,
    calibrated_model,
    calibration_stats,
    clip_search,
    gptq_quantize,
    layer_names,
    output_error,
    recovered,
    stats_of,
)
from ar_lab.engine.calibrated import _fold as fold
from ar_lab.engine.quant import QuantizedLinear, quantize_int4
from ar_lab.model.gpt import GPT, GPTConfig
from tests.raising import raises


def correlated_inputs(n_in: int, rows: int, seed: int) -> torch.Tensor:
    """Input rows with correlated channels and a few loud ones, as a layer's real inputs are."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(n_in, n_in, generator=g, dtype=torch.float64) / math.sqrt(n_in)
    x = torch.randn(rows, n_in, generator=g, dtype=torch.float64) @ (torch.eye(n_in) + 2 * mix)
    x[:, : max(1, n_in // 16)] *= 8  # salient channels
    return x


def sequential_least_squares(w: torch.Tensor, h: torch.Tensor, group: int) -> torch.Tensor:
    """GPTQ by brute force: after each column is rounded, the columns not yet rounded are re-fit
    by least squares with the rounded ones fixed (W_R = W0_R - (Q_F - W0_F) H_FR H_RR^-1, solved
    afresh each time); a group's scale taken from the weights as they are at its first column."""
    w0, work = w.clone(), w.clone()
    out, n = w.shape
    q = torch.zeros_like(w)
    scale = None
    for i in range(n):
        if i % group == 0:
            scale = work[:, i : i + group].abs().amax(1) / 7
            scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q[:, i] = torch.round(work[:, i] / scale).clamp(-7, 7) * scale
        if i + 1 < n:
            fixed, rest = slice(0, i + 1), slice(i + 1, n)
            shift = (q[:, fixed] - w0[:, fixed]) @ h[fixed, rest] @ torch.linalg.inv(h[rest, rest])
            work[:, rest] = w0[:, rest] - shift
    return q


def damped(h: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    return h + damp * h.diagonal().mean() * torch.eye(h.shape[0], dtype=h.dtype)


@settings(max_examples=25, deadline=None)
@given(
    out=st.sampled_from([1, 3, 8]),
    groups=st.integers(1, 3),
    group=st.sampled_from([4, 8]),
    block=st.sampled_from([1, 4, 5, 128]),
    seed=st.integers(0, 10_000),
)
def test_gptq_equals_least_squares_refit_after_every_column(out, groups, group, block, seed):
    n = groups * group
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n, generator=g, dtype=torch.float64).float().double()
    x = correlated_inputs(n, 64, seed)
    h = x.T @ x / x.shape[0]
    got = gptq_quantize(w, h, group, block=block).dequantize().double()
    want = sequential_least_squares(w, damped(h), group)
    torch.testing.assert_close(got, want.float().double(), rtol=1e-5, atol=1e-6)


def test_gptq_with_uncorrelated_inputs_is_round_to_nearest():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    qt = gptq_quantize(w, torch.eye(64, dtype=torch.float64), 32)
    rtn = quantize_int4(w, 32)
    assert torch.equal(qt.q, rtn.q)
    torch.testing.assert_close(qt.scale, rtn.scale)


def test_gptq_and_awq_cut_the_output_error_of_round_to_nearest():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    x = correlated_inputs(128, 512, 1)
    h = x.T @ x / x.shape[0]
    stats = LayerStats(h, x.abs().mean(0), x.shape[0])
    rtn = output_error(w, quantize_int4(w, 32).dequantize(), h)
    gptq = output_error(w, gptq_quantize(w, h, 32).dequantize(), h)
    search = awq_search(w, stats, 32)
    assert gptq < 0.7 * rtn
    assert search.errors[0] == pytest.approx(rtn)  # alpha 0: no scaling
    assert search.alpha > 0 and search.error < 0.9 * rtn  # the loud channels are protected
    clipped = output_error(w, clip_search(w, h, 32).dequantize(), h)
    assert clipped < rtn


def model_of(kind: str) -> GPT:
    configs = {
        "gpt2": GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64),
        "modern": GPTConfig.modern(block_size=64, n_layer=2, n_head=4, n_kv_heads=2, n_embd=64),
    }
    torch.manual_seed(0)
    model = GPT(configs[kind]).eval()
    with torch.no_grad():  # norms with weights and biases of their own, as trained ones have
        for name, p in model.named_parameters():
            if "ln" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("kind", ["gpt2", "modern"])
def test_awq_folds_leave_the_function_unchanged(kind):
    model = model_of(kind)
    x = torch.randint(0, 257, (2, 40))
    stats = calibration_stats(model, torch.randint(0, 257, (500,)), windows=4, length=32)
    found = awq_scales(model, stats, 32)
    assert ("blocks.0.mlp.proj" in found) == (kind == "modern")  # GELU's input does not fold
    scales = {k: 0.5 + torch.rand(v.scale.shape) for k, v in found.items()}  # far from 1
    cfg = model.config  # the attention output's scale: one per KV head's dimension
    for name in [k for k in scales if k.endswith("attn.proj")]:
        per_kv = 0.5 + torch.rand(cfg.kv_heads, 1, cfg.head_dim)
        scales[name] = per_kv.expand(-1, cfg.n_head // cfg.kv_heads, -1).reshape(-1)
    folded = GPT(model.config).eval()
    folded.load_state_dict(model.state_dict())
    fold(folded, scales)
    with torch.inference_mode():
        torch.testing.assert_close(folded(x), model(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["gpt2", "modern"])
def test_calibrated_models_quantize_every_block_layer(kind):
    model = model_of(kind)
    text = torch.randint(0, 257, (2000,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for method in ("rtn", "awq", "gptq"):
        q = calibrated_model(model, method, tokens=text, windows=4, length=64)
        layers = dict(q.named_modules())
        assert all(isinstance(layers[n], QuantizedLinear) for n in layer_names(q))
        with torch.inference_mode():
            logits = q(text[None, :48])
        assert torch.isfinite(logits).all()
    # every layer got its own answer: GPTQ's last layer is GPTQ of that layer
    stats = calibration_stats(model, text, windows=4, length=64)
    last = layer_names(model)[-1]
    want = gptq_quantize(dict(model.named_modules())[last].weight, stats[last].hessian, 32)
    assert torch.equal(dict(q.named_modules())[last].quantized().q, want.q)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_functions_of_ones_own_take_the_package_s_place():
    model = model_of("gpt2")
    text = torch.randint(0, 257, (2000,))
    seen = []

    def my_gptq(w, stats, group_size, damp):
        seen.append(stats.rows)
        qt = gptq_quantize(w, stats.hessian, group_size, damp=damp)
        return qt.q, qt.scale

    ours = calibrated_model(model, "gptq", tokens=text, windows=4, length=64)
    theirs = calibrated_model(model, "gptq", tokens=text, windows=4, length=64, gptq=my_gptq)
    assert seen[0] == 4 * 64  # each layer's statistics over its input rows
    for name in layer_names(model):
        a, b = (dict(m.named_modules())[name].quantized() for m in (ours, theirs))
        assert torch.equal(a.q, b.q)
    ones = calibrated_model(model, "awq", tokens=text, windows=4, length=64,
                            awq=lambda w, stats, g, grid: torch.ones(w.shape[1]))
    stats = calibration_stats(model, text, windows=4, length=64)["blocks.0.attn.qkv"]
    clipped = clip_search(model.blocks[0].attn.qkv.weight, stats.hessian, 32)
    assert torch.equal(ones.blocks[0].attn.qkv.quantized().q, clipped.q)  # s = 1: the clip alone
    with raises(BadValue, "awq"):
        calibrated_model(model, "awq", tokens=text, windows=2, length=32,
                         awq=lambda w, stats, g, grid: torch.ones(3))
    with raises(BadValue, "gptq"):
        calibrated_model(model, "awq", gptq=my_gptq)
    measured = calibration_stats(model, text, windows=4, length=64)  # one calibration, reused
    again = calibrated_model(model, "gptq", stats=measured)
    assert torch.equal(again.blocks[1].mlp.fc.quantized().q, ours.blocks[1].mlp.fc.quantized().q)
    with raises(BadValue, "stats"):
        calibrated_model(model, "gptq", stats={"blocks.0.attn.qkv": measured["blocks.0.attn.qkv"]})


def test_statistics_and_the_share_recovered():
    x = correlated_inputs(16, 40, 3).float()
    stats = stats_of(x)
    torch.testing.assert_close(stats.hessian, x.double().T @ x.double() / 40)
    torch.testing.assert_close(stats.mean_abs, x.double().abs().mean(0))
    assert stats.rows == 40
    assert recovered(rtn=2.0, method=1.5, full=1.0) == 0.5
    assert recovered(rtn=2.0, method=2.2, full=1.0) == pytest.approx(-0.2)  # worse than rounding
    assert math.isnan(recovered(rtn=1.0, method=1.0, full=1.0))  # nothing lost, nothing to share


def test_bad_input_is_refused_naming_the_argument():
    model = model_of("gpt2")
    w, h = torch.randn(16, 64), torch.eye(64, dtype=torch.float64)
    with raises(BadValue, "tokens"):
        calibrated_model(model, "gptq", tokens=torch.tensor([], dtype=torch.long))
    with raises(BadValue, "group_size"):
        gptq_quantize(w, h, 48)
    with raises(BadValue, "group_size"):
        calibrated_model(model, "awq", group_size=48)
    with raises(BadValue, "method"):
        calibrated_model(model, "smoothquant")
    with raises(BadValue, "hessian"):
        gptq_quantize(w, torch.full((64, 64), math.nan, dtype=torch.float64), 32)
    with raises(BadValue, "hessian"):
        gptq_quantize(w, torch.eye(32), 32)
    with raises(BadValue, "damp"):
        gptq_quantize(w, h, 32, damp=-0.1)
    singular = torch.ones(64, 64, dtype=torch.float64)  # one direction seen, no damping
    with raises(BadValue, "damp"):
        gptq_quantize(w, singular, 32, damp=0.0)
    gptq_quantize(w, singular, 32)  # damped, it factors
    with raises(BadType, "model"):
        calibrated_model("course", "gptq")
    broken = model_of("gpt2")
    with torch.no_grad():
        broken.blocks[0].attn.qkv.weight[0, 0] = math.inf
    with raises(BadValue, "model"):
        calibration_stats(broken, torch.randint(0, 257, (300,)), windows=2, length=32)
    quantized = calibrated_model(model, "rtn")
    with raises(BadValue, "model"):
        calibrated_model(quantized, "gptq")
