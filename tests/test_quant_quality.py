"""ar_lab.perf.quality: bits per byte, greedy agreement and self-draft acceptance of a quantized
model."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import ar_lab
from ar_lab.base.errors import BadType, BadValue
from ar_lab.engine.quant import quantize_model
from ar_lab.model.evaluation import COURSE_EVAL, EvalProtocol, evaluate_protocol
from ar_lab.model.gpt import GPT
from ar_lab.perf.quality import bits_per_byte, greedy_agreement, self_draft_acceptance
from tests.raising import raises

PROMPTS = ["def main(args):\n    ", "import os\nimport sys\n", "The for statement"]


@pytest.fixture(scope="module")
def course():
    return ar_lab.load_pretrained("course", "cpu").eval()


@pytest.fixture(scope="module")
def int8(course):
    return quantize_model(course, weights="int8")


def test_bits_per_byte_is_the_course_protocol_in_bits(course):
    small = COURSE_EVAL.first(2)
    assert bits_per_byte(course, small) == pytest.approx(
        evaluate_protocol(course, small).nats / math.log(2), rel=1e-12
    )
    # a trained byte-level model: well under 8 bits per byte
    assert 0.5 < bits_per_byte(course, small) < 4


def test_quantization_costs_a_little_quality_and_random_weights_a_lot(course, int8):
    small = EvalProtocol("val-128, first 8", 128, 8)
    full, quant = bits_per_byte(course, small), bits_per_byte(int8, small)
    assert abs(quant - full) < 0.05 * full  # int8: within 5% of the reference's loss
    torch.manual_seed(0)
    random = GPT(course.config).eval()
    assert bits_per_byte(random, small) > 2 * full  # untrained: about log2(257) = 8 bits per byte


def test_a_model_agrees_with_itself_completely(course):
    same = greedy_agreement(course, copy.deepcopy(course), PROMPTS[:2], n_tokens=12)
    assert (
        same.top1 == 1.0 and same.first_divergence == 12 and same.per_prompt_divergence == [12, 12]
    )
    acceptance = self_draft_acceptance(course, course, PROMPTS[:2], n_tokens=12, gamma=3)
    assert acceptance.greedy == 1.0 and acceptance.sampled == 1.0
    # sum_x min(p, p) = 1, up to rounding
    assert acceptance.sampled_exact == pytest.approx(1.0, abs=1e-4)


def test_a_random_model_disagrees_and_int8_mostly_agrees(course, int8):
    torch.manual_seed(0)
    random = GPT(course.config).eval()
    low = greedy_agreement(course, random, PROMPTS, n_tokens=16)
    assert low.top1 < 0.5 and low.first_divergence < 16
    high = greedy_agreement(course, int8, PROMPTS, n_tokens=16)
    assert high.top1 > 0.8 and high.top1 > low.top1
    assert len(high.per_prompt_top1) == len(PROMPTS)
    drafted = self_draft_acceptance(course, int8, PROMPTS, n_tokens=16)
    assert drafted.greedy > 0.8 and drafted.sampled_exact > 0.8
    weak = self_draft_acceptance(course, random, PROMPTS[:1], n_tokens=8)
    assert weak.sampled_exact < drafted.sampled_exact


def test_bad_arguments_are_explained(course):
    with raises(BadValue, 'prompts'):
        greedy_agreement(course, course, "just one string")
    with raises(BadValue, 'n_tokens'):
        greedy_agreement(course, course, PROMPTS, n_tokens=0)
    with raises(BadType, 'protocol'):
        bits_per_byte(course, 4096)
    with raises(BadValue, 'gamma'):
        self_draft_acceptance(course, course, PROMPTS, gamma=0)
