"""Appendix A1's check (ar_lab.course.checkers.compile_checks): a step compiled once for every
position passes; each wrong count of graphs is named, a compile of something else fails on its
values, and None or the package's own compile is no answer.

The answers here compile with the ``eager`` backend (TorchDynamo's graphs run by PyTorch itself):
the graphs are counted the same, and a test takes a second, not inductor's seconds per graph.
"""

import pytest
import torch

from ar_lab.course.checkers import compile_checks as cc
from ar_lab.course.checkers.answers import NoAnswer
from ar_lab.course.checkers.checks import CheckFailed
from ar_lab.engine.compiled import compile_once
from ar_lab.engine.lean import LeanGPT
from ar_lab.model.cache import Buffers, KVCache
from ar_lab.model.gpt import GPT, GPTConfig
from tests.raising import fails_naming

POSITIONS = [3, 4, 5, 8, 11]


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=8)).eval()
    engine = LeanGPT(model)

    def step(token, cache, pos):
        return engine.one(engine.wte[token].view(-1), Buffers(cache.k, cache.v), pos)

    return step, lambda: KVCache.for_model(model)


def check(answer, setup, positions=POSITIONS):
    step, make_cache = setup
    return cc.check_compiles_once("compile_once(step)", answer, step, make_cache, positions)


def test_one_graph_for_every_position_passes(setup):
    assert check(lambda s: torch.compile(s, dynamic=True, backend="eager"), setup) == 1


def test_each_wrong_count_of_graphs_is_named(setup):
    fails_naming(cc.RECOMPILED, check, lambda s: torch.compile(s, backend="eager"), setup)
    fails_naming(
        cc.PER_POSITION, check, lambda s: torch.compile(s, dynamic=False, backend="eager"), setup
    )
    fails_naming(cc.NOT_COMPILED, check, lambda s: s, setup)
    # a count no named mistake makes: two positions past a recompile, then a third constant
    assert cc.graph_mistake(3, 5) is None and cc.graph_mistake(1, 5) is None


def test_a_compile_that_computes_something_else_fails_on_its_values(setup):
    def at_three(s):  # every step computed at position 3, whatever it is asked
        return torch.compile(lambda token, cache, pos: s(token, cache, 3), backend="eager")

    with pytest.raises(CheckFailed) as info:
        check(at_three, setup)
    assert info.value.mistake is None  # (a wrong value, no named mistake)
    with pytest.raises(CheckFailed):  # not a callable
        check(lambda s: 42, setup)


@pytest.mark.parametrize("answer", [None, compile_once])
def test_none_or_the_packages_compile_is_no_answer(answer, setup):
    with pytest.raises(NoAnswer):
        check(answer, setup)
