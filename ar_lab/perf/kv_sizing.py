"""KV-cache sizes of real models under each attention scheme: MHA, GQA, MQA and MLA.

``kv_cache_bytes`` (``ar_lab.model.cache``) is the one formula for a model of per-head keys and
values; this module adds MLA's latent cache, the published shapes of well-known open models, and
the calculator chapter 04's widget shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ar_lab.base.errors import BadValue
from ar_lab.model.cache import check_sizes, kv_cache_bytes

# --- sizing the cache of any model: MHA, GQA, MQA and MLA --------------------------

BYTES_PER_VALUE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}
SCHEMES = ("MHA", "GQA", "MQA", "MLA")


def mla_cache_bytes(
    n_layer: int,
    latent_dim: int,
    rope_dim: int,
    seq_len: int,
    batch_size: int = 1,
    bytes_per_value: int = 4,
) -> int:
    """layers x (latent + RoPE key dim) x sequence x batch x bytes per value.

    Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434) caches, per token and
    layer, one compressed latent vector c_KV (``latent_dim`` values, from which every
    head's key and value are re-projected) and one RoPE key shared by all heads
    (``rope_dim`` values): no per-head keys or values, and no factor 2.
    """
    check_sizes(n_layer=n_layer, latent_dim=latent_dim, seq_len=seq_len, batch_size=batch_size)
    check_sizes(bytes_per_value=bytes_per_value)
    if not isinstance(rope_dim, int) or isinstance(rope_dim, bool) or rope_dim < 0:
        raise BadValue(f"rope_dim must be an int >= 0, got {rope_dim!r}", arg="rope_dim")
    return n_layer * (latent_dim + rope_dim) * seq_len * batch_size * bytes_per_value


@dataclass(frozen=True)
class AttentionShape:
    """The numbers that size a KV cache, as a model's published configuration gives them.

    ``latent_dim`` / ``rope_dim`` are MLA's compressed KV size and decoupled RoPE key size;
    for models that do not use MLA the presets fill in DeepSeek-V2's proportions
    (latent = 4 x head dim, RoPE key = head dim / 2) so the MLA column shows what the
    same shape would cache with it.
    """

    n_layer: int
    n_head: int  # query heads
    n_kv_heads: int  # what the model really uses: = n_head (MHA), fewer (GQA), 1 (MQA)
    head_dim: int
    latent_dim: int
    rope_dim: int
    context: int = 4096  # the published context window (the calculator's default sequence)
    scheme: str = "MHA"  # the model's own attention scheme
    source: str = ""  # where the numbers come from

    def __post_init__(self) -> None:
        check_sizes(
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            latent_dim=self.latent_dim,
            context=self.context,
        )
        if (
            not isinstance(self.rope_dim, int)
            or isinstance(self.rope_dim, bool)
            or self.rope_dim < 0
        ):
            raise BadValue(f"rope_dim must be an int >= 0, got {self.rope_dim!r}", arg="rope_dim")
        if self.n_kv_heads > self.n_head or self.n_head % self.n_kv_heads:
            raise BadValue(
                f"n_kv_heads ({self.n_kv_heads}) must divide n_head ({self.n_head}): "
                "each KV head serves an equal group of query heads",
                arg="n_kv_heads",
            )
        if self.scheme not in SCHEMES:
            raise BadValue(f"scheme must be one of {SCHEMES}, got {self.scheme!r}", arg="scheme")


def cache_sizes(
    shape: AttentionShape, seq_len: int, batch_size: int = 1, bytes_per_value: int = 2
) -> dict[str, int]:
    """Cache bytes of ``shape`` under each scheme, for ``seq_len`` positions x ``batch_size``
    sequences.

    MHA: every query head has its own K and V (n_head KV heads). GQA: ``shape.n_kv_heads``
    shared KV heads. MQA: one. MLA: one latent + one RoPE key per token and layer.
    """
    args = (seq_len, batch_size, bytes_per_value)
    L, d = shape.n_layer, shape.head_dim
    return {
        "MHA": kv_cache_bytes(L, shape.n_head, d, *args),
        "GQA": kv_cache_bytes(L, shape.n_kv_heads, d, *args),
        "MQA": kv_cache_bytes(L, 1, d, *args),
        "MLA": mla_cache_bytes(L, shape.latent_dim, shape.rope_dim, *args),
    }


def format_bytes(n: float) -> str:
    """Bytes in binary units, about three significant figures: 1536 -> '1.5 KiB'."""
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n) or n < 0:
        raise BadValue(f"a byte count (n) must be a finite number >= 0, got {n!r}", arg="n")
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        if n < 1000 or unit == "PiB":
            return f"{n:.3g} {unit}" if n < 100 else f"{n:.0f} {unit}"
    raise AssertionError("unreachable")


def _mla_like(head_dim: int) -> dict:
    # DeepSeek-V2's proportions (d_c = 4 d_h, d_h^R = d_h / 2), for models without MLA.
    return {"latent_dim": 4 * head_dim, "rope_dim": head_dim // 2}


# Published shapes of well-known open models, read from each model's config.json on the
# Hugging Face Hub (the field names are those files'); head_dim = hidden_size / num_attention_heads.
KV_PRESETS: dict[str, AttentionShape] = {
    # ar_lab's course model: GPTConfig() (4 layers, 4 heads, n_embd 256).
    "ar_lab course model": AttentionShape(
        4, 4, 4, 64, **_mla_like(64), context=1024, source="ar_lab GPTConfig()"
    ),
    # openai-community/gpt2: n_layer 12, n_head 12, n_embd 768, n_positions 1024.
    "GPT-2 small (124M)": AttentionShape(
        12, 12, 12, 64, **_mla_like(64), context=1024, source="openai-community/gpt2 config.json"
    ),
    # meta-llama/Llama-2-7b-hf: num_hidden_layers 32, num_attention_heads 32, num_key_value_heads
    # 32, hidden_size 4096, max_position_embeddings 4096.
    "Llama 2 7B": AttentionShape(
        32, 32, 32, 128, **_mla_like(128), context=4096, source="meta-llama/Llama-2-7b-hf"
    ),
    # meta-llama/Llama-2-70b-hf: 80 layers, 64 heads, num_key_value_heads 8, hidden_size 8192, 4096
    # positions.
    "Llama 2 70B": AttentionShape(
        80,
        64,
        8,
        128,
        **_mla_like(128),
        context=4096,
        scheme="GQA",
        source="meta-llama/Llama-2-70b-hf",
    ),
    # meta-llama/Meta-Llama-3-8B: 32 layers, 32 heads, num_key_value_heads 8, hidden_size 4096, 8192
    # positions.
    "Llama 3 8B": AttentionShape(
        32,
        32,
        8,
        128,
        **_mla_like(128),
        context=8192,
        scheme="GQA",
        source="meta-llama/Meta-Llama-3-8B",
    ),
    # tiiuae/falcon-7b: num_hidden_layers 32, num_attention_heads 71, hidden_size 4544, multi_query
    # true (one KV head of 64), 2048 positions.
    "Falcon 7B": AttentionShape(
        32, 71, 1, 64, **_mla_like(64), context=2048, scheme="MQA", source="tiiuae/falcon-7b"
    ),
    # deepseek-ai/DeepSeek-V2: num_hidden_layers 60, num_attention_heads 128, kv_lora_rank 512,
    # qk_rope_head_dim 64, qk_nope_head_dim = v_head_dim = 128, max_position_embeddings 163840.
    "DeepSeek-V2": AttentionShape(
        60, 128, 128, 128, 512, 64, context=163840, scheme="MLA", source="deepseek-ai/DeepSeek-V2"
    ),
    # deepseek-ai/DeepSeek-V3: num_hidden_layers 61, the same MLA sizes, max_position_embeddings
    # 163840.
    "DeepSeek-V3": AttentionShape(
        61, 128, 128, 128, 512, 64, context=163840, scheme="MLA", source="deepseek-ai/DeepSeek-V3"
    ),
}
