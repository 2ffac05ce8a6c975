"""ar_lab.engine.lean: the batch-1 decode step without nn.Module layers must be GPT.forward's
arithmetic."""



import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.engine import lean, packed
from ar_lab.engine.decoder import ForwardDecoder
from ar_lab.engine.generate import generate
from ar_lab.engine.lean import NotLean
from ar_lab.engine.sampling import SamplingParams
from ar_lab.engine.speculative import speculative_generate
from ar_lab.model.cache import BatchKVCache, KVCache
from ar_lab.model.gpt import GPT, GPTConfig
from tests.conftest import ScriptedModel
from tests.raising import raises


@st.composite
def configs(draw):
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    n_head = kv_heads * draw(st.sampled_from([1, 2]))  # MHA, GQA and MQA
    head_dim = draw(st.sampled_from([2, 8, 16]))  # 16: 1/sqrt(D) exact in binary; 2 and 8: not
    return GPTConfig(
        block_size=48,
        n_layer=draw(st.integers(1, 3)),
        n_head=n_head,
        n_kv_heads=kv_heads,
        n_embd=n_head * head_dim,
    )


def _pair(cfg: GPTConfig, seed: int, prefix: int):
    """A model with non-trivial weights (biases and LayerNorms too) and two caches holding one
    prefix."""
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, cfg.vocab_size, (1, prefix))
    a, b = KVCache.for_model(model), KVCache.for_model(model)
    with torch.inference_mode():
        model(ids, a), model(ids, b)
    return model, a, b


@pytest.mark.slow
@given(
    cfg=configs(), seed=st.integers(0, 10_000), prefix=st.integers(1, 30), steps=st.integers(1, 6)
)
def test_step_equals_forward(cfg, seed, prefix, steps):
    model, a, b = _pair(cfg, seed, prefix)
    engine = lean.for_model(model)
    tokens = torch.randint(0, cfg.vocab_size, (steps,)).tolist()
    with torch.inference_mode():
        for t in tokens:
            got = engine.step(t, a)
            want = model(torch.tensor([[t]]), b)[0, -1]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert a.length == b.length == prefix + steps
    for layer in range(cfg.n_layer):  # the cache holds the same keys and values
        torch.testing.assert_close(
            a.k[layer][:, :, : a.length], b.k[layer][:, :, : b.length], atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            a.v[layer][:, :, : a.length], b.v[layer][:, :, : b.length], atol=1e-5, rtol=1e-5
        )


@given(cfg=configs(), seed=st.integers(0, 10_000), prefix=st.integers(1, 30), T=st.integers(1, 12))
def test_extend_equals_forward(cfg, seed, prefix, T):
    model, a, b = _pair(cfg, seed, prefix)
    tokens = torch.randint(0, cfg.vocab_size, (T,)).tolist()
    with torch.inference_mode():
        got = lean.for_model(model).extend(tokens, a)
        want = model(torch.tensor([tokens]), b)[0]
    assert got.shape == (T, cfg.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert a.length == b.length == prefix + T
    torch.testing.assert_close(
        a.k[-1][:, :, : a.length], b.k[-1][:, :, : b.length], atol=1e-5, rtol=1e-5
    )


@given(prompt=st.lists(st.integers(0, 255), min_size=1, max_size=20), n=st.integers(1, 25))
def test_generate_lean_gives_forward_tokens(prompt, n):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_kv_heads=2, n_embd=32)).eval()
    lean_run = generate(model, prompt, n, eos_id=None)
    plain = generate(model, prompt, n, eos_id=None, lean=False)
    assert lean_run.tokens == plain.tokens
    assert (
        lean_run.stats.positions_processed == plain.stats.positions_processed == len(prompt) + n - 1
    )


@pytest.mark.slow
def test_sampled_generation_and_speculative_match_forward(tiny_model):
    params = SamplingParams(temperature=0.9, top_k=40)
    runs = [
        generate(
            tiny_model,
            "abc",
            30,
            sampling=params,
            generator=torch.Generator().manual_seed(4),
            lean=lean_,
        )
        for lean_ in (True, False)
    ]
    assert runs[0].tokens == runs[1].tokens
    torch.manual_seed(1)
    draft = GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_kv_heads=1, n_embd=16)).eval()
    for gamma in (1, 3, 6):
        a = speculative_generate(tiny_model, draft, "abc", 40, gamma, eos_id=None)
        b = speculative_generate(tiny_model, draft, "abc", 40, gamma, eos_id=None, lean=False)
        assert (
            a.tokens == b.tokens == generate(tiny_model, "abc", 40, eos_id=None, lean=False).tokens
        )
        assert a.stats.acceptances == b.stats.acceptances


