"""The GPU datasheet table and the FLOP/byte model of real model shapes (chapter 05 on a GPU)."""

import math

import pytest

from ar_lab.base.errors import BadValue, ContextFull
from ar_lab.model.gpt import GPTConfig
from ar_lab.perf import gpus
from ar_lab.perf import llm_costs as lc
from ar_lab.perf import roofline as rl
from tests.raising import raises

# --- the spec table ------------------------------------------------------------------


def test_every_ridge_is_flops_over_bandwidth():
    assert len(gpus.GPUS) >= 8
    for spec in gpus.GPUS.values():
        assert spec.tensor_flops > spec.fp32_flops > 0 and spec.bandwidth > 0 and spec.memory > 0
        assert spec.ridge == spec.tensor_flops / spec.bandwidth
        assert spec.peak_flops("fp32") == spec.fp32_flops
        assert spec.peak_flops("bf16") == spec.peak_flops("int4") == spec.tensor_flops
        assert "datasheet" in spec.source or "whitepaper" in spec.source
    rows = gpus.spec_rows()
    assert [r[0] for r in rows] == list(gpus.GPUS) and all(
        len(r) == len(gpus.SPEC_HEADERS) for r in rows
    )
    assert {r[0]: r[5] for r in rows}["H100 SXM"] == round(989.5e12 / 3.35e12)  # 295


def test_dense_figures_from_the_datasheets():
    g = gpus.GPUS
    # (dense 16-bit tensor TFLOP/s, TB/s, GB): sparse-only datasheets halved
    expected = {
        "T4": (65, 0.3, 16),
        "L4": (121, 0.3, 24),
        "A10": (125, 0.6, 24),
        "A100 40GB SXM": (312, 1.555, 40),
        "A100 80GB SXM": (312, 2.039, 80),
        "H100 SXM": (989.5, 3.35, 80),
        "H200 SXM": (989.5, 4.8, 141),
        "B200 (HGX)": (2250, 8.0, 180),
        "MI300X": (1307.4, 5.3, 192),
        "RTX 4090": (165.2, 1.008, 24),
    }
    for name, (tflops, tbs, gb) in expected.items():
        assert g[name].tensor_flops == pytest.approx(tflops * 1e12)
        assert g[name].bandwidth == pytest.approx(tbs * 1e12)
        assert g[name].memory == pytest.approx(gb * 1e9)


def test_match_gpu_finds_only_the_tabulated_product():
    cases = {
        "Tesla T4": "T4",
        "NVIDIA L4": "L4",
        "NVIDIA A10": "A10",
        "NVIDIA A100-SXM4-40GB": "A100 40GB SXM",
        "NVIDIA A100-SXM4-80GB": "A100 80GB SXM",
        "NVIDIA H100 80GB HBM3": "H100 SXM",
        "NVIDIA H200": "H200 SXM",
        "NVIDIA GeForce RTX 4090": "RTX 4090",
    }
    for device_name, row in cases.items():
        assert gpus.match_gpu(device_name).name == row, device_name
    for other in [
        "NVIDIA A10G",
        "NVIDIA H100 PCIe",
        "NVIDIA L40S",
        "NVIDIA A100 80GB PCIe",
        "NVIDIA H200 NVL",
        "cpu",
    ]:
        assert gpus.match_gpu(other) is None, other
    with raises(BadValue, 'name'):
        gpus.gpu("B300")


# --- the FLOP/byte model, by hand --------------------------------------------------------

# One layer, d = 4, 2 query heads sharing 1 KV head of width 2, SwiGLU of width 6, 10 tokens,
# untied.
TINY = lc.ModelShape(
    "tiny",
    n_layer=1,
    d_model=4,
    n_head=2,
    n_kv_heads=1,
    head_dim=2,
    d_ff=6,
    vocab=10,
    max_context=16,
)


