"""One evaluation protocol for every loss the course reports.

``COURSE_EVAL`` ("val-1024") is the protocol of the README, the checkpoint records, chapters 01, 03
and 09 and ``python -m ar_lab.bench quant``: the validation split of the built-in corpus (its last
10 %, never trained on) cut into consecutive windows of 1,024 tokens from its start, every position
of every whole window predicted once, given the window's earlier tokens. It reports the mean
cross-entropy over all those positions in nats per byte (the tokenizer is byte-level; the EOS
between documents counts as one byte) and in bits per byte (nats / ln 2), and the mean loss at each
position of the window across windows (the loss-by-position curve chapter 03b plots). Nothing is
random: the same model gives the same figures on every machine, up to float rounding.

A protocol with ``windows`` set reads only the first that many windows: a cheaper figure under its
own name, never to be compared with the whole protocol's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.model.data import corpus_tokens, train_val_split
from ar_lab.model.gpt import checked_model


@dataclass(frozen=True)
class EvalProtocol:
    """Consecutive ``window``-token windows of the validation split; ``windows``: the first N only
    (None: all)."""

    name: str
    window: int
    windows: int | None = None

    def __post_init__(self) -> None:
        positive_int("window", self.window, minimum=2)
        if self.windows is not None:
            positive_int("windows", self.windows)

    def first(self, windows: int) -> EvalProtocol:
        """The same windows, only the first ``windows`` of them, under a name that says so."""
        positive_int("windows", windows)
        return EvalProtocol(f"{self.name}, first {windows}", self.window, windows)

    def describe(self, tokens: torch.Tensor | None = None) -> str:
        n = whole_windows(self, validation_tokens() if tokens is None else tokens)
        return (
            f"{self.name}: the validation split in consecutive {self.window:,}-token windows, "
            f"every position predicted once ({n} windows, {n * self.window:,} positions); mean "
            "nats per byte, bits = nats / ln 2"
        )


COURSE_EVAL = EvalProtocol("val-1024", 1024)


def protocol_for(block_size: int) -> EvalProtocol:
    """``COURSE_EVAL`` for a model whose context holds its window; the same protocol at the model's
    context, under its own name, for a shorter one (a test's tiny model, a learner's own preset)."""
    positive_int("block_size", block_size, minimum=2)
    return (
        COURSE_EVAL
        if block_size >= COURSE_EVAL.window
        else EvalProtocol(f"val-{block_size}", block_size)
    )


@dataclass(frozen=True)
class EvalResult:
    """A model's loss under ``protocol``: the mean over every position, and the mean at each
    position."""

    protocol: EvalProtocol
    nats: float
    by_position: tuple[float, ...]  # mean nats at positions 0 .. window - 1, over the windows
    windows: int

    @property
    def bits(self) -> float:
        return self.nats / math.log(2)

    @property
    def positions(self) -> int:
        return self.windows * self.protocol.window

    def span(self, start: int, stop: int) -> float:
        """Mean nats at positions ``start`` .. ``stop`` - 1 of the window."""
        if not 0 <= start < stop <= self.protocol.window:
            arg = "start" if not 0 <= start < self.protocol.window else "stop"
            raise BadValue(
                f"need 0 <= start < stop <= {self.protocol.window}, got {start}, {stop}", arg=arg
            )
        return sum(self.by_position[start:stop]) / (stop - start)


def validation_tokens() -> torch.Tensor:
    """The built-in corpus' validation split (its last 10 %)."""
    return train_val_split(corpus_tokens())[1]


def whole_windows(protocol: EvalProtocol, tokens: torch.Tensor) -> int:
    """How many windows the protocol reads from ``tokens`` (each needs window + 1 tokens: inputs and
    targets)."""
    n = (len(tokens) - 1) // protocol.window
    return n if protocol.windows is None else min(n, protocol.windows)


def evaluate_protocol(
    model,
    protocol: EvalProtocol = COURSE_EVAL,
    tokens: torch.Tensor | None = None,
    *,
    batch_size: int = 8,
) -> EvalResult:
    """``model``'s loss under ``protocol`` on ``tokens`` (default: the built-in validation
    split)."""
    checked_model(model)
    if not isinstance(protocol, EvalProtocol):
        raise BadType(
            f"protocol must be an EvalProtocol (e.g. COURSE_EVAL), got {type(protocol).__name__}",
            arg="protocol",
        )
    positive_int("batch_size", batch_size)
    if protocol.window > model.config.block_size:
        raise ContextFull(
            f"the protocol's window ({protocol.window:,}) exceeds the model's context window "
            f"({model.config.block_size:,}): choose an EvalProtocol with a window of at most that",
            arg="protocol",
        )
    tokens = validation_tokens() if tokens is None else tokens
    n = whole_windows(protocol, tokens)
    if n < 1:
        raise BadValue(
            f"{len(tokens):,} tokens hold no whole {protocol.window:,}-token window (need window "
            "+ 1)",
            arg="tokens",
        )
    w = protocol.window
    x, y = tokens[: n * w].view(n, w), tokens[1 : n * w + 1].view(n, w)
    total = torch.zeros(w, dtype=torch.float64)
    # evaluated in eval mode, then put back as it was
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.inference_mode():
            for i in range(0, n, batch_size):
                xb, yb = (
                    x[i : i + batch_size].to(model.device),
                    y[i : i + batch_size].to(model.device),
                )
                logits = model(xb).float()
                loss = F.cross_entropy(logits.flatten(0, 1), yb.flatten(), reduction="none").view(
                    len(xb), w
                )
                total += loss.sum(0).double().cpu()
    finally:
        for m, training in flags:
            m.training = training
    by_position = total / n
    return EvalResult(protocol, float(by_position.mean()), tuple(by_position.tolist()), n)
