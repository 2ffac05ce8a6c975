"""``python -m ar_lab.bench paged`` with tiny sizes (structure and exactness, not speed)."""

import json

import pytest
import torch

from ar_lab.bench.__main__ import main
from ar_lab.bench.paged import format_paged_results, paged_benchmark
from ar_lab.model.gpt import GPT, GPTConfig


@pytest.fixture
def small_model():
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=128, n_layer=2, n_head=2, n_embd=32)).eval()


def test_paged_benchmark_returns_data_and_prints_nothing(small_model, capsys):
    res = paged_benchmark(
        small_model, requests=6, longest=20, max_batch=3, block_size=4, budget_slots=1, repeats=1
    )
    assert capsys.readouterr().out == ""
    assert res["identical_tokens"] is True and res["benchmark"] == "paged"
    runs = res["runs"]
    assert set(runs) == {"contiguous", "paged", "contiguous, fixed budget", "paged, fixed budget"}
    # the same slots: the same schedule; a paged pool reserves less than the slots for the same
    # positions
    assert runs["paged"]["decode_steps"] == runs["contiguous"]["decode_steps"]
    assert runs["paged"]["mean_used"] == pytest.approx(runs["contiguous"]["mean_used"])
    assert runs["paged"]["mean_reserved"] < runs["contiguous"]["mean_reserved"]
    assert runs["contiguous, fixed budget"]["most_rows"] == 1  # one slot
    assert runs["paged, fixed budget"]["mean_reserved"] <= res["budget_positions"]
    assert res["fit_paged"] >= res["fit_contiguous"] == 1
    # under a block each
    assert res["paged_footprint"]["reserved"] - res["paged_footprint"]["used"] < 6 * 4
    s = res["scale_up"]
    assert s["model"] == "Llama-3-8B" and s["paged_fit"] > s["contiguous_fit"] > 0
    assert json.loads(json.dumps(res)) == res
    text = format_paged_results(res)
    assert (
        "every run gave the contiguous cache's tokens" in text
        and "Llama-3-8B bf16 on H100 SXM" in text
    )


def test_bad_paged_options_end_with_one_message(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["paged", "--requests", "0"])
    assert stop.value.code == 2
    assert "paged: requests must be an int >= 1" in capsys.readouterr().err.splitlines()[-1]
