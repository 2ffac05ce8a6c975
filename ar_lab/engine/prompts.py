"""Prompts and the arguments of a decode loop, checked once at the public entry point.

Every decode loop in the package (``generate``, batched sampling, beam search, serving,
speculative decoding) takes a prompt as text or token ids and a token budget. This leaf
module turns the prompt into ids and checks it against the model, so they all accept the
same inputs and give the same messages.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.model.tokenizer import encode


def prompt_ids(prompt: str | Sequence[int]) -> list[int]:
    """Token ids of ``prompt`` (text is encoded; ids are checked to be integers)."""
    if isinstance(prompt, str):
        ids = encode(prompt)
    elif isinstance(prompt, torch.Tensor):
        if (
            prompt.dim() != 1
            or prompt.dtype.is_floating_point
            or prompt.dtype.is_complex
            or prompt.dtype == torch.bool
        ):
            raise BadType(
                f"a prompt tensor must be 1-D integer token ids, got {prompt.dtype} of shape "
                f"{tuple(prompt.shape)}",
                arg="prompt",
            )
        ids = prompt.tolist()
    elif isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
        raise BadType(
            f"the prompt must be text or a list of token ids, got {type(prompt).__name__}",
            arg="prompt",
        )
    else:
        ids = list(prompt)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise BadType(
                    f"token ids must be integers, got {t!r} ({type(t).__name__}) in the prompt",
                    arg="prompt",
                )
        ids = [int(t) for t in ids]
    if not ids:
        raise BadValue(
            "the prompt is empty: give at least one token (e.g. a character of text)", arg="prompt"
        )
    return ids


def stop_list(stop_strings) -> tuple[str, ...]:
    """``stop_strings`` as a tuple of non-empty strings (None: no stop strings)."""
    if stop_strings is None:
        return ()
    if isinstance(stop_strings, str) or not isinstance(stop_strings, (Sequence, set, frozenset)):
        raise BadValue(
            "stop_strings must be a list of non-empty strings, e.g. ['\\n\\n']", arg="stop_strings"
        )
    stops = tuple(stop_strings)
    if not all(isinstance(s, str) and s for s in stops):
        raise BadValue(
            "stop_strings must be a list of non-empty strings, e.g. ['\\n\\n']", arg="stop_strings"
        )
    return stops



def loop_model(model, name: str = "model"):
    """``model`` if a decode loop can run it: a ``torch.nn.Module`` whose ``.config`` gives its
    vocabulary and context window (an ar_lab GPT, a quantized copy, a model of one's own with a
    ``GPTConfig``); else a BadType naming ``name``. The one check of the model a loop makes, at its
    public entry point: what runs after it (the prompt's check, the decoder, the cache) trusts
    it."""
    cfg = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or not all(
        isinstance(getattr(cfg, a, None), int) for a in ("block_size", "vocab_size")
    ):
        raise BadType(
            f"{name} must be an ar_lab model (a GPT, e.g. load_pretrained('course'), or a module "
            f"with a GPTConfig .config), got {type(model).__name__}",
            arg=name,
        )
    return model


def check_eos(model, eos_id) -> int | None:
    """``eos_id`` if it is None (no end token) or a token id of ``model``'s vocabulary."""
    vocab = model.config.vocab_size
    if eos_id is not None and (not isinstance(eos_id, numbers.Integral) or isinstance(eos_id, bool)
                               or not 0 <= eos_id < vocab):
        raise BadValue(
            f"eos_id must be a token id in [0, {vocab - 1}] or None (never stop early), got "
            f"{eos_id!r}",
            arg="eos_id",
        )
    return eos_id


def check_budget(max_new_tokens) -> int:
    return positive_int("max_new_tokens", max_new_tokens)


def check_prompt(model, ids: list[int], max_new_tokens: int) -> None:
    """Raise if ``ids`` holds a token outside the vocabulary or the window cannot hold the text.

    The last new token is never fed back, so the model sees at most P + N - 1 positions. ``model``:
    checked by the caller (``loop_model``), or anything whose ``.config`` gives the vocabulary and
    window.
    """
    check_budget(max_new_tokens)
    vocab, window = model.config.vocab_size, model.config.block_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise BadValue(
            f"prompt holds token id {bad[0]}, outside the vocabulary [0, {vocab - 1}]", arg="prompt"
        )
    if len(ids) > window:
        raise ContextFull(
            f"the prompt has {len(ids)} tokens but the context window holds {window}; "
            f"shorten it to at most {window} tokens", arg="prompt"
        )
    if len(ids) + max_new_tokens - 1 > window:
        raise ContextFull(
            f"a {len(ids)}-token prompt plus {max_new_tokens} new tokens needs "
            f"{len(ids) + max_new_tokens - 1} positions, more than the context window of {window}"
            f"; ask for at most {window - len(ids) + 1} new tokens (max_new_tokens)",
            arg="max_new_tokens",
        )


def checked_prompt(model, prompt: str | Sequence[int], max_new_tokens: int) -> list[int]:
    """``prompt_ids(prompt)``, checked against ``model`` for ``max_new_tokens`` new tokens."""
    ids = prompt_ids(prompt)
    check_prompt(model, ids, max_new_tokens)
    return ids


def prompt_batch(model, prompts, max_new_tokens: int) -> torch.Tensor:
    """Token ids (B, P) for a list of equal-length prompts (text or ids), each checked."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise BadValue(
            "prompts must be a non-empty list of prompts (texts or lists of token ids)",
            arg="prompts",
        )
    ids = []
    for i, p in enumerate(prompts):
        try:
            ids.append(checked_prompt(model, p, max_new_tokens))
        # one prompt at fault: name it (max_new_tokens and model stay theirs)
        except (BadType, BadValue) as e:
            if e.arg != "prompt":
                raise
            raise type(e)(f"prompts[{i}]: {e}", arg="prompts") from None
    lengths = sorted({len(p) for p in ids})
    if len(lengths) > 1:
        raise BadValue(
            "the prompts must all have the same number of tokens (the model has no padding), "
            f"got lengths {lengths}",
            arg="prompts",
        )
    return torch.tensor(ids, dtype=torch.long, device=model.device)
