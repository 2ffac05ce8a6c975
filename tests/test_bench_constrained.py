"""``python -m ar_lab.bench constrained``, run with tiny sizes (structure and exactness, not
speed)."""

import json

import pytest
import torch

from ar_lab.base.errors import BadValue, ContextFull
from ar_lab.bench.__main__ import main
from ar_lab.bench.constrained import (
    RECORDS_PROMPT,
    constrained_benchmark,
    format_constrained_results,
    record_grammar,
)
from ar_lab.model.gpt import GPT, GPTConfig
from tests.raising import raises


def test_the_prompt_holds_records_of_the_grammar():
    grammar = record_grammar()
    lines = RECORDS_PROMPT.splitlines()
    assert len(lines) == 3 and all(grammar.accepts(line) for line in lines)


def test_the_benchmark_returns_data_and_prints_nothing(capsys):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=256, n_layer=1, n_head=2, n_embd=32)).eval()
    res = constrained_benchmark(model, samples=2, tokens=64, repeats=1)
    assert capsys.readouterr().out == ""
    # every text closed in time is valid
    assert res["valid_share"]["constrained"] == res["complete_share"]
    assert res["samples"] == 2 and res["steps"] >= 2 * 12  # '{"name": "", "size": 0}' is 23 bytes
    assert res["mask_cost_ratio"] == pytest.approx(
        res["ms_per_step"]["constrained"] / res["ms_per_step"]["free"]
    )
    assert 0 <= res["top_refused_share"] <= 1 and res["mean_logprob"]["constrained"] < 0
    assert all(record_grammar().valid(t) for t in res["examples"]["constrained"] if t.endswith("}"))
    assert json.loads(json.dumps(res)) == res
    table = format_constrained_results(res)
    assert "valid records" in table and "a constrained step takes" in table
    with raises(ContextFull, 'tokens'):
        constrained_benchmark(model, tokens=500)
    with raises(BadValue, 'samples'):
        constrained_benchmark(model, samples=0)


@pytest.mark.parametrize(
    "args", [["constrained", "--samples", "0"], ["constrained", "--tokens", "5000"]]
)
def test_bad_options_end_with_one_message_and_status_2(args, capsys):
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2 and "Traceback" not in capsys.readouterr().err
