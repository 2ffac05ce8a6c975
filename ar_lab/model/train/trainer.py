"""The trainer: ``TrainConfig``, the learning-rate schedule (``lr_at``), ``evaluate``, the
optimizer, one step (``train_step``) and the loop (``train``), with distillation from a teacher."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.model.data import get_batch
from ar_lab.model.gpt import GPT, checked_model


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 8
    block_size: int = 256  # training window (<= the model's context window)
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1  # cosine decay ends at lr x this
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0  # max gradient norm; None: no clipping
    eval_every: int = 50
    eval_batches: int = 8
    seed: int = 1337
    # Distillation: the name of a shipped checkpoint ("course") whose next-token distributions the
    # model learns (forward KL to the teacher) instead of the text's one-hot next tokens.
    teacher: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "batch_size",
            "block_size",
            "eval_every",
            "eval_batches",
            "warmup_steps",
            "seed",
        ):
            value, low = getattr(self, name), 0 if name in ("warmup_steps", "seed") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise BadValue(
                    f"TrainConfig.{name} must be an int >= {low}, got {value!r}", arg=name
                )
        for name, ok, rule in [
            ("lr", lambda v: v > 0, "> 0"),
            ("min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("weight_decay", lambda v: v >= 0, ">= 0"),
            ("grad_clip", lambda v: v > 0, "> 0"),
        ]:
            value = getattr(self, name)
            if name == "grad_clip" and value is None:
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or not ok(value):
                raise BadValue(
                    f"TrainConfig.{name} must be a finite number {rule}, got {value!r}", arg=name
                )
        if self.teacher is not None and not isinstance(self.teacher, str):
            raise BadValue(
                f"teacher must be a checkpoint name such as 'course', got {self.teacher!r}",
                arg="teacher",
            )


@dataclass
class TrainResult:
    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    seconds: float = 0.0


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` x lr."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
    return tc.lr * (
        tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


def evaluate(
    model: GPT,
    tokens: torch.Tensor,
    block_size: int,
    batches: int = 8,
    batch_size: int = 8,
    seed: int = 0,
) -> float:
    """Mean next-token cross-entropy (nats) on random windows of ``tokens``, seeded."""
    checked_model(model)
    if not isinstance(batches, int) or isinstance(batches, bool) or batches < 1:
        raise BadValue(f"batches must be an int >= 1, got {batches!r}", arg="batches")
    if isinstance(block_size, int) and block_size > model.config.block_size:
        raise ContextFull(
            f"block_size {block_size} exceeds the model's context window {model.config.block_size}",
            arg="block_size",
        )
    g = torch.Generator().manual_seed(seed)
    losses = []
    # evaluated in eval mode, then put back as it was
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.inference_mode():
            for _ in range(batches):
                x, y = get_batch(tokens, batch_size, block_size, g)
                x, y = x.to(model.device), y.to(model.device)
                losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item())
    finally:
        for m, training in flags:
            m.training = training
    return sum(losses) / len(losses)


def make_optimizer(model: nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    """AdamW with two parameter groups: the matrices (2-D or more) decayed by ``tc.weight_decay``,
    the biases and LayerNorm parameters not; betas (0.9, 0.99). Chapter 03's learner writes the
    same."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": tc.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=tc.lr,
        betas=(0.9, 0.99),
    )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    lr: float,
    grad_clip: float | None,
    teacher: nn.Module | None = None,
) -> float:
    """One update on inputs ``x`` and next tokens ``y`` (B, T): set ``lr`` on every group, forward,
    loss, backward, clip the gradients' global norm to ``grad_clip`` (None: no clipping), step. The
    loss (nats, before the update): cross-entropy, or with a ``teacher`` the forward KL to its
    distributions."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    if teacher is None:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    else:
        with torch.no_grad():
            target_logp = F.log_softmax(teacher(x), -1).flatten(0, 1)  # (B T, V)
        logq = F.log_softmax(model(x), -1).flatten(0, 1)
        # mean over positions
        loss = F.kl_div(logq, target_logp, log_target=True, reduction="batchmean")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.item()


def _check_teacher(teacher, model: GPT, tc: TrainConfig) -> None:
    """A distillation teacher must be a model (not a name: ``load_pretrained(name)`` loads a
    shipped one) with the student's vocabulary and a context window the training windows fit."""
    checked_model(teacher, "teacher")
    if teacher.config.vocab_size != model.config.vocab_size:
        raise BadValue(
            f"teacher and model must share the vocabulary: {teacher.config.vocab_size} vs "
            f"{model.config.vocab_size}",
            arg="teacher",
        )
    if tc.block_size > teacher.config.block_size:
        raise ContextFull(
            f"training window {tc.block_size} (tc.block_size) exceeds the teacher's context "
            "window",
            arg="tc",
        )


def train(
    model: GPT,
    train_tokens: torch.Tensor,
    val_tokens: torch.Tensor,
    tc: TrainConfig = TrainConfig(),
    progress: bool = True,
    teacher: GPT | None = None,
) -> TrainResult:
    """Train with AdamW on random windows; returns the loss curves.

    With a ``teacher``, the loss is the forward KL divergence KL(p_teacher || q_model) per
    position (distillation): the model learns the teacher's whole next-token distribution,
    which is what a speculative-decoding draft is judged on (alpha = 1 - TV(p, q)). The
    evaluation stays next-token cross-entropy on the text.
    """
    if not isinstance(tc, TrainConfig):
        raise BadType(
            f"tc must be a TrainConfig (e.g. TrainConfig(steps=100)), got {type(tc).__name__}",
            arg="tc",
        )
    checked_model(model)
    for name, tokens in (("train_tokens", train_tokens), ("val_tokens", val_tokens)):
        if (
            not isinstance(tokens, torch.Tensor)
            or tokens.ndim != 1
            or tokens.dtype.is_floating_point
        ):
            raise BadType(
                f"{name} must be a 1-D tensor of token ids (see ar_lab.model.data.train_val_split)",
                arg=name,
            )
    if teacher is not None:
        _check_teacher(teacher, model, tc)
        teacher.eval()
    if tc.block_size > model.config.block_size:
        raise ContextFull(
            f"training window {tc.block_size} (tc.block_size) exceeds the model's context window "
            f"{model.config.block_size}",
            arg="tc",
        )
    torch.manual_seed(tc.seed)
    g = torch.Generator().manual_seed(tc.seed)
    opt = make_optimizer(model, tc)
    result = TrainResult()
    model.train()
    t0 = time.perf_counter()
    bar = tqdm(range(tc.steps), desc="training", disable=not progress)
    for step in bar:
        x, y = get_batch(train_tokens, tc.batch_size, tc.block_size, g)
        loss = train_step(
            model,
            opt,
            x.to(model.device),
            y.to(model.device),
            lr_at(step, tc),
            tc.grad_clip,
            teacher,
        )
        result.steps.append(step)
        result.train_loss.append(loss)
        if (step + 1) % tc.eval_every == 0 or step == tc.steps - 1:
            result.eval_steps.append(step)
            result.val_loss.append(evaluate(model, val_tokens, tc.block_size, tc.eval_batches))
            bar.set_postfix(train=f"{loss:.3f}", val=f"{result.val_loss[-1]:.3f}")
    result.seconds = time.perf_counter() - t0
    model.eval()
    return result
