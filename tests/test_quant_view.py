"""Chapter 09's explorer (ar_lab.course.views.quant_view) and exercise checkers
(ar_lab.course.checkers.quant_checks)."""

import pytest
import torch

import ar_lab
from ar_lab.base.errors import BadValue
from ar_lab.course.checkers.checks import CheckFailed
from ar_lab.course.checkers.quant_checks import check_quantized, int4_mistakes, int8_mistakes
from ar_lab.course.views.quant_view import (
    check_group_size,
    group_error,
    levels,
    quant_explorer,
    quant_view,
    quantize_groups,
    step_bytes,
    weight_bytes,
)
from ar_lab.engine.quant import (
    INT4_GROUP_SIZES,
    quantization_error,
    quantize_int4,
    quantize_int8,
    quantize_model,
)
from ar_lab.model.gpt import GPTConfig
from ar_lab.perf.measure import CONFIGS
from ar_lab.perf.roofline import bytes_per_token, predicted_speedup
from tests.raising import mistaken, raises


@pytest.fixture(scope="module")
def course():
    return ar_lab.load_pretrained("course", "cpu")


@pytest.fixture(scope="module")
def weights(course):
    return {n: p for n, p in course.named_parameters() if n.startswith("blocks.") and p.ndim == 2}


def test_quantize_groups_is_the_packages_rule():
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    q, s = quantize_groups(w, 8, None)
    ref = quantize_int8(w)
    assert torch.equal(q, ref.q) and torch.equal(s[:, 0], ref.scale)
    for g in (1, 8, 32, 64):
        q, s = quantize_groups(w, 4, g)
        ref = quantize_int4(w, g)
        assert torch.equal(q, ref.q) and torch.equal(s, ref.scale)
        assert group_error(w, 4, g) == quantization_error(w, 4, g)
    assert group_error(w, 8, None) == quantization_error(w, 8)
    assert group_error(w, 4, 8).rms < group_error(w, 4, 32).rms < group_error(w, 4, None).rms
    # any combination, not just the package's two
    assert group_error(w, 8, 16).rms < group_error(w, 8, None).rms


@pytest.mark.parametrize(
    "weights_, group",
    [("fp32", None), ("bf16", None), (8, None)] + [(4, g) for g in INT4_GROUP_SIZES],
)
def test_byte_formula_equals_the_quantized_models_bytes(course, weights_, group):
    name = weights_ if isinstance(weights_, str) else f"int{weights_}"
    model = quantize_model(course, weights=name, **({"group_size": group} if group else {}))
    assert weight_bytes(course.config, weights_, group) == bytes_per_token(model)
    fp32 = quantize_model(course, weights="fp32")
    assert step_bytes(course.config, "fp32", context=40) / step_bytes(
        course.config, weights_, group, 40
    ) == pytest.approx(predicted_speedup(fp32, model, context=40), rel=1e-12)


def test_levels_and_group_sizes_are_checked_not_adjusted():
    assert (levels(8), levels(4)) == (127, 7)
    for bad in (3, 16, 8.0, True, "8"):
        with raises(BadValue, 'bits'):
            levels(bad)
    assert (
        check_group_size(0, 256) is None
        and check_group_size(None, 256) is None
        and check_group_size(32, 256) == 32
    )
    for bad in (-1, 100, 512, 3.0, True, "32"):
        with raises(BadValue, 'group_size'):
            check_group_size(bad, 256)


