"""Chapter 04: the cache-size calculator (pure functions and the widget) and the lean decode
path."""

import math

import pytest
import torch

from ar_lab.base.errors import BadValue
from ar_lab.engine.generate import generate
from ar_lab.engine.sampling import GREEDY, sample
from ar_lab.model.cache import KVCache, kv_cache_bytes
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.perf.kv_sizing import (
    BYTES_PER_VALUE,
    KV_PRESETS,
    AttentionShape,
    cache_sizes,
    format_bytes,
    mla_cache_bytes,
)
from tests.raising import raises

GiB, MiB = 2**30, 2**20


def test_kv_cache_bytes_by_hand():
    # Llama 2 7B, 4,096 positions, bf16: 32 layers x 32 heads x 128 x 4096 x 2 (K, V) x 2 bytes = 2
    # GiB, i.e. 0.5 MiB for every token of context.
    assert kv_cache_bytes(32, 32, 128, 4096, 1, 2) == 2 * GiB
    assert kv_cache_bytes(32, 32, 128, 1, 1, 2) == 512 * 1024
    # Llama 2 70B (GQA, 8 KV heads): 80 x 8 x 128 x 4096 x 2 x 2 = 1.25 GiB; a batch of 8: 10 GiB.
    assert kv_cache_bytes(80, 8, 128, 4096, 1, 2) == 1.25 * GiB
    assert kv_cache_bytes(80, 8, 128, 4096, 8, 2) == 10 * GiB
    assert kv_cache_bytes(4, 4, 64, 0) == 0  # an empty sequence holds nothing


def test_mla_bytes_by_hand():
    # DeepSeek-V2: 60 layers x (512 latent + 64 RoPE key) x 2 bytes = 69,120 bytes per token,
    # against 60 x 2 x 128 heads x 128 x 2 = 3,932,160 for MHA with the same heads (57x more).
    assert mla_cache_bytes(60, 512, 64, 1, 1, 2) == 69_120
    assert kv_cache_bytes(60, 128, 128, 1, 1, 2) == 3_932_160
    assert mla_cache_bytes(60, 512, 64, 1000, 3, 1) == 60 * 576 * 1000 * 3
    assert mla_cache_bytes(2, 8, 0, 5) == 2 * 8 * 5 * 4  # no RoPE key, float32 default


@pytest.mark.parametrize(
    "call, arg",
    [
        (lambda: kv_cache_bytes(0, 1, 1, 1), "n_layer"),
        (lambda: kv_cache_bytes(1, 1, 1, -1), "seq_len"),
        (lambda: kv_cache_bytes(1, 1, 1.5, 1), "head_dim"),
        (lambda: kv_cache_bytes(1, 1, 1, 1, 1, 0), "bytes_per_value"),
        (lambda: mla_cache_bytes(1, 0, 1, 1), "latent_dim"),
        (lambda: mla_cache_bytes(1, 1, -1, 1), "rope_dim"),
        # 7 does not divide n_head 32
        (lambda: AttentionShape(4, 32, 7, 128, 512, 64), "n_kv_heads"),
        # more KV heads than query heads
        (lambda: AttentionShape(4, 8, 16, 128, 512, 64), "n_kv_heads"),
        (lambda: AttentionShape(4, 8, 8, 128, 512, 64, scheme="XYZ"), "scheme"),
        (lambda: format_bytes(-1), "n"),
    ],
)
def test_bad_sizes_are_rejected_clearly(call, arg):
    with raises(BadValue, arg):
        call()


