"""Bad input to the claims, the GPU datasheets, the real-model costs and chapter 05/09's views and
explorers.

Each case is a call a learner could make: it either gives the right answer (a natural spelling,
a name where an object is expected) or an error naming the argument and what to pass, never a
silent wrong number or an error from deep inside torch or ipywidgets. Explorers refuse a bad
number in the widget: the box keeps what was typed and ``error`` (shown in the status) says why.
"""

from __future__ import annotations

import html

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from ar_lab.base.errors import ArLabError, BadType, BadValue, ContextFull
from ar_lab.course.checkers.claims import ClaimFailed, claim, magnitude, plural, say
from ar_lab.course.views import gpu_view as gv
from ar_lab.course.views.gpu_explorer import GPUExplorer, format_time, scenario_html
from ar_lab.course.views.quant_view import quant_explorer, quant_view, weight_bytes
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.perf import gpus
from ar_lab.perf import llm_costs as lc
from tests.raising import check_error, raises

H100 = gpus.GPUS["H100 SXM"]
LLAMA2 = lc.MODELS["Llama-2-13B"]  # 4,096 positions, 819,200 bytes of bf16 KV cache per position


def refused(call) -> BaseException:
    """The error ``call`` raises (a ValueError or TypeError), for ``check_error``."""
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    return info.value


# --- claims: only a real boolean can hold -------------------------------------------------


@pytest.mark.parametrize(
    "holds",
    [
        [False],
        "False",
        float("nan"),
        torch.tensor(float("nan")),
        1,
        None,
        torch.tensor(1.0),
        torch.tensor([True, True]),
        np.array([1, 2]) > 0,
    ],
    ids=[
        "list",
        "str",
        "nan",
        "nan tensor",
        "int",
        "None",
        "float tensor",
        "bool tensor of 2",
        "numpy array of 2",
    ],
)
def test_a_claim_that_cannot_fail_is_refused(holds):
    with raises(BadType, 'holds'):
        claim("x", holds)


def test_real_booleans_hold_or_fail():
    for yes in (True, np.bool_(True), torch.tensor(3.0) > 2, np.float64(3) > 2):
        claim("holds", yes)
    for no in (False, np.bool_(False), torch.tensor(3.0) < 2):
        with pytest.raises(ClaimFailed, match="'fails'"):
            claim("fails", no)
    with raises(BadType, 'name'):
        claim(True, "the arguments swapped")


def test_prose_helpers_refuse_what_they_cannot_render():
    assert magnitude(np.float32(2.0)) == "2 × 10⁰"  # numpy numbers are numbers
    with raises(BadValue, 'x'):
        magnitude(True)
    with raises(BadType, 'word'):
        plural(2, None)
    with raises(BadType, 'text'):
        say(None)


# --- the GPU datasheets: weight formats in any spelling ------------------------------------


@pytest.mark.parametrize("spelling", ["fp32", "FP32", "float32", " Float32 ", torch.float32])
def test_every_spelling_of_fp32_gets_the_fp32_roof(spelling):
    assert H100.peak_flops(spelling) == H100.fp32_flops


@pytest.mark.parametrize(
    "spelling", ["bf16", "BF16", "bfloat16", torch.bfloat16, "INT8", torch.int8, "Int4"]
)
def test_the_16_bit_formats_get_the_tensor_roof(spelling):
    assert H100.peak_flops(spelling) == H100.tensor_flops


@pytest.mark.parametrize("bad", ["int3", "fp16", torch.float16, None, 32, ""])
def test_an_unknown_weight_format_is_refused_with_the_accepted_ones(bad):
    text = str(refused(lambda: H100.peak_flops(bad)))  # the message lists what is accepted
    assert (
        "weight_dtype must be one of ['fp32', 'bf16', 'int8', 'int4']" in text and repr(bad) in text
    )


def test_gpu_lookups_name_what_to_pass():
    for bad in (None, ["H100 SXM"], "H100"):
        text = str(refused(lambda b=bad: gpus.gpu(b)))  # the message lists what is accepted
        assert text.startswith(f"unknown GPU {bad!r}; choose one of") and "'H100 SXM'" in text
    check_error(refused(lambda: gpus.match_gpu(None)), BadType, 'device_name')
    assert gpus.spec_rows(["H100 SXM"]) == gpus.spec_rows([H100])
    check_error(refused(lambda: gpus.spec_rows(H100)), BadType, 'specs')
    assert gpus.as_gpu("T4") is gpus.GPUS["T4"]
    check_error(refused(lambda: gpus.as_gpu(1)), BadType, "gpu")


# --- real models' costs: the same contexts as decode_cost ----------------------------------


