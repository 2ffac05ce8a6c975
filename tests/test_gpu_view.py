"""Chapter 05's GPU picture: the explorer's pure function, its plots and widget, and measured vs
datasheet."""

import json

import matplotlib.pyplot as plt
import pytest

from ar_lab.base.errors import BadValue, ContextFull
from ar_lab.course.views import gpu_view as gv
from ar_lab.course.views.gpu_explorer import GPUExplorer, format_time
from ar_lab.model.gpt import GPTConfig
from ar_lab.perf import gpus, measure
from ar_lab.perf import llm_costs as lc
from tests.raising import raises

# --- the pure function -------------------------------------------------------------------


def test_scenario_is_the_cost_model_at_the_datasheet_roofs():
    s = gv.gpu_scenario("H100 SXM", "Llama-2-13B", "bf16", batch=4, prompt_len=2000, context=2500)
    shape = lc.MODELS["Llama-2-13B"]
    assert s.gpu == gpus.GPUS["H100 SXM"]
    assert s.prefill == lc.prefill_cost(shape, 2000, 4) and s.decode == lc.decode_cost(
        shape, 2500, 4
    )
    assert s.ttft == max(s.prefill.flops / 989.5e12, s.prefill.bytes / 3.35e12)
    assert s.tpot == s.decode.bytes / 3.35e12  # memory-bound: the bytes set the time
    assert s.tokens_per_s == 4 / s.tpot
    assert s.memory == 2 * shape.parameters + 4 * 2500 * 819_200
    assert s.fits and s.verdict == "fits"
    assert s.bound(s.prefill) == "compute" and s.bound(s.decode) == "memory"


def test_scenario_says_why_it_does_not_fit():
    s = gv.gpu_scenario("T4", "Llama-2-13B", "bf16", 1, 2000, 2500)
    assert not s.fits and s.verdict.startswith("does not fit: the bf16 weights alone take 26.0 GB")
    s = gv.gpu_scenario("T4", "Llama-2-13B", "int4", 64, 2000, 2500)
    assert s.weights < s.gpu.memory < s.memory
    assert "at most 4 sequence(s) fit" in s.verdict and s.placement.max_batch == 4
    assert gv.gpu_scenario("T4", "Llama-2-13B", "int4", 4, 2000, 2500).fits
    # memory counts the whole context, prompt included; a context shorter than the prompt is refused
    long_prompt = gv.gpu_scenario("H100 SXM", "Llama-3-8B", "bf16", 8, 8000, 8000)
    assert long_prompt.memory == lc.memory_needed(lc.MODELS["Llama-3-8B"], 8000, 8)
    with raises(BadValue, 'context'):
        gv.gpu_scenario("H100 SXM", "Llama-3-8B", "bf16", 8, 8000, 100)


def test_smaller_weights_speed_up_decode_not_prefill():
    base = gv.gpu_scenario("A100 80GB SXM", "Llama-3-8B", "bf16", 1, 2048, 2048)
    int4 = gv.gpu_scenario("A100 80GB SXM", "Llama-3-8B", "int4", 1, 2048, 2048)
    assert int4.tpot < 0.35 * base.tpot  # a quarter of the weight bytes (+ the same KV cache)
    assert int4.ttft == pytest.approx(base.ttft, rel=0.02)  # compute-bound: same FLOPs, same roof
    fp32 = gv.gpu_scenario("A100 80GB SXM", "Llama-3-8B", "fp32", 1, 2048, 2048)
    assert fp32.ttft > 10 * base.ttft  # fp32 runs on the plain fp32 units (19.5 vs 312 TFLOP/s)


def test_scenario_errors():
    with raises(BadValue, 'gpu_name'):
        gv.gpu_scenario("A10G", "Llama-3-8B")
    with raises(ContextFull, 'context'):
        gv.gpu_scenario("H100 SXM", "Llama-2-13B", context=8192)
    with raises(BadValue, 'batch'):
        gv.gpu_scenario("H100 SXM", "Llama-2-13B", batch=0)