def test_cache_sizes_for_each_scheme():
    llama70 = KV_PRESETS["Llama 2 70B"]
    sizes = cache_sizes(llama70, 4096, 1, 2)
    assert sizes == {
        "MHA": 80 * 64 * 128 * 4096 * 2 * 2,  # 10 GiB if every query head had its own K and V
        "GQA": 80 * 8 * 128 * 4096 * 2 * 2,  # what the model really caches: 1.25 GiB
        "MQA": 80 * 1 * 128 * 4096 * 2 * 2,
        "MLA": 80 * (512 + 64) * 4096 * 2,  # DeepSeek-V2's proportions applied to this shape
    }
    assert sizes["MHA"] == 10 * GiB and sizes["GQA"] == 1.25 * GiB
    # Sizes scale linearly in sequence, batch and bytes per value.
    double = cache_sizes(llama70, 8192, 3, 4)
    assert all(double[s] == 2 * 3 * 2 * sizes[s] for s in sizes)
    # Falcon 7B is MQA: 71 query heads share one KV head of 64.
    falcon = cache_sizes(KV_PRESETS["Falcon 7B"], 2048, 1, 2)
    assert falcon["GQA"] == falcon["MQA"] == 32 * 64 * 2048 * 2 * 2
    assert falcon["MHA"] == 71 * falcon["MQA"]


def test_presets_are_consistent_published_shapes():
    assert {p.scheme for p in KV_PRESETS.values()} == {"MHA", "GQA", "MQA", "MLA"}
    for name, p in KV_PRESETS.items():
        assert p.source, f"{name} has no source"
        if p.scheme == "MHA":
            assert p.n_kv_heads == p.n_head, name
        if p.scheme == "MQA":
            assert p.n_kv_heads == 1, name
        if p.scheme == "GQA":
            assert 1 < p.n_kv_heads < p.n_head, name
    course = KV_PRESETS["ar_lab course model"]
    cfg = GPTConfig()
    assert (course.n_layer, course.n_head, course.head_dim, course.context) == (
        cfg.n_layer,
        cfg.n_head,
        cfg.head_dim,
        cfg.block_size,
    )
    # The MLA presets cache far less than MHA with the same heads, and more than MQA.
    s = cache_sizes(KV_PRESETS["DeepSeek-V2"], 1, 1, 2)
    assert s["MQA"] < s["MLA"] < s["MHA"] / 50


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(2 * GiB) == "2 GiB"
    assert format_bytes(1.25 * GiB) == "1.25 GiB"
    assert format_bytes(600 * GiB) == "600 GiB"
    assert format_bytes(999 * MiB) == "999 MiB" and format_bytes(1023 * MiB) == "0.999 GiB"
    assert format_bytes(5 * 2**40) == "5 TiB"


def test_our_model_nbytes_shrinks_with_fewer_kv_heads():
    sizes = {}
    for kv in (8, 4, 2, 1):
        cfg = GPTConfig(block_size=128, n_layer=2, n_head=8, n_kv_heads=kv, n_embd=64)
        cache = KVCache.for_model(GPT(cfg), batch_size=3)
        sizes[kv] = cache.nbytes
        assert cache.nbytes == kv_cache_bytes(2, kv, 8, 128, 3, 4)
        shape = AttentionShape(2, 8, kv, 8, 32, 4, context=128)
        assert cache.nbytes == cache_sizes(shape, 128, 3, 4)["GQA"]
    assert sizes[8] == 2 * sizes[4] == 4 * sizes[2] == 8 * sizes[1]


# --- the widget, driven headlessly ------------------------------------------------------