@pytest.mark.parametrize(
    "context, batch, kind, arg",
    [
        (-5, 1, BadValue, "context"),
        (0, 1, BadValue, "context"),
        (2.5, 1, BadValue, "context"),
        (True, 1, BadValue, "context"),
        (5000, 1, ContextFull, "context"),
        (100, -2, BadValue, "batch"),
        (100, 0.5, BadValue, "batch"),
    ],
)
def test_kv_memory_refuses_what_decode_cost_refuses_with_its_message(context, batch, kind, arg):
    check_error(refused(lambda: lc.decode_cost(LLAMA2, context, batch)), kind, arg)
    check_error(refused(lambda: lc.kv_memory(LLAMA2, context, batch)), kind, arg)
    check_error(refused(lambda: lc.memory_needed(LLAMA2, context, batch)), kind, arg)
    if batch == 1:
        check_error(refused(lambda: lc.max_batch(LLAMA2, 80e9, context)), kind, arg)


def test_valid_contexts_keep_their_costs():
    assert (
        lc.kv_memory(LLAMA2, 4096) == 4096 * 819_200
        and lc.kv_memory(LLAMA2, np.int64(10), 2) == 2 * 8_192_000
    )
    assert lc.decode_cost(LLAMA2, np.int64(10)) == lc.decode_cost(LLAMA2, 10)
    assert lc.weight_memory(LLAMA2, "BF16") == lc.weight_memory(LLAMA2) == 2 * LLAMA2.parameters
    assert lc.decode_cost(LLAMA2, 10, 1, torch.float32) == lc.decode_cost(LLAMA2, 10, 1, "fp32")
    assert lc.value_bytes("FP32") == 4 and lc.kv_memory("Llama-2-13B", 10) == lc.kv_memory(
        LLAMA2, 10
    )


@pytest.mark.parametrize("memory", [-1, 0, float("nan"), float("inf"), "80GB", H100])
def test_max_batch_needs_a_number_of_bytes(memory):
    check_error(refused(lambda: lc.max_batch(LLAMA2, memory, 100)), ArLabError, "memory")


def test_a_gpu_or_model_can_be_named_and_anything_else_is_refused():
    cost = lc.decode_cost(LLAMA2, 2500)
    assert lc.place_decode(LLAMA2, "H100 SXM", 2500) == lc.place_decode(LLAMA2, H100, 2500)
    assert lc.place_decode("Llama-2-13B", H100, 2500, "BF16") == lc.place_decode(LLAMA2, H100, 2500)
    assert lc.predicted_time(cost, "H100 SXM") == lc.predicted_time(cost, H100)
    check_error(refused(lambda: lc.place_decode(LLAMA2, "H100", 2500)), BadValue, 'gpu')
    check_error(refused(lambda: lc.predicted_time(cost, "H100")), BadValue, 'gpu')
    check_error(refused(lambda: lc.place_decode(LLAMA2, None, 2500)), BadType, 'gpu')
    check_error(refused(lambda: lc.predicted_time(cost, None)), BadType, 'gpu')
    check_error(refused(lambda: lc.predicted_time(None, H100)), BadType, 'cost')
    check_error(refused(lambda: lc.predicted_time(cost, H100, "int3")), BadValue, 'weight_dtype')
    check_error(refused(lambda: lc.kv_memory(None, 10)), BadType, 'shape')
    check_error(refused(lambda: lc.weight_memory(None)), BadType, 'shape')
    check_error(refused(lambda: lc.model(["x"])), BadValue, 'name')


# --- chapter 05's views --------------------------------------------------------------------


def test_gpu_scenario_refuses_a_context_shorter_than_the_prompt_and_takes_rows_or_spellings():
    check_error(
        refused(lambda: gv.gpu_scenario("H100 SXM", "Llama-2-13B", prompt_len=3000, context=100)),
        BadValue,
        "context",
    )
    assert gv.gpu_scenario(H100, LLAMA2) == gv.gpu_scenario("H100 SXM", "Llama-2-13B")
    assert gv.gpu_scenario("H100 SXM", "Llama-2-13B", "FP32").weight_dtype == "fp32"
    check_error(refused(lambda: gv.gpu_scenario(None, "Llama-2-13B")), BadType, 'gpu_name')
    check_error(refused(lambda: gv.gpu_scenario("T4", None)), BadType, 'model_name')


def test_gpu_view_functions_say_what_to_pass():
    ax = plt.figure().gca()
    check_error(refused(lambda: gv.plot_gpu_roof(ax, None)), BadType, 'spec')
    check_error(refused(lambda: gv.plot_gpu_roof(ax, H100, "int3")), BadValue, 'weight_dtype')
    check_error(refused(lambda: gv.plot_scenario(ax, None)), BadType, 's')
    check_error(refused(lambda: gv.plot_decode_intensity(ax, None, H100, [128])), BadType, 'shape')
    check_error(refused(lambda: gv.plot_decode_intensity(ax, LLAMA2, None, [128])), BadType, 'spec')
    for contexts in ([], 128):
        check_error(
            refused(lambda c=contexts: gv.plot_decode_intensity(ax, LLAMA2, H100, c)),
            BadType,
            "contexts",
        )
    check_error(
        refused(lambda: gv.plot_decode_intensity(ax, LLAMA2, H100, [128], max_b=0)),
        BadValue,
        "max_b",
    )
    for bad in (None, {}):
        check_error(refused(lambda b=bad: gv.spec_comparison(b)), BadType, 'result')
    check_error(refused(lambda: gv.result_label(None)), BadType, 'result')
    check_error(refused(lambda: gv.comparison_rows(None)), BadType, 'comparison')
    check_error(refused(lambda: gv.measure_config(-1)), BadValue, 'memory')
    check_error(refused(lambda: gv.measure_gpu("banana")), BadValue, 'device')
    check_error(refused(lambda: scenario_html(None)), BadType, 's')
    for bad in (-1, float("nan"), "1"):
        check_error(refused(lambda b=bad: format_time(b)), BadValue, 'seconds')
    plt.close("all")


