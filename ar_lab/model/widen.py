"""A wider model that computes the same function: a trained model's text at a big model's cost.

Speculative decoding pays where a decode step is memory-bound: where the step's time is reading the
weights (chapter 05). The course model fits in a CPU's cache, so its step is not; a model big enough
to stream its weights from memory would have to be trained, which a notebook cannot do. ``widen``
builds one from the course model without training: every channel of the residual stream, of each
attention head and of the MLP's hidden layer is copied ``k`` times, and the weights are split so the
wider model computes exactly the original function (Net2Net's function-preserving widening: Chen,
Goodfellow & Shlens, 2016, arXiv:1511.05641). Its weights are dense, ``k**2`` times as many per
matrix, and every decode step reads all of them, as a trained model of that size would.

With E the copy map (each channel repeated k times) and x' = E x the wide residual stream:

- embeddings: each row copied channel by channel, so the wide stream starts as E x;
- LayerNorm of E x is E LayerNorm(x) (the same mean and variance), with its weight and bias copied;
- a Linear layer W (out, in) becomes E W E^T / k: rows and columns copied, divided by k, so that
  W' (E x) = E (W x); its bias is copied;
- attention: each head is k times wider, so q'.k' is k q.k while the scale 1/sqrt(head dim) shrinks
  by sqrt(k): the query weights are divided by sqrt(k) more, and the scores are the original ones;
- GELU acts on each copy alike; the final LayerNorm's weight and bias are divided by k, because the
  output projection (tied to the embedding, copied but not divided) sums k copies of each product.

The logits equal the original model's up to float rounding (tests: the same greedy text).
"""

from __future__ import annotations

import math

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadType, BadValue
from ar_lab.model.gpt import GPT, GPTConfig


def _copy(t: torch.Tensor, k: int, dims: tuple[int, ...]) -> torch.Tensor:
    for d in dims:
        t = t.repeat_interleave(k, dim=d)
    return t


def widen(model: GPT, k: int) -> GPT:
    """A ``GPT`` with ``k`` times the width (``n_embd``; the heads k times wider, their number kept)
    that computes the same logits as ``model`` (see the module docstring). ``model`` is not
    changed."""
    # a subclass may compute something else: its forward is not widened here
    if type(model) is not GPT:
        raise BadType(
            f"widen takes an ar_lab GPT as model (not a subclass), got {type(model).__name__}",
            arg="model",
        )
    if model.lm_head.weight is not model.wte.weight:
        raise BadType(
            "widen takes a GPT model whose output projection is tied to its token embedding, as "
            "GPT ties them",
            arg="model",
        )
    if model.config.n_experts:
        raise BadType("widen takes a GPT with dense MLPs as model, got a mixture of experts "
                      f"({model.config.n_experts} experts per block)", arg="model")
    layers = [m for b in model.blocks for m in (b.attn.qkv, b.attn.proj, b.mlp.fc, b.mlp.proj)]
    # a quantized layer's weights are not a matrix
    if any(type(m) is not torch.nn.Linear for m in layers):
        raise BadType(
            "widen takes a GPT model of nn.Linear layers: widen first, then quantize "
            "(quantize_model)",
            arg="model",
        )
    try:
        k = positive_int("k (the widening factor)", k)
    except BadValue as e:  # the same message, naming the parameter as widen spells it
        raise BadValue(str(e), arg="k") from None
    cfg = model.config
    with torch.device("meta"):  # no random initialisation: every weight is set below
        wide = GPT(
            GPTConfig(
                vocab_size=cfg.vocab_size,
                block_size=cfg.block_size,
                n_layer=cfg.n_layer,
                n_head=cfg.n_head,
                n_kv_heads=cfg.n_kv_heads,
                n_embd=cfg.n_embd * k,
            )
        )
    wide.to_empty(device="cpu")  # memory, uninitialised
    # tied again, as GPT ties them (to_empty gives each its own memory)
    wide.lm_head.weight = wide.wte.weight
    src = model.state_dict()
    out = {}
    q_rows = cfg.n_head * cfg.head_dim * k  # the queries' share of a wide qkv layer's outputs
    for name, t in src.items():
        t = t.detach().float()
        if name.endswith((".qkv.weight", ".proj.weight", ".fc.weight")):
            w = _copy(t, k, (0, 1)) / k  # (out k, in k): E W E^T / k
            if name.endswith(".qkv.weight"):
                # the attention scale shrinks by sqrt(k): keep the scores
                w[:q_rows] /= math.sqrt(k)
            out[name] = w
        elif name.endswith(".qkv.bias"):
            b = _copy(t, k, (0,))
            b[:q_rows] /= math.sqrt(k)
            out[name] = b
        elif name in ("wte.weight", "wpe.weight", "lm_head.weight"):
            out[name] = _copy(t, k, (1,))
        elif name.startswith("ln_f."):
            out[name] = _copy(t, k, (0,)) / k  # the tied output sums k copies of each product
        else:  # LayerNorm weights and biases, Linear biases: copied
            out[name] = _copy(t, k, (0,))
    wide.load_state_dict(out)
    return wide.to(device=model.device, dtype=model.wte.weight.dtype).eval()
