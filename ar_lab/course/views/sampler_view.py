"""What the chapter-06 sampler explorer shows for one setting: the model's distribution before and
after the sampler, and a few continuations drawn in one batch (a pure function of its arguments)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ar_lab.base.args import check_seed
from ar_lab.base.errors import BadValue
from ar_lab.engine.generate import check_sampling, sample_rows
from ar_lab.engine.prompts import check_prompt, prompt_ids
from ar_lab.engine.sampling import (
    Sampler,
    SamplingParams,
    check_sampler,
    entropy_bits,
    probabilities,
)
from ar_lab.model.inference import inference
from ar_lab.model.tokenizer import decode

# --- what the chapter-06 explorer shows ----------------------------------------------


@dataclass
class SamplerView:
    """One state of the sampler explorer: the distribution before and after, and samples."""

    prompt: str
    params: SamplingParams
    seed: int
    before: torch.Tensor  # (vocab,) the model's own next-token distribution (T = 1, no filters)
    after: torch.Tensor  # (vocab,) the distribution the sampler draws from
    continuations: list[str] = field(default_factory=list)

    @property
    def kept(self) -> torch.Tensor:
        """(vocab,) bool: tokens the sampler can pick."""
        return self.after > 0

    @property
    def n_kept(self) -> int:
        return int(self.kept.sum())

    @property
    def kept_mass(self) -> float:
        """How much of the model's own probability the kept set holds."""
        return float(self.before[self.kept].sum())

    @property
    def entropy_before(self) -> float:
        return float(entropy_bits(self.before))

    @property
    def entropy_after(self) -> float:
        return float(entropy_bits(self.after))


def sampler_view(
    model,
    prompt: str,
    params: SamplingParams,
    *,
    seed: int = 0,
    n_samples: int = 4,
    max_new_tokens: int = 40,
    sampler: Sampler | None = None,
) -> SamplerView:
    """Everything the explorer draws for one setting (a pure function of its arguments).

    ``n_samples`` continuations are drawn in one batch from a generator seeded with
    ``seed``, so the same arguments always give the same view. A prompt longer than the
    context window keeps its end: that is what predicts the next token. ``sampler``: a function that
    picks each token of the continuations instead of ``sample`` (``ar_lab.engine.sampling.Sampler``:
    the learner's, in chapter 06); the distribution shown is ``probabilities``'.
    """
    if not isinstance(prompt, str) or not prompt:
        raise BadValue("the prompt is empty: type at least one character", arg="prompt")
    if not isinstance(n_samples, int) or isinstance(n_samples, bool) or n_samples < 0:
        raise BadValue(f"n_samples must be an int >= 0, got {n_samples!r}", arg="n_samples")
    if (
        not isinstance(max_new_tokens, int)
        or isinstance(max_new_tokens, bool)
        or max_new_tokens < 0
    ):
        raise BadValue(
            f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}", arg="max_new_tokens"
        )
    check_sampling(params, "params")
    check_sampler(sampler)
    check_seed(seed)
    window = model.config.block_size
    ids = prompt_ids(prompt)[-window:]
    check_prompt(model, ids, 1)
    with inference(model):
        logits = model(torch.tensor([ids], device=model.device))[0, -1].float()  # (vocab,)
    history = ids if params.repetition_penalty != 1.0 else ()
    before = torch.softmax(logits, dim=-1)
    after = probabilities(logits, params, history)
    texts = []
    if n_samples and max_new_tokens:
        max_new = min(max_new_tokens, window - len(ids) + 1)
        g = torch.Generator(device=model.device).manual_seed(int(seed))
        # (n_samples, P)
        idx = torch.tensor([ids] * n_samples, dtype=torch.long, device=model.device)
        rows = sample_rows(model, idx, max_new, params, g, use_cache=True, sampler=sampler).tolist()
        texts = [decode(r) for r in rows]
    return SamplerView(prompt, params, int(seed), before.cpu(), after.cpu(), texts)


def named_samplers(samplers) -> dict:
    """The explorer's choice of samplers: None (ar_lab's only) or a non-empty dict of name ->
    ``Sampler``."""
    if samplers is None:
        return {}
    if not isinstance(samplers, dict) or not samplers:
        raise BadValue(
            "samplers must be a dict naming at least one sampler, e.g. {'ar_lab': sample}",
            arg="samplers",
        )
    for fn in samplers.values():
        check_sampler(fn)
    return dict(samplers)