def test_swiglu_gqa_costs_by_hand():
    # matmul weights: q 4x4 + k 4x2 + v 4x2 = 32, o 4x4 = 16, gate+up 4x12 = 48, down 6x4 = 24 ->
    # 120; head 10x4
    assert TINY.layer_matmul_weights == 120 and TINY.matmul_weights == 160
    # + 2 RMSNorms (4 each), the input embedding 10x4 and the final norm
    assert TINY.parameters == 120 + 8 + 40 + 40 + 4
    assert TINY.kv_values_per_token == 2 * 1 * 2  # K and V, one KV head of 2, one layer

    c = lc.prefill_cost(TINY, 3)  # bf16: 2 bytes per weight and per value
    assert c.matmul_flops == 2 * 160 * 3
    # 4 x (2 heads x 2) per key; token i sees i keys
    assert c.attention_flops == 4 * 4 * (1 + 2 + 3)
    assert c.weight_bytes == 2 * (212 - 40 + 3 * 4)  # only the 3 embedding rows fed are read
    assert c.kv_bytes == 2 * (3 + 3) * 4  # 3 positions written, 3 read
    # matmul ins and outs, embedding, head
    per_token = (4 + 8) + (4 + 4) + (4 + 12) + (6 + 4) + 4 + (4 + 10)
    assert c.activation_bytes == 2 * 3 * per_token

    # 1-byte weights, 2-byte values
    d = lc.decode_cost(TINY, context=5, batch=2, weight_dtype="int8")
    assert d.matmul_flops == 2 * 160 * 2 and d.attention_flops == 4 * 4 * 2 * 5
    assert d.weight_bytes == 1 * (212 - 40 + 2 * 4)
    assert d.kv_bytes == 2 * 2 * (4 + 2) * 4  # per sequence: 4 cached + 1 new read, 1 written
    assert d.activation_bytes == 2 * 2 * per_token
    assert (d.phase, d.batch, d.context) == ("decode", 2, 5)
    assert lc.decode_cost(TINY, 5, 1, "int4").weight_bytes == 0.5 * (212 - 40 + 4)
    # fp32 weights: fp32 cache too
    assert lc.decode_cost(TINY, 5, 1, "fp32").kv_bytes == 4 * (4 + 2) * 4


def test_published_parameter_counts():
    assert lc.MODELS["Llama-2-13B"].parameters == 13_015_864_320
    assert lc.MODELS["Llama-3-8B"].parameters == 8_030_261_248
    assert lc.MODELS["Qwen2.5-7B"].parameters == pytest.approx(7.61e9, rel=1e-3)
    # KV cache per token in bf16: MHA 40 x 5120 x 2 x 2 B; GQA 32 layers x 8 heads x 128 x 2 x 2 B
    assert lc.kv_memory(lc.MODELS["Llama-2-13B"], 1) == 819_200
    assert lc.kv_memory(lc.MODELS["Llama-3-8B"], 1) == 131_072


def test_a_mixture_stores_every_expert_and_decode_reads_the_ones_its_batch_touches():
    mixtral = lc.MODELS["Mixtral-8x7B"]
    # Mistral AI's figures: 46.7 B parameters, 12.9 B of them used per token
    assert mixtral.parameters == pytest.approx(46.7e9, rel=2e-3)
    assert mixtral.matmul_weights + mixtral.vocab * mixtral.d_model == pytest.approx(12.9e9,
                                                                                     rel=2e-3)
    expert = 3 * 4096 * 14336
    assert mixtral.expert_weights == expert
    all_experts = lc.decode_cost(mixtral, 1024, 10_000).weight_bytes
    one = lc.decode_cost(mixtral, 1024, 1)
    # one token: the router's two experts of each layer, the other six unread (and 9,999 fewer
    # rows of the input embedding than 10,000 tokens read)
    assert all_experts - one.weight_bytes == pytest.approx(2 * (32 * 6 * expert + 9999 * 4096),
                                                           rel=1e-6)
    assert one.matmul_flops == 2 * mixtral.matmul_weights
    reads = [lc.decode_cost(mixtral, 1024, b).weight_bytes for b in (1, 2, 4, 8, 16, 32)]
    assert reads == sorted(reads) and reads[-1] < all_experts
    for b in (1, 3, 8):  # E (1 - (1 - k/E)^B) experts of each layer
        assert mixtral.experts_read(b) == pytest.approx(8 * (1 - (1 - 2 / 8) ** b))
    # a prompt of 512 tokens reads every expert, as a dense model of the stored size would
    assert lc.prefill_cost(mixtral, 512).weight_bytes == pytest.approx(
        2 * (mixtral.parameters - (mixtral.vocab - 512) * 4096), rel=1e-6)
    assert lc.MODELS["Llama-3-8B"].experts_read(64) == 1.0  # a dense MLP: one, always
    with raises(BadValue, "experts_per_token"):
        rl.ModelShape("m", 1, 8, 2, 2, 4, 16, 10, 8, n_experts=4, experts_per_token=5)
    with raises(BadValue, "n_experts"):
        rl.ModelShape("m", 1, 8, 2, 2, 4, 16, 10, 8, n_experts=0, experts_per_token=2)
    with raises(BadValue, "biases"):
        rl.ModelShape("m", 1, 8, 2, 2, 4, 16, 10, 8, biases="all", n_experts=4,
                      experts_per_token=2)
    with raises(BadValue, "cfg"):
        rl.from_gpt_config(GPTConfig(n_experts=4))


