"""Byte-level tokenizer: every UTF-8 byte is a token, plus one end-of-sequence token.

Why bytes: no vocabulary to learn or ship, every string round-trips exactly, and the
model still has to learn real structure (characters, words, syntax). The price is
longer sequences than a BPE tokenizer would give, which is fine for a course model.

Token ids 0..255 are the byte values; id 256 is EOS. ``VOCAB_SIZE`` is 257.
"""

from __future__ import annotations

import codecs
import numbers
from collections.abc import Iterable

from ar_lab.base.errors import BadType, BadValue

N_BYTES = 256
EOS_ID = 256
VOCAB_SIZE = 257


def encode(text: str, add_eos: bool = False) -> list[int]:
    """Turn text into token ids (its UTF-8 bytes), optionally followed by EOS."""
    if not isinstance(text, str):
        raise BadType(f"encode expects a str (the text), got {type(text).__name__}", arg="text")
    ids = list(text.encode("utf-8"))
    if add_eos:
        ids.append(EOS_ID)
    return ids


def _check_ids(ids: Iterable[int], name: str = "ids") -> list[int]:
    """``ids`` as a list of ints in the vocabulary, or an error that says what to pass (``name``:
    the argument)."""
    if isinstance(ids, str):
        raise BadType(
            f"decode expects a list of token ids (ints 0..{VOCAB_SIZE - 1}), got a str: use "
            "encode(text)",
            arg=name,
        )
    if hasattr(ids, "tolist") and hasattr(ids, "dtype"):  # a tensor or an array: integer ids, 1-D
        if getattr(ids, "ndim", 1) > 1:
            raise BadValue(
                f"token ids must be 1-D, got shape {tuple(ids.shape)}: decode one row at a time",
                arg=name,
            )
        if not _integer_dtype(ids.dtype):
            raise BadType(f"token ids must be integers, got a {ids.dtype} array", arg=name)
        ids = ids.tolist()
        ids = [ids] if isinstance(ids, int) else ids
    elif not isinstance(ids, Iterable):
        raise BadType(
            f"decode expects a list of token ids (ints 0..{VOCAB_SIZE - 1}), got "
            f"{type(ids).__name__}",
            arg=name,
        )
    out = []
    for i in ids:
        if getattr(i, "ndim", None) == 0 and _integer_dtype(i.dtype):  # one element of a tensor
            i = int(i)
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise BadType(
                f"{name}: token ids must be integers (0..{VOCAB_SIZE - 1}), got {i!r} ("
                f"{type(i).__name__})",
                arg=name,
            )
        i = int(i)
        if not 0 <= i < VOCAB_SIZE:
            raise BadValue(
                f"{name}: token id {i} is outside the vocabulary [0, {VOCAB_SIZE - 1}]", arg=name
            )
        out.append(i)
    return out


def _integer_dtype(dtype) -> bool:
    """True for integer dtypes of torch or numpy (bool is not an integer here)."""
    name = str(dtype).removeprefix("torch.")
    return name.startswith(("int", "uint", "long", "short"))


def decode(ids: Iterable[int], stop_at_eos: bool = True) -> str:
    """Turn token ids (a list of ints, or a 1-D integer tensor or array) back into text.

    EOS ends the text when ``stop_at_eos`` (the default); otherwise it is dropped.
    Byte sequences that are not valid UTF-8 (a model can emit those) become U+FFFD.
    """
    if not isinstance(stop_at_eos, bool):
        raise BadType(f"stop_at_eos must be True or False, got {stop_at_eos!r}", arg="stop_at_eos")
    ids = _check_ids(ids)
    if EOS_ID in ids:
        ids = ids[: ids.index(EOS_ID)] if stop_at_eos else [i for i in ids if i != EOS_ID]
    return bytes(ids).decode("utf-8", errors="replace")


class StreamDecoder:
    """Decode tokens one at a time without ever emitting half a character.

    A character such as "é" is two bytes, "€" three: after the first byte there is
    nothing printable yet, so ``feed`` returns "" until the character is complete.
    Joining everything ``feed`` and ``flush`` return equals ``decode`` of all tokens.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.finished = False

    def feed(self, token_id: int) -> str:
        # the common case needs no more checks
        if type(token_id) is not int or not 0 <= token_id < VOCAB_SIZE:
            (token_id,) = _check_ids([token_id], "token_id")
        if self.finished:
            return ""
        if token_id == EOS_ID:
            self.finished = True
            return self._decoder.decode(b"", final=True)
        return self._decoder.decode(bytes([token_id]))

    def flush(self) -> str:
        """Return what is still buffered (an incomplete character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)