def _sgd_through_data(model, other):
    """A manual SGD step written the old way: through ``.data``, which bumps no version counter."""
    model.zero_grad()
    model(torch.tensor([[1, 2, 3]]))[0].logsumexp(-1).sum().backward()
    for p in model.parameters():
        p.data -= 1.0 * p.grad


def _optimizer_step(model, other):
    model.zero_grad()
    model(torch.tensor([[1, 2, 3]]))[0].logsumexp(-1).sum().backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()


def _copy_in_place(model, other):
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters(), strict=True):
            p.copy_(q)


def _assign_data(model, other):
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        p.data = q.detach().clone()  # new storage behind the same Parameter


def _write_into_data(model, other):
    # only the matrices the old engine copied
    for b, ob in zip(model.blocks, other.blocks, strict=True):
        b.attn.qkv.weight.data.copy_(ob.attn.qkv.weight)
        b.mlp.proj.weight.data[:] = ob.mlp.proj.weight


WEIGHT_CHANGES = {
    "sgd through .data": _sgd_through_data,
    "optimizer step": _optimizer_step,
    "copy_": _copy_in_place,
    "load_state_dict": lambda model, other: model.load_state_dict(other.state_dict()),
    "p.data = new tensor": _assign_data,
    "writes into .data": _write_into_data,
}


@pytest.mark.parametrize("change", list(WEIGHT_CHANGES))
def test_every_change_of_the_weights_is_seen(change):
    """After each kind of change, lean steps, lean extends and speculative decoding use the new
    weights.

    (The engine this replaced missed the two kinds through ``.data``: the first in speculative
    decoding, the second in generate too.)
    """
    # weights that matter
    tiny_model, _, _ = _pair(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=32), 0, 1)
    torch.manual_seed(5)
    other, draft = (
        GPT(tiny_model.config).eval(),
        GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=16)).eval(),
    )
    engine = lean.for_model(tiny_model)  # made before the change, used after it
    before = generate(tiny_model, "hello", 20, eos_id=None).tokens
    # its (in, out) copies now exist
    speculative_generate(tiny_model, draft, "hello", 20, 3, eos_id=None)
    paused = generate_stream_tokens(tiny_model, "hi there", 10)
    lean_stream, plain_stream = paused(lean_=True), paused(lean_=False)
    head = [next(lean_stream) for _ in range(4)], [next(plain_stream) for _ in range(4)]
    WEIGHT_CHANGES[change](tiny_model, other)
    want = generate(tiny_model, "hello", 20, eos_id=None, lean=False).tokens
    assert want != before  # the change matters, so stale weights would show
    assert generate(tiny_model, "hello", 20, eos_id=None).tokens == want
    assert speculative_generate(tiny_model, draft, "hello", 20, 3, eos_id=None).tokens == want
    # a stream paused across the change continues on the new weights, as forward() does
    assert head[0] == head[1] and list(lean_stream) == list(plain_stream)
    ids = torch.tensor([[5, 6, 7, 8]])
    a, b = KVCache.for_model(tiny_model), KVCache.for_model(tiny_model)
    with torch.inference_mode():
        want_logits = tiny_model(ids, b)[0]
        tiny_model(ids[:, :1], a)
        torch.testing.assert_close(engine.step(6, a), want_logits[1], atol=1e-5, rtol=1e-5)
        got = engine.extend([7, 8], a, lean.extend_copies(tiny_model))
    torch.testing.assert_close(got, want_logits[2:], atol=1e-5, rtol=1e-5)


def generate_stream_tokens(model, prompt, n):
    """A token generator of ``model`` that can be paused (lean or through forward)."""
    from ar_lab.engine.generate import token_steps

    return lambda lean_: token_steps(model, prompt, n, lean=lean_)