# The course's GPT layout with GQA: one layer, d = 4, 2 query heads sharing 1 KV head of width 2,
# GELU MLP 4 x 4 = 16 wide, tied head, vocabulary 10, a learned table of 8 positions.
GQA_CFG = GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_kv_heads=1, n_embd=4)


def test_both_forward_costs_count_the_gpt_layout_by_hand():
    shape = lc.from_gpt_config(GQA_CFG)
    # matmul weights: qkv 4x8 = 32, proj 4x4 = 16, fc 4x16 = 64, proj 16x4 = 64 -> 176; head 10x4 =
    # 40
    assert shape.matmul_weights == rl.matmul_parameters(GQA_CFG) == 216
    # + biases (8 + 4 + 16 + 4) and 2 LayerNorms (8 each) per layer, token table 40, position
    # table 32 (not tied), final LayerNorm 8
    assert shape.parameters == rl.parameter_count(GQA_CFG) == 176 + 32 + 16 + 40 + 32 + 8 == 304
    # matmul ins and outs, embedding, head
    per_token = (4 + 8) + (4 + 4) + (4 + 16) + (16 + 4) + 4 + (4 + 10)
    prefill = {  # 2 sequences of 3 tokens, 2 bytes per weight and per value
        "matmul_flops": 2 * 216 * 6,
        # 4 x (2 heads x 2) per key; token i sees i keys
        "attention_flops": 4 * 4 * 2 * (1 + 2 + 3),
        # 3 position rows; the tied token table read whole by the head
        "weight_bytes": 2 * (304 - 32 + 3 * 4),
        # per sequence 3 positions written and read, 4 values each
        "kv_bytes": 2 * 2 * (0 + 2 * 3) * 4,
        "activation_bytes": 2 * 6 * per_token,
    }
    decode = {  # 2 sequences, one new token after 4 cached
        "matmul_flops": 2 * 216 * 2,
        "attention_flops": 4 * 4 * 2 * 5,
        "weight_bytes": 2 * (304 - 32 + 4),
        "kv_bytes": 2 * 2 * (4 + 2) * 4,
        "activation_bytes": 2 * 2 * per_token,
    }
    for cost in (lc.forward_cost(shape, 2, 3, 0, "bf16"), rl.forward_cost(GQA_CFG, 2, 3, 0, 2)):
        assert {k: getattr(cost, k) for k in prefill} == prefill and cost.phase == "prefill"
    for cost in (lc.decode_cost(shape, 5, 2, "bf16"), rl.decode_cost(GQA_CFG, 5, 2, 2)):
        assert {k: getattr(cost, k) for k in decode} == decode and cost.phase == "decode"
    # fp32 is 4 bytes for every weight and value in both spellings; int8 only shrinks the weights
    assert lc.forward_cost(shape, 2, 3, 0, "fp32") == rl.forward_cost(GQA_CFG, 2, 3, 0, 4)
    int8 = lc.forward_cost(shape, 2, 3, 0, "int8")
    assert int8.weight_bytes == prefill["weight_bytes"] / 2 and int8.kv_bytes == prefill["kv_bytes"]


def test_cost_errors():
    with raises(BadValue, 'weight_dtype'):
        lc.decode_cost(TINY, 4, 1, "fp8")
    with raises(ContextFull, 'prompt_len'):
        lc.prefill_cost(TINY, 17)
    with raises(BadValue, 'batch'):
        lc.decode_cost(TINY, 4, 0)
    with raises(BadValue, 'n_kv_heads'):
        lc.ModelShape("x", 1, 6, 3, 2, 2, 8, 10, 16)
    with raises(BadValue, 'name'):
        lc.model("GPT-5")


# --- a decode batch on a GPU -------------------------------------------------------------


