"""One sequence with a KV cache, run the way an inference engine runs it: no framework layers.

``GPT.forward`` serves training and every batch shape through ``nn.Module`` calls. For
one sequence and one new token that generality costs real time: a decode step of the
course model is dozens of small PyTorch calls (``ar_lab.perf.op_count`` counts them), each paying
microseconds of Python and dispatch, and the scaled-dot-product kernel sets up tiles for a query of length one.
On a CPU that overhead is a large share of the step (chapter 04 measures it). ``LeanGPT`` does
the same arithmetic on the model's own weights with direct tensor calls:

- ``step``: one new token. Every weight matrix is applied to one vector (``addmv``), the
  new key and value are written into the cache in place, and attention over the cache's
  filled prefix is two batched matrix-vector products with the softmax between (the
  1/sqrt(D) scale rides on the first, ``baddbmm``'s alpha). A single query sees every
  cached position, so there is no mask.
- ``extend``: several new tokens after the cached ones (the target's verify pass in
  speculative decoding, chapter 07), as matrix-matrix products.

The engine holds the model's parameters themselves, never copies of them, so every change
of the weights (an optimizer step, ``load_state_dict``, a write through ``p.data``,
``p.data = other``) is what the next step computes with, as in ``GPT.forward``. Its working
memory is per thread, so one engine (and one model) serves several threads at once. The one
copy is opt-in, for ``extend``: a product of a few rows by a weight matrix should cost about what
reading the matrix once costs (the verify pass of speculative decoding relies on it), and on a CPU
the float32 weights reach that only in the layout the product's kernel reads fastest, so
``extend_copies(model)`` makes copies in that layout (``ar_lab.engine.packed``: oneDNN's blocked one
on a CPU that has it), fresh at each call; a ``LeanDecoder`` (``ar_lab.engine.decoder``) takes them
once per generation and hands them to ``extend``.

A block's Linear layer may be a ``QuantizedLinear`` (``ar_lab.engine.quant``, chapter 09): the step and
``extend`` then call its kernel, which reads the layer's narrow weights (its buffers) at every
call, so edits are seen there too; no copy is ever made of them. A quantized model cast to
another dtype afterwards (``.bfloat16()``) is not run here: ``supports`` says so, and ``generate``
takes it through ``forward``, so ``lean=True`` and ``lean=False`` give the same tokens.

The results equal ``GPT.forward``'s up to float rounding (tests: logits within 1e-5, the
same greedy tokens). ``for_model(model)`` makes an engine (cheap: it copies nothing).
Call it under ``torch.inference_mode()``; the decode loops reach it through ``LeanDecoder``.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.base.timing import synchronize
from ar_lab.engine.kv_quant import Int8KVCache
from ar_lab.engine.packed import ExtendMatrix, extend_mm, product_copy
from ar_lab.engine.quant import QuantizedLinear, bf16_addmv, quantized_addmv
from ar_lab.model.cache import KVCache
from ar_lab.model.gpt import GPT, MLP, Block, CausalSelfAttention

# A weight matrix as the step reads it: nn.Linear's parameter, or a whole QuantizedLinear (chapter 09),
# whose own kernel multiplies with its narrow weights (read from the module at every call).
Matrix = torch.Tensor | QuantizedLinear


# The kernels the step calls, without their Python wrappers (a decode step makes ~60 calls, each
# paying its dispatch): LayerNorm's (output, mean, rstd) and GELU in place.
_layer_norm = torch.native_layer_norm
_gelu_ = torch._C._nn.gelu_


class LayerWeights(NamedTuple):
    """One block's parameters, in the order a decode step uses them (C = n_embd, KD = KV heads x D)."""

    ln1_weight: torch.Tensor  # (C,)
    ln1_bias: torch.Tensor  # (C,)
    qkv_weight: Matrix  # (C + 2 KD, C): queries, keys, values
    qkv_bias: torch.Tensor  # (C + 2 KD,)
    attn_proj_weight: Matrix  # (C, C)
    attn_proj_bias: torch.Tensor  # (C,)
    ln2_weight: torch.Tensor  # (C,)
    ln2_bias: torch.Tensor  # (C,)
    fc_weight: Matrix  # (4C, C)
    fc_bias: torch.Tensor  # (4C,)
    mlp_proj_weight: Matrix  # (C, 4C)
    mlp_proj_bias: torch.Tensor  # (C,)


