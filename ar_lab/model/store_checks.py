"""The checks a KV store makes of its arguments and of the model it serves (shared by every
store)."""

from __future__ import annotations

import torch

from ar_lab.base.errors import BadType, BadValue


def checked_index(name: str, value, low: int, high: int) -> int:
    """``value`` if it is an int (not a bool) in low..high; else a BadValue (a ValueError) naming
    ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadValue(f"{name} must be an int in {low}..{high}, got {value!r}", arg=name)
    return value


def check_dtype(dtype, name: str = "dtype") -> torch.dtype:
    """``dtype`` if it is a floating-point ``torch.dtype`` (what a model computes keys and values
    in)."""
    if not isinstance(dtype, torch.dtype):
        raise BadType(
            f"{name} must be a floating-point torch.dtype such as torch.float32, got {dtype!r}",
            arg=name,
        )
    if not dtype.is_floating_point:
        raise BadValue(
            f"{name} must be a floating-point torch.dtype (the model's compute dtype), got {dtype}",
            arg=name,
        )
    return dtype


def config_of(model):
    """The ``GPTConfig`` of ``model`` (what a cache is shaped from), or a BadType (a TypeError)
    saying what to pass."""
    cfg = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or not all(
        isinstance(getattr(cfg, a, None), int)
        for a in ("n_layer", "kv_heads", "head_dim", "block_size")
    ):
        raise BadType(
            f"model must be an ar_lab GPT (a module with a GPTConfig), got {type(model).__name__}",
            arg="model",
        )
    return cfg


def check_fits(cache, model) -> None:
    """Raise unless ``cache`` (a KV store) fits ``model``: its layers, KV heads and head size, the
    dtype its attention reads and the device. Checked at the public boundary, so a cache built for
    another model fails here with what to do, not inside torch's attention kernel."""
    if not isinstance(model, torch.nn.Module):
        raise BadType(
            f"model must be a torch.nn.Module (an ar_lab GPT), got {type(model).__name__}",
            arg="model",
        )
    cfg, k0 = getattr(model, "config", None), cache.k[0]
    if cfg is not None:
        check_shape(cache, cfg)
    p = next(model.parameters(), None)
    if p is not None and (cache.dtype != p.dtype or k0.device != p.device):
        raise BadValue(
            f"the cache holds {cache.dtype} on {k0.device}, the model {p.dtype} on {p.device}: "
            "build it with KVCache.for_model(model)",
            arg="cache",
        )


def check_shape(cache, cfg) -> None:
    """Raise unless ``cache``'s layers, KV heads and head size are those of the configuration
    ``cfg`` (a config without them, a model of one's own, is not checked)."""
    k0 = cache.k[0]
    sizes = [getattr(cfg, a, None) for a in ("n_layer", "kv_heads", "head_dim")]
    if all(isinstance(n, int) for n in sizes) and (len(cache.k), k0.shape[1], k0.shape[3]) != tuple(
        sizes
    ):
        raise BadValue(
            f"the cache {cache!r} is not shaped for this model ({sizes[0]} layers, {sizes[1]} KV "
            f"heads of size {sizes[2]}): build it with KVCache.for_model(model)",
            arg="cache",
        )
