"""Drafts without a draft model: prompt lookup decoding.

Speculative decoding needs proposals, not necessarily a second network. When the text being
written repeats text already in the context (editing code, quoting or summarising a passage,
filling in a template), the context itself predicts the next tokens: find an earlier place where
the last few tokens occurred, and propose the tokens that followed them there. Saxena's prompt
lookup decoding (2023) does exactly this, and ``transformers`` ships it as
``generate(..., prompt_lookup_num_tokens=k)``. The target verifies the proposals as it verifies a
draft model's (``ar_lab.engine.speculative``), so the output is unchanged: token for token under
greedy settings in exact arithmetic (a bf16 verify pass on a GPU can flip near-tied argmaxes), in
distribution when sampling (a deterministic proposal is a draft distribution q
that puts all its mass on one token; accepting it with probability min(1, p(x) / q(x)) = p(x) and
otherwise drawing from norm(max(0, p - q)) is the same exact rule).

A *proposer* is any function ``(tokens, k) -> list of at most k token ids``;
``speculative_generate`` takes one where it takes a draft model. ``PromptLookup`` is the n-gram one,
with the match rule of ``transformers``' prompt lookup: n from ``max_ngram`` down to ``min_ngram``,
the earliest earlier occurrence of the last n tokens that has at least one token after it, and up to
k of the tokens that follow it (never past the end of the text). ``transformers`` has no
``min_ngram`` (it goes down to 1), its default n is 2 (this default, 3, is Saxena's), and it also
cuts a proposal at EOS and at tokens its logits processors forbid.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadType, BadValue

Proposer = Callable[[list[int], int], Sequence[int]]


@dataclass(frozen=True)
class PromptLookup:
    """Propose the continuation of the earliest earlier match of the text's last n tokens."""

    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        positive_int("max_ngram", self.max_ngram)
        positive_int("min_ngram", self.min_ngram)
        if self.min_ngram > self.max_ngram:
            raise BadValue(
                f"min_ngram ({self.min_ngram}) must be at most max_ngram ({self.max_ngram})",
                arg="min_ngram",
            )

    @property
    def name(self) -> str:
        return f"prompt lookup (n-grams {self.max_ngram}..{self.min_ngram})"

    def __call__(self, tokens: Sequence[int], k: int) -> list[int]:
        return prompt_lookup(tokens, k, self.max_ngram, self.min_ngram)


def prompt_lookup(
    tokens: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1
) -> list[int]:
    """Up to ``k`` tokens that followed the earliest earlier occurrence of the last n tokens of
    ``tokens``, trying n = ``max_ngram`` down to ``min_ngram``; ``[]`` when no such occurrence
    exists (or k = 0)."""
    positive_int("k", k, minimum=0)
    tokens = list(tokens)
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        tail = tokens[length - n :]
        # an occurrence that ends before the text does: a token follows it
        for start in range(0, length - n):
            if tokens[start : start + n] == tail:
                follow = start + n
                return tokens[follow : min(follow + k, length)]
    return []


def is_proposer(draft) -> bool:
    """True for a proposer function (anything callable that is not a model)."""
    return callable(draft) and not isinstance(draft, torch.nn.Module)


def checked_proposal(proposal, k: int, vocab_size: int) -> list[int]:
    """A proposer's answer as a list of token ids, or a TypeError/ValueError saying what is wrong
    with it."""
    if isinstance(proposal, (str, bytes)) or not isinstance(proposal, Sequence):
        raise BadType(
            f"a proposer (draft) must return a list of token ids, got {type(proposal).__name__}",
            arg="draft",
        )
    ids = list(proposal)
    if len(ids) > k:
        raise BadValue(
            f"a proposer (draft) asked for at most {k} tokens returned {len(ids)}", arg="draft"
        )
    for x in ids:
        if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < vocab_size:
            raise BadValue(
                f"a proposer (draft) returned {x!r}: token ids are ints in [0, {vocab_size})",
                arg="draft",
            )
    return ids