class BlockCopies(NamedTuple):
    """One block's four weight matrices as ``extend``'s products read them."""

    qkv: ExtendMatrix  # (C, C + 2 KD) as (in, out)
    attn_proj: ExtendMatrix  # (C, C)
    fc: ExtendMatrix  # (C, 4C)
    mlp_proj: ExtendMatrix  # (4C, C)


class ExtendCopies(NamedTuple):
    """Every matrix ``extend`` multiplies by: per block, then the tied output projection."""

    layers: list[BlockCopies]
    out: ExtendMatrix  # (C, vocab) as (in, out)


class _Work(threading.local):
    """One thread's working memory for ``step``: the fused q|k|v output and the attention output,
    with the views the step reads them through, and the cache it last checked (with its
    per-layer (K, V) views). ``threading.local`` runs ``__init__`` once in every thread that uses it."""

    def __init__(self, C: int, Hk: int, G: int, D: int, dtype: torch.dtype, device: torch.device) -> None:
        KD = Hk * D
        qkv = torch.empty(C + 2 * KD, dtype=dtype, device=device)
        q = qkv[:C].view(Hk, G, D)  # query heads grouped by their KV head
        k, v = qkv[C : C + KD].view(Hk, D), qkv[C + KD :].view(Hk, D)
        y = torch.empty(Hk, G, D, dtype=dtype, device=device)
        self.buffers = (qkv, q, k, v, y)  # one tuple: each attribute of a thread-local costs a lookup
        self.cache: KVCache | None = None
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []


def _no_grad_needed() -> None:
    raise RuntimeError(
        "LeanGPT computes with the model's own parameters and records no gradients: call it under "
        "torch.inference_mode() (or torch.no_grad()), as ar_lab.generate does"
    )