def test_extend_copies_are_fresh_copies_of_the_weights_now(tiny_model):
    """Whatever their layout (oneDNN's blocked one on a CPU that has it, else (in, out)), the copies
    multiply like the weights they were taken from, and a later edit reaches the next copies
    only."""
    x = torch.randn(3, tiny_model.config.n_embd)
    block = tiny_model.blocks[1]
    first = lean.extend_copies(tiny_model)
    assert (type(first.layers[1].fc) is packed.Packed) == packed.packs(block.mlp.fc.weight)
    with torch.inference_mode():
        want = x @ block.mlp.fc.weight.t()
        torch.testing.assert_close(
            packed.extend_mm(None, x, first.layers[1].fc), want, atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            packed.extend_mm(None, x, first.out),
            x @ tiny_model.wte.weight.t(),
            atol=1e-5,
            rtol=1e-5,
        )
    block.mlp.fc.weight.data[0, 0] += 1.0  # one value, through .data: no version counter moves
    second = lean.extend_copies(tiny_model)
    with torch.inference_mode():
        edited = x @ block.mlp.fc.weight.t()
        torch.testing.assert_close(
            packed.extend_mm(None, x, second.layers[1].fc), edited, atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            packed.extend_mm(None, x, first.layers[1].fc), want, atol=1e-5, rtol=1e-5
        )
    with raises(NotLean, 'model'):
        lean.extend_copies(ScriptedModel([1], 1))


def test_a_model_with_large_matrices_runs_extend_on_packed_weights():
    torch.manual_seed(0)
    # fc: 2048 x 512 weights
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=4, n_embd=512)).eval()
    copies = lean.extend_copies(model)
    assert packed.packs(model.blocks[0].mlp.fc.weight) == (
        type(copies.layers[0].fc) is packed.Packed
    )
    if not packed.packs(model.blocks[0].mlp.fc.weight):
        pytest.skip(
            "this PyTorch has no oneDNN on this machine: extend runs on (in, out) copies (tested "
            "above)"
        )
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    a, b = KVCache.for_model(model), KVCache.for_model(model)
    with torch.inference_mode():
        want = model(ids, b)[0]
        model(ids[:, :2], a)
        got = lean.LeanGPT(model).extend([7, 8, 9, 10], a, copies)
    torch.testing.assert_close(got, want[2:], atol=1e-4, rtol=1e-4)


def test_extend_copies_fall_back_to_in_out_copies_where_onednn_does_not_take_the_weights():
    """A matrix large enough to pack, in float64 (which oneDNN's linear does not take), is copied
    (in, out)."""
    torch.manual_seed(0)
    # fc: 2048 x 512
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=4, n_embd=512)).eval().double()
    fc = model.blocks[0].mlp.fc.weight
    assert fc.numel() >= packed.PACK_MIN_WEIGHTS and not packed.packs(fc)
    copies = lean.extend_copies(model)
    assert type(copies.layers[0].fc) is torch.Tensor and copies.layers[0].fc.is_contiguous()
    torch.testing.assert_close(copies.layers[0].fc, fc.t(), rtol=0, atol=0)
    assert copies.layers[0].fc.data_ptr() != fc.data_ptr()  # a copy, not a view


def test_every_matrix_packed_the_output_projection_included(tiny_model, monkeypatch):
    """With the size floor lowered, every matrix of the tiny model is packed, the tied output
    projection (no bias) too; extend still gives forward's logits."""
    monkeypatch.setattr(packed, "PACK_MIN_WEIGHTS", 1)
    copies = lean.extend_copies(tiny_model)
    if not packed.packs(tiny_model.wte.weight):
        pytest.skip("this PyTorch has no oneDNN on this machine")
    assert type(copies.out) is packed.Packed and all(
        type(m) is packed.Packed for m in copies.layers[0]
    )
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    a, b = KVCache.for_model(tiny_model), KVCache.for_model(tiny_model)
    with torch.inference_mode():
        want = tiny_model(ids, b)[0]
        tiny_model(ids[:, :2], a)
        got = lean.LeanGPT(tiny_model).extend([7, 8, 9], a, copies)
    torch.testing.assert_close(got, want[2:], atol=1e-5, rtol=1e-5)


def test_a_decoder_takes_its_copies_once_and_a_new_one_sees_an_edit(tiny_model):
    """Copies live in the decoder of one generation (speculative_generate makes one per call)."""
    prompt = [5, 6, 7, 8, 9]
    before = speculative_generate(tiny_model, tiny_model, prompt, 12, 3, eos_id=None).tokens
    assert before == generate(tiny_model, prompt, 12, eos_id=None).tokens
    with torch.no_grad():
        for b in tiny_model.blocks:
            b.mlp.fc.weight.data.mul_(-1.0)
    after = speculative_generate(tiny_model, tiny_model, prompt, 12, 3, eos_id=None).tokens
    assert after == generate(tiny_model, prompt, 12, eos_id=None).tokens != before