def test_quant_view_reports_error_bytes_and_prediction(weights, course):
    configs = {"course": course.config, "100 M": CONFIGS["small"]}
    v = quant_view(weights, "blocks.0.mlp.fc.weight", 4, 32, configs)
    w = weights["blocks.0.mlp.fc.weight"]
    assert v.error == quantization_error(w, 4, 32) and v.error_int8 == quantization_error(w, 8)
    assert v.bits_per_weight == 4 + 32 / 32 and v.label == "int4, groups of 32"
    assert torch.equal(v.row, w[0, :64].detach()) and torch.equal(
        v.row_dequantized, quantize_int4(w, 32).dequantize()[0, :64]
    )
    course_row = v.models[0]
    assert (
        course_row.fp32 == step_bytes(course.config, "fp32")
        and course_row.predicted_speedup == course_row.fp32 / course_row.chosen
    )
    # weights dominate a larger model's bytes
    assert v.models[1].predicted_speedup > course_row.predicted_speedup
    per_row = quant_view(weights, "blocks.0.mlp.fc.weight", 8, 0, configs)
    assert per_row.group_size is None and per_row.label == "int8, one scale per row"
    with raises(BadValue, 'layer'):
        quant_view(weights, "wte", 8, 0, configs)
    with raises(BadValue, 'group_size'):
        quant_view(weights, "blocks.0.mlp.fc.weight", 4, 100, configs)
    # 96 is not a multiple of 64
    big = {"wide": GPTConfig(block_size=64, n_layer=1, n_head=3, n_embd=96)}
    with raises(BadValue, 'group_size'):
        quant_view(weights, "blocks.0.mlp.fc.weight", 4, 64, big)


def test_explorer_headless(course):
    ex = quant_explorer(
        course, {"course": course.config}, layer="blocks.1.attn.qkv.weight", bits=4, group_size=32
    )
    assert (
        ex.error == ""
        and ex.view.label == "int4, groups of 32"
        and ex.image.value[:4] == b"\x89PNG"
    )
    assert "relative RMS error" in ex.status.value and "predicted speedup" in ex.status.value
    ex.bits.value = 8
    assert ex.view.bits == 8 and "int8, groups of 32" in ex.status.value
    ex.group_size.value = 0
    assert ex.view.group_size is None
    before = ex.view
    ex.group_size.value = 1000  # refused, shown, the box keeps it; the last good view is kept
    assert "group size must be 0 (one scale per row) or a whole number from 1 to 256" in ex.error
    assert (
        ex.error in ex.status.value.replace("&#x27;", "'")
        and ex.group_size.value == 1000
        and ex.view is before
    )
    ex.group_size.value = 64
    assert ex.error == "" and ex.view.group_size == 64
    ex.layer.value = "blocks.3.mlp.proj.weight"
    assert ex.view.shape == (256, 1024)


# --- the exercise checkers --------------------------------------------------------------


def _right_int8(w):
    a = w.abs().amax(1)
    s = torch.where(a > 0, a / 127, torch.ones_like(a))
    return torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8), s


def _wrong_int8(w, kind):
    a = {"max": w.amax(1), "abs": w.abs().amax(1)}["max" if kind == "max" else "abs"]
    s = a / 127
    x = w / s[:, None]
    if kind == "max":
        return x.round().to(torch.int8), s
    if kind == "max-clamp":
        return x.round().clamp(-127, 127).to(torch.int8), w.amax(1) / 127
    if kind == "floor":
        return x.floor().to(torch.int8), s
    if kind == "trunc":
        return x.to(torch.int8), s
    if kind == "128":
        s = a / 128
        return (w / s[:, None]).round().clamp(-128, 127).to(torch.int8), s
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind, named",
    [
        ("max", "a scale from max w and no clamp"),
        ("floor", "rounding down (floor)"),
        ("trunc", "truncation"),
        ("128", "128 levels"),
    ],
)
def test_int8_checker_names_the_mistake(kind, named):
    torch.manual_seed(1)
    w = torch.randn(12, 20)
    w[4, 7] = -6.0  # the largest magnitude of row 4 is negative
    ref = quantize_int8(w)
    check_quantized("right", _right_int8(w), (ref.q, ref.scale), int8_mistakes(w))
    with mistaken(named):
        check_quantized("wrong", _wrong_int8(w, kind), (ref.q, ref.scale), int8_mistakes(w))


def test_int8_checker_explains_shapes_dtypes_and_unknown_mistakes():
    w = torch.randn(6, 8)
    ref = quantize_int8(w)
    mistakes = int8_mistakes(w)
    with pytest.raises(CheckFailed, match="torch.int8"):
        check_quantized("x", (ref.q.float(), ref.scale), (ref.q, ref.scale), mistakes)
    with pytest.raises(CheckFailed, match="pair"):
        check_quantized("x", ref.q, (ref.q, ref.scale), mistakes)
    with pytest.raises(CheckFailed, match="expected shape"):
        check_quantized("x", (ref.q, ref.scale[:3]), (ref.q, ref.scale), mistakes)
    odd = ref.q.clone()
    odd[2, 5] += 1
    with pytest.raises(CheckFailed, match="first row that differs is 2"):
        check_quantized("x", (odd, ref.scale), (ref.q, ref.scale), mistakes)
    col = w.abs().amax(0) / 127
    with pytest.raises(CheckFailed, match="one scale per input column"):
        check_quantized(
            "x", (torch.round(w / col).to(torch.int8), col), (ref.q, ref.scale), mistakes
        )


