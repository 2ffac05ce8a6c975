"""The shipped checkpoints: each preset's recipe (``PRESETS``), where its file lives
(``checkpoint_path``, ``load_pretrained``), training one phase after another with resuming
(``train_preset``), and the command ``python -m ar_lab.model.train --preset NAME``."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from ar_lab.base.errors import BadValue
from ar_lab.model.checkpoint import (
    load_checkpoint,
    read_checkpoint_metadata,
    save_checkpoint,
)
from ar_lab.model.data import check_writable, corpus_tokens, data_dir, train_val_split
from ar_lab.model.evaluation import evaluate_protocol, protocol_for
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.model.train.trainer import TrainConfig, TrainResult, train

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
            TrainConfig(
                steps=450, batch_size=8, block_size=1024, lr=2e-3, warmup_steps=30, eval_every=50
            ),
            TrainConfig(
                steps=600,
                batch_size=16,
                block_size=512,
                lr=1.5e-3,
                warmup_steps=20,
                eval_every=100,
                seed=1338,
            ),
            # Phase 3: back to full windows, so positions 512..1023 fit the weights phase 2 moved.
            TrainConfig(
                steps=120,
                batch_size=8,
                block_size=1024,
                lr=6e-4,
                warmup_steps=10,
                eval_every=40,
                seed=1339,
            ),
            # Phases 4 and 5: full windows again, long enough to train the positions past 512 (after
            # phase 4 the last 128 positions were still the worst predicted: phase 5 evens them
            # out).
            TrainConfig(
                steps=600,
                batch_size=8,
                block_size=1024,
                lr=1e-3,
                warmup_steps=20,
                eval_every=100,
                seed=1341,
            ),
            TrainConfig(
                steps=600,
                batch_size=8,
                block_size=1024,
                lr=5e-4,
                warmup_steps=10,
                eval_every=100,
                seed=1342,
            ),
        ],
    ),
    # The modern model: the course model's size, Llama-shaped (RMSNorm, RoPE, SwiGLU, two KV heads).
    # Rotary positions learn order from the first steps; phase 2 trains the full window (distances
    # past 511 appear only there). Both phases stop early: this block memorises the 419,577
    # training tokens faster than GPT-2's (a 700-step phase 1 and a 250-step phase 2 left the
    # validation loss rising from step 500 and step 50, at 1.276 nats in the end).
    "modern": (
        GPTConfig.modern(block_size=1024),
        [
            TrainConfig(
                steps=450, batch_size=16, block_size=512, lr=3e-3, warmup_steps=30, eval_every=75
            ),
            TrainConfig(
                steps=100,
                batch_size=8,
                block_size=1024,
                lr=5e-4,
                warmup_steps=10,
                eval_every=25,
                seed=1343,
            ),
        ],
    ),
    # The draft for speculative decoding: same tokenizer, a fraction of the cost.
    "draft": (
        GPTConfig(block_size=1024, n_layer=1, n_head=2, n_embd=128, dropout=0.0),
        [
            TrainConfig(
                steps=600, batch_size=16, block_size=1024, lr=3e-3, warmup_steps=30, eval_every=100
            ),
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
            # Phase 3: distillation from the course model (forward KL to its next-token
            # distributions): a draft is judged on agreeing with its target, not on predicting the
            # text.
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
        raise BadValue(
            f"unknown checkpoint name {name!r}; choose one of {sorted(PRESETS)}", arg="name"
        )
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
            raise BadValue(
                f"resume file {resume} is not a partial {name!r} checkpoint of this preset",
                arg="resume",
            )
        if len(done) >= len(phases):
            raise BadValue(
                f"resume file {resume} has already run all {len(phases)} phases of {name!r}: "
                "nothing to resume",
                arg="resume",
            )
    else:
        torch.manual_seed(phases[0].seed)
        model = GPT(config)
    for i, tc in enumerate(phases[len(done) :], start=len(done)):
        if tc.teacher is not None and not checkpoint_path(tc.teacher).exists():
            raise FileNotFoundError(
                f"phase {i + 1} of {name!r} distils from {checkpoint_path(tc.teacher)}, which is "
                f"missing: train it first (python -m ar_lab.model.train --preset {tc.teacher})"
            )
        if tc.teacher is not None:
            # a damaged teacher: say so before training
            read_checkpoint_metadata(checkpoint_path(tc.teacher))
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


def _train_phases(
    name: str, start: tuple[GPT, list[dict]], out: Path | None, progress: bool
) -> dict:
    """Run the phases of preset ``name`` that ``start`` has not done; save after each; the last
    record."""
    config, phases = PRESETS[name]
    model, done = start
    train_tokens, val_tokens = train_val_split(corpus_tokens())
    out = Path(out or checkpoint_path(name))
    check_writable(out, "out")  # before the training, not at its first save
    for i, tc in enumerate(phases[len(done) :], start=len(done)):
        teacher = (
            load_checkpoint(checkpoint_path(tc.teacher), "cpu") if tc.teacher is not None else None
        )
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
            "val_halves_nats": [
                round(measured.span(0, half), 4),
                round(measured.span(half, protocol.window), 4),
            ],
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "phases": done,
        }
        if last:
            save_checkpoint(out, model, record, dtype=torch.float16)
        else:
            save_checkpoint(out.with_name(f"{out.stem}.phase{i + 1}.safetensors"), model, record)
    return record


def train_preset(
    name: str, out: Path | None = None, progress: bool = True, resume: Path | None = None
) -> dict:
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
        prog="python -m ar_lab.model.train",
        description="Train the course checkpoints reproducibly.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument(
        "--out", type=_file_arg, default=None, help="where to write (default data/NAME.safetensors)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads (default 1; make checkpoints uses 2, seeded either way)",
    )
    parser.add_argument(
        "--resume",
        type=_file_arg,
        default=None,
        help="continue from a partial checkpoint (NAME.phaseK)",
    )
    args = parser.parse_args(argv)
    try:
        if args.threads < 1:
            raise BadValue(f"--threads must be >= 1, got {args.threads}", arg="--threads")
        # a path that cannot be written: said before hours of training, not after
        if args.out is not None:
            check_writable(args.out, "--out")
        torch.set_num_threads(args.threads)
        start = _starting_point(args.preset, args.resume)
    # a mistake in the command: its message, no traceback
    except (FileNotFoundError, ValueError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    record = _train_phases(args.preset, start, args.out, progress=True)
    print(json.dumps({k: v for k, v in record.items() if k != "phases"}, indent=2))
