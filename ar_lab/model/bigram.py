"""A count-based bigram model: the simplest autoregressive language model.

p(next | context) is estimated from how often each byte follows the previous one in
the corpus (with add-alpha smoothing), ignoring everything earlier. It has the same
interface as ``GPT`` (``config``, ``forward(idx, cache)`` -> logits), so the same
decode loop runs it, and chapter 07 can use it as a (weak, nearly free) draft model.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.model.cache import KVCache
from ar_lab.model.gpt import GPTConfig
from ar_lab.model.tokenizer import VOCAB_SIZE


def bigram_counts(tokens: torch.Tensor, vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    """counts[a, b] = how many times token b directly follows token a. Shape (V, V)."""
    if (
        not isinstance(tokens, torch.Tensor)
        or tokens.dtype.is_floating_point
        or tokens.dtype == torch.bool
    ):
        raise BadType(
            "tokens must be an integer tensor of token ids (e.g. "
            "ar_lab.model.data.corpus_tokens())",
            arg="tokens",
        )
    if tokens.ndim != 1 or len(tokens) < 2:
        raise BadValue("need a 1-D tensor of at least 2 tokens to count bigrams", arg="tokens")
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        bad = int(tokens.min()) if int(tokens.min()) < 0 else int(tokens.max())
        raise BadValue(
            f"tokens: token id {bad} is outside the vocabulary [0, {vocab_size - 1}]", arg="tokens"
        )
    pairs = tokens[:-1] * vocab_size + tokens[1:]
    return torch.bincount(pairs, minlength=vocab_size * vocab_size).reshape(vocab_size, vocab_size)


class BigramModel(nn.Module):
    def __init__(
        self, counts: torch.Tensor, smoothing: float = 0.1, block_size: int = 1024
    ) -> None:
        super().__init__()
        if (
            isinstance(smoothing, bool)
            or not isinstance(smoothing, (int, float))
            or not 0 <= smoothing < math.inf
        ):
            raise BadValue(
                f"smoothing must be a finite number >= 0 (add-alpha counts), got {smoothing!r}",
                arg="smoothing",
            )
        if not isinstance(counts, torch.Tensor) or counts.ndim != 2:
            raise BadType(
                "counts must be a (V, V) tensor of bigram counts (see bigram_counts)", arg="counts"
            )
        V = counts.shape[0]
        if counts.shape != (V, V):
            raise BadValue(f"counts must be square (V, V), got {tuple(counts.shape)}", arg="counts")
        probs = (counts.double() + smoothing) / (counts.double() + smoothing).sum(-1, keepdim=True)
        # Rows with no counts and no smoothing would be 0/0: make them uniform.
        probs = torch.nan_to_num(probs, nan=1.0 / V)
        self.log_probs = nn.Parameter(probs.log().float(), requires_grad=False)  # (V, V)
        self.config = GPTConfig(vocab_size=V, block_size=block_size, n_layer=1, n_head=1, n_embd=1)

    @classmethod
    def from_tokens(
        cls, tokens: torch.Tensor, smoothing: float = 0.1, block_size: int = 1024
    ) -> BigramModel:
        return cls(bigram_counts(tokens), smoothing, block_size)

    @property
    def device(self) -> torch.device:
        return self.log_probs.device

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Log-probabilities (B, T, V): row t depends only on token t (the previous byte)."""
        start = 0 if cache is None else cache.length
        if start + idx.shape[1] > self.config.block_size:
            raise ContextFull(
                f"{start + idx.shape[1]} positions exceed the context window of "
                f"{self.config.block_size}; shorten the prompt (idx)",
                arg="idx",
            )
        if cache is not None:
            cache.length = start + idx.shape[1]  # nothing to cache: only the last token matters
        return self.log_probs[idx]
