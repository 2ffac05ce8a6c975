"""Training, evaluation and checkpoints.

``python -m ar_lab.model.train --preset course`` (and ``--preset draft``) reproduces the
checkpoints shipped in data/: seeded, on the built-in corpus, on the CPU.

Checkpoints are safetensors files: tensors plus a JSON header (config and training
record) and a digest of both (``ar_lab.model.checkpoint``, whose functions this module
re-exports). Loading one never runs pickled code; a corrupted, edited or mismatched
file gives an error that says what is wrong.

- ``ar_lab.model.train.trainer``: ``TrainConfig``, ``lr_at``, ``evaluate``, ``train_step``,
  ``train``.
- ``ar_lab.model.train.presets``: ``PRESETS``, ``checkpoint_path``, ``load_pretrained``,
  ``train_preset`` and the command (``main``, run by ``python -m ar_lab.model.train``).
"""

from ar_lab.base.timing import default_device
from ar_lab.model.checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_checkpoint_metadata,
    save_checkpoint,
)
from ar_lab.model.train.presets import PRESETS, checkpoint_path, load_pretrained, train_preset
from ar_lab.model.train.trainer import (
    TrainConfig,
    TrainResult,
    evaluate,
    lr_at,
    make_optimizer,
    train,
    train_step,
)

# ar_lab.model.checkpoint's functions and default_device too: chapters 03 and 03b import them here
__all__ = [
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
    "make_optimizer",
    "read_checkpoint_metadata",
    "save_checkpoint",
    "train",
    "train_preset",
    "train_step",
]
