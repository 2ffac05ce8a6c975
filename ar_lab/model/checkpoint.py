"""Checkpoint files: a model's weights, its config and a training record, in one safetensors file.

The config and the record are JSON texts in the file's header, and a SHA-256 digest of both and
of every tensor is stored beside them when the file is written and checked when it is read.
Without it, a config edited after saving would load as a different model without a word:
``n_head`` 4 -> 2 keeps every tensor's shape. Loading never runs pickled code; a corrupted,
truncated, edited or mismatched file raises ``CheckpointError`` saying what is wrong and what
to do. ``ar_lab.model.train`` writes the course's checkpoints and re-exports these functions.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ar_lab.base.errors import BadType, BadValue
from ar_lab.base.timing import checked_device, default_device
from ar_lab.model.gpt import GPT, GPTConfig

FORMAT = "ar_lab-gpt-1"
_REMEDY = (
    "re-create it: save the model again with save_checkpoint, or for a shipped checkpoint restore "
    "data/ (git checkout data/) or retrain it (python -m ar_lab.model.train --preset NAME)"
)


class CheckpointError(BadValue):
    """A checkpoint file that cannot be loaded: corrupted, truncated, edited or mismatched (a
    ValueError; ``arg`` is "path", the file to replace)."""


def _path(path, name: str = "path") -> Path:
    if not isinstance(path, (str, Path)):
        raise BadType(
            f"{name} must be a file path (str or pathlib.Path), got {type(path).__name__}", arg=name
        )
    return Path(path)


def expected_shapes(config: GPTConfig) -> dict[str, torch.Size]:
    """The tensors a checkpoint of ``config`` holds (name -> shape), found on the meta device:
    nothing is allocated, so a header claiming a huge model is refused before any memory is spent on
    it."""
    with torch.device("meta"):
        skeleton = GPT(config)
    return {k: v.shape for k, v in skeleton.state_dict().items() if k != "lm_head.weight"}


def _mismatch(state: dict[str, torch.Tensor], expected: dict[str, torch.Size]) -> str:
    """What differs between ``state`` and the tensors a stock GPT holds ("" if nothing): names,
    shapes, dtypes."""
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and state[k].shape != expected[k]]
    dtypes = [k for k in expected if k in state and not state[k].is_floating_point()]
    return "; ".join(
        s
        for s in [
            f"missing {missing[:3]}" if missing else "",
            f"unexpected {extra[:3]}" if extra else "",
            f"shape of {wrong[0]}: file {tuple(state[wrong[0]].shape)} vs config "
            f"{tuple(expected[wrong[0]])}"
            if wrong
            else "",
            f"{dtypes[0]} is {state[dtypes[0]].dtype}, not floating point (the model holds float "
            "weights)"
            if dtypes
            else "",
        ]
        if s
    )


def checkpoint_digest(config: str, record: str | None, state: dict[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of the config and record texts and of every tensor (name, dtype, shape,
    bytes)."""
    h = hashlib.sha256()
    for text in (config, record or ""):
        data = text.encode()
        h.update(len(data).to_bytes(8, "little") + data)
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def save_checkpoint(
    path: str | Path, model: GPT, record: dict | None = None, dtype: torch.dtype | None = None
) -> None:
    """Write weights + config (+ a JSON-able training record, a dict) as safetensors, with their
    digest.

    ``dtype`` stores the weights in another precision (the shipped checkpoints use
    float16 to halve the file); loading always gives the model's float32 parameters.
    """
    from safetensors.torch import save_file

    if not isinstance(model, GPT):
        raise BadType(
            f"model must be an ar_lab GPT (ar_lab.model.gpt.GPT), got {type(model).__name__}",
            arg="model",
        )
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise BadType(
            f"dtype must be a floating-point torch.dtype such as torch.float16, got {dtype!r}",
            arg="dtype",
        )
    if record is not None and not isinstance(record, dict):
        raise BadType(
            f"record must be a dict (stored as JSON), got {type(record).__name__}", arg="record"
        )
    path = _path(path)
    if path.is_dir():
        raise BadValue(
            f"path {path} is a folder: give a file name, e.g. {path / 'model.safetensors'}",
            arg="path",
        )
    try:
        record_text = None if record is None else json.dumps(record)
    except (TypeError, ValueError) as e:
        raise BadValue(
            f"record must be JSON-serialisable (numbers, strings, lists, dicts): {e}", arg="record"
        ) from None
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    wrong = _mismatch(state, expected_shapes(model.config))
    # e.g. QuantizedLinear layers (ar_lab.engine.quant): a file load_checkpoint would refuse
    if wrong:
        raise BadValue(
            f"model holds tensors a GPT of its config does not ({wrong}): a quantized or "
            "modified model cannot be saved as a checkpoint; save the full-precision model and "
            "quantize it again after loading",
            arg="model",
        )
    state = {k: v.detach().cpu().to(dtype or v.dtype).contiguous() for k, v in state.items()}
    config = json.dumps(model.config.to_dict())
    meta = {
        "format": FORMAT,
        "config": config,
        "digest": checkpoint_digest(config, record_text, state),
    }
    if record_text is not None:
        meta["record"] = record_text
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata=meta)


