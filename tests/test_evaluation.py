"""ar_lab.model.evaluation: the one protocol every reported loss uses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import ar_lab
from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.model.checkpoint import read_checkpoint_metadata
from ar_lab.model.data import data_dir
from ar_lab.model.evaluation import (
    COURSE_EVAL,
    EvalProtocol,
    evaluate_protocol,
    protocol_for,
    validation_tokens,
    whole_windows,
)
from ar_lab.model.gpt import GPT, GPTConfig
from tests.raising import raises


def tiny(block_size: int = 16) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=block_size, n_layer=1, n_head=2, n_embd=16)).eval()


def test_every_position_of_every_whole_window_is_predicted_once_given_its_window():
    model, tokens = (
        tiny(),
        torch.randint(0, 257, (16 * 5 + 7,), generator=torch.Generator().manual_seed(1)),
    )
    protocol = EvalProtocol("t", 16)
    # 5 windows in batches of 2, 2, 1
    result = evaluate_protocol(model, protocol, tokens, batch_size=2)
    by_hand = (
        torch.stack(
            [
                F.cross_entropy(
                    model(tokens[i * 16 : i * 16 + 16][None])[0],
                    tokens[i * 16 + 1 : i * 16 + 17],
                    reduction="none",
                )
                for i in range(5)
            ]
        )
        .detach()
        .double()
    )
    assert result.windows == whole_windows(protocol, tokens) == 5 and result.positions == 80
    assert result.nats == pytest.approx(by_hand.mean().item(), rel=1e-6)
    assert result.by_position == pytest.approx(by_hand.mean(0).tolist(), rel=1e-6)
    assert result.bits == pytest.approx(result.nats / math.log(2))
    assert result.span(0, 16) == pytest.approx(result.nats)
    assert result.span(3, 4) == pytest.approx(result.by_position[3])
    # batching and repeats change nothing
    again = evaluate_protocol(model, protocol, tokens, batch_size=8)
    assert again.by_position == pytest.approx(result.by_position, rel=1e-6)


def test_first_reads_only_the_first_windows_under_its_own_name():
    model, tokens = (
        tiny(),
        torch.randint(0, 257, (16 * 6 + 1,), generator=torch.Generator().manual_seed(2)),
    )
    whole, first = EvalProtocol("t", 16), EvalProtocol("t", 16).first(2)
    assert first.name == "t, first 2" and first != whole
    part = evaluate_protocol(model, first, tokens[: 16 * 2 + 1])
    assert evaluate_protocol(model, first, tokens).nats == pytest.approx(part.nats, rel=1e-9)
    assert evaluate_protocol(model, whole, tokens).windows == 6


def test_the_course_protocol_is_named_and_the_shipped_records_use_it():
    assert (
        COURSE_EVAL.name == "val-1024"
        and COURSE_EVAL.window == 1024
        and COURSE_EVAL.windows is None
    )
    n = whole_windows(COURSE_EVAL, validation_tokens())
    assert f"{n} windows, {n * 1024:,} positions" in COURSE_EVAL.describe()
    assert (
        protocol_for(1024) is COURSE_EVAL
        and protocol_for(64).window == 64
        and protocol_for(64).name == "val-64"
    )
    for name in ("course", "modern", "draft"):
        record = read_checkpoint_metadata(data_dir() / f"{name}.safetensors")["record"]
        assert record["eval"] == COURSE_EVAL.name
    course = ar_lab.load_pretrained("course", "cpu")
    result = evaluate_protocol(course)
    # re-measurable
    assert result.nats == pytest.approx(course.checkpoint_record["val_loss_nats"], abs=1e-4)
    assert course.checkpoint_record["val_bits_per_byte"] == pytest.approx(result.bits, abs=1e-4)


def test_bad_protocols_and_models_are_refused_with_the_reason():
    with raises(BadValue, 'window'):
        EvalProtocol("x", 1)
    with raises(BadValue, 'windows'):
        EvalProtocol("x", 8, 0)
    with raises(ContextFull, 'protocol'):
        evaluate_protocol(tiny(8), EvalProtocol("x", 16))
    with raises(BadType, 'protocol'):
        evaluate_protocol(tiny(), 16)
    with raises(BadValue, 'tokens'):
        evaluate_protocol(tiny(), EvalProtocol("x", 16), torch.zeros(16, dtype=torch.long))
    with raises(BadType, 'model'):
        evaluate_protocol(None)
    with raises(BadValue, 'stop'):
        evaluate_protocol(tiny(), EvalProtocol("x", 16), torch.zeros(17, dtype=torch.long)).span(
            4, 4
        )
