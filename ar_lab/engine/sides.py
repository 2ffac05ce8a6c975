"""The two sides of a speculative iteration: each model with its cache, fed at implicit positions.

``speculative_generate`` (``ar_lab.engine.speculative``) hands an iteration, its own
(``speculative_iteration``) or chapter 07's learner's, a ``Side`` per model (``ProposerSide`` for a
proposer function such as ``PromptLookup``), ``Distributions`` for the call's sampling settings and
``accept.Accept``, the accept rule with the uniforms drawn. An iteration feeds each side what its
cache lacks, lets the rule decide and rolls both caches back with ``truncate``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from ar_lab.base.errors import BadType, BadValue
from ar_lab.base.timing import synchronize
from ar_lab.engine.lookup import checked_proposal
from ar_lab.engine.pipeline import LogitsPipeline
from ar_lab.engine.sampling import SamplingParams
from ar_lab.model.cache import KVCache


class Side:
    """One model and its KV cache, fed at *implicit* positions: what a speculative iteration drives.

    ``feed(tokens)`` runs ``tokens`` at positions ``length``, ``length + 1``, ... through the
    model's decoder (``ar_lab.engine.decoder``: after the prompt, the lean engine's step for one
    token and its ``extend`` for several, the target's verify pass) and returns their logits (T,
    vocab): row i is the model's next-token logits after ``tokens[i]``. ``truncate(n)`` keeps the
    cache's first n positions (rolling back rejected drafts); ``length`` is how many it holds. A
    side starts holding ``prompt`` (the text's tokens but its last), read by its first pass together
    with what that pass feeds (one forward pass over the prompt, as ``generate``'s first step). A
    side counts its passes and positions for the loop's stats; the loop also notes when the target's
    first pass of an iteration starts (``started``), which splits the iteration's time into the
    draft's and the target's.
    """

    def __init__(
        self, model, cache: KVCache, decoder, clock, name: str, prompt: Sequence[int] = ()
    ) -> None:
        self.model, self.cache, self.decoder, self.clock, self.name = (
            model,
            cache,
            decoder,
            clock,
            name,
        )
        self.pending = list(prompt)  # held, not yet read: the first pass reads them
        self.vocab_size = model.config.vocab_size
        self.calls = self.positions = 0
        # the clock when this iteration's first pass began (after a sync)
        self.started: float | None = None

    @property
    def length(self) -> int:
        """Positions the cache holds: the next ``feed`` starts here."""
        return self.cache.length + len(self.pending)

    def feed(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits (T, vocab) of ``tokens`` fed at positions length .. length + T - 1; the cache
        grows by T."""
        tokens = checked_tokens(f"{self.name}.feed(tokens)", tokens, self.vocab_size)
        if not tokens:
            raise BadValue(
                f"{self.name}.feed(tokens) got no tokens: its cache holds {self.length} "
                "positions; after an iteration it holds at most the text minus its last token "
                "(roll back: truncate)",
                arg="tokens",
            )
        if self.started is None and self.name == "target":
            synchronize(self.model.device)
            self.started = self.clock()
        fed, self.pending = self.pending + tokens, []
        # (T, vocab)
        logits = self.decoder.extend(fed, self.cache, self.cache.length)[-len(tokens) :]
        self.calls += 1
        self.positions += len(fed)
        return logits

    @property
    def token_ids(self) -> list[int] | None:
        """The token ids at positions 0 .. length - 1 (the cache's and those still pending), or None
        if unknown."""
        held = self.cache.token_ids
        return None if held is None else held + self.pending

    def truncate(self, n: int) -> None:
        """Keep the cache's first ``n`` positions (0 <= n <= length): drop what was fed after
        them."""
        if self.pending:
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.length:
                raise BadValue(
                    f"n must be an int: can truncate to 0..{self.length} positions, got {n!r}",
                    arg="n",
                )
            del self.pending[n:]
            return
        self.cache.truncate(n)

    def __repr__(self) -> str:
        return f"<{self.name}: {type(self.model).__name__}, cache length {self.length}>"


class ProposerSide:
    """A proposer function (``lookup.PromptLookup``: tokens so far, k -> at most k ids) in the
    draft's place: no model and no cache (``length`` stays 0, ``truncate`` does nothing);
    ``propose(seq, k)`` asks it."""

    length = 0
    started = None

    def __init__(self, proposer, vocab_size: int) -> None:
        self.proposer, self.vocab_size = proposer, vocab_size
        self.calls = self.positions = self.proposed = 0

    def propose(self, seq: list[int], k: int) -> list[int]:
        drafts = checked_proposal(self.proposer(list(seq), k), k, self.vocab_size)
        self.calls += 1
        self.proposed += len(drafts)
        return drafts

    def feed(self, tokens) -> torch.Tensor:
        raise BadType(
            "this draft is a proposer function (tokens, k) -> token ids, not a model: call "
            "propose(seq, k)",
            arg="draft",
        )

    def truncate(self, n: int) -> None:
        pass


def checked_tokens(what: str, tokens, vocab_size: int, arg: str = "tokens") -> list[int]:
    """``tokens`` as a list of ints, or a BadType/BadValue naming ``what`` (a token id is an int in
    [0, V)); ``arg``: the argument at fault (``what`` must name it)."""
    if isinstance(tokens, (str, bytes, torch.Tensor)) or not isinstance(tokens, Sequence):
        raise BadType(
            f"{what}: tokens must be a list of token ids (ints), got {type(tokens).__name__}",
            arg=arg,
        )
    for x in tokens:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise BadType(
                f"{what}: a token id must be an int, got {x!r} ({type(x).__name__})", arg=arg
            )
        if not 0 <= x < vocab_size:
            raise BadValue(
                f"{what}: token id {x} is outside the vocabulary [0, {vocab_size})", arg=arg
            )
    return [int(x) for x in tokens]


class Distributions:
    """``probs(logits, tokens)``: the distributions tokens are drawn from under the call's
    ``SamplingParams``.

    ``logits`` (vocab,) or (T, vocab); ``tokens``: the text the logits were computed on, so the last
    row follows all of it and row i follows ``tokens[:len(tokens) - T + 1 + i]`` (what the
    repetition penalty reads). Greedy gives one-hot distributions; ``argmax_only`` says so (greedy,
    no penalty), and ``pick`` takes the argmax of each row directly, without building them (the
    package's iteration uses it).
    """

    def __init__(self, sampling: SamplingParams, vocab_size: int) -> None:
        self.pipeline, self.vocab_size = LogitsPipeline(sampling), vocab_size
        self.argmax_only = self.pipeline.argmax_only
        self.penalised = sampling.repetition_penalty != 1.0

    def __call__(self, logits: torch.Tensor, tokens: Sequence[int] = ()) -> torch.Tensor:
        if (
            not isinstance(logits, torch.Tensor)
            or logits.ndim not in (1, 2)
            or logits.shape[-1] != self.vocab_size
        ):
            raise BadType(
                "probs(logits, tokens): logits must be a tensor (vocab,) or (T, vocab) with "
                f"vocab = {self.vocab_size}, got {logits!r:.120}",
                arg="logits",
            )
        if not self.penalised:
            return self.pipeline.probabilities(logits)
        tokens = checked_tokens("probs(logits, tokens)", tokens, self.vocab_size)
        if logits.ndim == 1:
            return self.pipeline.probabilities(logits, tokens)
        T, base = logits.shape[0], len(tokens) - logits.shape[0] + 1
        if base < 0:
            raise BadValue(
                f"probs(logits, tokens): {T} rows of logits need the {T - 1}+ tokens they "
                f"follow, got {len(tokens)}",
                arg="tokens",
            )
        history = torch.zeros(T, self.vocab_size, dtype=torch.bool, device=logits.device)
        history[:, tokens[:base]] = True
        for i, x in enumerate(tokens[base:]):  # row i + 1 on has also seen tokens[base + i]
            history[i + 1 :, x] = True
        return self.pipeline.probabilities(logits, history)  # (T, vocab)

    def pick(self, logits: torch.Tensor) -> list[int]:
        """The greedy token of each row of logits (T, vocab) (``argmax_only`` settings)."""
        return self.pipeline(logits).tolist()


def checked_emitted(emitted, g: int, vocab_size: int) -> list[int]:
    """What an iteration returned, checked: a list of 1 to g + 1 token ids."""
    if isinstance(emitted, (str, bytes, torch.Tensor)) or not isinstance(emitted, Sequence):
        raise BadType(
            "an iteration must return the list of token ids it emits, got "
            f"{type(emitted).__name__}",
            arg="iteration",
        )
    if not 1 <= len(emitted) <= g + 1:
        raise BadValue(
            f"an iteration with gamma = {g} emits 1 to {g + 1} tokens (the accepted drafts and "
            "one of the target's: a correction, or the bonus after a full accept), got "
            f"{len(emitted)}",
            arg="iteration",
        )
    return checked_tokens("the iteration's tokens", emitted, vocab_size, arg="iteration")


class CacheMismatch(BadValue):
    """An iteration left a side's cache holding what the text does not: positions past the text
    minus its last token (a rollback forgotten, a bonus token fed but not emitted), or another token
    than the text's at some position (a token fed twice, or fed where another belongs). The next
    pass would attend to those keys and give a wrong text: ``speculative_generate`` stops
    instead."""


def check_rolled_back(side, text: list[int]) -> None:
    """Raise ``CacheMismatch`` unless ``side``'s cache holds a prefix of ``text`` minus its last
    token."""
    if isinstance(side, ProposerSide):
        return
    n, most = side.length, len(text) - 1
    if n > most:
        raise CacheMismatch(
            f"after the iteration the {side.name}'s cache holds {n} positions, but the text "
            f"minus its last token is {most} long: roll it back ({side.name}.truncate) so it "
            "drops what the text does not hold",
            arg="iteration",  # the iteration function left the cache so
        )
    held = side.token_ids
    if held is not None and held != text[:n]:
        i = next(i for i, (a, b) in enumerate(zip(held, text, strict=False)) if a != b)
        raise CacheMismatch(
            f"after the iteration the {side.name}'s cache holds token {held[i]} at position {i}, "
            f"where the text has {text[i]}: feed each side what its cache lacks, text[{side.name}"
            ".length:]",
            arg="iteration",
        )

