"""From logits to the next token: greedy, temperature, top-k, top-p, min-p, penalties.

One documented order, applied by ``probabilities``:

1. repetition penalty on the raw logits (each distinct token in ``history`` once;
   ``generate`` passes prompt + generated tokens, so the prompt counts);
2. temperature (divide by T; T below ``GREEDY_EPS`` means greedy);
3. truncation: top-k, then top-p on what is left, then min-p;
4. softmax in float32 -> the exact distribution the token is drawn from.

The model's forward pass is the same whatever the strategy: only the pick changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-5  # temperatures below this are treated as 0, i.e. greedy (no division by ~0)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int | None = None  # None: no top-k; k larger than the vocabulary keeps all
    top_p: float = 1.0  # 1.0 keeps everything
    min_p: float = 0.0  # 0.0 keeps everything
    repetition_penalty: float = 1.0  # 1.0: no penalty

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or t != t or t < 0 or t == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if self.top_k is not None and (
            not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1
        ):
            raise ValueError(f"top_k must be an int >= 1 or None, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        r = self.repetition_penalty
        if not isinstance(r, (int, float)) or not 0.0 < r < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


GREEDY = SamplingParams(temperature=0.0)


def apply_repetition_penalty(logits: torch.Tensor, history: Iterable[int], penalty: float) -> torch.Tensor:
    """Make already-seen tokens less likely: positive logits / penalty, negative x penalty."""
    if penalty == 1.0:
        return logits
    seen = sorted(set(int(t) for t in history))
    if not seen:
        return logits
    idx = torch.tensor(seen, device=logits.device)
    out = logits.clone()
    sel = out[..., idx]
    out[..., idx] = torch.where(sel > 0, sel / penalty, sel * penalty)
    return out


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits (and any tied with the k-th); the rest become -inf."""
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches p.

    The token whose probability makes the running sum cross p is kept, and so is the
    most likely token always; p = 1 keeps everything.
    """
    if p >= 1.0:
        return logits
    probs = torch.softmax(logits.float(), dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly more likely tokens
    drop_sorted = mass_before >= p  # the first token has mass_before 0 < p: always kept
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens with probability >= min_p x (probability of the most likely token)."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits.float(), dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def _check_logits(logits: torch.Tensor) -> None:
    if logits.ndim not in (1, 2):
        raise ValueError(f"logits must have shape (vocab,) or (batch, vocab), got {tuple(logits.shape)}")
    if torch.isnan(logits).any():
        raise ValueError("logits contain NaN; the model output is broken (check its inputs and weights)")
    if torch.isneginf(logits).all(dim=-1).any():
        raise ValueError("every logit is -inf: no token can be picked")


def probabilities(
    logits: torch.Tensor, params: SamplingParams = SamplingParams(), history: Iterable[int] = ()
) -> torch.Tensor:
    """The exact float32 distribution a token is drawn from, (vocab,) or (batch, vocab)."""
    _check_logits(logits)
    x = apply_repetition_penalty(logits.float(), history, params.repetition_penalty)
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(dim=-1), x.shape[-1]).float()
    x = x / params.temperature
    if params.top_k is not None:
        x = filter_top_k(x, params.top_k)
    x = filter_top_p(x, params.top_p)
    x = filter_min_p(x, params.min_p)
    return torch.softmax(x, dim=-1)


def sample(
    logits: torch.Tensor,
    params: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    history: Iterable[int] = (),
) -> torch.Tensor:
    """Pick token ids: shape () for logits (vocab,), (batch,) for (batch, vocab)."""
    if params.greedy and params.repetition_penalty == 1.0:
        _check_logits(logits)
        return logits.argmax(dim=-1)
    probs = probabilities(logits, params, history)
    if params.greedy:
        return probs.argmax(dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    picked = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return picked.reshape(probs.shape[:-1])
