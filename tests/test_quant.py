"""ar_lab.engine.quant: int8 / int4 weights, their fast kernels, and quantized models through every
decode loop."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ar_lab
from ar_lab.base.errors import BadType, BadValue
from ar_lab.engine import lean
from ar_lab.engine.generate import generate, token_steps
from ar_lab.engine.quant import (
    INT4_GROUP_SIZES,
    QuantizedLinear,
    QuantizedTensor,
    dequantize,
    quantization_error,
    quantize_int4,
    quantize_int8,
    quantize_model,
)
from ar_lab.engine.speculative import speculative_generate
from ar_lab.model.cache import KVCache
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.perf.roofline import bytes_per_token, decode_cost, decode_step_bytes, predicted_speedup
from tests.greedy import assert_same_greedy
from tests.raising import raises

PROMPTS = ["def main(args):\n    ", "import os\nimport sys\n", "The for statement"]

# bfloat16 keeps 8 significant bits: unit roundoff u = 2^-9. The kernels round the activations
# (each product w_i x_i off by at most u |w_i x_i|), the scales (u again) and the output (u |y|
# <= u sum |w_i x_i|), and accumulate in float32: |y - dequantize(W) x| <= 3u sum_i |w_i x_i|
# + float32 rounding. Asserted with 4u = 2^-7 times sum_i |w_i x_i|.
KERNEL_RTOL = 2.0**-7


@pytest.fixture(scope="module")
def course():
    return ar_lab.load_pretrained("course", "cpu").eval()


@pytest.fixture(scope="module")
def draft():
    return ar_lab.load_pretrained("draft", "cpu").eval()


@pytest.fixture(scope="module")
def quantized(course):
    return {w: quantize_model(course, weights=w) for w in ("bf16", "int8", "int4")}


@pytest.fixture(scope="module")
def course_greedy(course):
    """The full-precision model's greedy 20 tokens for each prompt (both quantized drafts must give
    them)."""
    return {prompt: generate(course, prompt, 20, eos_id=None).tokens for prompt in PROMPTS}


@st.composite
def matrices(draw, group=False):
    out = draw(st.integers(1, 12))
    size = draw(st.sampled_from([1, 2, 4, 8, 32])) if group else None
    n_in = (size or 1) * draw(st.integers(1, 6))
    values = st.floats(-1e3, 1e3, width=32, allow_subnormal=False)
    w = torch.tensor(draw(st.lists(values, min_size=out * n_in, max_size=out * n_in))).view(
        out, n_in
    )
    if draw(st.booleans()):
        w[draw(st.integers(0, out - 1))] = 0.0  # an all-zero row
    return (w, size) if group else w


def _within_half_a_step(w: torch.Tensor, qt: QuantizedTensor) -> None:
    scale = qt.scale if qt.group_size is None else qt.scale.repeat_interleave(qt.group_size, dim=1)
    scale = scale if scale.ndim == 2 else scale[:, None]
    err = (w - qt.dequantize()).abs()
    assert bool((err <= scale / 2 * (1 + 1e-6)).all()), float((err - scale / 2).max())
    assert bool(torch.isfinite(qt.scale).all()) and bool((qt.scale > 0).all())


@settings(max_examples=60, deadline=None)
@given(w=matrices())
def test_int8_round_trip_is_within_half_a_step(w):
    qt = quantize_int8(w)
    assert qt.q.dtype == torch.int8 and qt.q.shape == w.shape and qt.scale.shape == (w.shape[0],)
    assert qt.scale.dtype == torch.float32 and qt.bits == 8 and qt.group_size is None
    assert int(qt.q.min()) >= -127 and int(qt.q.max()) <= 127
    _within_half_a_step(w, qt)
    rows = w.abs().amax(dim=1) > 0
    torch.testing.assert_close(qt.scale[rows], w.abs().amax(dim=1)[rows] / 127, rtol=0, atol=0)
    # the largest weight of a row uses the full range
    assert bool((qt.q.abs().amax(dim=1)[rows] == 127).all())


@settings(max_examples=60, deadline=None)
@given(wg=matrices(group=True))
def test_int4_round_trip_is_within_half_a_step(wg):
    w, size = wg
    qt = quantize_int4(w, size)
    assert (
        qt.q.dtype == torch.int8
        and qt.q.shape == w.shape
        and qt.scale.shape == (w.shape[0], w.shape[1] // size)
    )
    assert qt.bits == 4 and qt.group_size == size
    assert int(qt.q.min()) >= -8 and int(qt.q.max()) <= 7
    _within_half_a_step(w, qt)


def test_zero_rows_and_groups_dequantize_to_exact_zeros():
    w = torch.randn(3, 64)
    w[1] = 0.0
    w[2, 32:] = 0.0
    for qt in (quantize_int8(w), quantize_int4(w, 32)):
        back = qt.dequantize()
        assert bool(torch.isfinite(back).all()) and bool((back[1] == 0).all())
        assert torch.equal(dequantize(qt), back)
    assert bool((quantize_int4(w, 32).dequantize()[2, 32:] == 0).all())


def test_nbytes_count_packed_weights_and_stored_scales():
    w = torch.randn(16, 128)
    assert quantize_int8(w).nbytes == 16 * 128 + 16 * 4
    assert quantize_int4(w, 32).nbytes == 16 * 128 // 2 + 16 * 4 * 4
    assert quantize_int4(w, 32).shape == (16, 128)


def test_quantization_error_shrinks_with_more_bits_and_smaller_groups():
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    e8, e4, e4_small = (
        quantization_error(w, 8),
        quantization_error(w, 4, 128),
        quantization_error(w, 4, 32),
    )
    assert e8.rms < e4_small.rms < e4.rms
    assert e8.max_abs <= float(quantize_int8(w).scale.max()) / 2 * (1 + 1e-6)
    assert e8.relative_rms == pytest.approx(e8.rms / float(w.square().mean().sqrt()))
    assert quantization_error(torch.zeros(2, 32), 4).relative_rms == 0.0


@pytest.mark.parametrize(
    "call, arg",
    [
        # does not divide the 256 input columns
        (lambda: quantize_int4(torch.randn(4, 256), 96), "group_size"),
        (lambda: quantize_int4(torch.randn(4, 256), 0), "group_size"),
        (lambda: quantize_int4(torch.randn(4, 256), True), "group_size"),
        (lambda: quantize_int4(torch.randn(4, 256), 32.0), "group_size"),
        (lambda: quantize_int8(torch.randn(5)), "weight"),  # not a 2-D (out, in) matrix
        (lambda: quantize_int8(torch.ones(2, 2, dtype=torch.long)), "weight"),  # not floating-point
        (lambda: quantize_int8(torch.tensor([[1.0, float("nan")]])), "weight"),  # NaN
        (lambda: quantization_error(torch.randn(4, 32), 3), "bits"),
        # int8 takes no group size
        (lambda: quantization_error(torch.randn(4, 32), 8, 32), "group_size"),
    ],
)
def test_bad_arguments_are_explained(call, arg):
    with raises(BadValue, arg):
        call()


def test_bad_model_arguments_are_explained(tiny_model, quantized):
    with raises(BadValue, 'weights'):
        quantize_model(tiny_model, weights="int3")
    with raises(BadValue, 'group_size'):
        quantize_model(tiny_model, weights="int4", group_size=16)
    with raises(BadValue, 'group_size'):
        quantize_model(tiny_model, weights="int8", group_size=32)
    with raises(BadValue, 'group_size'):
        quantize_model(tiny_model, weights="int4", group_size=64)
    with raises(BadValue, 'model'):
        quantize_model(quantized["int8"], weights="int4")
    with raises(BadType, 'model'):
        quantize_model(nn.Linear(2, 2), weights="int8")
    with raises(BadValue, 'qt'):
        QuantizedLinear(quantize_int4(torch.randn(8, 32)))
    with raises(BadType, 'qt'):
        dequantize(torch.randn(2, 2))


@pytest.mark.parametrize("bits, group_size", [(8, None), (4, 32), (4, 64), (4, 128), (4, 256)])
@pytest.mark.parametrize("rows", [1, 5])
def test_kernels_equal_the_dequantized_product(bits, group_size, rows):
    torch.manual_seed(bits + rows)
    n_out, n_in = 48, 512
    layer = QuantizedLinear.from_linear(nn.Linear(n_in, n_out), bits, group_size)
    qt = layer.quantized()
    assert qt.bits == bits and qt.group_size == group_size and qt.q.shape == (n_out, n_in)
    # what the layer stands for (its scales as the kernel stores them, bfloat16)
    w = qt.dequantize()
    x = torch.randn(rows, n_in)
    got = layer.matmul(x).float()
    bound = KERNEL_RTOL * (x.abs() @ w.abs().t()) + 1e-6
    assert bool(((got - x @ w.t()).abs() <= bound).all())
    torch.testing.assert_close(layer(x), got + layer.bias, rtol=0, atol=0)
    # one row of a many-row product is the one-row product, bit for bit (decode step == verify pass)
    for i in range(rows):
        assert torch.equal(layer.matmul(x[i : i + 1])[0], layer.matmul(x)[i])
    assert torch.equal(layer.addmv(layer.bias, x[0]), layer.addmm(layer.bias, x[:1])[0])


@pytest.mark.parametrize("group_size", INT4_GROUP_SIZES)
def test_int4_layer_gives_back_the_exact_integers(group_size):
    torch.manual_seed(group_size)
    w = torch.randn(32, 512)
    qt = quantize_int4(w, group_size)
    back = QuantizedLinear(qt).quantized()
    assert torch.equal(back.q, qt.q)
    torch.testing.assert_close(back.scale, qt.scale.bfloat16().float(), rtol=0, atol=0)
    qt8 = quantize_int8(w)
    assert torch.equal(QuantizedLinear(qt8).quantized().q, qt8.q)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8", "int4"])
def test_quantize_model_returns_a_new_model_and_leaves_the_original(course, weights):
    before = _state(course)
    new = quantize_model(course, weights=weights)
    assert new is not course and all(type(b.mlp.fc) is nn.Linear for b in course.blocks)
    after = course.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # still tied, own copy
    assert new.lm_head.weight is new.wte.weight and new.wte.weight is not course.wte.weight
    assert lean.supports(new)
    linears = [m for b in new.blocks for m in (b.attn.qkv, b.attn.proj, b.mlp.fc, b.mlp.proj)]
    if weights in ("int8", "int4"):
        assert all(type(m) is QuantizedLinear and m.bits == int(weights[3]) for m in linears)
        assert new.wte.weight.dtype == torch.float32
    else:
        dtype = torch.float32 if weights == "fp32" else torch.bfloat16
        assert all(p.dtype == dtype for p in new.parameters())
        assert all(type(m) is nn.Linear for m in linears)


def test_bytes_per_token_counts_what_each_format_stores(course, quantized):
    cfg = course.config
    fp32 = bytes_per_token(course)
    assert fp32 == decode_cost(cfg, 1).weight_bytes  # the roofline's count of the same reads
    assert bytes_per_token(quantized["bf16"]) == decode_cost(cfg, 1, bytes_per_value=2).weight_bytes
    int8, int4 = bytes_per_token(quantized["int8"]), bytes_per_token(quantized["int4"])
    assert int4 < int8 < bytes_per_token(quantized["bf16"]) < fp32
    layers = [
        m for b in quantized["int8"].blocks for m in (b.attn.qkv, b.attn.proj, b.mlp.fc, b.mlp.proj)
    ]
    linear_fp32 = sum(
        m.weight.nbytes + m.bias.nbytes
        for b in course.blocks
        for m in (b.attn.qkv, b.attn.proj, b.mlp.fc, b.mlp.proj)
    )
    assert fp32 - int8 == linear_fp32 - sum(m.nbytes for m in layers)
    assert predicted_speedup(course, course) == 1.0
    assert (
        predicted_speedup(course, quantized["int4"], context=64)
        > predicted_speedup(course, quantized["int8"], context=64)
        > 1
    )
    # a longer context adds the same KV bytes to both: the predicted ratio shrinks toward 1
    assert predicted_speedup(course, quantized["int8"], context=512) < predicted_speedup(
        course, quantized["int8"]
    )
    assert decode_step_bytes(course, 1) == decode_cost(cfg, 1).bytes


def test_quantized_logits_stay_close_to_full_precision(course, quantized):
    """Bounds: the course model's logits span about +-16; int8 moves them by well under 1% of that
    (per-row error ~0.4% of a weight's scale), int4 by a few percent: 5% and 15% of the largest
    logit."""
    idx = torch.tensor([list(b"def main(args):\n    return os.path.join(")])
    with torch.inference_mode():
        want = course(idx)[0]
        top = float(want.abs().max())
        for weights, share in (("int8", 0.05), ("int4", 0.15), ("bf16", 0.05)):
            got = quantized[weights](idx)[0].float()
            assert float((got - want).abs().max()) < share * top, weights
            assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) > 0.8, weights


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_lean_and_forward_agree_and_speculative_is_exact(
    quantized, course, draft, course_greedy, weights
):
    """Token for token, unless the two sides part at a near-tie: PyTorch's int8 and int4 kernels
    round the activations to bfloat16 (u = 2^-9), and one row (a decode step) and several (a forward
    pass, a verify pass) take different kernels, so the same logits of about 5 can differ by 0.01
    (measured on an AVX2 CPU: the top two 0.009 apart at token 19, and the two paths chose
    differently)."""
    model = quantized[weights]
    for prompt in PROMPTS:
        tokens = generate(model, prompt, 20, eos_id=None).tokens
        assert_same_greedy(
            model, prompt, tokens, generate(model, prompt, 20, eos_id=None, lean=False).tokens, 0.05
        )
        # quantized target: speculative greedy is the target's greedy text
        for lean_path in (True, False):
            got = speculative_generate(
                model, draft, prompt, 20, 4, eos_id=None, lean=lean_path
            ).tokens
            assert_same_greedy(model, prompt, tokens, got, 0.05)
        # quantized draft of the full-precision model: the full-precision greedy text
        got = speculative_generate(course, model, prompt, 20, 4, eos_id=None).tokens
        assert_same_greedy(course, prompt, course_greedy[prompt], got)


def test_bf16_model_runs_lean_and_forward(quantized):
    model = quantized["bf16"]
    c1, c2 = KVCache.for_model(model), KVCache.for_model(model)
    assert c1.k[0].dtype == torch.bfloat16
    ids = torch.tensor([list(b"import os\n")])
    engine = lean.for_model(model)
    with torch.inference_mode():
        model(ids, c1), model(ids, c2)
        got, want = engine.step(32, c1), model(torch.tensor([[32]]), c2)[0, -1]
    # both in bfloat16 throughout
    torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=0.02)
    assert len(generate(model, PROMPTS[0], 10, eos_id=None).tokens) == 10


def test_a_reused_cache_gives_the_fresh_tokens(quantized):
    model = quantized["int4"]
    cache = KVCache.for_model(model, max_len=80)
    first = generate(model, PROMPTS[0], 20, eos_id=None, cache=cache)
    again = generate(model, PROMPTS[0] + "x = 1\n", 20, eos_id=None, cache=cache).tokens
    assert again == generate(model, PROMPTS[0] + "x = 1\n", 20, eos_id=None).tokens
    assert first.tokens == generate(model, PROMPTS[0], 20, eos_id=None).tokens


def _zero_in_place(layer):
    layer.qweight.zero_()


def _reassign(layer):
    layer.qweight = torch.zeros_like(layer.qweight)


def _scales_through_data(layer):
    target = layer.scales if layer.bits == 8 else layer.scales_and_zeros
    target.data.mul_(-1)


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("edit", [_zero_in_place, _reassign, _scales_through_data])
def test_edits_of_quantized_weights_are_seen(course, quantized, weights, edit):
    model = quantize_model(course, weights=weights)
    engine = lean.for_model(model)
    before = generate(model, PROMPTS[1], 20, eos_id=None).tokens
    paused, plain = (
        token_steps(model, PROMPTS[1], 12),
        token_steps(model, PROMPTS[1], 12, lean=False),
    )
    head = [next(paused) for _ in range(4)], [next(plain) for _ in range(4)]
    for b in model.blocks:
        edit(b.mlp.fc)
    want = generate(model, PROMPTS[1], 20, eos_id=None, lean=False).tokens
    assert want != before
    assert generate(model, PROMPTS[1], 20, eos_id=None).tokens == want
    # a paused stream continues on the edit
    assert head[0] == head[1] and list(paused) == list(plain)
    ids = torch.tensor([[5, 6, 7, 8]])
    a, b = KVCache.for_model(model), KVCache.for_model(model)
    with torch.inference_mode():
        want_logits = model(ids, b)[0]
        unedited = quantized[weights](ids)[0]
        model(ids[:, :1], a)
        torch.testing.assert_close(engine.step(6, a), want_logits[1], atol=1e-4, rtol=1e-4)
        got = engine.extend([7, 8], a, lean.extend_copies(model))
    # A zeroed matrix leaves each layer's MLP a constant, and LayerNorm then magnifies float
    # rounding: CPUs' kernels differ there (a few 1e-3 on one, 0.024 on one logit of 514 on an AMX
    # Xeon, whose int8 kernel takes another path for 2 rows than for 4). The edit itself moves the
    # logits 20x further.
    torch.testing.assert_close(got, want_logits[2:], atol=5e-2, rtol=1e-3)
    moved = (want_logits[2:] - unedited[2:]).abs().max()
    assert moved > 0.5 and (got - want_logits[2:]).abs().max() < moved / 20


def test_threads_share_a_quantized_model(quantized):
    model = quantized["int8"]
    alone = [generate(model, p, 15, eos_id=None).tokens for p in PROMPTS]
    got: dict[int, list[int]] = {}
    threads = [
        threading.Thread(
            target=lambda i=i: got.__setitem__(
                i, generate(model, PROMPTS[i], 15, eos_id=None).tokens
            )
        )
        for i in range(len(PROMPTS))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(len(PROMPTS))] == alone


def test_random_small_model_quantizes_and_generates():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64)).eval()
    for weights in ("int8", "int4"):
        q = quantize_model(model, weights=weights)
        assert (
            generate(q, "hi", 8, eos_id=None).tokens
            == generate(q, "hi", 8, eos_id=None, lean=False).tokens
        )


def test_the_weights_only_floor_reads_the_quantized_layers(quantized, monkeypatch):
    calls = []
    original = QuantizedLinear.matmul
    monkeypatch.setattr(
        QuantizedLinear, "matmul", lambda self, x: calls.append(self) or original(self, x)
    )
    lean.weights_only_pass(quantized["int4"], 2)
    # every quantized layer, every step
    assert len(calls) == 2 * 4 * quantized["int4"].config.n_layer


def test_quantize_model_runs_a_quantizer_of_ones_own_and_checks_its_answer():
    """quantizer= (chapter 09's learner passes theirs): one written from the rule gives ar_lab's
    layers exactly; a wrong answer is refused with what was wrong; the model's own weights are never
    written."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def int8(w):
        absmax = w.abs().amax(1)
        scale = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax))
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        w.zero_()  # a quantizer that scribbles on its input: the model must not notice
        return q, scale

    def int4(w, size):
        g = w.view(w.shape[0], -1, size)
        absmax = g.abs().amax(-1)
        scale = torch.where(absmax > 0, absmax / 7, torch.ones_like(absmax))
        return torch.round(g / scale[..., None]).clamp(-7, 7).to(torch.int8).view(w.shape), scale

    for fmt, fn, kw in [("int8", int8, {}), ("int4", int4, {"group_size": 32})]:
        own, ref = (
            quantize_model(model, weights=fmt, quantizer=fn, **kw),
            quantize_model(model, weights=fmt, **kw),
        )
        for a, b in zip(own.buffers(), ref.buffers(), strict=True):
            assert torch.equal(a, b), fmt
        ids = torch.tensor([[1, 2, 3]])
        assert torch.equal(own(ids), ref(ids))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    for bad, _why in [
        (lambda w: w, "must return \\(q, scale\\)"),
        (lambda w: (w, w.abs().amax(1)), "int8 tensor"),
        (lambda w: (torch.zeros_like(w, dtype=torch.int8), torch.zeros(w.shape[0])), "positive"),
    ]:
        with raises(BadValue, 'quantizer'):
            quantize_model(model, weights="int8", quantizer=bad)
    with raises(BadValue, 'quantizer'):
        quantize_model(
            model,
            weights="int4",
            quantizer=lambda w, s: (
                torch.full_like(w, 9, dtype=torch.int8),
                torch.ones(w.shape[0], w.shape[1] // s),
            ),
        )
    with raises(BadValue, 'quantizer'):
        quantize_model(model, weights="bf16", quantizer=int4)
