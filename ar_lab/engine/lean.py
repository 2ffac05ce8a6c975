"""One sequence with a KV cache, run the way an inference engine runs it: no framework layers.

``GPT.forward`` serves training and every batch shape through ``nn.Module`` calls. For one sequence
and one new token that generality costs real time: a decode step of the course model is dozens of
small PyTorch calls (``ar_lab.perf.op_count`` counts them), each paying microseconds of Python and
dispatch, and the scaled-dot-product kernel sets up tiles for a query of length one. On a CPU that
overhead is a large share of the step (chapter 04 measures it). ``LeanGPT`` does the same arithmetic
on the model's own weights with direct tensor calls:

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

A block's Linear layer may be a ``QuantizedLinear`` (``ar_lab.engine.quant``, chapter 09): the step
and ``extend`` then call its kernel, which reads the layer's narrow weights (its buffers) at every
call, so edits are seen there too; no copy is ever made of them. A quantized model cast to another
dtype afterwards (``.bfloat16()``) is not run here: ``supports`` says so, and ``generate`` takes it
through ``forward``, so ``lean=True`` and ``lean=False`` give the same tokens.

The results equal ``GPT.forward``'s up to float rounding (tests: logits within 1e-5, the
same greedy tokens). ``for_model(model)`` makes an engine (cheap: it copies nothing).
Call it under ``torch.inference_mode()``; the decode loops reach it through ``LeanDecoder``.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.base.timing import synchronize
from ar_lab.engine.packed import ExtendMatrix, extend_mm, product_copy
from ar_lab.engine.quant import QuantizedLinear, bf16_addmv
from ar_lab.model.block import BlockWeights, block
from ar_lab.model.cache import BatchKVCache, KVCache
from ar_lab.model.gpt import GPT, MLP, Block, CausalSelfAttention

# A weight matrix as the step reads it: nn.Linear's parameter, or a whole QuantizedLinear (chapter
# 09), whose own kernel multiplies with its narrow weights (read from the module at every call).
Matrix = torch.Tensor | QuantizedLinear


class LayerNorm:
    """LayerNorm's kernel on the module's own parameters, without the module's call."""

    __slots__ = ("weight", "bias", "eps", "shape")

    def __init__(self, m: nn.LayerNorm) -> None:
        self.weight, self.bias, self.eps, self.shape = (
            m.weight,
            m.bias,
            m.eps,
            tuple(m.normalized_shape),
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.native_layer_norm(x, self.shape, self.weight, self.bias, self.eps)[0]


class RMSNorm:
    """RMSNorm's kernel on the module's own weight."""

    __slots__ = ("weight", "eps", "shape")

    def __init__(self, m: nn.RMSNorm) -> None:
        self.weight, self.eps, self.shape = m.weight, m.eps, tuple(m.normalized_shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.rms_norm(x, self.shape, self.weight, self.eps)


def vector(
    m: nn.Linear | QuantizedLinear, slow_addmv: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A linear layer applied to one vector (in,): a matrix-vector product on the layer's own weight
    (or a ``QuantizedLinear``'s kernel), the fastest product for one vector; bias added in the same
    call. The step keeps its residual stream as one vector (C,), so no view is needed around the
    product. A ``partial`` of torch's function itself: the step's 17 products a token call the
    kernel with no Python frame between."""
    if type(m) is QuantizedLinear:
        return partial(m.addmv, m.bias)
    if m.bias is None:
        return partial(torch.mv, m.weight)
    return partial(bf16_addmv if slow_addmv else torch.addmv, m.bias, m.weight)


class Rows:
    """A linear layer applied to a few rows (1, T, in) through ``extend``'s copy of its weight
    (packed for oneDNN, (in, out), or a ``QuantizedLinear``'s kernel)."""

    __slots__ = ("copy", "bias")

    def __init__(self, copy: ExtendMatrix, bias: torch.Tensor | None) -> None:
        self.copy, self.bias = copy, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[:2]  # (1, T) for extend's rows of one sequence, (B, 1) for a batched step
        return extend_mm(self.bias, x.view(B * T, -1), self.copy).view(B, T, -1)


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


def _no_grad_needed() -> None:
    raise RuntimeError(
        "LeanGPT computes with the model's own parameters and records no gradients: call it under "
        "torch.inference_mode() (or torch.no_grad()), as ar_lab.generate does"
    )


class LeanGPT:
    """The batch-1 cached inference of a ``GPT``: ``step`` (one token) and ``extend`` (several).

    Both run ``ar_lab.model.block.block``, the block ``GPT.forward`` runs, on the model's own
    parameters held without their modules (no copies), so several threads may use one engine, each
    with its own cache.
    """

    def __init__(self, model: GPT) -> None:
        blocks = _stock_blocks(model)
        if blocks is None:
            raise NotLean(
                "LeanGPT runs a GPT with the stock modules and GPT.forward (see lean.supports), "
                f"got {type(model).__name__}: call the model itself",
                arg="model",
            )
        if _cast_after_quantizing(model, blocks):
            raise NotLean(
                "LeanGPT runs a quantized model on a float32 residual stream (what "
                f"quantize_model makes); this one computes in {model.wte.weight.dtype} (cast "
                "after quantizing), which the step would round differently from GPT.forward: "
                "call the model itself (generate does), or quantize the float32 model and keep "
                "it so",
                arg="model",
            )
        cfg = model.config
        self.config, self.model, self.spec = cfg, model, model.spec
        # The parameters themselves (not .detach() aliases, not copies): `p.data = t` swaps what
        # p holds, and a step must see it, as forward() does.
        self.wte = model.wte.weight
        self.wpe = None if model.wpe is None else model.wpe.weight
        self.device, dtype = self.wte.device, self.wte.dtype
        slow_addmv = dtype == torch.bfloat16 and self.device.type == "cpu"  # (see quant.bf16_addmv)
        self.blocks = blocks
        self.layers = [
            BlockWeights(
                _norm(b.ln1),
                vector(b.attn.qkv, slow_addmv),
                vector(b.attn.proj, slow_addmv),
                _norm(b.ln2),
                vector(b.mlp.fc, slow_addmv),
                vector(b.mlp.proj, slow_addmv),
            )
            for b in blocks
        ]
        self.ln_f = _norm(model.ln_f)
        self.head = vector(model.lm_head, slow_addmv)

    def _check(self, cache: KVCache, T: int) -> int:
        if not isinstance(cache, KVCache):
            raise BadType(f"cache must be a KVCache, got {type(cache).__name__}", arg="cache")
        if cache.batch_size != 1:
            raise BadValue(
                "LeanGPT runs one sequence: the cache must have batch size 1, got "
                f"{cache.batch_size}",
                arg="cache",
            )
        if len(cache.k) != len(self.layers) or cache.k[0].shape[1::2] != (
            self.config.kv_heads,
            self.config.head_dim,
        ):
            raise BadValue(
                f"cache {cache!r} is not shaped for this model: build it with "
                "KVCache.for_model(model)",
                arg="cache",
            )
        end = cache.length + T
        if end > self.config.block_size:
            raise ContextFull(
                f"{end} positions (the cache's and the new tokens) exceed the context window of "
                f"{self.config.block_size} tokens (config.block_size); shorten the prompt or "
                "generate fewer tokens",
                arg="cache",
            )
        if end > cache.max_len:
            raise ContextFull(
                f"KV cache full: positions up to {end} requested, capacity is {cache.max_len}",
                arg="cache",
            )
        dtype = cache.dtype  # an Int8KVCache: what it dequantizes to
        if dtype != self.wte.dtype or cache.k[0].device != self.device:
            raise BadValue(
                f"the cache holds {dtype} on {cache.k[0].device}, the model {self.wte.dtype} on "
                f"{self.device}: build it with KVCache.for_model(model)", arg="cache"
            )
        return cache.length

    def step(self, token: int, cache: KVCache, run: Callable | None = None) -> torch.Tensor:
        """Logits (vocab,) after feeding one token at position ``cache.length``; the cache advances
        by one. ``run(token, cache, pos)``: what computes them after the checks (default
        ``eager``; ``ar_lab.engine.compiled`` passes its compiled graph)."""
        if type(token) is not int:
            token = _token_id(token)
        if not 0 <= token < self.config.vocab_size:
            raise BadValue(
                f"token id {token} is outside the vocabulary [0, {self.config.vocab_size - 1}]",
                arg="token",
            )
        pos = self._check(cache, 1)
        if torch.is_grad_enabled():
            _no_grad_needed()
        logits = (run or self.eager)(token, cache, pos)
        cache.length = pos + 1
        cache.record(pos, [token])
        return logits

    def eager(self, token: int, store, pos: int) -> torch.Tensor:
        """The step's arithmetic, unchecked: logits (vocab,) of ``token`` at ``pos``, its keys and
        values written to ``store``."""
        return self.one(self.wte.select(0, token), store, pos)

    def one(self, x: torch.Tensor, store, pos) -> torch.Tensor:
        """Every block and the head on one token's embedding x (C,) at ``pos`` (what a compiled step
        traces: nothing here depends on pos's value)."""
        if self.wpe is not None:  # (pos a tensor (1, 1): a step recorded for every position)
            wpe = self.wpe
            x = x + (wpe[pos].view(-1) if isinstance(pos, torch.Tensor) else wpe.select(0, pos))
        for i, w in enumerate(self.layers):
            x = block(x, w, self.spec, store, i, pos)
        return self.head(self.ln_f(x))  # tied output projection: (vocab,)

    def extend(
        self,
        tokens: Sequence[int] | torch.Tensor,
        cache: KVCache,
        copies: ExtendCopies | None = None,
    ) -> torch.Tensor:
        """Logits (T, vocab) after feeding T tokens at positions ``cache.length ..``; the cache
        advances by T.

        ``copies``: ``extend_copies(model)`` (faster on CPU), taken after the weights last
        changed; without them the products read the parameters through transposed views.
        """
        if len(tokens) == 1 and not isinstance(tokens, torch.Tensor):  # one token: the decode step
            return self.step(tokens[0], cache)[None]
        idx = self._ids(tokens, None, "a non-empty 1-D sequence of ids")
        T = idx.numel()
        pos = self._check(cache, T)
        if torch.is_grad_enabled():
            _no_grad_needed()
        L = pos + T
        x = self.wte[idx] if self.wpe is None else self.wte[idx] + self.wpe[pos:L]
        x = x.view(1, T, -1)
        layers_t, out_t = copies if copies is not None else self._views()
        for i, (w, wt, b) in enumerate(zip(self.layers, layers_t, self.blocks, strict=True)):
            x = block(x, _rows(w, wt, b), self.spec, cache, i, pos)
        cache.length = L
        cache.record(
            pos, tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]
        )
        return Rows(out_t, None)(self.ln_f(x)).view(T, -1)  # (T, vocab)

    def step_rows(
        self, tokens: torch.Tensor, cache: BatchKVCache, copies: ExtendCopies
    ) -> torch.Tensor:
        """Logits (B, vocab) after one token for each of the B rows of a ``BatchKVCache``, each at
        its own position; every row advances by one.

        The B rows share each product through ``copies`` (``extend_copies``: on a CPU, a few rows
        read the packed layout in about one matrix-vector product's time, where ``nn.Linear``'s
        layout takes about twice as long for four), so a batched step reads the weights once;
        attention is the store's, each row over its own keys. The block is ``block``, as for
        ``step`` and ``extend``.
        """
        if not isinstance(cache, BatchKVCache):
            raise BadType(f"cache must be a BatchKVCache, got {type(cache).__name__}", arg="cache")
        idx = self._ids(tokens, cache.rows, f"one id for each of the cache's {cache.rows} rows")
        if torch.is_grad_enabled():
            _no_grad_needed()
        positions, _ = cache.begin(1)  # (B, 1): each row's next position (the store masks by them)
        x = self.wte[idx] if self.wpe is None else self.wte[idx] + self.wpe[positions[:, 0]]
        x = x.view(idx.numel(), 1, -1)
        layers_t, out_t = copies
        for i, (w, wt, b) in enumerate(zip(self.layers, layers_t, self.blocks, strict=True)):
            x = block(x, _rows(w, wt, b), self.spec, cache, i, positions)
        cache.advance(1)
        return Rows(out_t, None)(self.ln_f(x))[:, -1]  # (B, vocab)

    def _ids(self, tokens, n: int | None, what: str) -> torch.Tensor:
        """``tokens`` as a 1-D long tensor of ``n`` ids (None: any number but 0) in the
        vocabulary; else a BadType or BadValue naming ``tokens`` (``what``: the shape asked
        for)."""
        idx = _token_ids(tokens, self.device)
        if idx.ndim != 1 or idx.numel() == 0 or (n is not None and idx.numel() != n):
            raise BadValue(f"tokens must hold {what}, got shape {tuple(idx.shape)}", arg="tokens")
        if int(idx.min()) < 0 or int(idx.max()) >= self.config.vocab_size:
            raise BadValue(
                f"tokens hold ids outside the vocabulary [0, {self.config.vocab_size - 1}]",
                arg="tokens",
            )
        return idx

    def _views(self) -> ExtendCopies:
        """The parameters' (in, out) views: always current, no copy (slower than copies on CPU for a
        few rows)."""
        layers = [BlockCopies(*(_t(_matrix(m)) for m in _linears(b))) for b in self.blocks]
        return ExtendCopies(layers, self.wte.t())


def _rows(w: BlockWeights, wt: BlockCopies, b: Block) -> BlockWeights:
    """One block's weights for a product of several rows: its norms, and its four matrices through
    their copies ``wt`` (with the layers' biases)."""
    return BlockWeights(
        w.norm1,
        Rows(wt.qkv, b.attn.qkv.bias),
        Rows(wt.attn_proj, b.attn.proj.bias),
        w.norm2,
        Rows(wt.fc, b.mlp.fc.bias),
        Rows(wt.mlp_proj, b.mlp.proj.bias),
    )


def _norm(m: nn.Module) -> LayerNorm | RMSNorm:
    return RMSNorm(m) if type(m) is nn.RMSNorm else LayerNorm(m)


def _linears(b: Block) -> tuple[nn.Module, ...]:
    return b.attn.qkv, b.attn.proj, b.mlp.fc, b.mlp.proj


def _token_id(token) -> int:
    """``token`` as an int: a whole number or a one-element integer tensor (a bool or a float is a
    mistake)."""
    if isinstance(token, torch.Tensor) and token.numel() == 1 and not token.is_floating_point():
        token = token.item()
    if isinstance(token, bool) or not isinstance(token, numbers.Integral):
        raise BadType(f"token must be an int token id, got {token!r}", arg="token")
    return int(token)


def _token_ids(tokens, device: torch.device) -> torch.Tensor:
    """``tokens`` (ids, or an integer tensor) as a long tensor; floats and bools are refused, not
    truncated."""
    if isinstance(tokens, str):
        raise BadType(
            "tokens must be token ids (a list of ints or an integer tensor), not a str: encode "
            "it first",
            arg="tokens",
        )
    try:
        t = torch.as_tensor(tokens, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise BadType(
            f"tokens must be token ids (a list of ints or an integer tensor), got {tokens!r}",
            arg="tokens",
        ) from None
    if t.numel() == 0:
        raise BadValue(
            f"tokens must be a non-empty 1-D sequence of ids, got shape {tuple(t.shape)}",
            arg="tokens",
        )
    if t.is_floating_point() or t.dtype == torch.bool or t.is_complex():
        raise BadType(f"tokens must be integer token ids, got {t.dtype}", arg="tokens")
    return t.long()


def _t(m: Matrix) -> Matrix:
    """(in, out) view of a weight; a QuantizedLinear stands for its own transpose (its kernel takes
    x rows)."""
    return m if type(m) is QuantizedLinear else m.t()


class NotLean(BadType):
    """The model is not one ``LeanGPT`` reproduces (see ``supports``)."""


def supports(model) -> bool:
    """True for a ``GPT`` that runs ``GPT.forward`` with the stock modules: what ``LeanGPT``
    reproduces.

    A subclass with its own ``forward``, a module swapped for another or subclassed (an experiment
    in a notebook, a parametrized weight), or an output projection no longer tied to the token
    embedding keeps going through ``forward``, so ``generate`` never silently skips it. A block's
    Linear layer may be a ``QuantizedLinear`` (``ar_lab.engine.quant``): the step then calls its
    kernel, as long as the model keeps the float32 embeddings ``quantize_model`` gave it.
    """
    blocks = _stock_blocks(model)
    return blocks is not None and not _cast_after_quantizing(model, blocks)


def _cast_after_quantizing(model: GPT, blocks: list[Block]) -> bool:
    """A quantized model whose embeddings are not float32 (cast after ``quantize_model``, e.g.
    ``.bfloat16()``): its QuantizedLinear layers add float32 biases, and the step's
    reduced-precision attention would round differently from ``GPT.forward``'s, so such a model goes
    through ``forward``."""
    return model.wte.weight.dtype != torch.float32 and any(
        type(m) is QuantizedLinear for b in blocks for m in _linears(b)
    )


_NORMS = (nn.LayerNorm, nn.RMSNorm)


def _stock_blocks(model) -> list[Block] | None:
    """The model's blocks, if every module is the stock one (else None); one walk over the model."""
    if not (isinstance(model, GPT) and type(model).forward is GPT.forward):
        return None
    head, ln_f = model.lm_head, model.ln_f
    if not (
        type(head) is nn.Linear
        and head.weight is model.wte.weight
        and head.bias is None
        and type(model.wte) is nn.Embedding
        and (model.wpe is None or type(model.wpe) is nn.Embedding)
        and type(ln_f) in _NORMS
    ):
        return None
    for b in model.blocks:
        if (
            type(b) is not Block
            or type(b.attn) is not CausalSelfAttention
            or type(b.mlp) is not MLP
        ):
            return None
        if not (
            all(type(m) in (nn.Linear, QuantizedLinear) for m in _linears(b))
            and type(b.ln1) is type(b.ln2) is type(ln_f)
        ):
            return None
    return list(model.blocks)


def _matrix(linear: nn.Linear | QuantizedLinear) -> Matrix:
    """What the step multiplies by: an nn.Linear's weight parameter, or the QuantizedLinear
    itself."""
    return linear if type(linear) is QuantizedLinear else linear.weight


def for_model(model: GPT) -> LeanGPT:
    """A ``LeanGPT`` for ``model``: cheap to make (it copies nothing), always on the model's current
    weights."""
    return LeanGPT(model)


# --- (in, out) copies for extend ---------------------------------------------------------


def _matrices(model: GPT) -> list[Matrix]:
    """The matrices ``extend`` multiplies by, in ``ExtendCopies`` order (4 per block, then the
    embedding).

    A QuantizedLinear is its own entry: its kernel reads the module's buffers at each call, no
    copy."""
    out = [_matrix(m) for b in model.blocks for m in _linears(b)]
    return [*out, model.wte.weight]


def extend_copies(model: GPT, *, pack: bool = True) -> ExtendCopies:
    """Copies of every matrix ``LeanGPT.extend`` multiplies by, in the layout its products read
    fastest (``ar_lab.engine.packed``; ``pack=False``: (in, out) copies, to compare), equal to
    ``model``'s weights now.

    Fresh copies each call, kept by whoever asked (a ``LeanDecoder``, for one generation): no
    registry to consult, and a later change of the weights is never hidden behind a stale copy.
    """
    if not supports(model):
        raise NotLean(
            f"extend_copies takes a GPT that LeanGPT runs as model, got {type(model).__name__}",
            arg="model",
        )
    with torch.no_grad():
        t = [product_copy(m, pack=pack) for m in _matrices(model)]
    layers = [BlockCopies(*t[i : i + 4]) for i in range(0, len(t) - 1, 4)]
    return ExtendCopies(layers, t[-1])


def weights_only_pass(model, steps: int) -> None:
    """Apply every weight matrix of ``model`` to one vector, ``steps`` times, and nothing else.

    The floor under any batch-1 decoder of the model (no attention, no LayerNorm, no sampling, no
    Python around it): time it to see what a decode step adds on top. Matrix-vector products, the
    fastest kernel for one vector (the one ``LeanGPT.step`` uses); a ``QuantizedLinear``'s own
    kernel.
    """
    positive_int("steps", steps)
    calls = weight_products(model)
    with torch.inference_mode():
        for _ in range(steps):
            for product, x in calls:
                product(x)
    synchronize(calls[0][1].device)


def weight_products(model) -> list[tuple[Callable, torch.Tensor]]:
    """(product, its input) for every weight matrix of ``model``: what ``weights_only_pass`` runs
    once a step (a benchmark adds other reads to the same products)."""
    if not isinstance(model, nn.Module):
        raise BadType(
            f"model must be a torch.nn.Module (an ar_lab GPT), got {type(model).__name__}",
            arg="model",
        )
    calls = []  # (product, its input)
    for m in model.modules():
        if type(m) is QuantizedLinear:
            calls.append((m.matmul, torch.randn(1, m.in_features)))  # (the CPU kernels: one row)
        elif isinstance(m, torch.nn.Linear):
            calls.append(
                (
                    m.weight.mv,
                    torch.randn(m.in_features, device=m.weight.device, dtype=m.weight.dtype),
                )
            )
    return calls