@pytest.mark.parametrize(
    "model,gpu,context,dtype",
    [
        ("Llama-2-13B", "H100 SXM", 2500, "bf16"),
        ("Llama-3-8B", "H100 SXM", 128, "bf16"),
        ("Llama-3-8B", "A100 80GB SXM", 4096, "int8"),
        ("Qwen2.5-7B", "L4", 2048, "int4"),
        ("ar_lab course model", "T4", 1024, "fp32"),
    ],
)
def test_place_decode_batches_are_the_first_that_cross(model, gpu, context, dtype):
    shape, spec = lc.MODELS[model], gpus.GPUS[gpu]
    p = lc.place_decode(shape, spec, context, dtype)
    assert p.ridge == spec.peak_flops(dtype) / spec.bandwidth

    def at(b):
        return lc.decode_cost(shape, context, b, dtype)

    for b in (1, 3, 64):  # the linear model is exact
        assert p.intensity(b) == pytest.approx(at(b).intensity, rel=1e-12)
    assert p.intensity(10**6) < p.intensity_limit
    w = p.weights_stop_dominating_batch  # the sequences' own bytes reach the weights' first at w
    own = [at(b).bytes - p.shared_bytes for b in (w - 1, w)]
    assert own[1] >= p.shared_bytes and (w == 1 or own[0] < p.shared_bytes)
    if p.compute_bound_batch is None:
        assert p.intensity_limit <= p.ridge
    else:
        b = p.compute_bound_batch
        assert at(b).intensity >= p.ridge and (b == 1 or at(b - 1).intensity < p.ridge)
    m = p.max_batch  # the memory limit: m sequences fit, m + 1 do not
    assert (
        lc.memory_needed(shape, context, m, dtype)
        <= spec.memory
        < lc.memory_needed(shape, context, m + 1, dtype)
    )
    # per operator: the weight matmuls alone reach the ridge first at b
    b = p.matmul_compute_bound_batch
    assert at(b).matmul_intensity >= p.ridge and (b == 1 or at(b - 1).matmul_intensity < p.ridge)
    # the same at any batch
    assert p.attention_intensity == pytest.approx(at(b).attention_intensity, rel=1e-12)
    assert p.attention_intensity == pytest.approx(at(1).attention_intensity, rel=1e-12)


@pytest.mark.parametrize("name", ["Llama-2-13B", "Llama-3-8B", "Qwen2.5-7B"])
def test_per_operator_matmuls_scale_with_the_batch_and_attention_with_the_group(name):
    shape, h100 = lc.MODELS[name], gpus.GPUS["H100 SXM"]
    # bf16: 2 FLOPs per weight per sequence over 2 bytes per weight -> about B FLOP/byte
    # (activations lower it)
    for b in (1, 16, 256):
        assert 0.8 * b < lc.decode_cost(shape, 2048, b).matmul_intensity <= b
    # attention: 4 q_width FLOPs per position per layer over 2 x kv_width values x 2 bytes -> the
    # group size
    group = shape.n_head / shape.n_kv_heads
    assert lc.decode_cost(shape, 2048, 64).attention_intensity == pytest.approx(group, rel=2e-3)
    # the matmuls cross near the ridge at every context; attention stays where it was
    crossings = {
        lc.place_decode(shape, h100, n).matmul_compute_bound_batch for n in (128, 2048, 4096)
    }
    assert len(crossings) == 1 and h100.ridge < crossings.pop() < 1.15 * h100.ridge


def test_decode_attention_alone_stays_near_one_flop_per_byte():
    # Each sequence reads its own cache: batching never amortises it. MHA: 4 d FLOPs per position
    # per layer over 2 x d values x 2 bytes -> 1 FLOP/byte; GQA with 4 query heads per KV head -> 4.
    for name, ratio in [("Llama-2-13B", 1.0), ("Llama-3-8B", 4.0)]:
        c = lc.decode_cost(lc.MODELS[name], 4096, 64)
        assert c.attention_flops / c.kv_bytes == pytest.approx(ratio, rel=1e-3)


def test_the_seed_example_with_its_kv_cache():
    # 13 B parameters in fp16 at 3.35 TB/s: 7.8 ms per step from the weights alone. Llama-2-13B's
    # own cache at the reply's contexts (2,001 .. 2,500) adds 1.6-2.0 GB a step (its 13.0 B weights
    # read are 25.7 GB: the input embedding is read only for the rows used): about 6 % more.
    shape, h100 = lc.MODELS["Llama-2-13B"], gpus.GPUS["H100 SXM"]
    seed = rl.approx_tpot(13e9, 3.35e12)
    steps = [lc.predicted_time(lc.decode_cost(shape, c), h100) for c in range(2001, 2501)]
    assert all(s > seed for s in steps)
    assert sum(steps) / len(steps) / seed == pytest.approx(1.06, abs=0.005)
    assert lc.kv_memory(shape, 2500) == pytest.approx(2.048e9)
    assert lc.max_batch(shape, h100.memory, 2500) == math.floor(
        (80e9 - 2 * shape.parameters) / (2500 * 819_200)
    )
