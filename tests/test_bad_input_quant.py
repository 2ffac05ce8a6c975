"""No silent wrong results from quantized models, int8 KV caches, checkpoints and caches (round
two).

Two kinds of case, written from the public API:

- ``CALLS``: a mistaken call raises the named error type with a message holding the fragment (the
  argument it names, or what to do), never an exception from inside torch or pathlib.
- the other tests: inputs that used to give a wrong result without a word (a quantized model cast to
  bfloat16 decoding other text through the lean step, a prefix copied into an int8 cache unscaled,
  NaN keys coming back finite, a swapped or int8-typed checkpoint loading, a refused ``truncate``
  leaving the cache broken) now give the right result or are refused.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ar_lab
from ar_lab.base.errors import BadType, BadValue
from ar_lab.engine import lean
from ar_lab.engine.decoder import ForwardDecoder, LeanDecoder, decoder_for
from ar_lab.engine.generate import generate
from ar_lab.engine.kv_quant import Int8KVCache
from ar_lab.engine.lean import NotLean
from ar_lab.engine.prefix_cache import PrefixCache
from ar_lab.engine.quant import QuantizedLinear, QuantizedTensor, quantize_int8, quantize_model
from ar_lab.model import checkpoint
from ar_lab.model.cache import BatchKVCache, KVCache
from ar_lab.model.checkpoint import CheckpointError
from ar_lab.model.gpt import GPT, GPTConfig
from tests.raising import raises
from tests.test_bad_input import Call, check_call

PROMPT = "The history of the "


@functools.cache
def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64)).eval()


@functools.cache
def other() -> GPT:
    """Same width as ``tiny``, other heads: a cache of one does not fit the other."""
    torch.manual_seed(1)
    return GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64)).eval()


@functools.cache
def course() -> GPT:
    return ar_lab.load_pretrained("course", "cpu").eval()


def tokens(model, n: int = 30, **options) -> list[int]:
    return generate(model, PROMPT, n, eos_id=None, **options).tokens


def qt(q=None, scale=None, bits=8, group_size=None) -> QuantizedTensor:
    q = torch.zeros(16, 64, dtype=torch.int8) if q is None else q
    return QuantizedTensor(q, torch.ones(16) if scale is None else scale, bits, group_size)


def on(cache_or_decoder_call):
    with torch.inference_mode():
        return cache_or_decoder_call()


# --- 1. mistaken calls -------------------------------------------------------------------




CALLS = [
    # quantized tensors and layers: only what the kernels support
    Call(
        "QuantizedTensor(bits=3)",
        lambda: qt(bits=3, group_size=32, scale=torch.ones(16, 2)),
        BadValue,
        "bits",
    ),
    Call("QuantizedTensor(bits=True)", lambda: qt(bits=True), BadValue, "bits"),
    Call("QuantizedTensor(float q)", lambda: qt(q=torch.zeros(16, 64)), BadValue, "q"),
    Call("QuantizedTensor(1-D q)", lambda: qt(q=torch.zeros(64, dtype=torch.int8)), BadValue, "q"),
    Call("QuantizedTensor(scale (3,))", lambda: qt(scale=torch.ones(3)), BadValue, "scale"),
    Call(
        "QuantizedTensor(NaN scale)",
        lambda: qt(scale=torch.full((16,), torch.nan)),
        BadValue,
        "scale",
    ),
    Call("QuantizedTensor(int8, group_size=32)", lambda: qt(group_size=32), BadValue, "group_size"),
    Call(
        "QuantizedTensor(int4 q = 9)",
        lambda: qt(
            q=torch.full((16, 64), 9, dtype=torch.int8),
            scale=torch.ones(16, 2),
            bits=4,
            group_size=32,
        ),
        BadValue,
        'q',
    ),
    Call(
        "QuantizedTensor(int4, no group_size)",
        lambda: qt(bits=4, scale=torch.ones(16, 1)),
        BadValue,
        "group_size",
    ),
    Call(
        "QuantizedLinear(qt, bias of 5)",
        lambda: QuantizedLinear(quantize_int8(torch.randn(16, 64)), torch.zeros(5)),
        BadValue,
        'bias',
    ),
    Call(
        "QuantizedLinear(qt, bias=list)",
        lambda: QuantizedLinear(quantize_int8(torch.randn(16, 64)), [0.0] * 16),
        BadValue,
        'bias',
    ),
    Call(
        "QuantizedLinear(...)(x of width 63)",
        lambda: QuantizedLinear(quantize_int8(torch.randn(16, 64)))(torch.randn(2, 63)),
        BadValue,
        'x',
    ),
    Call(
        "QuantizedLinear(...)(int64 x)",
        lambda: QuantizedLinear(quantize_int8(torch.randn(16, 64)))(
            torch.ones(2, 64, dtype=torch.long)
        ),
        BadValue,
        'x',
    ),
    Call(
        "QuantizedLinear.from_linear(Conv1d)",
        lambda: QuantizedLinear.from_linear(torch.nn.Conv1d(4, 4, 1), 8),
        BadType,
        'linear',
    ),
    Call(
        "save_checkpoint(path, int8 model)",
        lambda: checkpoint.save_checkpoint(
            Path(tempfile.gettempdir()) / "ar_lab_never_written.safetensors",
            quantize_model(tiny(), weights="int8"),
        ),
        BadValue,
        'model',
    ),
    # caches: types, dtypes, devices, sizes
    Call(
        "KVCache(dtype='float32')",
        lambda: KVCache(1, 1, 1, 4, 4, dtype="float32"),
        BadType,
        "dtype",
    ),
    Call(
        "KVCache(dtype=torch.int64)",
        lambda: KVCache(1, 1, 1, 4, 4, dtype=torch.int64),
        BadValue,
        "dtype",
    ),
    Call(
        "KVCache(device='banana')",
        lambda: KVCache(1, 1, 1, 4, 4, device="banana"),
        BadValue,
        "device",
    ),
    Call(
        "Int8KVCache(dtype='bf16')",
        lambda: Int8KVCache(1, 1, 1, 4, 4, dtype="bf16"),
        BadType,
        "dtype",
    ),
    Call("KVCache.for_model('model')", lambda: KVCache.for_model("model"), BadType, "model"),
    Call(
        "KVCache.for_model(m, max_len=2.5)",
        lambda: KVCache.for_model(tiny(), max_len=2.5),
        BadValue,
        "max_len",
    ),
    Call(
        "KVCache.for_model(m, max_len=True)",
        lambda: KVCache.for_model(tiny(), max_len=True),
        BadValue,
        "max_len",
    ),
    Call(
        "KVCache.from_buffers(..., length=2.5)",
        lambda: KVCache.from_buffers([torch.zeros(1, 2, 4, 4)], [torch.zeros(1, 2, 4, 4)], 2.5),
        BadValue,
        'length',
    ),
    Call(
        "KVCache.from_buffers(tensor, tensor)",
        lambda: KVCache.from_buffers(torch.zeros(2, 1, 2, 4, 4), torch.zeros(2, 1, 2, 4, 4)),
        BadType,
        'k',
    ),
    Call(
        "KVCache.reusable('abc')",
        lambda: KVCache.for_model(tiny()).reusable("abc"),
        BadType,
        "prompt",
    ),
    Call(
        "BatchKVCache.slot(True)",
        lambda: BatchKVCache.for_model(tiny(), 2).slot(True),
        BadValue,
        "slot",
    ),
    Call(
        "BatchKVCache.add(True)",
        lambda: BatchKVCache.for_model(tiny(), 2).add(True),
        BadValue,
        "length",
    ),
    Call(
        "BatchKVCache.begin(0)",
        lambda: (lambda b: (b.add(1), b.begin(0)))(BatchKVCache.for_model(tiny(), 2)),
        BadValue,
        'T',
    ),
    Call(
        "BatchKVCache.advance(-3)",
        lambda: (lambda b: (b.add(1), b.advance(-3)))(BatchKVCache.for_model(tiny(), 2)),
        BadValue,
        'T',
    ),
    # a cache of another model, dtype or device reaching generate or a decoder
    *[
        Call(
            f"generate(m, cache={what}, lean={flag})",
            lambda make=make, flag=flag: generate(tiny(), [1, 2, 3], 5, cache=make(), lean=flag),
            BadValue,
            "cache",
        )
        for what, make in [
            ("bf16", lambda: KVCache.for_model(tiny(), dtype=torch.bfloat16)),
            ("float64", lambda: KVCache.for_model(tiny(), dtype=torch.float64)),
            ("other heads", lambda: KVCache.for_model(other())),
            ("1 layer", lambda: KVCache(1, 1, 4, 64, 16)),
            ("3 layers", lambda: KVCache(3, 1, 4, 64, 16)),
            ("int8 other heads", lambda: Int8KVCache.for_model(other())),
        ]
        for flag in (True, False)
    ],
    Call(
        "ForwardDecoder(m).prefill(ids, cache of other)",
        lambda: on(
            lambda: ForwardDecoder(tiny()).prefill(
                torch.tensor([[1, 2]]), KVCache.for_model(other()), 0
            )
        ),
        BadValue,
        'cache',
    ),
    Call(
        "LeanDecoder(m).step(1, None, 0)",
        lambda: on(lambda: LeanDecoder(tiny()).step(1, None, 0)),
        BadType,
        'cache',
    ),
    Call(
        "LeanDecoder(m).step(2.5, cache, 0)",
        lambda: on(lambda: LeanDecoder(tiny()).step(2.5, KVCache.for_model(tiny()), 0)),
        BadType,
        'token',
    ),
    Call("decoder_for('model')", lambda: decoder_for("model"), BadType, "model"),
    Call("decoder_for(m, lean='yes')", lambda: decoder_for(tiny(), lean="yes"), BadType, "lean"),
    # the lean engine: token ids, not floats or bools
    Call(
        "LeanGPT.step(True)",
        lambda: on(lambda: lean.LeanGPT(tiny()).step(True, KVCache.for_model(tiny()))),
        BadType,
        'token',
    ),
    Call(
        "LeanGPT.step(2.5)",
        lambda: on(lambda: lean.LeanGPT(tiny()).step(2.5, KVCache.for_model(tiny()))),
        BadType,
        'token',
    ),
    Call(
        "LeanGPT.extend([1.5, 2.5])",
        lambda: on(lambda: lean.LeanGPT(tiny()).extend([1.5, 2.5], KVCache.for_model(tiny()))),
        BadType,
        'tokens',
    ),
    Call(
        "LeanGPT.extend([300, 1])",
        lambda: on(lambda: lean.LeanGPT(tiny()).extend([300, 1], KVCache.for_model(tiny()))),
        BadValue,
        'tokens',
    ),
    Call(
        "weights_only_pass('model', 1)",
        lambda: lean.weights_only_pass("model", 1),
        BadType,
        "model",
    ),
    # prefix caches
    Call("PrefixCache('model', 'ab')", lambda: PrefixCache("model", "ab"), BadType, 'model'),
    Call("PrefixCache(m, [999])", lambda: PrefixCache(tiny(), [999]), BadValue, 'prefix'),
    Call(
        "PrefixCache(m, 'ab').copy_into('x', 'abc')",
        lambda: PrefixCache(tiny(), "ab").copy_into("x", "abc"),
        BadType,
        'cache',
    ),
    Call(
        "PrefixCache(m, 'ab').copy_into(bf16 cache, 'abc')",
        lambda: PrefixCache(tiny(), "ab").copy_into(
            KVCache.for_model(tiny(), dtype=torch.bfloat16), "abc"
        ),
        BadValue,
        'cache',
    ),
    # checkpoint paths
    Call("load_checkpoint(None)", lambda: checkpoint.load_checkpoint(None), BadType, "path"),
    Call(
        "read_checkpoint_metadata(123)",
        lambda: checkpoint.read_checkpoint_metadata(123),
        BadType,
        "path",
    ),
    Call(
        "save_checkpoint(123, m)", lambda: checkpoint.save_checkpoint(123, tiny()), BadType, "path"
    ),
]


@pytest.mark.parametrize("case", CALLS, ids=[c.name for c in CALLS])
def test_a_mistaken_call_raises_an_actionable_error(case: Call):
    check_call(case)


# --- 2. quantized models ---------------------------------------------------------------------


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_quantized_model_cast_after_quantizing_decodes_the_same_tokens_lean_or_not(weights):
    """Cast to bfloat16 after quantizing, the lean step rounded differently from forward (other text
    for the same prompt); such a model now goes through forward, and its layers keep the kernels'
    dtypes."""
    model = quantize_model(course(), weights=weights).to(torch.bfloat16)
    assert not lean.supports(model)
    with raises(NotLean, 'model'):
        lean.LeanGPT(model)
    layer = model.blocks[0].attn.qkv
    assert layer.bias.dtype == torch.float32 and all(
        b.dtype in (torch.int8, torch.uint8, torch.bfloat16) for b in layer.buffers()
    )
    got = tokens(model, 40)
    assert tokens(model, 40, lean=False) == got
    assert tokens(model, 40, use_cache=False) == got


@pytest.mark.parametrize("cast", ["half", "double"])
def test_a_quantized_model_cast_to_another_float_type_still_generates(cast):
    """``.half()`` or ``.double()`` used to cast the kernels' bfloat16 scales (an error from inside
    torch)."""
    model = getattr(quantize_model(tiny(), weights="int8"), cast)()
    assert model.blocks[0].mlp.fc.scales.dtype == torch.bfloat16
    assert tokens(model, 10) == tokens(model, 10, lean=False) and len(tokens(model, 10)) == 10


def test_quantizing_a_bfloat16_model_keeps_the_residual_stream_float32():
    model = quantize_model(course().bfloat16(), weights="int8")
    assert model.wte.weight.dtype == model.ln_f.weight.dtype == torch.float32 and lean.supports(
        model
    )
    assert tokens(model, 30) == tokens(model, 30, lean=False)


def test_an_fp32_copy_shares_no_storage_with_its_source():
    copy = quantize_model(tiny(), weights="fp32")
    assert all(
        a.data_ptr() != b.data_ptr()
        for a, b in zip(copy.parameters(), tiny().parameters(), strict=True)
    )


def test_an_int8_value_of_minus_128_is_computed_as_it_stands():
    q = QuantizedTensor(
        torch.full((16, 64), -128, dtype=torch.int8), torch.full((16,), 0.01), 8, None
    )
    x = torch.randn(3, 64)
    torch.testing.assert_close(QuantizedLinear(q)(x), x @ q.dequantize().T, rtol=0.02, atol=0.05)


def test_saving_a_quantized_model_is_refused_before_anything_is_written(tmp_path):
    path = tmp_path / "q.safetensors"
    with raises(BadValue, 'model'):
        checkpoint.save_checkpoint(path, quantize_model(tiny(), weights="int4"))
    assert not path.exists()


# --- 3. the int8 KV cache ---------------------------------------------------------------------


def test_a_prefix_copied_into_an_int8_cache_is_quantized_and_decodes_as_a_fresh_one():
    model = course()
    prefix, prompt = (
        PrefixCache(model, "The history of the world "),
        "The history of the world is long",
    )
    cache = Int8KVCache.for_model(model, max_len=80)
    n = prefix.copy_into(cache, prompt)
    assert n > 0 and bool((cache.k_scale[0][0, :, :n] != 1).all())
    # each vector within half a step of the prefix's float keys
    for layer in range(model.config.n_layer):
        want = prefix.cache.k[layer][:, :, :n]
        got = cache.k[layer][:, :, :n].float() * cache.k_scale[layer][:, :, :n, None]
        assert bool(((got - want).abs() <= cache.k_scale[layer][:, :, :n, None] / 2 + 1e-6).all())
    fresh = generate(
        model, prompt, 30, eos_id=None, cache=Int8KVCache.for_model(model, max_len=80)
    ).tokens
    assert generate(model, prompt, 30, eos_id=None, cache=cache).tokens == fresh


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_keys_stay_non_finite_in_an_int8_cache(bad):
    cache = Int8KVCache(1, 1, 2, 8, 4)
    k = torch.randn(1, 2, 3, 4)
    k[0, 0, 1, 2] = bad
    keys, _ = cache.update(0, 0, k, torch.randn(1, 2, 3, 4))
    assert not bool(torch.isfinite(keys[0, 0, 1]).any()) and bool(torch.isfinite(keys[0, 1]).all())
    k1 = torch.randn(1, 2, 1, 4)
    k1[0, 0, 0, 0] = bad
    cache.write(0, k1, torch.randn(1, 2, 1, 4), 3)
    for T in (1, 2):  # one query: the folded scales; several: the dequantized copy
        out = cache.attend(0, torch.randn(1, 2, T, 4), 4 - T)  # (1, H, T, D)
        assert not bool(torch.isfinite(out[0, 0, -1]).all()) and bool(
            torch.isfinite(out[0, 1]).all()
        )


# --- 4. checkpoints ---------------------------------------------------------------------------


def _write(path, state: dict, config: GPTConfig, record: dict | None = None):
    """A checkpoint with a correct digest for whatever ``state`` holds (what an edited file can be
    made to have)."""
    cfg, rec = json.dumps(config.to_dict()), None if record is None else json.dumps(record)
    meta = {
        "format": checkpoint.FORMAT,
        "config": cfg,
        "digest": checkpoint.checkpoint_digest(cfg, rec, state),
    }
    if rec is not None:
        meta["record"] = rec
    save_file(state, str(path), metadata=meta)
    return path


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}


def test_a_checkpoint_of_another_preset_is_refused_when_a_preset_is_asked_for(tmp_path):
    path = _write(
        tmp_path / "course.safetensors", _state(tiny()), tiny().config, {"preset": "draft"}
    )
    with raises(CheckpointError, 'path'):
        checkpoint.load_checkpoint(path, "cpu", preset="course")
    assert (
        checkpoint.load_checkpoint(path, "cpu", preset="draft").checkpoint_record["preset"]
        == "draft"
    )


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool])
def test_tensors_of_a_dtype_the_model_does_not_hold_are_refused_despite_a_correct_digest(
    tmp_path, dtype
):
    state = {k: (v * 100).to(dtype) for k, v in _state(tiny()).items()}
    path = _write(tmp_path / "typed.safetensors", state, tiny().config)
    with raises(CheckpointError, 'path'):
        checkpoint.load_checkpoint(path, "cpu")


def test_a_header_claiming_a_huge_model_is_refused_before_it_is_allocated(tmp_path, monkeypatch):
    built = []

    def spy(config):
        built.append(torch.empty(0).device.type)  # "meta" while only shapes are being worked out
        if built[-1] != "meta":
            # (never 80 GB)
            raise AssertionError("load_checkpoint allocated the model before checking the file")
        return GPT(config)

    monkeypatch.setattr(checkpoint, "GPT", spy)
    big = GPTConfig(block_size=4096, n_layer=400, n_head=16, n_embd=2048)
    path = _write(tmp_path / "huge.safetensors", _state(tiny()), big)
    with raises(CheckpointError, 'path'):
        checkpoint.load_checkpoint(path, "cpu")
    assert built and set(built) == {"meta"}


# --- 5. caches ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2.5, True, "1", None, -1, 99])
def test_a_refused_truncate_leaves_the_cache_as_it_was(n):
    cache = KVCache.for_model(tiny(), max_len=8)
    generate(tiny(), [1, 2, 3], 3, eos_id=None, cache=cache)
    before = (cache.length, cache.token_ids)
    with raises(BadValue, 'n'):
        cache.truncate(n)
    assert (cache.length, cache.token_ids) == before and before[0] == 5  # unchanged, still usable
    fresh = generate(tiny(), [1, 2, 3], 3, eos_id=None).tokens
    assert generate(tiny(), [1, 2, 3], 3, eos_id=None, cache=cache).tokens == fresh


def test_check_fits_accepts_the_caches_for_model_builds():
    for cache in (
        KVCache.for_model(tiny()),
        Int8KVCache.for_model(tiny()),
        BatchKVCache.for_model(tiny(), 2),
    ):
        cache.check_fits(tiny())
    assert Int8KVCache.for_model(tiny(), dtype=torch.bfloat16).dtype == torch.bfloat16
    with raises(BadValue, 'cache'):
        BatchKVCache.for_model(other(), 2).check_fits(tiny())


def test_lean_step_takes_a_one_element_integer_tensor_as_its_id():
    engine = lean.LeanGPT(tiny())
    with torch.inference_mode():
        a = engine.step(torch.tensor(7), KVCache.for_model(tiny()))
        b = engine.step(7, KVCache.for_model(tiny()))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
