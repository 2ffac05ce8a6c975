"""Chapter 04's checks beyond ``ar_lab.course.checkers.mistakes``: a cache that copies, and the
bytes-per-token slips.

``check_view`` fails a cache update that returns a copy of the cache (``torch.cat``, ``.clone()``)
instead of a view of its buffer, saying so without memory addresses. ``kv_bytes_mistakes`` gives
what the classic slips of the bytes-per-token exercise compute (MLA with a factor 2, the layers or
the factor 2 left out, one KV head per query head under GQA), for ``check_exact`` to name.
"""

from __future__ import annotations

from typing import Any

import torch

from ar_lab.course.checkers.checks import CheckFailed


def kv_bytes_mistakes(
    scheme: str,
    n_layer: int,
    n_head: int,
    n_kv_heads: int,
    head_dim: int,
    latent_dim: int,
    rope_dim: int,
    bytes_per_value: int,
) -> dict[str, int]:
    """Bytes one token adds to the cache under ``scheme`` ("MHA", "GQA", "MQA", "MLA"), counted
    wrongly."""
    kv = {"MHA": n_head, "GQA": n_kv_heads, "MQA": 1}
    if scheme == "MLA":
        latent = latent_dim + rope_dim
        return {
            "a factor 2 for K and V (MLA caches one latent vector, not a key and a value)": 2
            * n_layer
            * latent
            * bytes_per_value,
            "the latent alone (the RoPE key left out)": n_layer * latent_dim * bytes_per_value,
            "one layer (n_layer left out)": latent * bytes_per_value,
        }
    heads = kv[scheme]
    out = {
        "no factor 2 (the keys without the values)": n_layer * heads * head_dim * bytes_per_value,
        "one layer (n_layer left out)": 2 * heads * head_dim * bytes_per_value,
    }
    if bytes_per_value != 2:  # (with 2 bytes a value, the same number as the missing factor 2)
        out["a count of values, not bytes (bytes_per_value left out)"] = (
            2 * n_layer * heads * head_dim
        )
    if scheme != "MHA":
        out["n_head KV heads (one per query head: MHA's count)"] = (
            2 * n_layer * n_head * head_dim * bytes_per_value
        )
    return out


def check_view(what: str, got: Any, buffer: torch.Tensor, hint: str = "") -> None:
    """``got`` is a view of the start of ``buffer`` (the cache's own memory), not a copy of it: the
    classic slip is ``torch.cat`` or ``.clone()``, which copies the cache at every step. Says so
    without addresses."""
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(
            f"{what}: expected a tensor, got {type(got).__name__}"
            + (f"\nHint: {hint}" if hint else "")
        )
    if (
        got.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
        or got.data_ptr() != buffer.data_ptr()
    ):
        raise CheckFailed(
            f"{what}: your result is a copy, not a view of the cache's buffer (it does not share "
            "the buffer's memory)" + (f"\nHint: {hint}" if hint else ""),
            "a copy, not a view of the cache's buffer",
        )
