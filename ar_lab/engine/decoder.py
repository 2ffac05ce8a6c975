"""The decoder interface: the one way every decoding loop runs a model.

A loop (generate, stream, batched sampling, beam search, speculative decoding, serving) never calls
a model or an engine directly. It asks a decoder for logits, and says where the new tokens go:

- ``prefill(tokens, cache, pos)``: a block of tokens (B, T) at positions pos .. pos + T - 1 (a
  prompt, or what a reused prefix leaves of it); logits (B, T, vocab). ``cache=None`` runs the
  whole sequence without a cache (what a model without one must do every step).
- ``step(token, cache, pos)``: one new token per row at position pos; logits (vocab,) for an int
  token of one sequence, (B, vocab) for a tensor of B tokens.
- ``extend(tokens, cache, pos)``: several tokens of one sequence at once (the target's verify pass
  in speculative decoding); logits (T, vocab).

Positions are explicit, as in gpt-fast's ``input_pos``: feeding tokens at ``pos`` drops whatever
the cache held from ``pos`` on (rejected drafts, the part of a cached prompt that differs).
``pos=None`` is for a ``BatchKVCache``, whose rows sit at lengths of their own.

Two decoders implement it. ``LeanDecoder`` runs a stock ``GPT`` with a batch-1 cache the way an
inference engine does (``ar_lab.engine.lean``: no module layers in the decode step).
``ForwardDecoder`` calls ``model(idx, cache)``: any model that keeps the cache contract (the
learner's own, a quantized or wrapped one), any batch, and rows at different lengths.
``decoder_for(model)`` picks the lean one where it reproduces the model (``pick_decoder`` the same
for a loop that has checked the model already). Decoders trust the model and the token ids they are
given (the public functions check them once, before the first token), but check each cache the first
time they see it (``check_fits``: its type, shape, dtype and device against the model), so a cache
built for another model is refused before it reaches torch's attention kernel.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ar_lab.base.errors import BadType, BadValue
from ar_lab.engine.lean import ExtendCopies, LeanGPT, NotLean, extend_copies
from ar_lab.engine.quant import QuantizedLinear
from ar_lab.model.cache import BatchKVCache, KVCache


class Decoder(Protocol):
    """What a decoding loop needs of a decoder (``ForwardDecoder`` and ``LeanDecoder`` are the
    two)."""

    model: torch.nn.Module

    def fits(self, cache) -> None: ...

    def prefill(self, tokens: torch.Tensor, cache, pos: int = 0, *, mask: torch.Tensor | None = None
                ) -> torch.Tensor: ...

    def step(
        self, token, cache, pos: int | None, *, mask: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def extend(self, tokens: list[int], cache, pos: int) -> torch.Tensor: ...


def _rewind(cache, pos: int | None) -> None:
    """Drop the positions from ``pos`` on (a cache only ever rewinds: it is never ahead of its
    writes)."""
    if pos is not None and cache.length != pos:
        cache.truncate(pos)


def _record(cache, pos: int, ids: list[int]) -> None:
    """Note which tokens a batch-1 ``KVCache`` now holds from ``pos`` (what lets ``generate`` reuse
    it)."""
    if isinstance(cache, KVCache) and cache.batch_size == 1:
        cache.record(pos, ids)


def check_one_dtype(model: torch.nn.Module) -> None:
    """Raise unless the model's floating-point parameters share one dtype (a quantized layer keeps
    its own): a block cast alone would otherwise stop torch deep inside a product ("mixed
    dtype")."""
    first = None
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            continue
        for pname, p in module.named_parameters(recurse=False):
            if not p.is_floating_point():
                continue
            if first is None:
                first = (f"{name}.{pname}" if name else pname, p.dtype)
            elif p.dtype != first[1]:
                raise BadValue(
                    f"the model holds {first[0]} in {first[1]} but {name}.{pname} in {p.dtype}: "
                    f"convert the whole model to one dtype (model.to({first[1]}), or model.to("
                    f"{p.dtype})) before generating",
                    arg="model",
                )


class ForwardDecoder:
    """Every pass through ``model(idx, cache)``: any model keeping the cache contract, any batch."""

    def __init__(self, model) -> None:
        check_one_dtype(model)
        self.model = model
        # the cache last checked against the model (none yet)
        self._checked: object = ForwardDecoder

    def fits(self, cache) -> None:
        """Raise unless ``cache`` is a ``KVCache`` or ``BatchKVCache`` that fits the model (checked
        once per cache)."""
        if cache is self._checked:
            return
        if not isinstance(cache, (KVCache, BatchKVCache)):
            raise BadType(
                f"cache must be a KVCache or a BatchKVCache, got {type(cache).__name__}",
                arg="cache",
            )
        cache.check_fits(self.model)
        self._checked = cache

    def prefill(
        self, tokens: torch.Tensor, cache, pos: int | None = 0, *, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``mask``: for rows of a ``BatchKVCache``, a mask of one's own (chapter 08's) instead of
        the one the store derives from the rows' positions."""
        if cache is None:
            return self.model(tokens)  # (B, T, vocab): the whole sequence, no cache
        self.fits(cache)
        if isinstance(cache, BatchKVCache):  # rows at lengths of their own: explicit positions
            # (a paged cache takes the blocks the step needs here)
            positions, _ = cache.begin(tokens.shape[1])
            logits = self.model(tokens, cache, positions=positions, mask=mask)
            cache.advance(tokens.shape[1])
            return logits
        _rewind(cache, pos)
        logits = self.model(tokens, cache)
        if tokens.shape[0] == 1:
            _record(cache, pos, tokens[0].tolist())
        return logits

    def step(
        self, token, cache, pos: int | None, *, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if isinstance(token, int):  # one sequence: (vocab,)
            idx = torch.tensor([[token]], device=self.model.device)
            self.fits(cache)
            _rewind(cache, pos)
            logits = self.model(idx, cache)[0, -1]
            _record(cache, pos, [token])
            return logits
        if not isinstance(token, torch.Tensor) or token.ndim != 1:
            raise BadType(
                "token must be an int (one sequence) or a 1-D tensor of B token ids, got "
                f"{token!r}",
                arg="token",
            )
        # (B, vocab): one token for every row
        return self.prefill(token[:, None], cache, pos, mask=mask)[:, -1]

    def extend(self, tokens: list[int], cache, pos: int) -> torch.Tensor:
        # (T, vocab)
        return self.prefill(torch.tensor([tokens], device=self.model.device), cache, pos)[0]


class LeanDecoder(ForwardDecoder):
    """A stock ``GPT``: the prompt through ``forward`` (one call), then the lean engine's step and
    extend for a batch-1 cache, and its ``step_rows`` for the rows of a ``BatchKVCache`` (unless a
    mask of one's own is given: then ``forward``).

    One decoder serves one generation: ``extend`` multiplies by copies of the weights made at its
    first use, in the layout a few rows read fastest (``lean.extend_copies``: packed for oneDNN, or
    (in, out)); they cost a pass over the weights per generation, and a new decoder after the
    weights change sees the change. ``step`` reads the model's parameters themselves at every call.
    """

    def __init__(self, model) -> None:
        super().__init__(model)
        self.engine = LeanGPT(model)
        # what runs a batch-1 step: the engine's eager step (a CompiledDecoder's compiled one)
        self.stepper = self.engine
        self._copies: ExtendCopies | None = None

    def step(
        self, token, cache, pos: int | None, *, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not isinstance(token, int):
            if mask is not None or not isinstance(cache, BatchKVCache):  # one's own mask: forward
                return super().step(token, cache, pos, mask=mask)
            # a batch of rows at positions of their own: one read of the weights' copies for all
            self.fits(cache)
            return self.engine.step_rows(token, cache, self._extend_copies())
        self.fits(cache)
        _rewind(cache, pos)
        return self.stepper.step(token, cache)  # records the token itself

    def extend(self, tokens: list[int], cache, pos: int) -> torch.Tensor:
        if pos == 0:  # a prompt: one prefill through forward
            return super().extend(tokens, cache, pos)
        self.fits(cache)
        _rewind(cache, pos)
        if len(tokens) == 1:
            return self.stepper.step(tokens[0], cache)[None]  # (1, vocab)
        return self.engine.extend(tokens, cache, self._extend_copies())  # (T, vocab)

    def _extend_copies(self) -> ExtendCopies:
        """The weights' copies for products of a few rows, made at first use (one generation)."""
        if self._copies is None:
            self._copies = extend_copies(self.model)
        return self._copies


def decoder_for(model, *, lean: bool = True) -> Decoder:
    """The decoder a loop runs ``model`` with: the lean engine where it reproduces the model (and
    ``lean`` is on), else the model's own forward."""
    if not isinstance(lean, bool):
        raise BadType(f"lean must be True or False, got {lean!r}", arg="lean")
    if not isinstance(model, torch.nn.Module):
        raise BadType(
            f"model must be a torch.nn.Module (an ar_lab GPT), got {type(model).__name__}",
            arg="model",
        )
    return pick_decoder(model, lean=lean)


def pick_decoder(model, *, lean: bool) -> Decoder:
    """``decoder_for`` for a loop that has checked ``model`` and ``lean`` at its own entry point."""
    if lean:
        try:
            return LeanDecoder(model)  # checks and gathers the weights in one walk over the model
        except NotLean:
            pass
    return ForwardDecoder(model)