def test_int8_checker_accepts_ties_rounded_either_way_and_nothing_else(capsys):
    # scale 1: exact halves
    w = torch.tensor([[127.0, 63.5, -2.5, 0.5, 10.2], [-127.0, 1.5, 3.0, -64.5, 0.0]])
    ref = quantize_int8(w)
    # round half up: differs from torch.round only on the halves
    half_up = torch.floor(w + 0.5).to(torch.int8)
    assert not torch.equal(half_up, ref.q)
    # without the weights no tie can be told
    with pytest.raises(CheckFailed, match="values differ"):
        check_quantized("x", (half_up, ref.scale), (ref.q, ref.scale), int8_mistakes(w))
    check_quantized("x", (half_up, ref.scale), (ref.q, ref.scale), int8_mistakes(w), weights=w)
    assert "weights lie exactly halfway between two levels" in capsys.readouterr().out
    wrong = half_up.clone()
    wrong[1, 2] += 1  # 3.0 is no tie
    with pytest.raises(
        CheckFailed, match=r"first row that differs is 1 .*index \(1, 2\): expected 3, got 4"
    ):
        check_quantized("x", (wrong, ref.scale), (ref.q, ref.scale), int8_mistakes(w), weights=w)
    two_off = ref.q.clone()
    two_off[0, 1] += 2  # a tie, but two levels away
    with pytest.raises(CheckFailed, match="values differ"):
        check_quantized("x", (two_off, ref.scale), (ref.q, ref.scale), int8_mistakes(w), weights=w)


def test_int8_checker_accepts_w_times_127_over_absmax_on_the_course_weights():
    # (1024, 256)
    W = ar_lab.load_pretrained("course", device="cpu").blocks[0].mlp.fc.weight.detach()
    ref = quantize_int8(W)
    q = torch.round(W * (127 / W.abs().amax(1, keepdim=True))).clamp(-127, 127).to(torch.int8)
    assert 0 < int((q != ref.q).sum()) < 100  # a few dozen ties land the other way
    # the first tie that landed the other way, in row order
    differ = (q != ref.q).nonzero()[0].tolist()
    want, got = int(ref.q[differ[0], differ[1]]), int(q[differ[0], differ[1]])
    # without the weights: a plain mismatch
    with pytest.raises(CheckFailed, match=f"expected {want}, got {got}"):
        check_quantized("x", (q, ref.scale), (ref.q, ref.scale), int8_mistakes(W))
    check_quantized("x", (q, ref.scale), (ref.q, ref.scale), int8_mistakes(W), weights=W)


def test_int4_checker_names_groups_along_the_wrong_axis():
    torch.manual_seed(2)
    w, g = torch.randn(16, 32), 8
    ref = quantize_int4(w, g)
    cols = w.t().reshape(32, 2, g)
    s = cols.abs().amax(-1, keepdim=True) / 7
    q = (cols / s).round().clamp(-7, 7).reshape(32, 16).t().to(torch.int8)
    with mistaken("groups of consecutive rows"):
        check_quantized("axis", (q, s[..., 0].t()), (ref.q, ref.scale), int4_mistakes(w, g))
    groups = w.view(16, 4, g)
    s8 = groups.abs().amax(-1) / 8
    q8 = (groups / s8[..., None]).round().clamp(-8, 7).view(16, 32).to(torch.int8)
    with mistaken("8 levels"):
        check_quantized("levels", (q8, s8), (ref.q, ref.scale), int4_mistakes(w, g))
    check_quantized(
        "right", (ref.q.clone(), ref.scale.clone()), (ref.q, ref.scale), int4_mistakes(w, g)
    )
