"""What the benchmarks start from: the course model (or a stand-in), and their arguments checked
once."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ar_lab.base.errors import BadValue
from ar_lab.base.timing import checked_device

__all__ = [
    "checked_device",
    "checked_threads",
    "checkpoints",
    "course_model_or_random",
    "torch_threads",
]


def course_model_or_random():
    """``(model, source)``: the course checkpoint on CPU, or ``GPTConfig()`` with seeded random
    weights while it is missing.

    Decode timing depends on the shapes, not on what the weights learned.
    """
    from ar_lab.model.gpt import GPT, GPTConfig
    from ar_lab.model.train import checkpoint_path, load_checkpoint

    path = checkpoint_path("course")
    if path.exists():
        return load_checkpoint(path, "cpu").eval(), f"data/{path.name}"
    torch.manual_seed(0)
    return GPT(GPTConfig()).eval(), f"random init (data/{path.name} not found)"


def checked_threads(threads) -> list[int]:
    """``threads`` (an int or a list of ints) as a list of thread counts, each >= 1."""
    counts = [threads] if isinstance(threads, int) else list(threads)
    if not counts or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in counts):
        raise BadValue(f"--threads must be positive ints, got {threads}", arg="threads")
    return counts


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block with ``threads`` torch CPU threads (checked), restoring the count after it."""
    (threads,) = checked_threads(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def checkpoints(target, draft, device: torch.device) -> tuple[object, object, dict]:
    """The models (the shipped checkpoints on ``device`` where not given) and where each came
    from."""
    from ar_lab.model.train import checkpoint_path, load_checkpoint

    models, sources = {"target": target, "draft": draft}, {}
    for role, name in [("target", "course"), ("draft", "draft")]:
        sources[role] = "given"
        if models[role] is None:
            path = checkpoint_path(name)
            if not path.exists():
                raise FileNotFoundError(
                    f"{path} is missing; run `make checkpoints` (or pass the models)"
                )
            models[role], sources[role] = load_checkpoint(path, device).eval(), f"data/{path.name}"
    return models["target"], models["draft"], sources