def test_calculator_widget_shows_the_preset_and_follows_the_controls():
    from ar_lab.course.views.kv_calculator import kv_cache_calculator

    calc = kv_cache_calculator("Llama 2 7B", dtype="bfloat16")
    assert calc.sizes["MHA"] == 2 * GiB and calc.error == ""
    assert (calc.layers.value, calc.heads.value, calc.kv_heads.value, calc.seq_len.value) == (
        32,
        32,
        32,
        4096,
    )
    assert "2 GiB" in calc.output.value and "this model" in calc.output.value

    calc.batch.value = 4  # 4 sequences: 4x the bytes, preset kept
    assert calc.sizes["MHA"] == 8 * GiB and calc.preset.value == "Llama 2 7B"
    calc.dtype.value = "float32"
    assert calc.sizes["MHA"] == 16 * GiB and "16 GiB" in calc.output.value
    calc.seq_len.value = 1024
    assert calc.sizes["MHA"] == 4 * GiB

    calc.kv_heads.value = 8  # editing the shape: a custom GQA model
    assert calc.preset.value == "custom"
    assert calc.sizes["GQA"] == kv_cache_bytes(32, 8, 128, 1024, 4, 4) == calc.sizes["MHA"] // 4
    assert calc.shape.scheme == "GQA"

    calc.kv_heads.value = 5  # 32 heads cannot be split into 5 groups: message instead of sizes
    assert "must divide n_head" in calc.error and calc.sizes == {}
    assert "must divide" in calc.output.value

    calc.preset.value = "DeepSeek-V2"  # a preset replaces every number and clears the error
    assert calc.error == "" and calc.seq_len.value == 163840
    assert calc.sizes["MLA"] == mla_cache_bytes(60, 512, 64, 163840, 4, 4)
    calc.latent.value = 256
    assert calc.preset.value == "custom"
    assert calc.sizes["MLA"] == mla_cache_bytes(60, 256, 64, 163840, 4, 4)


def test_calculator_rejects_unknown_presets():
    from ar_lab.course.views.kv_calculator import kv_cache_calculator, kv_cache_table_html

    with raises(BadValue, 'preset'):
        kv_cache_calculator("GPT-5")
    with raises(BadValue, 'dtype'):
        kv_cache_table_html(KV_PRESETS["Llama 3 8B"], 10, 1, "int3")
    assert set(BYTES_PER_VALUE) >= {"float32", "bfloat16", "float16"}


def test_calculator_says_when_a_scheme_saves_nothing():
    """The 'vs MHA' column: an MLA model has no KV-head groups (not '1.0x smaller'); an MHA model's
    GQA row is MHA itself; a real GQA model's row is the ratio of its heads."""
    import re

    from ar_lab.course.views.kv_calculator import kv_cache_table_html

    def column(name):
        table = kv_cache_table_html(KV_PRESETS[name], 64, 1, "bfloat16")[1]
        return re.findall(r"(n/a: MLA|same as MHA|[\d.,]+× smaller)", table)

    assert column("DeepSeek-V3")[0] == "n/a: MLA"
    assert column("Llama 2 7B")[0] == "same as MHA"
    assert column("Llama 2 70B")[0] == "8.0× smaller"
    assert all(c != "1.0× smaller" for name in KV_PRESETS for c in column(name))


# --- the lean greedy path of the decode loop keeps sample()'s behaviour ------------------


class _FixedLogits(torch.nn.Module):
    """Returns the same logits at every position (and keeps the cache contract)."""

    def __init__(self, row: torch.Tensor):
        super().__init__()
        self.config = GPTConfig(
            block_size=32, n_layer=1, n_head=1, n_embd=4, vocab_size=row.numel()
        )
        self.row = row
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    @property
    def device(self):
        return self.dummy.device

    def forward(self, idx, cache=None):
        if cache is not None:
            cache.length += idx.shape[1]
        return self.row.expand(idx.shape[0], idx.shape[1], -1).clone()


@pytest.mark.parametrize(
    "row",
    [
        [0.0, 3.0, 1.0, 3.0, 2.0],  # tie: the first maximum, as sample() picks
        [-1.0, -5.0, -0.5, -2.0, -9.0],
    ],
)
def test_greedy_fast_path_matches_sample(row):
    row = torch.tensor(row)
    model = _FixedLogits(row)
    expected = int(sample(row, GREEDY))
    assert generate(model, [0], 3, eos_id=None).tokens == [expected] * 3


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_greedy_fast_path_still_rejects_broken_logits(bad):
    row = torch.tensor([0.0, 1.0, bad, 2.0])
    with pytest.raises(ValueError) as fast:
        generate(_FixedLogits(row), [0], 2, eos_id=None)
    with pytest.raises(ValueError) as slow:
        sample(row, GREEDY)
    assert str(fast.value) == str(slow.value)
    with pytest.raises(ValueError):
        generate(_FixedLogits(torch.full((4,), -math.inf)), [0], 2, eos_id=None)
