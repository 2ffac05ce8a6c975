"""How ar_lab runs a model for inference: under ``torch.inference_mode()``, never switching its
mode.

A model's training flag belongs to whoever trains it. ar_lab's loops (generate, stream, beam,
speculative, serving, the measurements) never call ``model.eval()`` or ``model.train()`` on the
caller's model. A model in training mode computes exactly what it computes in eval mode unless it
holds a module that behaves differently when training (dropout with p > 0, batch norm): such a model
is run as it is; the other kind is refused with a message that says to call ``model.eval()``.

``inference(*models)`` checks and enters ``torch.inference_mode()``; a generator enters it per
step, never across a ``yield``, so a paused stream leaves gradients on in the notebook. With no
shared state, several threads can run one model at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ar_lab.base.errors import BadType, BadValue

_TRAINING_DIFFERS = (nn.modules.batchnorm._BatchNorm,)  # modules whose training-mode output differs


def _random_in_training(module: nn.Module) -> str | None:
    """What in ``module`` would compute differently because it is in training mode, or None."""
    for name, sub in module.named_modules():
        if not sub.training:
            continue
        if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
            return f"{name or type(module).__name__} (dropout p={sub.p:g})"
        if isinstance(sub, _TRAINING_DIFFERS):
            return f"{name or type(module).__name__} ({type(sub).__name__})"
        p = getattr(sub, "dropout", None)  # e.g. attention that hands dropout_p to its kernel
        if isinstance(p, float) and p > 0:
            return f"{name or type(module).__name__} (attention dropout p={p:g})"
    return None


def check_inference_ready(*models: nn.Module) -> None:
    """Raise if a model in training mode would compute differently from eval mode (active
    dropout)."""
    for m in models:
        if not isinstance(m, nn.Module):
            raise BadType(f"model must be a torch.nn.Module, got {type(m).__name__}", arg="model")
        if m.training:
            what = _random_in_training(m)
            if what is not None:
                raise BadValue(
                    f"the model is in training mode and {what} would make its outputs random: "
                    "call model.eval() before generating or measuring (ar_lab never switches "
                    "your model's mode)",
                    arg="model",
                )


@contextlib.contextmanager
def inference(*models: nn.Module) -> Iterator[None]:
    """Check ``models`` (``check_inference_ready``) and run the block under
    ``torch.inference_mode()``.

    The check is one attribute read for a model in eval mode, so a generator can enter this per
    step: a model switched to training mode (dropout on) during a paused stream is refused at the
    next step.
    """
    check_inference_ready(*models)
    with torch.inference_mode():
        yield