def _read(path: Path) -> tuple[dict[str, str], dict, dict, dict[str, torch.Tensor]]:
    """The header's metadata texts, the parsed config and record, and the tensors of ``path``."""
    from safetensors.torch import load

    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path} (make checkpoints writes the course's)")
    raw = path.read_bytes()
    try:
        state = load(raw)  # checks the header and that every tensor's bytes are there
        meta = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")]).get("__metadata__") or {}
    except Exception as e:  # safetensors raises several types for a damaged file
        raise CheckpointError(
            f"path {path} is corrupted or truncated, or not a safetensors file ({e}); {_REMEDY}",
            arg="path",
        ) from None
    if meta.get("format") != FORMAT or "config" not in meta:
        raise CheckpointError(
            f"path {path} is not an ar_lab checkpoint (no ar_lab config in its header)", arg="path"
        )
    parsed = {}
    for key in ("config", "record"):
        try:
            parsed[key] = json.loads(meta[key]) if key in meta else {}
        except json.JSONDecodeError as e:
            raise CheckpointError(
                f"path {path}: the {key} in its header is not valid JSON ({e}); {_REMEDY}",
                arg="path",
            ) from None
        if not isinstance(parsed[key], dict):
            what = "an invalid model config" if key == "config" else "an invalid training record"
            raise CheckpointError(
                f"path {path} holds {what}: {meta[key][:80]!r} is not a JSON object; {_REMEDY}",
                arg="path",
            )
    return meta, parsed["config"], parsed["record"], state


def _verify(path: Path, meta: dict[str, str], state: dict[str, torch.Tensor]) -> None:
    if meta.get("digest") == checkpoint_digest(meta["config"], meta.get("record"), state):
        return
    if "digest" not in meta:
        what = "has no digest of its contents (it was written by an older version of ar_lab)"
    else:
        what = (
            "was changed since it was saved: its config, record or weights no longer match their "
            "stored digest"
        )
    raise CheckpointError(
        f"path {path} {what}. A config edited by hand can describe a different model with the "
        "same tensor shapes; " + _REMEDY,
        arg="path",
    )


def read_checkpoint_metadata(path: str | Path) -> dict:
    """The config and training record stored in a checkpoint (checked against its digest), without
    building a model."""
    path = _path(path)
    meta, config, record, state = _read(path)
    _verify(path, meta, state)
    return {"config": config, "record": record}


def load_checkpoint(
    path: str | Path, device: str | torch.device | None = None, *, preset: str | None = None
) -> GPT:
    """Build the model a checkpoint describes and load its weights (on ``device``, default cuda if
    present).

    Everything is checked before the model is built: the header, every tensor's name, shape and
    dtype against the config (found without allocating), ``preset`` (when given: the preset its
    record must name, e.g. "course", so a file swapped for another preset's is refused) and the
    digest.
    """
    device = default_device() if device is None else checked_device(device)
    if preset is not None and not isinstance(preset, str):
        raise BadType(
            f"preset must be a preset name (str) or None, got {type(preset).__name__}", arg="preset"
        )
    path = _path(path)
    meta, config_dict, record, state = _read(path)
    try:
        config = GPTConfig(**config_dict)
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"path {path} holds an invalid model config: {e}", arg="path"
        ) from None
    wrong = _mismatch(state, expected_shapes(config))
    if wrong:
        raise CheckpointError(f"path {path} does not match its config: {wrong}", arg="path")
    if preset is not None and record.get("preset") != preset:
        raise CheckpointError(
            f"path {path} should hold the {preset!r} checkpoint, but its record says preset "
            f"{record.get('preset')!r}: it was replaced by another file; {_REMEDY}",
            arg="path",
        )
    _verify(path, meta, state)
    model = GPT(config)
    model.load_state_dict(state, strict=False)  # lm_head.weight is tied to wte.weight
    model.checkpoint_record = record
    return model.to(device).eval()
