"""The benchmark command line and the small benchmarks, run with tiny sizes (structure, not
speed)."""

import json
import sys

import pytest
import torch

from ar_lab.base.errors import BadValue, ContextFull
from ar_lab.bench.__main__ import main
from ar_lab.bench.common import checked_device, torch_threads
from ar_lab.bench.sampler import format_sampler_results, sampler_benchmark
from ar_lab.bench.serving import format_serving_results, serving_benchmark
from ar_lab.bench.table import format_table
from ar_lab.model.gpt import GPT, GPTConfig
from tests.raising import raises


def test_format_table_right_aligns_and_rounds_floats():
    table = format_table(["name", "x"], [["a", 1234.5678], ["bcd", 0.5], ["e", 12]])
    lines = [
        "name         x",
        "----  --------",
        "   a  1.23e+03",
        " bcd       0.5",
        "   e        12",
    ]
    assert table.splitlines() == lines


@pytest.mark.parametrize(
    "args",
    [
        ["roofline", "--device", "mps"],
        ["roofline", "--device", "banana"],
        ["speculative", "--device", "banana"],
        ["speculative", "--gammas", "0"],
        ["sampler", "--threads", "0"],
        ["decode", "--threads", "0"],
        ["serving", "--batch-sizes", "1,two"],
        ["lookup", "--lookahead", "0"],
        ["verify", "--ks", "2", "3"],
        ["verify", "--device", "banana"],
    ],
)
def test_bad_options_end_with_one_message_and_status_2(args, capsys):
    threads = torch.get_num_threads()
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith(f"python -m ar_lab.bench: error: {args[0]}: ")
    assert "Traceback" not in err
    assert torch.get_num_threads() == threads


def test_checked_device():
    assert checked_device("cpu") == torch.device("cpu")
    for bad in ["mps", "banana", "cuda:x"]:
        with raises(BadValue, 'device'):
            checked_device(bad)


def test_torch_threads_restores_the_count():
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with raises(BadValue, 'threads'):
        with torch_threads(0):
            pass


def test_main_records_the_arguments_it_parsed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["pytest", "something", "else"])
    path = tmp_path / "sampler.json"
    args = ["sampler", "--context", "8", "--rounds", "1", "--calls", "1", "--json", str(path)]
    assert main(args) == 0
    res = json.loads(path.read_text())
    assert res["command"] == "python -m ar_lab.bench " + " ".join(args)
    assert "sampler: greedy" in capsys.readouterr().out


