"""One sequence with a KV cache, run the way an inference engine runs it: no framework layers.

``GPT.forward`` serves training and every batch shape through ``nn.Module`` calls. For
one sequence and one new token that generality costs real time: a decode step of the
course model is some seventy tiny kernels, each paying microseconds of Python and
dispatch, and the scaled-dot-product kernel sets up tiles for a query of length one.
On a CPU that overhead is a large share of the step (chapter 04 measures it). ``LeanGPT`` does
the same arithmetic on the model's own weights with direct tensor calls:

- ``step``: one new token. Every weight matrix is applied to one vector (``addmv``), the
  new key and value are written into the cache in place, and attention over the cache's
  filled prefix is two batched matrix-vector products with the softmax between. A single
  query sees every cached position, so there is no mask. Outputs land in buffers
  allocated once; the softmax scale 1/sqrt(D) is folded into a copy of the query weights.
- ``extend``: several new tokens after the cached ones (the target's verify pass in
  speculative decoding, chapter 07). Matrix-matrix products against transposed copies of
  the weights, made on first use: for a handful of rows, MKL's CPU kernels are markedly
  faster with the (in, out) layout than with nn.Linear's (out, in).

The results equal ``GPT.forward``'s up to float rounding (tests: logits within 1e-5, the
same greedy tokens). ``for_model(model)`` returns the engine of a model, rebuilt when its
parameters change (training updates them in place; every in-place update is counted by
the tensor's version counter, which the check reads). Call it under
``torch.inference_mode()``, as ``ar_lab.generate`` does.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ar_lab.cache import KVCache
from ar_lab.model import GPT, MLP, Block, CausalSelfAttention
from ar_lab.timing import synchronize


class LayerWeights(NamedTuple):
    """One block's tensors, in the order a decode step uses them (C = n_embd, KD = KV heads x D)."""

    ln1_weight: torch.Tensor  # (C,)
    ln1_bias: torch.Tensor  # (C,)
    qkv_weight: torch.Tensor  # (C + 2 KD, C): a copy whose query rows are scaled by 1/sqrt(D)
    qkv_bias: torch.Tensor  # (C + 2 KD,): scaled the same way
    attn_proj_weight: torch.Tensor  # (C, C)
    attn_proj_bias: torch.Tensor  # (C,)
    ln2_weight: torch.Tensor  # (C,)
    ln2_bias: torch.Tensor  # (C,)
    fc_weight: torch.Tensor  # (4C, C)
    fc_bias: torch.Tensor  # (4C,)
    mlp_proj_weight: torch.Tensor  # (C, 4C)
    mlp_proj_bias: torch.Tensor  # (C,)


class TransposedWeights(NamedTuple):
    """(in, out) copies of one block's four weight matrices: what ``extend``'s matrix products read."""

    qkv: torch.Tensor  # (C, C + 2 KD)
    attn_proj: torch.Tensor  # (C, C)
    fc: torch.Tensor  # (C, 4C)
    mlp_proj: torch.Tensor  # (4C, C)