class LeanGPT:
    """The batch-1 cached inference of a ``GPT``: ``step`` (one token) and ``extend`` (several).

    It reads the model's parameters at every call (no copies) and keeps its working memory per
    thread, so several threads may use one engine, each with its own cache.
    """

    def __init__(self, model: GPT) -> None:
        layers = _stock_layers(model)
        if layers is None:
            raise NotLean(
                f"LeanGPT runs a GPT with the stock modules and GPT.forward (see lean.supports), got "
                f"{type(model).__name__}: call the model itself", arg="model"
            )
        cfg = model.config
        self.config = cfg
        self.C, self.Hk, self.D = cfg.n_embd, cfg.kv_heads, cfg.head_dim
        self.G = cfg.n_head // cfg.kv_heads  # query heads per KV head (1: MHA)
        self.KD = self.Hk * self.D  # width of the keys (and of the values) of one position
        self.scale = 1.0 / math.sqrt(self.D)
        self.shape = (self.C,)
        self.eps = model.ln_f.eps
        # The parameters themselves (not .detach() aliases, not copies): `p.data = t` swaps what
        # p holds, and a step must see it, as forward() does.
        self.wte, self.wpe = model.wte.weight, model.wpe.weight
        self.ln_f = (model.ln_f.weight, model.ln_f.bias)
        self.device, dtype = self.wte.device, self.wte.dtype
        self.layers = layers
        # Matrix products: torch's own for nn.Linear weights, the dispatching ones if a layer is quantized.
        quantized = any(type(m) is QuantizedLinear for lw in layers for m in lw)
        if _cast_after_quantizing(model, layers):
            raise NotLean(
                f"LeanGPT runs a quantized model on a float32 residual stream (what quantize_model makes); this one "
                f"computes in {dtype} (cast after quantizing), which the step would round differently from "
                "GPT.forward: call the model itself (generate does), or quantize the float32 model and keep it so",
                arg="model",
            )
        slow_addmv = dtype == torch.bfloat16 and self.device.type == "cpu"  # (see quant.bf16_addmv)
        self._mv = quantized_addmv if quantized else bf16_addmv if slow_addmv else torch.addmv
        self._zero = torch.zeros(1, 1, 1, dtype=dtype, device=self.device)  # baddbmm's ignored input (beta 0)
        self._work = _Work(self.C, self.Hk, self.G, self.D, dtype, self.device)

    def _check(self, cache: KVCache, T: int) -> int:
        if not isinstance(cache, KVCache):
            raise BadType(f"cache must be a KVCache, got {type(cache).__name__}", arg="cache")
        if cache.batch_size != 1:
            raise BadValue(f"LeanGPT runs one sequence: the cache must have batch size 1, got {cache.batch_size}",
                           arg="cache")
        if len(cache.k) != len(self.layers) or cache.k[0].shape[1:] != (self.Hk, cache.max_len, self.D):
            raise BadValue(f"cache {cache!r} is not shaped for this model: build it with KVCache.for_model(model)",
                           arg="cache")
        end = cache.length + T
        if end > self.config.block_size:
            raise ContextFull(
                f"{end} positions (the cache's and the new tokens) exceed the context window of "
                f"{self.config.block_size} tokens (config.block_size); shorten the prompt or generate fewer tokens",
                arg="cache",
            )
        if end > cache.max_len:
            raise ContextFull(f"KV cache full: positions up to {end} requested, capacity is {cache.max_len}",
                              arg="cache")
        dtype = cache.dtype  # an Int8KVCache: what it dequantizes to
        if dtype != self.wte.dtype or cache.k[0].device != self.device:
            raise BadValue(
                f"the cache holds {dtype} on {cache.k[0].device}, the model {self.wte.dtype} on "
                f"{self.device}: build it with KVCache.for_model(model)", arg="cache"
            )
        return cache.length

    def step(self, token: int, cache: KVCache) -> torch.Tensor:
        """Logits (vocab,) after feeding one token at position ``cache.length``; the cache advances by one."""
        w = self._work  # this thread's buffers
        if type(token) is not int:
            token = _token_id(token)
        if cache is not w.cache:
            self._check(cache, 0)
            w.cache, w.kv = cache, [(k[0], v[0]) for k, v in zip(cache.k, cache.v, strict=True)]
        pos = cache.length
        if not 0 <= token < self.config.vocab_size:
            raise BadValue(f"token id {token} is outside the vocabulary [0, {self.config.vocab_size - 1}]", arg="token")
        if pos >= cache.max_len or pos >= self.config.block_size:
            self._check(cache, 1)  # raises the explanatory error
        if torch.is_grad_enabled():
            _no_grad_needed()
        qkv, q, k, v, y = w.buffers
        C, shape, eps, scale, zero, mv = self.C, self.shape, self.eps, self.scale, self._zero, self._mv
        L = pos + 1  # keys the new query attends over: all cached positions and its own
        x = torch.add(self.wte.select(0, token), self.wpe.select(0, pos))  # (C,)
        int8_cache = cache if type(cache) is Int8KVCache else None  # (ar_lab.engine.kv_quant)
        for i, (lw, (K, V)) in enumerate(zip(self.layers, w.kv, strict=True)):
            h = _layer_norm(x, shape, lw.ln1_weight, lw.ln1_bias, eps)[0]
            mv(lw.qkv_bias, lw.qkv_weight, h, out=qkv)  # q | k | v
            if int8_cache is None:
                K.select(1, pos).copy_(k)  # the new key and value, written in place
                V.select(1, pos).copy_(v)
                scores = torch.baddbmm(zero, q, K.narrow(1, 0, L).transpose(1, 2), beta=0, alpha=scale)  # (Hk, G, L)
                torch.bmm(torch.softmax(scores, -1), V.narrow(1, 0, L), out=y)  # (Hk, G, D)
            else:
                int8_cache.attend(i, pos, q, k, v, scale, y)  # the same, on int8 keys and values
            x = mv(lw.attn_proj_bias, lw.attn_proj_weight, y.view(C)).add_(x)  # heads side by side + residual
            h = _layer_norm(x, shape, lw.ln2_weight, lw.ln2_bias, eps)[0]
            h = _gelu_(mv(lw.fc_bias, lw.fc_weight, h), approximate="tanh")  # in place on the fresh product
            x = mv(lw.mlp_proj_bias, lw.mlp_proj_weight, h).add_(x)  # MLP out + residual
        cache.length = L
        cache.record(pos, [token])
        return torch.mv(self.wte, _layer_norm(x, shape, *self.ln_f, eps)[0])  # tied output projection

    def extend(
        self, tokens: Sequence[int] | torch.Tensor, cache: KVCache, copies: ExtendCopies | None = None
    ) -> torch.Tensor:
        """Logits (T, vocab) after feeding T tokens at positions ``cache.length ..``; the cache advances by T.

        ``copies``: ``extend_copies(model)`` (faster on CPU), taken after the weights last
        changed; without them the products read the parameters through transposed views.
        """
        if len(tokens) == 1 and not isinstance(tokens, torch.Tensor):  # one token: the decode step
            return self.step(tokens[0], cache)[None]
        if type(cache) is Int8KVCache:
            raise BadType("extend writes float keys and values: give it a KVCache as cache (an Int8KVCache runs step)",
                          arg="cache")
        idx = _token_ids(tokens, self.device)
        if idx.ndim != 1 or idx.numel() == 0:
            raise BadValue(f"tokens must be a non-empty 1-D sequence of ids, got shape {tuple(idx.shape)}",
                           arg="tokens")
        if int(idx.min()) < 0 or int(idx.max()) >= self.config.vocab_size:
            raise BadValue(f"tokens hold ids outside the vocabulary [0, {self.config.vocab_size - 1}]", arg="tokens")
        T = idx.numel()
        pos = self._check(cache, T)
        if torch.is_grad_enabled():
            _no_grad_needed()
        C, Hk, G, D, KD, shape, eps, mm = self.C, self.Hk, self.G, self.D, self.KD, self.shape, self.eps, extend_mm
        L = pos + T
        x = self.wte[idx] + self.wpe[pos:L]  # (T, C)
        hidden = torch.ones(T, L, dtype=torch.bool, device=self.device).triu_(pos + 1)  # query i sees keys <= pos + i
        layers_t, out_t = copies if copies is not None else self._views()
        for w, wt, K, V in zip(self.layers, layers_t, cache.k, cache.v, strict=True):
            K, V = K[0], V[0]  # (Hk, T_max, D)
            h = torch.layer_norm(x, shape, w.ln1_weight, w.ln1_bias, eps)  # (T, C)
            qkv = mm(w.qkv_bias, h, wt.qkv)  # (T, C + 2 KD)
            K[:, pos:L] = qkv[:, C : C + KD].view(T, Hk, D).transpose(0, 1)
            V[:, pos:L] = qkv[:, C + KD :].view(T, Hk, D).transpose(0, 1)
            q = qkv[:, :C].view(T, Hk, G, D).permute(1, 2, 0, 3).reshape(Hk, G * T, D)  # (Hk, G T, D)
            scores = torch.baddbmm(self._zero, q, K[:, :L].transpose(1, 2), beta=0, alpha=self.scale)
            scores = scores.view(Hk, G, T, L).masked_fill_(hidden, float("-inf"))
            y = torch.bmm(torch.softmax(scores, -1).view(Hk, G * T, L), V[:, :L])  # (Hk, G T, D)
            y = y.view(Hk, G, T, D).permute(2, 0, 1, 3).reshape(T, C)  # heads side by side again
            x = mm(w.attn_proj_bias, y, wt.attn_proj).add_(x)
            h = torch.layer_norm(x, shape, w.ln2_weight, w.ln2_bias, eps)
            h = F.gelu(mm(w.fc_bias, h, wt.fc), approximate="tanh")
            x = mm(w.mlp_proj_bias, h, wt.mlp_proj).add_(x)
        cache.length = L
        cache.record(pos, tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens])
        return mm(None, torch.layer_norm(x, shape, *self.ln_f, eps), out_t)  # (T, vocab)

    def _views(self) -> ExtendCopies:
        """The parameters' (in, out) views: always current, no copy (slower than copies on CPU for a few rows)."""
        layers = [
            BlockCopies(*map(_t, (w.qkv_weight, w.attn_proj_weight, w.fc_weight, w.mlp_proj_weight)))
            for w in self.layers
        ]
        return ExtendCopies(layers, self.wte.t())