def test_plots_draw_the_ridge_and_both_phases():
    s = gv.gpu_scenario("H100 SXM", "Llama-3-8B", "bf16", 1, 2048, 4096)
    fig, (a, b) = plt.subplots(1, 2)
    gv.plot_scenario(a, s)
    texts = [t.get_text() for t in a.texts]
    assert "ridge 295 FLOP/B" in texts and "T=128" in texts and "B=256" in texts
    assert any(t.startswith("KV + activations = weights\nat B=28") for t in texts)
    assert any("never reaches the ridge" in t for t in texts)
    assert a.get_legend_handles_labels()[1][1:] == ["prefill", "decode", "this setting"]
    gv.plot_decode_intensity(b, lc.MODELS["Llama-3-8B"], gpus.GPUS["H100 SXM"], [128, 8192])
    labels = b.get_legend_handles_labels()[1]
    assert labels[0].startswith("context 128: limit 697 FLOP/B") and "fits up to B=59" in labels[1]
    plt.close(fig)


def test_the_per_operator_plot_draws_both_operators_and_marks_what_does_not_fit():
    fig, ax = plt.subplots()
    place = gv.plot_operators(ax, "Llama-3-8B", "H100 SXM", 8192, batches=[1, 16, 64])
    assert place.max_batch == 59 and place.attention_intensity == pytest.approx(4, rel=2e-3)
    labels = ax.get_legend_handles_labels()[1]
    assert labels[1].startswith("weight matmuls")
    assert labels[2].startswith("attention over the cache, at every batch: 4.0")
    squares = [line for line in ax.lines if line.get_marker() == "s"]
    # B = 64 > 59
    assert [line.get_markerfacecolor() == "white" for line in squares] == [False, False, True]
    assert {t.get_text() for t in ax.texts} >= {"B=1", "B=16", "B=64"}
    plt.close(fig)


# --- measured beside the datasheet ------------------------------------------------------------


def synthetic_gpu_result(tmp_path, tiny_model, name="NVIDIA H100 80GB HBM3"):
    """A real run on the CPU, relabelled as a bf16 run on a GPU and written as
    data/roofline_gpu_*.json."""
    peaks = {"matmul_flops_per_s": 700e12, "bandwidth_bytes_per_s": 3.0e12, "matmul_size": 8192}
    result = measure.run_roofline(tiny_model, [4, 16], [1, 2], 8, peaks=peaks, repeats=1)
    result["device"] = {"type": "cuda", "name": name, "threads": 1, "cpus": 2}
    result["dtype"] = "bfloat16"
    path = tmp_path / "roofline_gpu_test.json"
    path.write_text(json.dumps(result))
    return path


def test_a_committed_gpu_json_is_compared_with_its_datasheet(tmp_path, tiny_model):
    path = synthetic_gpu_result(tmp_path, tiny_model)
    assert measure.reference_files(tmp_path, device_type="cuda") == [path]
    result = measure.load_result(path)
    c = gv.spec_comparison(result)
    assert c["spec"].name == "H100 SXM" and c["dtype"] == "bf16"
    assert c["roofs"]["compute"] == (700e12, 989.5e12, 700e12 / 989.5e12)
    assert c["roofs"]["bandwidth"][2] == pytest.approx(3.0 / 3.35)
    for row, p in zip(c["rows"], result["points"], strict=True):
        predicted = max(p["flops"] / 989.5e12, p["bytes"] / 3.35e12)
        assert (
            row["predicted_s"] == predicted
            and row["measured_over_predicted"] == p["seconds"] / predicted
        )
        assert row["at_measured_roofs_s"] == max(p["flops"] / 700e12, p["bytes"] / 3.0e12)
    rows = gv.comparison_rows(c)
    assert (
        len(rows) == 4
        and rows[0][:4] == ["prefill", 1, 4, 4]
        and len(rows[0]) == len(gv.COMPARISON_HEADERS)
    )
    fig, ax = plt.subplots()
    gv.plot_measured_vs_spec(ax, result)
    labels = ax.get_legend_handles_labels()[1]
    assert labels[0].startswith("roofs of NVIDIA H100 80GB HBM3, bfloat16, measured")
    assert any(lab.startswith("H100 SXM datasheet") for lab in labels)
    assert "decode predicted from the datasheet" in labels
    plt.close(fig)