class LeanGPT:
    """The batch-1 cached inference of a ``GPT``: ``step`` (one token) and ``extend`` (several)."""

    def __init__(self, model: GPT) -> None:
        if not supports(model):
            raise TypeError(
                f"LeanGPT runs a GPT with the stock blocks and GPT.forward, got {type(model).__name__}: "
                "call the model itself"
            )
        cfg = model.config
        self.config = cfg
        self.C, self.Hk, self.D = cfg.n_embd, cfg.kv_heads, cfg.head_dim
        self.G = cfg.n_head // cfg.kv_heads  # query heads per KV head (1: MHA)
        self.KD = self.Hk * self.D  # width of the keys (and of the values) of one position
        self.scale = 1.0 / math.sqrt(self.D)
        self.shape = (self.C,)
        self.eps = model.ln_f.eps
        self.wte, self.wpe = model.wte.weight, model.wpe.weight
        self.ln_f = (model.ln_f.weight, model.ln_f.bias)
        self.device = self.wte.device
        # Each block's tensors. The qkv weight and bias are copies whose query rows are multiplied by the
        # softmax scale 1/sqrt(D) (exact when D is a power of 4, 1/sqrt(D) then being a power of 2):
        # queries come out scaled, and attention needs no extra kernel for it.
        self.layers: list[LayerWeights] = []
        with torch.no_grad():
            for b in model.blocks:
                wqkv, bqkv = b.attn.qkv.weight.detach().clone(), b.attn.qkv.bias.detach().clone()
                wqkv[: self.C] *= self.scale
                bqkv[: self.C] *= self.scale
                self.layers.append(
                    LayerWeights(
                        ln1_weight=b.ln1.weight,
                        ln1_bias=b.ln1.bias,
                        qkv_weight=wqkv,
                        qkv_bias=bqkv,
                        attn_proj_weight=b.attn.proj.weight,
                        attn_proj_bias=b.attn.proj.bias,
                        ln2_weight=b.ln2.weight,
                        ln2_bias=b.ln2.bias,
                        fc_weight=b.mlp.fc.weight,
                        fc_bias=b.mlp.fc.bias,
                        mlp_proj_weight=b.mlp.proj.weight,
                        mlp_proj_bias=b.mlp.proj.bias,
                    )
                )
        # extend's (in, out) weights per block, and the output projection's, made on first use.
        self._transposed: tuple[list[TransposedWeights], torch.Tensor] | None = None
        # step's working memory, allocated once: the fused q|k|v output and the attention output,
        # with the views the step reads them through.
        self._qkv = torch.empty(self.C + 2 * self.KD, dtype=self.wte.dtype, device=self.device)
        self._q = self._qkv[: self.C].view(self.Hk, self.G, self.D)  # query heads grouped by their KV head
        self._k = self._qkv[self.C : self.C + self.KD].view(self.Hk, self.D)
        self._v = self._qkv[self.C + self.KD :].view(self.Hk, self.D)
        self._y = torch.empty(self.Hk, self.G, self.D, dtype=self.wte.dtype, device=self.device)
        self._checked: KVCache | None = None  # the cache step last checked, and its per-layer (K, V) views
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _check(self, cache: KVCache, T: int) -> int:
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
        if cache.batch_size != 1:
            raise ValueError(f"LeanGPT runs one sequence: the cache must have batch size 1, got {cache.batch_size}")
        if len(cache.k) != len(self.layers) or cache.k[0].shape[1:] != (self.Hk, cache.max_len, self.D):
            raise ValueError(f"{cache!r} is not shaped for this model: build it with KVCache.for_model(model)")
        end = cache.length + T
        if end > self.config.block_size:
            raise ValueError(
                f"{end} positions exceed the context window of {self.config.block_size} tokens "
                f"(config.block_size); shorten the prompt or generate fewer tokens"
            )
        if end > cache.max_len:
            raise ValueError(f"KV cache full: positions up to {end} requested, capacity is {cache.max_len}")
        if cache.k[0].dtype != self.wte.dtype or cache.k[0].device != self.device:
            raise ValueError(
                f"the cache holds {cache.k[0].dtype} on {cache.k[0].device}, the model {self.wte.dtype} on "
                f"{self.device}: build it with KVCache.for_model(model)"
            )
        return cache.length

    def step(self, token: int, cache: KVCache) -> torch.Tensor:
        """Logits (vocab,) after feeding one token at position ``cache.length``; the cache advances by one."""
        if cache is not self._checked:
            self._check(cache, 0)
            self._checked, self._kv = cache, [(k[0], v[0]) for k, v in zip(cache.k, cache.v, strict=True)]
        pos = cache.length
        if pos >= cache.max_len or pos >= self.config.block_size:
            self._check(cache, 1)  # raises the explanatory error
        C, shape, eps, q, y = self.C, self.shape, self.eps, self._q, self._y
        L = pos + 1  # keys the new query attends over: all cached positions and its own
        x = self.wte[token] + self.wpe[pos]  # (C,)
        for w, (K, V) in zip(self.layers, self._kv, strict=True):
            h = torch.layer_norm(x, shape, w.ln1_weight, w.ln1_bias, eps)
            torch.addmv(w.qkv_bias, w.qkv_weight, h, out=self._qkv)  # q/sqrt(D) | k | v
            K[:, pos] = self._k  # the new key and value, written in place
            V[:, pos] = self._v
            scores = torch.bmm(q, K[:, :L].transpose(1, 2))  # (Hk, G, L)
            torch.bmm(torch.softmax(scores, -1), V[:, :L], out=y)  # (Hk, G, D)
            x = torch.addmv(w.attn_proj_bias, w.attn_proj_weight, y.view(C)).add_(x)  # heads side by side + residual
            h = torch.layer_norm(x, shape, w.ln2_weight, w.ln2_bias, eps)
            h = F.gelu(torch.addmv(w.fc_bias, w.fc_weight, h), approximate="tanh")
            x = torch.addmv(w.mlp_proj_bias, w.mlp_proj_weight, h).add_(x)  # MLP out + residual
        cache.length = L
        return torch.mv(self.wte, torch.layer_norm(x, shape, *self.ln_f, eps))  # tied output projection

    def _weights_t(self) -> tuple[list[TransposedWeights], torch.Tensor]:
        """(in, out) copies of each layer's four weight matrices and of the output projection, made once."""
        if self._transposed is None:
            layers = [
                TransposedWeights(
                    qkv=w.qkv_weight.t().contiguous(),
                    attn_proj=w.attn_proj_weight.t().contiguous(),
                    fc=w.fc_weight.t().contiguous(),
                    mlp_proj=w.mlp_proj_weight.t().contiguous(),
                )
                for w in self.layers
            ]
            self._transposed = (layers, self.wte.t().contiguous())  # (C, vocab): the tied output projection
        return self._transposed

    def extend(self, tokens: Sequence[int] | torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits (T, vocab) after feeding T tokens at positions ``cache.length ..``; the cache advances by T."""
        if len(tokens) == 1 and not isinstance(tokens, torch.Tensor):  # one token: the decode step
            return self.step(int(tokens[0]), cache)[None]
        idx = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        if idx.ndim != 1 or idx.numel() == 0:
            raise ValueError(f"tokens must be a non-empty 1-D sequence of ids, got shape {tuple(idx.shape)}")
        T = idx.numel()
        pos = self._check(cache, T)
        C, Hk, G, D, KD, shape, eps = self.C, self.Hk, self.G, self.D, self.KD, self.shape, self.eps
        L = pos + T
        x = self.wte[idx] + self.wpe[pos:L]  # (T, C)
        hidden = torch.ones(T, L, dtype=torch.bool, device=self.device).triu_(pos + 1)  # query i sees keys <= pos + i
        layers_t, out_t = self._weights_t()
        for w, wt, K, V in zip(self.layers, layers_t, cache.k, cache.v, strict=True):
            K, V = K[0], V[0]  # (Hk, T_max, D)
            h = torch.layer_norm(x, shape, w.ln1_weight, w.ln1_bias, eps)  # (T, C)
            qkv = torch.addmm(w.qkv_bias, h, wt.qkv)  # (T, C + 2 KD)
            K[:, pos:L] = qkv[:, C : C + KD].view(T, Hk, D).transpose(0, 1)
            V[:, pos:L] = qkv[:, C + KD :].view(T, Hk, D).transpose(0, 1)
            q = qkv[:, :C].view(T, Hk, G, D).permute(1, 2, 0, 3).reshape(Hk, G * T, D)  # (Hk, G T, D)
            scores = torch.bmm(q, K[:, :L].transpose(1, 2)).view(Hk, G, T, L).masked_fill_(hidden, float("-inf"))
            y = torch.bmm(torch.softmax(scores, -1).view(Hk, G * T, L), V[:, :L])  # (Hk, G T, D)
            y = y.view(Hk, G, T, D).permute(2, 0, 1, 3).reshape(T, C)  # heads side by side again
            x = torch.addmm(w.attn_proj_bias, y, wt.attn_proj).add_(x)
            h = torch.layer_norm(x, shape, w.ln2_weight, w.ln2_bias, eps)
            h = F.gelu(torch.addmm(w.fc_bias, h, wt.fc), approximate="tanh")
            x = torch.addmm(w.mlp_proj_bias, h, wt.mlp_proj).add_(x)
        cache.length = L
        return torch.mm(torch.layer_norm(x, shape, *self.ln_f, eps), out_t)  # (T, vocab)


def supports(model) -> bool:
    """True for a ``GPT`` that runs ``GPT.forward`` with the stock blocks: what ``LeanGPT`` reproduces.

    A subclass with its own ``forward``, or a block swapped for another module (an experiment
    in a notebook), keeps going through ``forward``, so ``generate`` never silently skips it.
    """
    return (
        isinstance(model, GPT)
        and type(model).forward is GPT.forward
        and all(type(b) is Block and type(b.attn) is CausalSelfAttention and type(b.mlp) is MLP for b in model.blocks)
    )


_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (parameter fingerprint, engine)


def for_model(model: GPT) -> LeanGPT:
    """The ``LeanGPT`` of ``model``, made once and remade after its parameters change."""
    # Storage and version counter of every parameter: an optimizer step, load_state_dict or .to()
    # changes one of them, and the transposed copies ``extend`` keeps would then be stale.
    key = tuple((p.data_ptr(), p._version) for p in model.parameters())
    hit = _ENGINES.get(model)
    if hit is not None and hit[0] == key:
        return hit[1]
    engine = LeanGPT(model)
    _ENGINES[model] = (key, engine)
    return engine


def engine_for(model) -> LeanGPT | None:
    """``for_model(model)`` when ``supports(model)``, else None (the caller then runs ``model.forward``)."""
    return for_model(model) if supports(model) else None


def weights_only_pass(model, steps: int) -> None:
    """Apply every weight matrix of ``model`` to one vector, ``steps`` times, and nothing else.

    The floor under any batch-1 decoder of the model (no attention, no LayerNorm, no sampling,
    no Python around it): time it to see what a decode step adds on top. Matrix-vector
    products, the fastest kernel for one vector (the one ``LeanGPT.step`` uses).
    """
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    vectors = [torch.randn(m.in_features, device=m.weight.device, dtype=m.weight.dtype) for m in linears]
    with torch.inference_mode():
        for _ in range(steps):
            for m, x in zip(linears, vectors, strict=True):
                torch.mv(m.weight, x)
    synchronize(vectors[0].device)
