"""Prefix (prompt) caching: the keys/values of a shared static prefix, computed once (chapter 08).

Many requests start with the same tokens (a long system prompt, a document under
discussion). Keys and values of a position depend only on the tokens up to it, so the
prefix's can be computed once and copied into each request's own cache; its prefill then
processes only the rest of the prompt. The outputs are those without reuse (up to float
rounding); only the time to first token changes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import SimpleNamespace

import torch

from ar_lab.base.timing import synchronize
from ar_lab.engine.decoder import decoder_for
from ar_lab.engine.prompts import check_prompt, prompt_ids
from ar_lab.model.cache import KVCache, reusable_length  # reusable_length: re-exported for chapter 08
from ar_lab.model.inference import inference


class PrefixCache:
    """The keys/values of a shared static prefix (e.g. a long system prompt), computed once.

    ``copy_into(cache, prompt)`` puts the reusable part into a request's own cache (what
    ``serve(..., prefix=...)`` does for every request it admits); ``cache_for`` makes a fresh
    cache for ``generate(..., cache=...)`` with it already in.
    """

    def __init__(self, model, prefix: str | Sequence[int]) -> None:
        self.tokens = prompt_ids(prefix)
        if len(self.tokens) > model.config.block_size:
            raise ValueError(
                f"the prefix has {len(self.tokens)} tokens but the context window holds {model.config.block_size}"
            )
        self.config = model.config
        self.cache = KVCache.for_model(model, max_len=len(self.tokens))
        with inference(model):
            t0 = time.perf_counter()
            decoder_for(model).prefill(torch.tensor([self.tokens], device=model.device), self.cache)
            synchronize(model.device)
            self.build_time = time.perf_counter() - t0  # paid once, not per request

    def __len__(self) -> int:
        return len(self.tokens)

    def reusable(self, prompt: str | Sequence[int]) -> int:
        return reusable_length(self.tokens, prompt_ids(prompt))

    def copy_into(self, cache: KVCache, prompt: str | Sequence[int]) -> int:
        """Copy the reusable keys/values into ``cache`` (batch 1); returns how many positions."""
        n = self.reusable(prompt)
        src = self.cache.k[0]
        if cache.batch_size != 1 or len(cache.k) != len(self.cache.k) or cache.k[0].shape[1::2] != src.shape[1::2]:
            raise ValueError(
                f"cannot copy a prefix cache of shape {tuple(src.shape)} per layer into one of "
                f"{tuple(cache.k[0].shape)}: it must be batch 1, with the same layers, KV heads and head size"
            )
        if cache.max_len < n:
            raise ValueError(f"the cache holds {cache.max_len} positions, the reusable prefix {n}")
        for dst, s in zip(cache.k + cache.v, self.cache.k + self.cache.v, strict=True):
            dst[:, :, :n] = s[:, :, :n]
        cache.length = n
        cache.record(0, self.tokens[:n])  # which tokens those positions hold (generate checks them)
        return n

    def cache_for(self, prompt: str | Sequence[int], max_new_tokens: int) -> KVCache:
        """A fresh cache for one request (``generate(..., cache=...)``), the prefix already in it.

        It holds prompt + ``max_new_tokens`` - 1 positions, checked against the model's window.
        """
        ids = prompt_ids(prompt)
        check_prompt(SimpleNamespace(config=self.config), ids, max_new_tokens)  # the model's window and vocabulary
        src = self.cache.k[0]
        _, h, _, d = src.shape
        cache = KVCache(len(self.cache.k), 1, h, len(ids) + max_new_tokens - 1, d, src.dtype, src.device)
        self.copy_into(cache, ids)
        return cache