def test_an_untabulated_gpu_is_compared_with_its_measured_roofs_only(tmp_path, tiny_model):
    result = measure.load_result(synthetic_gpu_result(tmp_path, tiny_model, name="NVIDIA A10G"))
    c = gv.spec_comparison(result)
    assert c["spec"] is None and c["roofs"] == {} and "predicted_s" not in c["rows"][0]
    assert gv.comparison_rows(c)[0][-2:] == ["-", "-"]
    fig, ax = plt.subplots()
    gv.plot_measured_vs_spec(ax, result)
    plt.close(fig)


def test_result_label_names_the_cpu_threads():
    cpu = {"device": {"type": "cpu", "name": "Xeon", "threads": 1, "cpus": 2}, "dtype": "float32"}
    assert gv.result_label(cpu) == "Xeon, float32, 1 thread"
    cpu["device"]["threads"] = 2
    assert gv.result_label(cpu) == "Xeon, float32, 2 threads"
    assert gv.result_label(json.loads(measure.reference_files()[0].read_text())).endswith(
        "float32, 1 thread"
    )


def test_measure_gpu_runs_the_same_path_on_a_cpu():
    result = gv.measure_gpu(
        "cpu",
        GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=16),
        prompt_lens=[4],
        batches=[1, 2],
        context=8,
        repeats=1,
        matmul_size=64,
        buffer_bytes=2**20,
    )
    assert [(p["phase"], p["batch"]) for p in result["points"]] == [
        ("prefill", 1),
        ("decode", 1),
        ("decode", 2),
    ]
    assert gv.measure_config(80e9).n_embd == 4096 and gv.measure_config(16e9).n_embd == 2048
    assert gv.measure_config(8e9).n_embd == 2048


# --- the widget, headless ---------------------------------------------------------------------


def test_gpu_explorer_follows_its_controls():
    ex = GPUExplorer()
    s = ex.scenario
    assert (s.gpu.name, s.model.name, s.weight_dtype, s.batch) == (
        "H100 SXM",
        "Llama-2-13B",
        "bf16",
        1,
    )
    assert "fits" in ex.status.value and f"<b>{format_time(s.tpot)}</b>" in ex.status.value
    assert ex.image.value[:4] == b"\x89PNG"
    ex.gpu.value = "T4"  # 26 GB of bf16 weights on a 16 GB card
    assert (
        not ex.scenario.fits
        and "does not fit" in ex.status.value
        and "(if it fitted)" in ex.status.value
    )
    ex.dtype.value = "int4"
    assert ex.scenario.fits and ex.scenario.weights == 0.5 * lc.MODELS["Llama-2-13B"].parameters
    tpot1 = ex.scenario.tpot
    ex.batch.value = 4
    # 4x the tokens per step, but each sequence reads its own 2 GB cache against 6.5 GB of int4
    # weights
    assert ex.scenario.fits and 2 < ex.scenario.tokens_per_s * tpot1 < 3
    ex.batch.value = 64
    assert "at most 4 sequence(s) fit" in ex.status.value
    ex.model.value = "Llama-3-8B"
    ex.gpu.value = "H100 SXM"
    ex.dtype.value = "bf16"
    ex.batch.value = 1024
    ex.context.value = 128
    ex.prompt_len.value = 128
    assert (
        ex.scenario.bound(ex.scenario.decode) == "compute"
        and "compute-bound from batch 511" in ex.status.value
    )
    ex.context.value = 9000  # past Llama-3-8B's window: a message, and no plot of the old settings
    assert (
        ex.scenario is None and "context window of 8,192" in ex.error and "8,192" in ex.status.value
    )
    assert ex.image.value == b""
    ex.context.value = 4096
    assert ex.error == "" and ex.scenario.context == 4096 and ex.image.value[:4] == b"\x89PNG"
    plt.close("all")


def test_format_time():
    assert format_time(0.0083) == "8.3 ms" and format_time(6.5e-5) == "65 µs"
    assert format_time(2.5) == "2.50 s" and format_time(52.23) == "52.23 s"