def test_models_with_their_own_forward_or_blocks_are_not_bypassed(tiny_model):
    """generate must follow what the model computes: a subclass's forward or a swapped block stays
    in charge."""

    class AlwaysA(GPT):
        def forward(self, idx, cache=None):
            logits = super().forward(idx, cache)
            logits[..., ord("A")] += 1e4  # this model always says "A"
            return logits

    model = AlwaysA(tiny_model.config).eval()
    assert not lean.supports(model) and lean.supports(tiny_model)
    assert generate(model, "xy", 10, eos_id=None).text == "A" * 10
    with raises(NotLean, 'model'):
        lean.LeanGPT(model)

    class Doubled(torch.nn.Module):  # an experiment: a block whose MLP output is doubled
        def __init__(self, mlp):
            super().__init__()
            self.mlp = mlp

        def forward(self, x):
            return 2 * self.mlp(x)

    torch.manual_seed(2)
    swapped = GPT(tiny_model.config).eval()
    swapped.blocks[0].mlp = Doubled(swapped.blocks[0].mlp)
    assert not lean.supports(swapped)
    got = generate(swapped, "hello", 20, eos_id=None).tokens
    assert got == generate(swapped, "hello", 20, eos_id=None, use_cache=False).tokens


def test_bad_input_is_explained(tiny_model):
    engine = lean.for_model(tiny_model)
    with raises(NotLean, 'model'):
        lean.LeanGPT(ScriptedModel([1], 1))
    assert not lean.supports(ScriptedModel([1], 1))
    with raises(BadValue, 'cache'):
        engine.step(1, KVCache.for_model(tiny_model, batch_size=2))
    with raises(BadType, 'cache'):
        engine.step(1, BatchKVCache.for_model(tiny_model, max_batch=2))
    with raises(BadValue, 'cache'):
        engine.step(1, KVCache(1, 1, 4, 16, 8))
    with raises(BadValue, 'cache'):
        engine.step(1, KVCache.for_model(tiny_model, dtype=torch.float64))
    full = KVCache.for_model(tiny_model, max_len=3)
    with torch.inference_mode():
        engine.extend([1, 2, 3], full)
        with raises(ContextFull, 'cache'):
            engine.step(4, full)
        with raises(ContextFull, 'cache'):
            engine.extend([4, 5], full)
        window = KVCache.for_model(tiny_model)  # block_size 64
        engine.extend(list(range(60)), window)
        with raises(ContextFull, 'cache'):
            engine.extend([1, 2, 3, 4, 5], window)
        assert window.length == 60  # a refused call changes nothing
        with raises(BadValue, 'tokens'):
            engine.extend([], window)


def test_layer_weights_are_the_blocks_own_parameters_by_name(tiny_model):
    """Each field of a layer's weights is the block's parameter it names: no copies to go stale."""
    engine = lean.for_model(tiny_model)
    for w, b in zip(engine.layers, tiny_model.blocks, strict=True):
        # products: partial(addmv, bias, weight)
        assert w.norm1.weight is b.ln1.weight and w.norm2.bias is b.ln2.bias
        assert w.proj.args[0] is b.attn.proj.bias and w.qkv.args == (
            b.attn.qkv.bias,
            b.attn.qkv.weight,
        )
        assert w.fc.args[1] is b.mlp.fc.weight and w.mlp_proj.args[1] is b.mlp.proj.weight
    assert engine.wte is tiny_model.wte.weight is tiny_model.lm_head.weight


def test_steps_record_their_tokens_and_need_inference_mode(tiny_model):
    engine, cache = lean.for_model(tiny_model), KVCache.for_model(tiny_model)
    with torch.inference_mode():
        # (the model alone records nothing)
        ForwardDecoder(tiny_model).prefill(torch.tensor([[1, 2]]), cache)
        engine.step(3, cache)
        engine.extend([4, 5, 6], cache)
    assert cache.token_ids == [1, 2, 3, 4, 5, 6]
    cache.truncate(4)
    assert cache.token_ids == [1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="inference_mode"):
        engine.step(5, cache)
    with pytest.raises(RuntimeError, match="inference_mode"):
        engine.extend([5, 6], cache)
    assert cache.length == 4


