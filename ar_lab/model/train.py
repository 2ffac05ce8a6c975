"""Training, evaluation and checkpoints.

``python -m ar_lab.model.train --preset course`` (and ``--preset draft``) reproduces the
checkpoints shipped in data/: seeded, on the built-in corpus, on the CPU.

Checkpoints are safetensors files: tensors plus a JSON header (config and training
record) and a digest of both (``ar_lab.model.checkpoint``, whose functions this module
re-exports). Loading one never runs pickled code; a corrupted, edited or mismatched
file gives an error that says what is wrong.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.base.timing import default_device
from ar_lab.model.checkpoint import CheckpointError, load_checkpoint, read_checkpoint_metadata, save_checkpoint
from ar_lab.model.data import check_writable, corpus_tokens, data_dir, get_batch, train_val_split
from ar_lab.model.evaluation import evaluate_protocol, protocol_for
from ar_lab.model.gpt import GPT, GPTConfig, checked_model

__all__ = [  # ar_lab.model.checkpoint's functions and default_device too: chapters 03 and 03b import them here
    "PRESETS",
    "CheckpointError",
    "TrainConfig",
    "TrainResult",
    "checkpoint_path",
    "default_device",
    "evaluate",
    "load_checkpoint",
    "load_pretrained",
    "lr_at",
    "read_checkpoint_metadata",
    "save_checkpoint",
    "train",
    "train_preset",
]


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
        for name in ("steps", "batch_size", "block_size", "eval_every", "eval_batches", "warmup_steps", "seed"):
            value, low = getattr(self, name), 0 if name in ("warmup_steps", "seed") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise BadValue(f"TrainConfig.{name} must be an int >= {low}, got {value!r}", arg=name)
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
                raise BadValue(f"TrainConfig.{name} must be a finite number {rule}, got {value!r}", arg=name)
        if self.teacher is not None and not isinstance(self.teacher, str):
            raise BadValue(f"teacher must be a checkpoint name such as 'course', got {self.teacher!r}", arg="teacher")


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
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def evaluate(
    model: GPT, tokens: torch.Tensor, block_size: int, batches: int = 8, batch_size: int = 8, seed: int = 0
) -> float:
    """Mean next-token cross-entropy (nats) on random windows of ``tokens``, seeded."""
    checked_model(model)
    if not isinstance(batches, int) or isinstance(batches, bool) or batches < 1:
        raise BadValue(f"batches must be an int >= 1, got {batches!r}", arg="batches")
    if isinstance(block_size, int) and block_size > model.config.block_size:
        raise ContextFull(
            f"block_size {block_size} exceeds the model's context window {model.config.block_size}", arg="block_size"
        )
    g = torch.Generator().manual_seed(seed)
    losses = []
    flags = [(m, m.training) for m in model.modules()]  # evaluated in eval mode, then put back as it was
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
    """AdamW with two parameter groups: the matrices (2-D or more) decayed by ``tc.weight_decay``, the
    biases and LayerNorm parameters not; betas (0.9, 0.99). Chapter 03's learner writes the same."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
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
    """One update on inputs ``x`` and next tokens ``y`` (B, T): set ``lr`` on every group, forward, loss,
    backward, clip the gradients' global norm to ``grad_clip`` (None: no clipping), step. The loss
    (nats, before the update): cross-entropy, or with a ``teacher`` the forward KL to its distributions."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    if teacher is None:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    else:
        with torch.no_grad():
            target_logp = F.log_softmax(teacher(x), -1).flatten(0, 1)  # (B T, V)
        logq = F.log_softmax(model(x), -1).flatten(0, 1)
        loss = F.kl_div(logq, target_logp, log_target=True, reduction="batchmean")  # mean over positions
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.item()


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
        raise BadType(f"tc must be a TrainConfig (e.g. TrainConfig(steps=100)), got {type(tc).__name__}", arg="tc")
    checked_model(model)
    for name, tokens in (("train_tokens", train_tokens), ("val_tokens", val_tokens)):
        if not isinstance(tokens, torch.Tensor) or tokens.ndim != 1 or tokens.dtype.is_floating_point:
            raise BadType(f"{name} must be a 1-D tensor of token ids (see ar_lab.model.data.train_val_split)", arg=name)
    if teacher is not None:
        checked_model(teacher, "teacher")  # a model, not a name: load_pretrained(name) loads a shipped one
        if teacher.config.vocab_size != model.config.vocab_size:
            raise BadValue(
                f"teacher and model must share the vocabulary: {teacher.config.vocab_size} vs "
                f"{model.config.vocab_size}",
                arg="teacher",
            )
        if tc.block_size > teacher.config.block_size:
            raise ContextFull(
                f"training window {tc.block_size} (tc.block_size) exceeds the teacher's context window", arg="tc"
            )
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
        loss = train_step(model, opt, x.to(model.device), y.to(model.device), lr_at(step, tc), tc.grad_clip, teacher)
        result.steps.append(step)
        result.train_loss.append(loss)
        if (step + 1) % tc.eval_every == 0 or step == tc.steps - 1:
            result.eval_steps.append(step)
            result.val_loss.append(evaluate(model, val_tokens, tc.block_size, tc.eval_batches))
            bar.set_postfix(train=f"{loss:.3f}", val=f"{result.val_loss[-1]:.3f}")
    result.seconds = time.perf_counter() - t0
    model.eval()
    return result


# --- the shipped checkpoints -------------------------------------------------------

# Each preset: the model config and one or more training phases, run in order (each
# phase a fresh optimizer and schedule, continuing from the previous phase's weights).
PRESETS: dict[str, tuple[GPTConfig, list[TrainConfig]]] = {
    # The course model. Phase 1 trains every position of the 1,024-token window; phase 2
    # continues on 512-token windows, cheaper per token; phases 3 to 5 return to full windows,
    # long enough that positions past 512 are predicted as well as the earlier ones
    # (chapter 03b plots the loss by position; phases 1-3 alone left a step at 512).
    "course": (
        GPTConfig(block_size=1024, n_layer=4, n_head=4, n_embd=256, dropout=0.0),
        [
            TrainConfig(steps=450, batch_size=8, block_size=1024, lr=2e-3, warmup_steps=30, eval_every=50),
            TrainConfig(
                steps=600, batch_size=16, block_size=512, lr=1.5e-3, warmup_steps=20, eval_every=100, seed=1338
            ),
            # Phase 3: back to full windows, so positions 512..1023 fit the weights phase 2 moved.
            TrainConfig(steps=120, batch_size=8, block_size=1024, lr=6e-4, warmup_steps=10, eval_every=40, seed=1339),
            # Phases 4 and 5: full windows again, long enough to train the positions past 512 (after phase 4
            # the last 128 positions were still the worst predicted: phase 5 evens them out).
            TrainConfig(steps=600, batch_size=8, block_size=1024, lr=1e-3, warmup_steps=20, eval_every=100, seed=1341),
            TrainConfig(steps=600, batch_size=8, block_size=1024, lr=5e-4, warmup_steps=10, eval_every=100, seed=1342),
        ],
    ),
    # The modern model: the course model's size, Llama-shaped (RMSNorm, RoPE, SwiGLU, two KV heads). Rotary positions
    # learn order from the first steps; phase 2 trains the full window (distances past 511 appear only there).
    "modern": (GPTConfig.modern(block_size=1024), [
        TrainConfig(steps=700, batch_size=16, block_size=512, lr=3e-3, warmup_steps=30, eval_every=100),
        TrainConfig(steps=250, batch_size=8, block_size=1024, lr=1e-3, warmup_steps=10, eval_every=50, seed=1343),
    ]),
    # The draft for speculative decoding: same tokenizer, a fraction of the cost.
    "draft": (
        GPTConfig(block_size=1024, n_layer=1, n_head=2, n_embd=128, dropout=0.0),
        [
            TrainConfig(steps=600, batch_size=16, block_size=1024, lr=3e-3, warmup_steps=30, eval_every=100),
            # Phase 2: many small full-window steps, which raise the draft's greedy acceptance rate
            # against the course model (python -m ar_lab.bench speculative measures it).
            TrainConfig(
                steps=3000,
                batch_size=2,
                block_size=1024,
                lr=1e-3,
                warmup_steps=20,
                weight_decay=0.0,
                eval_every=500,
                seed=1339,
            ),
            # Phase 3: distillation from the course model (forward KL to its next-token distributions):
            # a draft is judged on agreeing with its target, not on predicting the text.
            TrainConfig(
                steps=1500,
                batch_size=2,
                block_size=1024,
                lr=5e-4,
                warmup_steps=10,
                weight_decay=0.0,
                eval_every=500,
                seed=1340,
                teacher="course",
            ),
        ],
    ),
}


def checkpoint_path(name: str) -> Path:
    if name not in PRESETS:
        raise BadValue(f"unknown checkpoint name {name!r}; choose one of {sorted(PRESETS)}", arg="name")
    return data_dir() / f"{name}.safetensors"


def load_pretrained(name: str = "course", device=None) -> GPT:
    """Load a shipped checkpoint ("course" or "draft") on ``device`` (default: cuda if present)."""
    path = checkpoint_path(name)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; run `make checkpoints` to train it")
    return load_checkpoint(path, device, preset=name)


def _starting_point(name: str, resume: Path | None) -> tuple[GPT, list[dict]]:
    """The model a preset's training starts from and the records of the phases it has done.

    A fresh seeded model, or the partial checkpoint ``resume`` (its record lists its phases).
    Checks everything a run needs before any training: the resume file, and the teacher of
    every remaining distillation phase.
    """
    if name not in PRESETS:
        raise BadValue(f"unknown preset name {name!r}; choose one of {sorted(PRESETS)}", arg="name")
    config, phases = PRESETS[name]
    done: list[dict] = []
    if resume is not None:
        model = load_checkpoint(resume, "cpu")
        done = model.checkpoint_record.get("phases", [])
        if model.config != config or model.checkpoint_record.get("preset") != name or not done:
            raise BadValue(f"resume file {resume} is not a partial {name!r} checkpoint of this preset", arg="resume")
        if len(done) >= len(phases):
            raise BadValue(
                f"resume file {resume} has already run all {len(phases)} phases of {name!r}: nothing to resume",
                arg="resume",
            )
    else:
        torch.manual_seed(phases[0].seed)
        model = GPT(config)
    for i, tc in enumerate(phases[len(done) :], start=len(done)):
        if tc.teacher is not None and not checkpoint_path(tc.teacher).exists():
            raise FileNotFoundError(
                f"phase {i + 1} of {name!r} distils from {checkpoint_path(tc.teacher)}, which is missing: "
                f"train it first (python -m ar_lab.model.train --preset {tc.teacher})"
            )
        if tc.teacher is not None:
            read_checkpoint_metadata(checkpoint_path(tc.teacher))  # a damaged teacher: say so before training
    return model, done


def _phase_record(tc: TrainConfig, result: TrainResult) -> dict:
    return {
        **({"teacher": tc.teacher} if tc.teacher else {}),
        "steps": tc.steps,
        "batch_size": tc.batch_size,
        "block_size": tc.block_size,
        "tokens": tc.steps * tc.batch_size * tc.block_size,
        "seconds": round(result.seconds, 1),
        "threads": torch.get_num_threads(),
        "val_curve": [round(v, 4) for v in result.val_loss],
    }


def _train_phases(name: str, start: tuple[GPT, list[dict]], out: Path | None, progress: bool) -> dict:
    """Run the phases of preset ``name`` that ``start`` has not done; save after each; the last record."""
    config, phases = PRESETS[name]
    model, done = start
    train_tokens, val_tokens = train_val_split(corpus_tokens())
    out = Path(out or checkpoint_path(name))
    check_writable(out, "out")  # before the training, not at its first save
    for i, tc in enumerate(phases[len(done) :], start=len(done)):
        teacher = load_checkpoint(checkpoint_path(tc.teacher), "cpu") if tc.teacher is not None else None
        result = train(model, train_tokens, val_tokens, tc, progress=progress, teacher=teacher)
        done.append(_phase_record(tc, result))
        last = i == len(phases) - 1
        # Every phase ends on float16 values (what the shipped file stores): a run resumed from any
        # phase's file then continues from exactly the weights a run of all phases has there.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.half().float())
        protocol = protocol_for(config.block_size)
        measured = evaluate_protocol(model, protocol, val_tokens)
        val, half = measured.nats, protocol.window // 2
        record = {
            "preset": name,
            "parameters": model.num_parameters(),
            "train_steps": sum(p["steps"] for p in done),
            "train_tokens": sum(p["tokens"] for p in done),
            "train_seconds": round(sum(p["seconds"] for p in done), 1),
            "val_loss_nats": round(val, 4),
            "val_bits_per_byte": round(val / math.log(2), 4),
            "eval": protocol.name,
            "val_halves_nats": [round(measured.span(0, half), 4), round(measured.span(half, protocol.window), 4)],
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "phases": done,
        }
        if last:
            save_checkpoint(out, model, record, dtype=torch.float16)
        else:
            save_checkpoint(out.with_name(f"{out.stem}.phase{i + 1}.safetensors"), model, record)
    return record


def train_preset(name: str, out: Path | None = None, progress: bool = True, resume: Path | None = None) -> dict:
    """Train a preset on the built-in corpus and save it; returns its record.

    ``resume``: a checkpoint this function wrote after some of the preset's phases
    (its record lists them); training continues with the remaining phases, giving the
    same result as running them all. ``out`` (default data/NAME.safetensors) is checked to be a
    writable file path before any training, so a bad path costs nothing.
    """
    return _train_phases(name, _starting_point(name, resume), out, progress)


def _file_arg(text: str) -> Path:
    """A command-line file path; an empty one is refused (it would name the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("give a file path, got an empty string")
    return Path(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ar_lab.model.train", description="Train the course checkpoints reproducibly."
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--out", type=_file_arg, default=None, help="where to write (default data/NAME.safetensors)")
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (default 1; make checkpoints uses 2, seeded either way)"
    )
    parser.add_argument(
        "--resume", type=_file_arg, default=None, help="continue from a partial checkpoint (NAME.phaseK)"
    )
    args = parser.parse_args(argv)
    try:
        if args.threads < 1:
            raise BadValue(f"--threads must be >= 1, got {args.threads}", arg="--threads")
        if args.out is not None:  # a path that cannot be written: said before hours of training, not after
            check_writable(args.out, "--out")
        torch.set_num_threads(args.threads)
        start = _starting_point(args.preset, args.resume)
    except (FileNotFoundError, ValueError) as e:  # a mistake in the command: its message, no traceback
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    record = _train_phases(args.preset, start, args.out, progress=True)
    print(json.dumps({k: v for k, v in record.items() if k != "phases"}, indent=2))


if __name__ == "__main__":
    main()
