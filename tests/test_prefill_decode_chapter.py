"""Chapter 05's course-layer helpers: the named mistakes of its TPOT and decode-plan exercises (the
probes' are in test_mistakes_ch05.py), where its GPU measurement comes from, and the sizes of the
models a GPU measures."""

import math
from pathlib import Path

import pytest

from ar_lab.course.checkers.mistakes import name_mistake
from ar_lab.course.checkers.roofline_checks import decode_plan_mistakes, predict_tpot_mistakes
from ar_lab.course.views import gpu_view as gv
from ar_lab.perf import gpus, measure
from ar_lab.perf import llm_costs as lc
from ar_lab.perf import roofline as rl
from tests.raising import fails_naming


def _named(fragment: str, what: str, got, expected, mistakes) -> None:
    fails_naming(fragment, name_mistake, what, got, expected, mistakes)


def test_predict_tpot_mistakes_are_named():
    args = (1e8, 4, 2e10, 1e8)
    right = (1e8 * 4 + 1e8) / 2e10
    mistakes = predict_tpot_mistakes(*args)
    name_mistake("t", right, right, mistakes)
    for fragment, answer in {"KV cache": 1e8 * 4 / 2e10, "upside down": 2e10 / (1e8 * 4 + 1e8),
                             "milliseconds": 1e3 * right, "bits": 8 * right,
                             "one byte per parameter": (1e8 + 1e8) / 2e10}.items():
        _named(fragment, "t", answer, right, mistakes)
    # one byte per parameter is the right answer for int8 weights: not named there
    assert not any("one byte" in m for m in predict_tpot_mistakes(7e9, 1, 1e12))


def test_decode_plan_mistakes_are_named_key_by_key():
    m, g, context = lc.MODELS["Llama-3-8B"], gpus.GPUS["H100 SXM"], 8192
    ref = lc.place_decode(m, g, context)
    right = {
        "tpot": lc.predicted_time(lc.decode_cost(m, context), g),
        "max_batch": ref.max_batch,
        "matmul_batch": ref.matmul_compute_bound_batch,
        "attention_intensity": ref.attention_intensity,
    }
    mistakes = decode_plan_mistakes(m, g, context)
    assert set(mistakes) == set(right)
    cache = context * m.kv_values_per_token * 2
    answer = {"tpot": ((m.parameters - (m.vocab - 1) * m.d_model) * 2 + cache) / g.bandwidth,
              "max_batch": math.floor((g.memory - m.parameters * 2) / cache),
              "matmul_batch": math.ceil(g.ridge), "attention_intensity": m.q_width / m.kv_width}
    for key in right:  # the chapter's reference answer is never taken for a mistake
        name_mistake(key, answer[key], right[key], mistakes[key])
    _named(
        "not subtracting the weights",
        "b",
        math.floor(g.memory / cache),
        right["max_batch"],
        mistakes["max_batch"],
    )
    _named(
        "embedding table",
        "t",
        (m.parameters * 2 + cache) / g.bandwidth,
        right["tpot"],
        mistakes["tpot"],
    )
    _named("group size", "a", 1.0, right["attention_intensity"], mistakes["attention_intensity"])
    _named(
        "half the intensity",
        "m",
        math.ceil(2 * g.ridge),
        right["matmul_batch"],
        mistakes["matmul_batch"],
    )


def test_gpu_measurement_says_where_it_comes_from(monkeypatch):
    monkeypatch.setattr(measure, "reference_files", lambda **_: [])
    result, where = gv.gpu_measurement("cpu")
    assert (
        result is None
        and where.startswith("This machine has no GPU")
        and "predictions from datasheets" in where
    )
    committed = Path("data") / "roofline_gpu_h100.json"
    monkeypatch.setattr(measure, "reference_files", lambda **_: [committed])
    monkeypatch.setattr(measure, "load_result", lambda path: {"from": path})
    result, where = gv.gpu_measurement("cpu")
    assert (
        result == {"from": committed}
        and where == "committed measurement data/roofline_gpu_h100.json"
    )
    with pytest.raises(ValueError):
        gv.gpu_measurement("banana")


def test_roof_lines_compare_each_roof_with_its_datasheet():
    c = {"spec": gpus.GPUS["H100 SXM"], "roofs": {"compute": (700e12, 989.5e12, 700 / 989.5)}}
    assert gv.roof_lines(c) == [
        "compute roof: measured 7e+14, datasheet 9.9e+14 -> measured / datasheet = 0.71"
    ]
    assert gv.roof_lines({"spec": None, "roofs": {}}) == [
        "this GPU is not in ar_lab.perf.gpus: compared with its measured roofs only"]
    with pytest.raises(TypeError):
        gv.roof_lines([1, 2])


def test_the_gpu_measurements_models_are_the_sizes_their_comments_say():
    sizes = {memory: round(rl.parameter_count(cfg) / 1e8) for memory, cfg in gv.GPU_CONFIGS.items()}
    assert sizes == {40e9: 65, 12e9: 12}  # 6.5 B parameters from 40 GB, 1.2 B below