class LoRALinear(torch.nn.Linear):
    """A fine-tuning experiment: an nn.Linear with a low-rank update added in its forward."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__(base.in_features, base.out_features)
        self.load_state_dict(base.state_dict())
        self.a = torch.nn.Parameter(torch.randn(2, base.in_features))
        self.b = torch.nn.Parameter(torch.randn(base.out_features, 2))

    def forward(self, x):
        return super().forward(x) + x @ self.a.t() @ self.b.t()


def _untie(model):
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.wte.weight) * 0.02)


def _lora(model):
    model.blocks[0].attn.qkv = LoRALinear(model.blocks[0].attn.qkv)


def _parametrize(model):
    torch.nn.utils.parametrize.register_parametrization(model.blocks[1].mlp.fc, "weight", Doubled())


def _other_eps(model):
    model.blocks[0].ln2.eps = 0.5


class Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


def test_each_norm_keeps_its_own_epsilon_in_the_lean_step(tiny_model):
    """The lean step runs each norm module's own epsilon: a block given another one decodes as
    forward does."""
    _other_eps(tiny_model)
    assert lean.supports(tiny_model)
    with torch.inference_mode():
        cache = KVCache.for_model(tiny_model, max_len=8)
        tiny_model(torch.tensor([[1, 2, 3]]), cache)
        want = tiny_model(torch.tensor([[1, 2, 3, 4]]))[0, -1]
        torch.testing.assert_close(
            lean.for_model(tiny_model).step(4, cache), want, atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("edit", [_untie, _lora, _parametrize], ids=lambda f: f.__name__[1:])
def test_modules_the_lean_step_does_not_reproduce_go_through_forward(tiny_model, edit):
    """Weights reached through a module's own forward: generate follows forward."""
    torch.manual_seed(3)
    model = GPT(tiny_model.config).eval()
    edit(model)
    assert not lean.supports(model)
    with raises(NotLean, 'model'):
        lean.LeanGPT(model)
    want = generate(model, "hello", 15, eos_id=None, use_cache=False).tokens
    assert generate(model, "hello", 15, eos_id=None).tokens == want
    assert speculative_generate(model, model, "hello", 15, 3, eos_id=None).tokens == want


# --- a batched step: every row of a BatchKVCache at a position of its own ------------------------

BATCHED = {
    "gpt2": GPTConfig(block_size=48, n_layer=2, n_head=4, n_embd=32),
    "modern": GPTConfig.modern(block_size=48, n_layer=2, n_head=4, n_kv_heads=2, n_embd=32),
    "window": GPTConfig.modern(
        block_size=48, n_layer=2, n_head=4, n_kv_heads=1, n_embd=32, window=6, bias=True
    ),
}


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(sorted(BATCHED)),
    seed=st.integers(0, 10_000),
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=5),
    steps=st.integers(1, 4),
)
def test_a_batched_step_through_the_copies_equals_forward(name, seed, lengths, steps):
    """LeanDecoder.step on a BatchKVCache (rows at lengths of their own) runs the block once for all
    rows through the weights' few-row copies: the logits and the cache's keys and values are
    forward's, step after step."""
    from ar_lab.engine.decoder import ForwardDecoder, LeanDecoder

    torch.manual_seed(seed)
    model = GPT(BATCHED[name]).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    caches = [BatchKVCache.for_model(model, max_batch=len(lengths)) for _ in range(2)]
    for cache in caches:  # the same prompts in the same slots
        for i, n in enumerate(lengths):
            ids = torch.randint(0, 257, (1, n), generator=torch.Generator().manual_seed(seed + i))
            with torch.inference_mode():
                model(ids, cache.slot(cache.rows))  # prefilled, then put in use
            cache.add(n)
    lean_d, forward_d = LeanDecoder(model), ForwardDecoder(model)
    with torch.inference_mode():
        for _ in range(steps):
            tokens = torch.randint(0, 257, (len(lengths),))
            got = lean_d.step(tokens, caches[0], None)
            want = forward_d.step(tokens, caches[1], None)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert caches[0].lengths == caches[1].lengths
    for layer in range(model.config.n_layer):
        torch.testing.assert_close(caches[0].k[layer], caches[1].k[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(caches[0].v[layer], caches[1].v[layer], atol=1e-5, rtol=1e-5)


def test_a_batched_step_refuses_what_does_not_fit_its_rows(tiny_model):
    from ar_lab.engine.decoder import LeanDecoder

    cache = BatchKVCache.for_model(tiny_model, max_batch=3)
    for n in (2, 3):
        with torch.inference_mode():
            tiny_model(torch.ones(1, n, dtype=torch.long), cache.slot(cache.rows))
        cache.add(n)
    d = LeanDecoder(tiny_model)
    with torch.inference_mode():
        with raises(BadValue, "tokens"):  # three ids for two rows
            d.step(torch.tensor([1, 2, 3]), cache, None)
        with raises(BadValue, "tokens"):
            d.step(torch.tensor([1, 999]), cache, None)
        with raises(BadType, "tokens"):
            d.step(torch.tensor([1.0, 2.0]), cache, None)
    assert cache.lengths[:2] == [2, 3]  # nothing written, nothing advanced
