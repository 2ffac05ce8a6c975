"""The compiled decode step (ar_lab.engine.compiled): the lean step's tokens and logits, every
position of a cache (the eager edges included), edits of the weights seen, a missing compiler
reported in one line (and a fallback only when asked for), bad input refused.

Each model compiles once (seconds): the models are tiny and shared by the module's tests."""

from __future__ import annotations

import pytest
import torch

from ar_lab import generate
from ar_lab.base.errors import BadType, BadValue
from ar_lab.bench.decode import decode_benchmark, format_decode_results
from ar_lab.engine.compiled import CompiledDecoder, CompileUnavailable, compiled_step
from ar_lab.engine.kv_quant import Int8KVCache
from ar_lab.engine.lean import LeanGPT, NotLean
from ar_lab.engine.quant import quantize_model
from ar_lab.model.cache import KVCache
from ar_lab.model.gpt import GPT, GPTConfig
from tests.raising import raises

TINY = dict(vocab_size=257, block_size=24, n_layer=1, n_head=4, n_embd=32)
# RoPE at a symbolic position, RMSNorm, SwiGLU, grouped heads and a window with sinks (GPT-2's block
# compiles in appendix A1, its logits checked against the eager step's)
MODERN = GPTConfig(
    **TINY, n_kv_heads=2, norm="rmsnorm", positions="rope", mlp="swiglu", window=8, sinks=2
)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(1)
    return GPT(MODERN).eval()


def test_every_position_of_a_cache_gives_the_lean_steps_logits(model):
    """Positions 0 and 1 and the cache's last run eagerly, the rest compiled: all equal the lean
    step's logits, and the caches hold the same keys, values and token ids."""
    ours, lean = compiled_step(model), LeanGPT(model)
    assert ours.compiled
    a, b = KVCache.for_model(model), KVCache.for_model(model)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for token in torch.randint(0, 257, (model.config.block_size,), generator=g).tolist():
            torch.testing.assert_close(ours.step(token, a), lean.step(token, b), rtol=1e-4,
                                       atol=1e-4)
        for x, y in zip(a.k + a.v, b.k + b.v, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert a.length == b.length == model.config.block_size
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("prompt", [[5], [5, 6, 7]])
def test_generate_with_compile_gives_the_lean_tokens(model, prompt):
    n = model.config.block_size - len(prompt)  # to the end of the context
    got = generate(model, prompt, n, eos_id=None, compile=True)
    assert got.tokens == generate(model, prompt, n, eos_id=None).tokens
    assert len(got.tokens) == n


def test_an_edit_of_the_weights_is_what_the_next_compiled_step_computes_with(model):
    """The graph takes the parameters as inputs: an in-place edit and a swap of ``.data`` are seen
    (a graph that froze them would keep the old tokens). The model is restored afterwards."""
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    before = generate(model, [5, 6], 16, eos_id=None, compile=True).tokens
    try:
        with torch.no_grad():
            model.blocks[0].mlp.fc.weight.mul_(-4.0)
            model.blocks[0].attn.qkv.weight.data = torch.randn_like(model.blocks[0].attn.qkv.weight)
        after = generate(model, [5, 6], 16, eos_id=None, compile=True).tokens
        assert after == generate(model, [5, 6], 16, eos_id=None).tokens
        assert after != before  # (the edit changes the tokens: the test can see a stale graph)
    finally:
        model.load_state_dict(saved)


def test_other_stores_step_eagerly_with_their_own_arithmetic(model):
    """An int8 cache keeps its own attention: the compiled step runs it eagerly, as the lean one."""
    ours, lean = compiled_step(model), LeanGPT(model)
    a, b = Int8KVCache.for_model(model), Int8KVCache.for_model(model)
    with torch.inference_mode():
        for token in [5, 6, 7, 8]:
            torch.testing.assert_close(ours.step(token, a), lean.step(token, b))


def test_bad_input_is_refused_before_any_compiling(model):
    with raises(BadType, "compile"):
        generate(model, [5], 4, compile="yes")
    with raises(BadValue, "compile"):
        generate(model, [5], 4, compile=True, lean=False)
    with raises(BadValue, "compile"):
        generate(model, [5], 4, compile=True, use_cache=False)
    with raises(BadType, "fallback"):
        CompiledDecoder(model, fallback="no")
    with raises(NotLean, "model"):
        CompiledDecoder(quantize_model(model, weights="int8"))
    with raises(NotLean, "model"):
        CompiledDecoder(torch.nn.Linear(2, 2))


def test_the_decode_benchmark_times_the_compiled_step_beside_the_others(model):
    """bench decode's compiled column: the same tokens as every other run (asserted inside), and its
    ratios from the runs' medians."""
    res = decode_benchmark(model, tokens=8, repeats=2, uncached_repeats=0, prompt="ab", threads=1,
                           peer=False)
    runs, r = res["runs"], res["ratios"]
    compiled = runs["ar_lab cached, compiled"]
    assert compiled["forward_calls"] == 8 and len(compiled["seconds"]) == 2
    assert r["compiled_vs_lean"] == pytest.approx(runs["ar_lab cached"]["median_s"]
                                                  / compiled["median_s"])
    assert r["compiled_over_floor"] == pytest.approx(compiled["median_s"]
                                                     / runs["weights only (floor)"]["median_s"])
    assert "compiled step's time per token" in format_decode_results(res)


def test_a_missing_compiler_is_one_clear_error_and_a_fallback_only_when_asked():
    """Inductor needs a C++ compiler on a CPU: without one, ``CompileUnavailable`` says so and
    what to do; ``fallback=True`` steps eagerly instead, with a warning."""
    import torch._inductor.config as inductor

    torch.manual_seed(2)
    model = GPT(GPTConfig(**{**TINY, "n_layer": 1, "n_embd": 48})).eval()  # shapes of its own
    # (inductor's own patch, undone on exit; its caches off, so no compiled graph is reused)
    with inductor.patch({"cpp.cxx": (None, "no-such-c++-compiler"), "force_disable_caches": True}):
        # the wording is the point here: what is missing, and what to do
        with pytest.raises(CompileUnavailable, match="needs a C\\+\\+ compiler") as err:
            CompiledDecoder(model)
        assert err.value.arg == "compile"
        with pytest.warns(UserWarning):  # (it says the steps run eagerly)
            decoder = CompiledDecoder(model, fallback=True)
    assert not decoder.compiled
    with torch.inference_mode():
        assert decoder.step(5, KVCache.for_model(model), 0).shape == (257,)
    torch._dynamo.reset()  # (the failed compile is not kept for later tests)