def _token_id(token) -> int:
    """``token`` as an int: a whole number or a one-element integer tensor (a bool or a float is a mistake)."""
    if isinstance(token, torch.Tensor) and token.numel() == 1 and not token.is_floating_point():
        token = token.item()
    if isinstance(token, bool) or not isinstance(token, numbers.Integral):
        raise BadType(f"token must be an int token id, got {token!r}", arg="token")
    return int(token)


def _token_ids(tokens, device: torch.device) -> torch.Tensor:
    """``tokens`` (ids, or an integer tensor) as a long tensor; floats and bools are refused, not truncated."""
    if isinstance(tokens, str):
        raise BadType("tokens must be token ids (a list of ints or an integer tensor), not a str: encode it first",
                      arg="tokens")
    try:
        t = torch.as_tensor(tokens, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise BadType(f"tokens must be token ids (a list of ints or an integer tensor), got {tokens!r}",
                      arg="tokens") from None
    if t.numel() == 0:
        raise BadValue(f"tokens must be a non-empty 1-D sequence of ids, got shape {tuple(t.shape)}", arg="tokens")
    if t.is_floating_point() or t.dtype == torch.bool or t.is_complex():
        raise BadType(f"tokens must be integer token ids, got {t.dtype}", arg="tokens")
    return t.long()


def _t(m: Matrix) -> Matrix:
    """(in, out) view of a weight; a QuantizedLinear stands for its own transpose (its kernel takes x rows)."""
    return m if type(m) is QuantizedLinear else m.t()


class NotLean(BadType):
    """The model is not one ``LeanGPT`` reproduces (see ``supports``)."""


def supports(model) -> bool:
    """True for a ``GPT`` that runs ``GPT.forward`` with the stock modules: what ``LeanGPT`` reproduces.

    A subclass with its own ``forward``, a module swapped for another or subclassed (an experiment
    in a notebook, a parametrized weight), or an output projection no longer tied to the token
    embedding keeps going through ``forward``, so ``generate`` never silently skips it. A block's Linear
    layer may be a ``QuantizedLinear`` (``ar_lab.engine.quant``): the step then calls its kernel, as
    long as the model keeps the float32 embeddings ``quantize_model`` gave it.
    """
    layers = _stock_layers(model)
    return layers is not None and not _cast_after_quantizing(model, layers)


def _cast_after_quantizing(model: GPT, layers: list[LayerWeights]) -> bool:
    """A quantized model whose embeddings are not float32 (cast after ``quantize_model``, e.g. ``.bfloat16()``):
    its QuantizedLinear layers add float32 biases, and the step's reduced-precision attention would round
    differently from ``GPT.forward``'s, so such a model goes through ``forward``."""
    return model.wte.weight.dtype != torch.float32 and any(type(m) is QuantizedLinear for lw in layers for m in lw)


def _stock_layers(model) -> list[LayerWeights] | None:
    """Each block's parameters, if every module is the stock one (else None); one walk over the model."""
    if not (isinstance(model, GPT) and type(model).forward is GPT.forward):
        return None
    head, ln_f = model.lm_head, model.ln_f
    if not (
        type(head) is nn.Linear
        and head.weight is model.wte.weight
        and head.bias is None
        and type(model.wte) is nn.Embedding
        and type(model.wpe) is nn.Embedding
        and type(ln_f) is nn.LayerNorm
    ):
        return None
    layers = []
    for b in model.blocks:
        if type(b) is not Block or type(b.attn) is not CausalSelfAttention or type(b.mlp) is not MLP:
            return None
        ln1, ln2, attn, mlp = b.ln1, b.ln2, b.attn, b.mlp
        qkv, proj, fc, mlp_proj = attn.qkv, attn.proj, mlp.fc, mlp.proj
        if not (
            all(type(m) in (nn.Linear, QuantizedLinear) for m in (qkv, proj, fc, mlp_proj))
            and type(ln1) is type(ln2) is nn.LayerNorm
            and ln1.eps == ln2.eps == ln_f.eps  # the step normalises every layer with one epsilon
        ):
            return None
        layers.append(
            LayerWeights(
                ln1_weight=ln1.weight,
                ln1_bias=ln1.bias,
                qkv_weight=_matrix(qkv),
                qkv_bias=qkv.bias,
                attn_proj_weight=_matrix(proj),
                attn_proj_bias=proj.bias,
                ln2_weight=ln2.weight,
                ln2_bias=ln2.bias,
                fc_weight=_matrix(fc),
                fc_bias=fc.bias,
                mlp_proj_weight=_matrix(mlp_proj),
                mlp_proj_bias=mlp_proj.bias,
            )
        )
    return layers


def _matrix(linear: nn.Linear | QuantizedLinear) -> Matrix:
    """What the step multiplies by: an nn.Linear's weight parameter, or the QuantizedLinear itself."""
    return linear if type(linear) is QuantizedLinear else linear.weight


def for_model(model: GPT) -> LeanGPT:
    """A ``LeanGPT`` for ``model``: cheap to make (it copies nothing), always on the model's current weights."""
    return LeanGPT(model)


# --- (in, out) copies for extend ---------------------------------------------------------


def _matrices(model: GPT) -> list[Matrix]:
    """The matrices ``extend`` multiplies by, in ``ExtendCopies`` order (4 per block, then the embedding).

    A QuantizedLinear is its own entry: its kernel reads the module's buffers at each call, no copy."""
    out = []
    for b in model.blocks:
        out += [_matrix(b.attn.qkv), _matrix(b.attn.proj), _matrix(b.mlp.fc), _matrix(b.mlp.proj)]
    return [*out, model.wte.weight]


def extend_copies(model: GPT, *, pack: bool = True) -> ExtendCopies:
    """Copies of every matrix ``LeanGPT.extend`` multiplies by, in the layout its products read fastest
    (``ar_lab.engine.packed``; ``pack=False``: (in, out) copies, to compare), equal to ``model``'s weights now.

    Fresh copies each call, kept by whoever asked (a ``LeanDecoder``, for one generation): no
    registry to consult, and a later change of the weights is never hidden behind a stale copy.
    """
    if not supports(model):
        raise NotLean(f"extend_copies takes a GPT that LeanGPT runs as model, got {type(model).__name__}", arg="model")
    with torch.no_grad():
        t = [product_copy(m, pack=pack) for m in _matrices(model)]
    layers = [BlockCopies(*t[i : i + 4]) for i in range(0, len(t) - 1, 4)]
    return ExtendCopies(layers, t[-1])


def weights_only_pass(model, steps: int) -> None:
    """Apply every weight matrix of ``model`` to one vector, ``steps`` times, and nothing else.

    The floor under any batch-1 decoder of the model (no attention, no LayerNorm, no sampling,
    no Python around it): time it to see what a decode step adds on top. Matrix-vector
    products, the fastest kernel for one vector (the one ``LeanGPT.step`` uses); a ``QuantizedLinear``'s own kernel.
    """
    positive_int("steps", steps)
    if not isinstance(model, nn.Module):
        raise BadType(f"model must be a torch.nn.Module (an ar_lab GPT), got {type(model).__name__}", arg="model")
    calls = []  # (product, its input)
    for m in model.modules():
        if type(m) is QuantizedLinear:
            calls.append((m.matmul, torch.randn(1, m.in_features)))  # (the CPU kernels: one row)
        elif isinstance(m, torch.nn.Linear):
            calls.append((m.weight.mv, torch.randn(m.in_features, device=m.weight.device, dtype=m.weight.dtype)))
    with torch.inference_mode():
        for _ in range(steps):
            for product, x in calls:
                product(x)
    synchronize(calls[0][1].device)
