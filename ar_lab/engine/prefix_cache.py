"""Prefix (prompt) caching: the keys/values of a shared static prefix, computed once (chapter 08).

Many requests start with the same tokens (a long system prompt, a document under
discussion). Keys and values of a position depend only on the tokens up to it, so the
prefix's can be computed once and copied into each request's own cache; its prefill then
processes only the rest of the prompt. The outputs are those without reuse (up to float
rounding); only the time to first token changes.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from types import SimpleNamespace

import torch

from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.base.timing import synchronize
from ar_lab.engine.decoder import pick_decoder
from ar_lab.engine.prompts import check_prompt, loop_model, prompt_ids

# reusable_length: re-exported for chapter 08
from ar_lab.model.cache import KVCache, reusable_length
from ar_lab.model.inference import check_inference_ready, inference


class PrefixCache:
    """The keys/values of a shared static prefix (e.g. a long system prompt), computed once.

    ``copy_into(cache, prompt)`` puts the reusable part into a request's own cache (what
    ``serve(..., prefix=...)`` does for every request it admits); ``cache_for`` makes a fresh
    cache for ``generate(..., cache=...)`` with it already in.
    """

    def __init__(self, model, prefix: str | Sequence[int]) -> None:
        loop_model(model)
        check_inference_ready(model)  # in eval mode where that matters
        try:
            self.tokens = prompt_ids(prefix)
        except (BadType, BadValue) as e:  # the prompt checks, about the prefix
            raise type(e)(f"prefix: {e}", arg="prefix") from None
        if len(self.tokens) > model.config.block_size:
            raise ContextFull(
                f"the prefix has {len(self.tokens)} tokens but the context window holds "
                f"{model.config.block_size}",
                arg="prefix",
            )
        bad = [t for t in self.tokens if not 0 <= t < model.config.vocab_size]
        if bad:
            raise BadValue(
                f"prefix holds token id {bad[0]}, outside the vocabulary [0, "
                f"{model.config.vocab_size - 1}]",
                arg="prefix",
            )
        self.config = model.config
        # who filled it, and with what
        self._model, self._weights = weakref.ref(model), weights_fingerprint(model)
        self.cache = KVCache.for_model(model, max_len=len(self.tokens))
        with inference(model):
            t0 = time.perf_counter()
            pick_decoder(model, lean=True).prefill(
                torch.tensor([self.tokens], device=model.device), self.cache
            )
            synchronize(model.device)
            self.build_time = time.perf_counter() - t0  # paid once, not per request

    def check_model(self, model=None, *, arg: str = "model") -> None:
        """Raise unless the keys/values are still those of the model that filled them: ``model``
        (when given) must be that model itself, not another of the same shape (a copy, a checkpoint
        loaded again, a fine-tuned sibling), and its weights unchanged since
        (``weights_fingerprint``), or the copies would be stale keys of other weights. A
        ``BadValue`` naming ``arg``; build the ``PrefixCache`` again from the model in use."""
        owner = self._model()
        again = "build PrefixCache(model, prefix) again from the model that uses it"
        if owner is None:
            raise BadValue(f"the model that filled this prefix cache is gone: {again}", arg=arg)
        if model is not None and model is not owner:
            raise BadValue(
                f"this prefix cache was filled by another {type(owner).__name__} (same shape, "
                f"other weights as far as it knows): {again}",
                arg=arg,
            )
        if weights_fingerprint(owner) != self._weights:
            raise BadValue(
                "the weights of the model that filled this prefix cache changed since (trained, "
                f"loaded, moved or cast): its keys and values are stale: {again}",
                arg=arg,
            )

    def __len__(self) -> int:
        return len(self.tokens)

    def reusable(self, prompt: str | Sequence[int]) -> int:
        return reusable_length(self.tokens, prompt_ids(prompt))

    def copy_into(self, cache: KVCache, prompt: str | Sequence[int], *, model=None) -> int:
        """Copy the reusable keys/values into ``cache`` (batch 1); returns how many positions.

        They are written through ``cache.update``, so an ``Int8KVCache`` quantizes them as it does
        its own (with their scales). The cache must compute in the prefix's dtype: keys of a float32
        model are not those of its bfloat16 copy. ``model``: the model that will read ``cache``,
        which must be the one that filled the prefix (``check_model``); the filling model's weights
        are checked unchanged either way."""
        if not isinstance(cache, KVCache):
            raise BadType(
                f"cache must be a KVCache (batch 1), got {type(cache).__name__}", arg="cache"
            )
        n = self.reusable(prompt)
        src = self.cache.k[0]
        if cache.dtype != src.dtype or cache.k[0].device != src.device:
            raise BadValue(
                f"the cache computes in {cache.dtype} on {cache.k[0].device}, the prefix was "
                f"computed in {src.dtype} on {src.device}: build the PrefixCache from the model "
                "that uses the cache",
                arg="cache",
            )
        if (
            cache.batch_size != 1
            or len(cache.k) != len(self.cache.k)
            or cache.k[0].shape[1::2] != src.shape[1::2]
        ):
            raise BadValue(
                f"cannot copy a prefix cache of shape {tuple(src.shape)} per layer into one of "
                f"{tuple(cache.k[0].shape)}: it must be batch 1, with the same layers, KV heads "
                "and head size",
                arg="cache",
            )
        if cache.max_len < n:
            raise ContextFull(
                f"the cache holds {cache.max_len} positions, the reusable prefix {n}", arg="cache"
            )
        self.check_model(model)
        for layer, (k, v) in enumerate(zip(self.cache.k, self.cache.v, strict=True)):
            cache.update(layer, 0, k[:, :, :n], v[:, :, :n])  # (an Int8KVCache quantizes them)
        cache.length = n
        cache.record(0, self.tokens[:n])  # which tokens those positions hold (generate checks them)
        return n

    def cache_for(self, prompt: str | Sequence[int], max_new_tokens: int, *, model=None) -> KVCache:
        """A fresh cache for one request (``generate(model, ..., cache=...)``), the prefix already
        in it.

        It holds prompt + ``max_new_tokens`` - 1 positions, checked against the model's window.
        ``model``: the model ``generate`` will run, checked to be the one that filled the prefix
        (``check_model``).
        """
        ids = prompt_ids(prompt)
        # the model's window and vocabulary
        check_prompt(SimpleNamespace(config=self.config), ids, max_new_tokens)
        src = self.cache.k[0]
        _, h, _, d = src.shape
        cache = KVCache(
            len(self.cache.k), 1, h, len(ids) + max_new_tokens - 1, d, src.dtype, src.device
        )
        self.copy_into(cache, ids, model=model)
        return cache


def weights_fingerprint(model: torch.nn.Module) -> tuple:
    """What changes when ``model``'s weights do, read without touching their values: each
    parameter's and buffer's name, storage address, shape, dtype, device and version counter (which
    every in-place write through autograd's view of it bumps: ``load_state_dict``, an optimizer
    step, ``with torch.no_grad(): w.add_``). A write through ``w.data`` bypasses the version
    counter, as it bypasses autograd: it goes unseen."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return tuple(
        (name, t.data_ptr(), tuple(t.shape), t.dtype, t.device, t._version) for name, t in tensors
    )
