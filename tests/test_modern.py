"""One block, one KV-store protocol: a Llama-shaped model is a configuration of the same GPT.

Every store (contiguous, batched, paged, int8, rolling) and every pass (prompt, decode step, verify
pass, the lean engine) computes the logits of one uncached forward pass; the modern configuration
equals transformers' Llama (Mistral with a window) on the same weights; bad configurations and
stores of another configuration are refused naming the argument.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from raising import raises

from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.engine import lean
from ar_lab.engine.beam import beam_search
from ar_lab.engine.generate import generate
from ar_lab.engine.kv_quant import Int8KVCache
from ar_lab.engine.lookup import PromptLookup
from ar_lab.engine.paged import PagedKVCache
from ar_lab.engine.serving.requests import Request
from ar_lab.engine.serving.server import serve
from ar_lab.engine.speculative import speculative_generate
from ar_lab.model.cache import BatchKVCache, KVCache
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.model.reference import have_transformers, to_hf
from ar_lab.model.rolling import RollingKVCache

CONFIGS = {
    "gpt2": GPTConfig(block_size=48, n_layer=2, n_head=4, n_embd=32),
    "modern": GPTConfig.modern(block_size=48, n_layer=2, n_head=4, n_kv_heads=2, n_embd=32),
    "mqa_bias": GPTConfig.modern(
        block_size=48, n_layer=2, n_head=4, n_kv_heads=1, n_embd=32, bias=True
    ),
    "window": GPTConfig.modern(
        block_size=48, n_layer=2, n_head=4, n_kv_heads=2, n_embd=32, window=6
    ),
    "sinks": GPTConfig.modern(
        block_size=48, n_layer=2, n_head=4, n_kv_heads=2, n_embd=32, window=5, sinks=2
    ),
}


def _model(name: str, seed: int = 0, spread: float = 0.3) -> GPT:
    torch.manual_seed(seed)
    model = GPT(CONFIGS[name]).eval()
    # weights far from init: attention that is not near-uniform tells mistakes apart
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, spread)
    return model


MODELS = {name: _model(name) for name in CONFIGS}


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(sorted(CONFIGS)),
    cuts=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    store=st.sampled_from(["contiguous", "rolling", "batch", "paged"]),
    seed=st.integers(0, 2**16),
)
def test_every_store_computes_the_uncached_logits(name, cuts, store, seed):
    """Fed in pieces of any sizes through any store, a model gives the logits of one uncached
    pass."""
    model = MODELS[name]
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    n = min(sum(cuts), cfg.block_size)
    idx = torch.randint(0, cfg.vocab_size, (1, n), generator=g)
    if store == "rolling" and cfg.window is None:
        store = "contiguous"
    with torch.no_grad():
        want = model(idx)
        if store == "contiguous":
            cache = KVCache.for_model(model, max_len=n)
        elif store == "rolling":
            cache = RollingKVCache.for_model(model)
        else:
            cache = (BatchKVCache if store == "batch" else PagedKVCache).for_model(
                model, 2, max_len=n
            )
        got, at = [], 0
        for c in cuts:
            piece = idx[:, at : at + c]
            if piece.shape[1] == 0:
                break
            if store in ("batch", "paged"):
                if at == 0:
                    slot = cache.slot(0)
                    got.append(model(piece, slot))
                    cache.add(slot.length)
                else:
                    positions, _ = cache.begin(piece.shape[1])
                    got.append(model(piece, cache, positions=positions))
                    cache.advance(piece.shape[1])
            else:
                got.append(model(piece, cache))
            at += c
    torch.testing.assert_close(torch.cat(got, dim=1), want[:, :at], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_lean_engine_runs_the_same_block(name):
    """The lean step and the verify pass (extend, packed copies) equal forward for every
    configuration, on a contiguous and an int8 store alike (int8: within its rounding)."""
    model = MODELS[name]
    idx = torch.randint(0, 257, (1, 20), generator=torch.Generator().manual_seed(1))
    engine, copies = lean.for_model(model), lean.extend_copies(model)
    with torch.inference_mode():
        want = model(idx)[0]
        for kind, tol in ((KVCache, 2e-5), (Int8KVCache, 0.1)):
            cache = kind.for_model(model, max_len=20)
            model(idx[:, :8], cache)
            steps = [engine.step(int(t), cache) for t in idx[0, 8:12]]
            verify = engine.extend(idx[0, 12:].tolist(), cache, copies)
            got = torch.cat([torch.stack(steps), verify])
            torch.testing.assert_close(got, want[8:], atol=tol, rtol=tol)


@pytest.mark.parametrize("name", ["modern", "window", "sinks"])
def test_every_loop_runs_the_modern_model(name):
    """generate (lean and forward), speculative decoding (a draft model, prompt lookup), beam search
    with one beam and serving on contiguous and paged memory all give the same greedy tokens on a
    Llama-shaped model."""
    model, draft = MODELS[name], _model(name, seed=5)
    prompt, n = [3, 14, 15, 92, 65, 35], 12
    greedy = generate(model, prompt, n, eos_id=None).tokens
    assert generate(model, prompt, n, lean=False, eos_id=None).tokens == greedy
    assert generate(model, prompt, n, use_cache=False, eos_id=None).tokens == greedy
    assert speculative_generate(model, draft, prompt, n, gamma=3, eos_id=None).tokens == greedy
    assert (
        speculative_generate(model, PromptLookup(), prompt, n, gamma=3, eos_id=None).tokens
        == greedy
    )
    assert beam_search(model, prompt, n, num_beams=1, eos_id=None).best.tokens == greedy
    for kv in ("contiguous", "paged"):
        report = serve(model, [Request(prompt, n), Request(prompt[:3], n)], kv=kv, eos_id=None)
        assert report.results[0].tokens == greedy
        assert report.results[1].tokens == generate(model, prompt[:3], n, eos_id=None).tokens


def test_a_rolling_cache_holds_constant_memory_and_refuses_a_rollback_past_its_ring():
    model = MODELS["sinks"]
    cache = RollingKVCache.for_model(model, spare=2)
    before = cache.nbytes
    idx = torch.randint(0, 257, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(idx)
        model(idx[:, :30], cache)
        cache.truncate(28)  # within the spare places: the next query still finds every key it sees
        torch.testing.assert_close(
            model(idx[:, 28:40], cache), want[:, 28:40], atol=2e-5, rtol=1e-4
        )
        assert cache.nbytes == before and cache.length == 40
        with raises(ContextFull, "n"):
            cache.truncate(30)


@pytest.mark.skipif(
    not have_transformers(), reason="transformers is the reference peer (dev extra)"
)
@pytest.mark.parametrize("name", ["modern", "mqa_bias", "window"])
def test_the_modern_configuration_equals_transformers_llama(name):
    """Our weights in transformers' LlamaForCausalLM (MistralForCausalLM with a window) give our
    logits."""
    model = MODELS[name]
    hf = to_hf(model)
    assert type(hf).__name__ == ("MistralForCausalLM" if name == "window" else "LlamaForCausalLM")
    idx = torch.randint(0, 257, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), atol=1e-5, rtol=1e-4)


def test_sinks_have_no_transformers_peer():
    with raises(BadValue, "model"):
        to_hf(MODELS["sinks"])


@pytest.mark.parametrize(
    ("change", "arg"),
    [
        (dict(window=0), "window"),
        (dict(window=-3), "window"),
        (dict(n_kv_heads=3), "n_kv_heads"),
        (dict(rope_theta=0.0), "rope_theta"),
        (dict(rope_theta=float("nan")), "rope_theta"),
        (dict(sinks=2, window=None), "sinks"),
        (dict(sinks=-1), "sinks"),
        (dict(norm="batchnorm"), "norm"),
        (dict(mlp="relu"), "mlp"),
        (dict(positions="alibi"), "positions"),
        (dict(n_embd=36, n_head=4, n_kv_heads=2), "positions"),  # head_dim 9: RoPE needs pairs
        (dict(bias=1), "bias"),
    ],
)
def test_a_bad_configuration_is_refused_naming_the_field(change, arg):
    base = dataclasses.asdict(CONFIGS["modern"])
    with raises(BadValue, arg):
        GPTConfig(**{**base, **change})


def test_a_store_of_another_configuration_is_refused_before_any_write():
    modern, window = MODELS["modern"], MODELS["window"]
    idx = torch.tensor([[1, 2, 3]])
    other = KVCache.for_model(MODELS["gpt2"])  # 4 KV heads; the modern model has 2
    with raises(BadValue, "cache"), torch.no_grad():
        modern(idx, other)
    assert other.length == 0 and not other.k[0].any()
    # window 5 with sinks, the model's is 6 without
    rolling = RollingKVCache.for_model(MODELS["sinks"])
    with raises(BadValue, "cache"), torch.no_grad():
        window(idx, rolling)
    with raises(BadValue, "model"):
        RollingKVCache.for_model(modern)  # no window to roll
    with raises(BadType, "pos"):
        rolling.write(0, torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), torch.tensor([[0]]))


@pytest.mark.parametrize("weights", ["int8", "int4", "bf16"])
def test_a_quantized_modern_model_decodes_the_same_through_the_lean_step_and_forward(weights):
    from ar_lab.engine.quant import quantize_model

    model = quantize_model(
        MODELS["modern"], weights=weights, group_size=None if weights != "int4" else 32
    )
    prompt = [5, 6, 7, 8]
    assert (
        generate(model, prompt, 8, eos_id=None).tokens
        == generate(model, prompt, 8, eos_id=None, lean=False).tokens
    )


def test_a_modern_checkpoint_round_trips(tmp_path):
    from ar_lab.model.checkpoint import load_checkpoint, save_checkpoint

    model = MODELS["sinks"]
    save_checkpoint(tmp_path / "m.safetensors", model, {"preset": "test"})
    loaded = load_checkpoint(tmp_path / "m.safetensors", "cpu")
    assert loaded.config == model.config and loaded.wpe is None
    idx = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx), model(idx))


@pytest.mark.skipif(
    not have_transformers(), reason="transformers is the reference peer (dev extra)"
)
def test_the_shipped_modern_checkpoint_is_llama_and_decodes_alike_everywhere():
    """data/modern.safetensors (make checkpoints): a Llama-shaped model whose logits are
    transformers' Llama's, decoding the same text lean, through forward and from a paged server."""
    from ar_lab.model.train import load_pretrained

    model = load_pretrained("modern", "cpu")
    assert (
        model.config.positions == "rope"
        and model.config.kv_heads < model.config.n_head
        and model.wpe is None
    )
    idx = torch.tensor([list(b"def __init__(self, name):\n        self.")])
    with torch.no_grad():
        torch.testing.assert_close(to_hf(model)(idx).logits, model(idx), atol=1e-4, rtol=1e-4)
    prompt = list(b"The assert statement")
    lean_tokens = generate(model, prompt, 24, eos_id=None).tokens
    assert lean_tokens == generate(model, prompt, 24, eos_id=None, lean=False).tokens
    assert (
        serve(model, [Request(prompt, 24)], kv="paged", eos_id=None).results[0].tokens
        == lean_tokens
    )


def test_rope_refuses_positions_past_its_table_rather_than_a_short_slice():
    from ar_lab.model.block import Rope

    rope = Rope(8, 10000.0, 4)
    x = torch.randn(1, 1, 2, 8)
    assert torch.allclose(rope(x, 2)[..., 0, :], Rope(8, 10000.0, 64)(x, 2)[..., 0, :])
    with raises(ContextFull, "pos"):
        rope(x, 3)  # positions 3 and 4 of a 4-position table
