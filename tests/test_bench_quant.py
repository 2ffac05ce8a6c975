"""``python -m ar_lab.bench quant``, run with tiny sizes: structure and real relations, never timing
thresholds."""

import json

import pytest
import torch

from ar_lab.bench.__main__ import main
from ar_lab.bench.quant import FORMATS, format_quant_results, quant_benchmark
from ar_lab.bench.quant.benchmark import CALIBRATED
from ar_lab.model.gpt import GPT, GPTConfig


@pytest.fixture(scope="module")
def result():
    torch.manual_seed(0)
    course = GPT(GPTConfig(block_size=128, n_layer=2, n_head=2, n_embd=64)).eval()
    large = GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=128)).eval()
    modern = GPT(GPTConfig.modern(block_size=128, n_layer=1, n_head=4, n_kv_heads=2, n_embd=64))
    return quant_benchmark(course, large, tokens=4, repeats=2, quick=True,
                           extra=((modern.eval(), "modern model (random init)"),))


def test_every_format_is_measured_and_predicted(result):
    assert json.loads(json.dumps(result)) == result
    assert [m["label"].split(" (")[0] for m in result["models"]] == [
        "course model",
        "modern model",
        "random-init large model",
    ]
    every = [FORMATS + CALIBRATED, FORMATS + CALIBRATED, FORMATS]
    for model, formats in zip(result["models"], every, strict=True):
        rows = model["rows"]
        assert list(rows) == list(formats)
        b = {w: rows[w]["bytes_per_token"] for w in FORMATS}
        assert b["int4"] < b["int8"] < b["bf16"] < b["fp32"]
        p = {w: rows[w]["predicted_speedup"] for w in FORMATS}
        assert p["fp32"] == 1.0 and 1 < p["bf16"] < p["int8"] < p["int4"]
        assert rows["fp32"]["speedup"] == 1.0
        for r in rows.values():
            assert len(r["seconds"]) == 2 and r["tokens_per_s"] > 0
            assert r["measured_vs_predicted"] == pytest.approx(
                r["speedup"] / r["predicted_speedup"]
            )
    course = result["models"][0]["rows"]
    assert course["fp32"]["greedy_top1"] == 1.0 and course["fp32"]["acceptance_greedy"] == 1.0
    assert all(
        0 <= course[w]["greedy_top1"] <= 1 and course[w]["bits_per_byte"] > 0 for w in FORMATS
    )
    assert "bits_per_byte" not in result["models"][2]["rows"]["fp32"]
    for w in CALIBRATED:  # the same format as int4: the same bytes, the roofline's same prediction
        assert course[w]["bytes_per_token"] == course["int4"]["bytes_per_token"]
        assert course[w]["predicted_speedup"] == course["int4"]["predicted_speedup"]
        share = course[w]["recovered_of_int4_loss"]
        loss = course["int4"]["bits_per_byte"] - course["fp32"]["bits_per_byte"]
        assert share == pytest.approx(
            (course["int4"]["bits_per_byte"] - course[w]["bits_per_byte"]) / loss
        )


def test_float_formats_are_scored_beside_the_integers(result):
    from ar_lab.engine.float_formats import FORMATS as FLOAT_FORMATS

    formats = result["formats"]
    assert list(formats) == list(FLOAT_FORMATS)
    assert formats["int4"]["bits_per_weight"] == formats["nvfp4"]["bits_per_weight"] == 4.5
    assert all(r["bits_per_byte"] > 0 and r["relative_rms"] > 0 for r in formats.values())
    assert "relative RMS error" in format_quant_results(result)


def test_int8_kv_cache_figures(result):
    kv = result["kv_cache"]
    assert kv["nbytes"] == kv["formula_bytes"] and kv["nbytes"]["int8"] < kv["nbytes"]["fp32"] / 3
    assert set(kv["tokens_per_s"]) == {"fp32", "int8"} and 0 <= kv["greedy_top1"] <= 1


def test_kernels_are_checked_against_the_matrix_they_stand_for(result):
    calls = {k["call"]: k for k in result["kernels"]}
    assert set(calls) >= {"fp32 addmv", "int8 kernel", "int4 kernel", "int8 kernel, fp32 input"}
    assert calls["fp32 addmv"]["x_fp32"] == 1.0
    for k in result["kernels"]:
        assert k["rel_error"] < 2**-6, k  # bfloat16 rounding at most (see tests/test_quant.py)


def test_the_report_names_every_column(result):
    report = format_quant_results(result)
    for text in (
        "kernels: one (out, in) matrix x one vector",
        "measured/predicted",
        "bits/byte",
        "accept T=1",
        "int4",
        "int4 gptq",
        "recovered by calibration",
    ):
        assert text in report


@pytest.mark.parametrize(
    "args",
    [["quant", "--tokens", "1"], ["quant", "--repeats", "0"], ["quant", "--config", "banana"]],
)
def test_bad_options_end_with_one_message_and_status_2(args, capsys):
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("python -m ar_lab.bench: error: quant: ")
    assert "Traceback" not in err


def test_the_command_runs_quick(tmp_path, capsys):
    path = tmp_path / "quant.json"
    assert main(["quant", "--quick", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    assert res["benchmark"] == "quant" and len(res["models"]) == 2
    assert "measured/predicted" in capsys.readouterr().out
