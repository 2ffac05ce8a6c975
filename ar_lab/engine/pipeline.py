"""The logits pipeline: the step from a model's logits to token ids, built once per call and run by
every loop.

``LogitsPipeline(params, sampler=None)`` is ``ar_lab.engine.sampling``'s chain (repetition penalty
-> temperature and filters -> pick) as one object, or, after the penalty, a ``sampler`` of one's own
(``pick`` calls it row by row and checks each answer). ``generate``/``stream``/``token_steps``,
``sample_batch``, ``serve`` and speculative decoding all pick through it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch

from ar_lab.base.errors import BadValue
from ar_lab.engine.sampling import (
    Sampler,
    SamplingParams,
    apply_repetition_penalty,
    check_sampler,
    check_sampling,
    choose,
    logits_error,
    probabilities,
    processed_logits,
)


def pick(
    sampler: Sampler,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    history: Iterable[int] | torch.Tensor = (),
) -> torch.Tensor:
    """The token ids ``sampler`` picks, as ``sample`` returns them: () for logits (vocab,), (batch,)
    for (batch, vocab). The repetition penalty is applied first (step 1, with ``history``); then
    ``sampler`` is called on each row in order, with ``params`` and the one ``generator``. A sampler
    that returns anything but a token id of this vocabulary raises a ``ValueError`` saying what it
    returned."""
    x = apply_repetition_penalty(logits.float(), history, params.repetition_penalty)
    if not torch.isfinite(x.amax(dim=-1)).all():
        raise logits_error(logits, x)
    V = x.shape[-1]
    ids = [_token_id(sampler(row, params, generator), V) for row in (x if x.ndim == 2 else x[None])]
    out = torch.tensor(ids, dtype=torch.long, device=logits.device)
    return out if x.ndim == 2 else out[0]


class LogitsPipeline:
    """The step from a model's logits to token ids, built once per call from checked settings and
    run by every loop that picks tokens (``generate``/``stream``/``token_steps``, ``sample_batch``,
    ``serve``, speculative decoding): repetition penalty -> temperature and filters -> pick, or
    after the penalty the ``sampler`` of one's own. A grammar's mask (``constrained.masked_logits``)
    is the loop's to apply first: it needs the sequence's state. Greedy without a penalty or a
    sampler of one's own is the argmax of the logits, taken directly (``argmax_only``: no
    distribution built); a winner that is not finite (NaN, inf, or every logit -inf) goes through
    ``sample``, which raises the error that says which."""

    def __init__(self, params: SamplingParams, sampler: Sampler | None = None) -> None:
        check_sampling(params)
        check_sampler(sampler)
        self.params, self.sampler = params, sampler
        self.argmax_only = sampler is None and params.greedy and params.repetition_penalty == 1.0

    def __call__(
        self,
        logits: torch.Tensor,
        generator: torch.Generator | None = None,
        history: Iterable[int] | torch.Tensor = (),
    ) -> torch.Tensor:
        """Token ids: shape () for logits (vocab,), (batch,) for (batch, vocab); ``history`` as
        ``sample`` takes it (a list of ids, or a bool mask (batch, vocab) of the ids each row has
        seen)."""
        if self.argmax_only:
            ids = logits.argmax(dim=-1)
            if bool(torch.isfinite(logits.gather(-1, ids.unsqueeze(-1))).all()):
                return ids
        if self.sampler is None:
            return choose(processed_logits(logits, self.params, history), self.params, generator)
        return pick(self.sampler, logits, self.params, generator, history)

    def rows(
        self,
        logits: torch.Tensor,
        generators: list[torch.Generator | None],
        histories: list | None = None,
    ) -> list[int]:
        """One token per row of logits (rows, vocab), row i drawing with ``generators[i]`` (a
        serving batch: each request its own seed). The penalty, temperature and filters run once for
        the whole batch; only the draws are per row. ``histories``: each row's seen ids (for the
        repetition penalty), or None."""
        if self.argmax_only:
            return self(logits).tolist()
        if self.sampler is not None:
            return [
                int(self(row, g, h))
                for row, g, h in zip(
                    logits, generators, histories or [()] * len(logits), strict=True
                )
            ]
        seen = None
        if histories is not None:
            seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
            for i, h in enumerate(histories):
                seen[i, list(h)] = True
        x = processed_logits(logits, self.params, () if seen is None else seen)
        return [int(choose(row, self.params, g)) for row, g in zip(x, generators, strict=True)]

    def one(
        self, logits: torch.Tensor, generator: torch.Generator | None = None, history=()
    ) -> int:
        """The token id for one row of logits (vocab,): the per-step call of a batch-1 loop."""
        if self.argmax_only:
            token = int(logits.argmax())
            if math.isfinite(logits[token]):
                return token
        return int(self(logits, generator, history))

    def probabilities(
        self, logits: torch.Tensor, history: Iterable[int] | torch.Tensor = ()
    ) -> torch.Tensor:
        """The distribution a token is drawn from (``probabilities``): what speculative decoding
        compares. A ``sampler`` of one's own picks a token and has no distribution to give."""
        if self.sampler is not None:
            raise BadValue(
                "a sampler of one's own picks tokens; speculative decoding needs the distribution "
                "(give sampling=SamplingParams(...) instead)",
                arg="sampler",
            )
        return probabilities(logits, self.params, history)


def _token_id(picked, V: int) -> int:
    if isinstance(picked, torch.Tensor) and picked.numel() == 1 and not picked.is_floating_point():
        picked = picked.item()
    if isinstance(picked, bool) or not isinstance(picked, numbers.Integral) or not 0 <= picked < V:
        raise BadValue(
            f"the sampler returned {picked!r}: it must return one token id, an int in [0, {V - 1}]",
            arg="sampler",
        )
    return int(picked)