# --- chapter 05's explorer: a refused number stays as typed ----------------------------------


@pytest.fixture(scope="module")
def explorer():
    ex = GPUExplorer()
    yield ex
    plt.close("all")


def shows_refusal(ex, arg: str) -> None:
    check_error(ex.refused, ValueError, arg)
    assert ex.error == str(ex.refused)
    assert html.escape(ex.error) in ex.status.value and ex.scenario is None


@pytest.mark.parametrize(
    "control, value, arg",
    [
        ("batch", 0, "batch"),
        ("batch", -3, "batch"),
        ("batch", 2.7, "batch"),
        ("prompt_len", 0, "prompt tokens"),
        ("context", 0, "decode context"),
        ("context", 10**7, "context"),
        ("context", 100, "context"),
    ],
)
def test_a_bad_number_in_the_gpu_explorer_is_kept_and_refused(explorer, control, value, arg):
    assert explorer.image.value[:4] == b"\x89PNG"
    getattr(explorer, control).value = value
    assert getattr(explorer, control).value == value, "the value was changed (clamped), not refused"
    shows_refusal(explorer, arg)
    assert explorer.image.value == b""  # no plot of settings the boxes no longer show
    getattr(explorer, control).value = {"batch": 1, "prompt_len": 2000, "context": 2500}[control]
    assert (
        explorer.error == "" and explorer.scenario.batch == 1 and explorer.scenario.context == 2500
    )
    assert explorer.image.value[:4] == b"\x89PNG"  # the plot of what the boxes show


def test_a_large_batch_is_a_prediction_not_a_clamp(explorer):
    explorer.batch.value = 10**6
    assert (
        explorer.batch.value == 10**6
        and explorer.scenario.batch == 10**6
        and "does not fit" in explorer.status.value
    )
    explorer.batch.value = 1


@pytest.mark.parametrize(
    "settings, arg",
    [
        (dict(batch=0), "batch"),
        (dict(batch=2.7), "batch"),
        (dict(batch=True), "batch"),
        (dict(prompt_len="2000"), "prompt tokens"),
        (dict(context=100), "context"),
    ],
)
def test_the_gpu_explorer_refuses_bad_numbers_at_construction_too(settings, arg):
    ex = GPUExplorer(**settings)
    shows_refusal(ex, arg)
    if isinstance(settings.get("batch"), float):
        assert ex.batch.value == settings["batch"]
    plt.close("all")


@pytest.mark.parametrize(
    "settings, kind, arg",
    [
        (dict(gpu="H100"), BadValue, "gpu"),
        (dict(gpu=None), BadType, "gpu"),
        (dict(model="llama"), BadValue, "model"),
        (dict(weight_dtype="int3"), BadValue, "weight_dtype"),
    ],
)
def test_an_unknown_choice_is_a_clear_error_not_a_trait_error(settings, kind, arg):
    check_error(refused(lambda: GPUExplorer(**settings)), kind, arg)


def test_the_gpu_explorer_takes_a_spelling_of_its_weight_format():
    ex = GPUExplorer(weight_dtype="FP32")
    assert ex.dtype.value == "fp32" and ex.scenario.weight_dtype == "fp32" and ex.error == ""
    plt.close("all")


# --- chapter 09's view and explorer ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()


def test_quant_view_says_what_to_pass(tiny):
    w, cfgs = {"w": torch.randn(4, 8)}, {"t": tiny.config}
    check_error(refused(lambda: quant_view(w, "w", 8, 0, None, context=8)), BadType, 'configs')
    check_error(refused(lambda: quant_view(None, "w", 8, 0, cfgs, context=8)), BadType, 'weights')
    check_error(
        refused(lambda: quant_view({"w": torch.randn(8)}, "w", 8, 0, cfgs, context=8)),
        BadValue,
        "weights",
    )
    check_error(
        refused(lambda: quant_view(w, "w", 8, 0, cfgs, context=8, shown=0)), BadValue, "shown"
    )
    check_error(refused(lambda: quant_view(w, "w", 8, 0, cfgs, context=0)), BadValue, 'context')
    check_error(refused(lambda: weight_bytes(tiny.config, "FP32")), BadValue, 'weights')
    check_error(refused(lambda: quant_explorer(None)), BadType, 'model')
    check_error(refused(lambda: quant_explorer(tiny, bits=3, group_size=8)), BadValue, 'bits')
    check_error(
        refused(lambda: quant_explorer(tiny, layer="nope", group_size=8)), BadValue, "layer"
    )