def test_a_result_that_names_its_device_is_recorded_as_run_there(tmp_path, monkeypatch, capsys):
    """A GPU run's JSON says it ran on the GPU (the result's own device), not on the host's CPU."""
    from ar_lab.bench import roofline

    gpu = {"type": "cuda", "name": "NVIDIA H200", "threads": 16, "cpus": 16, "load_1min": 0.5}
    ran = {
        "device": gpu,
        "versions": {"torch": "2.11.0+cu130", "cuda": "13.0"},
        "date": "2026-12-04T16:37:36+00:00",
    }
    monkeypatch.setattr(roofline, "run", lambda args: dict(ran))
    assert main(["roofline", "--quick", "--json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["machine"] == ran
    monkeypatch.setattr(roofline, "run", lambda args: {"points": []})  # names no device: the host's
    assert main(["roofline", "--quick", "--json", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["machine"]["device"]["type"] == "cpu"


@pytest.fixture
def model_128():
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=128, n_layer=2, n_head=2, n_embd=32)).eval()


def test_sampler_benchmark_returns_data_and_prints_nothing(model_128, capsys):
    res = sampler_benchmark(model_128, context=16, rounds=2, calls=2)
    assert capsys.readouterr().out == ""
    assert res["context"] == 16 and res["parameters"] == model_128.num_parameters()
    assert len(res["samplers"]) == 6 and "greedy" in res["samplers"]
    for s in res["samplers"].values():
        assert s["ratio_to_decode_step"] == pytest.approx(s["seconds"] / res["decode_step_seconds"])
    assert json.loads(json.dumps(res)) == res
    table = format_sampler_results(res)
    assert "x decode step" in table and "sampler: all + repetition penalty 1.2" in table
    with raises(ContextFull, 'context'):
        sampler_benchmark(model_128, context=128)
    with raises(BadValue, 'rounds'):
        sampler_benchmark(model_128, rounds=0)


def test_serving_benchmark_returns_data_and_prints_nothing(model_128, capsys):
    res = serving_benchmark(
        model_128,
        requests=4,
        max_batch=2,
        short=2,
        long=4,
        repeats=1,
        batch_sizes=(1, 2),
        context=16,
        prefix_tokens=32,
        chunks=(16,),
    )
    assert capsys.readouterr().out == ""
    assert set(res["policies"]) == {"static", "continuous"} and res["workload"]["requests"] == 4
    chunked = res["chunked"]
    assert [r["chunk"] for r in chunked["rows"]] == [None, 16] and chunked["document"] == 96
    assert chunked["identical_outputs"] == chunked["requests"] == 16
    one, two = res["batch_sweep"]
    assert (one["batch"], two["batch"]) == (1, 2) and one["x_batch_1"] == 1.0
    # read once per step
    assert two["weight_bytes_per_token"] == pytest.approx(one["weight_bytes_per_token"] / 2)
    assert res["prefix"]["prefix_tokens"] == 32 and res["prefix"]["runs"] == 2 * 3
    assert json.loads(json.dumps(res)) == res
    report = format_serving_results(res)
    assert "continuous / static" in report and "prefix cache: 32-token static prefix" in report
    assert "chunked prefill: 16 requests, every 4th a 96-position document" in report


def test_selfspec_benchmark_widens_drafts_and_times_the_verify_pass(capsys):
    from ar_lab.bench.selfspec import format_selfspec_results, selfspec_benchmark
    from ar_lab.model.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    course = GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=32)).eval()
    res = selfspec_benchmark(
        2, "int8", course=course, tokens=6, prompts=1, prompt_tokens=8, gammas=[2, 3], repeats=1
    )
    assert capsys.readouterr().out == ""
    assert (
        res["benchmark"] == "selfspec" and res["target"]["parameters"] > 3 * course.num_parameters()
    )
    assert res["target"]["weight_bytes"] == 4 * res["target"]["parameters"]
    assert set(res["modes"]) == {"greedy"} and set(res["modes"]["greedy"]["gammas"]) == {2, 3}
    assert set(res["verify_pass"]["rows"]) == {3, 4}
    assert all(v > 0 for row in res["verify_pass"]["rows"].values() for v in row.values())
    assert json.loads(json.dumps(res))["benchmark"] == "selfspec"
    assert "verify pass alone" in format_selfspec_results(res)
    with pytest.raises(ValueError):
        selfspec_benchmark(0, course=course)
    with pytest.raises(ValueError):
        selfspec_benchmark(2, "fp8", course=course)


def test_verify_curve_is_relative_to_one_decode_step(capsys):
    from ar_lab.bench.verify import format_verify_results, verify_curve

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=32)).eval()
    curve = verify_curve(model, [1, 3, 9], past=16, rounds=2, cuda_graph=True)  # ignored on a CPU
    assert capsys.readouterr().out == ""
    assert curve["mode"] == "eager" and curve["parameters"] == model.num_parameters()
    rows = curve["rows"]
    assert rows[1]["time"] == rows[1]["flops"] == rows[1]["bytes"] == 1.0
    # k positions: k times the arithmetic
    assert [round(rows[k]["flops"]) for k in (3, 9)] == [3, 9]
    # the weights read once: bytes grow far slower
    assert 1 < rows[3]["bytes"] < rows[9]["bytes"] < 9 / 4
    assert all(
        r["seconds"] > 0 and r["time"] == r["seconds"] / rows[1]["seconds"] for r in rows.values()
    )
    text = format_verify_results({"past": 16, "models": {"tiny": curve}})
    assert "after 16 cached ones" in text and text.count("tiny") == 3
    for bad in ([], [2, 3], [1, 0], [True, 2]):
        with raises(BadValue, "ks"):
            verify_curve(model, bad, past=16, rounds=1, cuda_graph=False)
    with raises(ContextFull, "past"):
        verify_curve(model, [1, 60], past=16, rounds=1, cuda_graph=False)
