"""Text corpora and training batches.

The built-in corpus is the Python documentation that ships inside CPython
(``pydoc_data.topics``): on every machine, no download, real technical English with
code in it. Any UTF-8 text file of your own works too (``load_text``).

Documents are separated by EOS so the model learns where a text ends.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ar_lab.base.errors import BadType, BadValue
from ar_lab.model.tokenizer import EOS_ID, encode


def data_dir() -> Path:
    """The folder of the shipped checkpoints and reference measurements.

    ``data/`` beside the package, unless the ``AR_LAB_DATA`` environment variable names
    another folder (read on every call, so setting it in a running notebook takes effect).
    """
    return Path(os.environ.get("AR_LAB_DATA") or Path(__file__).resolve().parents[2] / "data")


def check_writable(path: Path, what: str) -> None:
    """Refuse a file path that cannot be written before the work that fills it: a folder, a path
    under a file, a name too long, or a folder this process may not write in. A test file is created
    beside it (or in its nearest existing folder) and removed; an existing file is opened for
    appending, unchanged."""
    path = Path(path)
    try:
        if path.is_dir():
            raise BadValue(
                f"{what} {path} is a folder: give a file name, e.g. {path / 'out.json'}", arg=what
            )
        folder = path.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not folder.is_dir():
            raise BadValue(
                f"{what} {path} cannot be written: {folder} is a file, not a folder", arg=what
            )
        test = path if folder == path.parent else folder / f".ar_lab_write_test_{os.getpid()}"
        existed = test.exists()
        with open(test, "ab"):
            pass
        if not existed:
            test.unlink()
    except OSError as e:  # a name too long, no permission, a read-only or virtual file system
        raise BadValue(
            f"{what} {path} cannot be written ({e.strerror}): choose another path", arg=what
        ) from None


def builtin_documents() -> list[str]:
    """The Python documentation topics of this interpreter, sorted by topic name."""
    from pydoc_data.topics import topics

    return [topics[name].strip() + "\n" for name in sorted(topics)]


def builtin_corpus() -> str:
    """All built-in documents in one string (no EOS markers)."""
    return "".join(builtin_documents())


def load_text(path: str | Path) -> str:
    """Read a UTF-8 text file, with errors a learner can act on."""
    if not isinstance(path, (str, Path)):
        raise BadType(
            f"give the path of a UTF-8 text file (a str or Path), got {type(path).__name__}",
            arg="path",
        )
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no such text file: {p} (give the path of a UTF-8 text file)")
    if p.is_dir():
        raise IsADirectoryError(f"{p} is a folder; give the path of a text file inside it")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BadValue(
            f"path {p} is not UTF-8 text ({e.reason} at byte {e.start})", arg="path"
        ) from None
    if not text.strip():
        raise BadValue(f"path {p} is empty; a corpus needs some text to learn from", arg="path")
    return text


def tokenize_documents(documents: list[str]) -> torch.Tensor:
    """Encode documents, each followed by EOS, into one 1-D tensor of token ids."""
    if isinstance(documents, str) or not isinstance(documents, (list, tuple)):
        raise BadType(
            "documents must be a list of str (one text per document), got "
            f"{type(documents).__name__}",
            arg="documents",
        )
    ids: list[int] = []
    for doc in documents:
        if not isinstance(doc, str):  # (encode would name its own argument, text)
            raise BadType(
                f"documents must hold str (one text per document), got a {type(doc).__name__}",
                arg="documents",
            )
        ids.extend(encode(doc))
        ids.append(EOS_ID)
    if not ids:
        raise BadValue("no documents to tokenize", arg="documents")
    return torch.tensor(ids, dtype=torch.long)


def corpus_tokens(path: str | Path | None = None) -> torch.Tensor:
    """Token ids of the built-in corpus, or of the text file at ``path``."""
    if path is None:
        return tokenize_documents(builtin_documents())
    return tokenize_documents([load_text(path)])


def train_val_split(
    tokens: torch.Tensor, val_fraction: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a 1-D token tensor: the first part trains, the last ``val_fraction`` validates.

    A contiguous tail (not a random sample) keeps validation text unseen during
    training and makes the split the same on every run.
    """
    _check_tokens(tokens)
    if not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 1.0:
        raise BadValue(f"val_fraction must be in (0, 1), got {val_fraction}", arg="val_fraction")
    n_val = max(1, int(len(tokens) * val_fraction))
    if len(tokens) - n_val < 2:
        raise BadValue(
            f"only {len(tokens)} tokens: too few to split into train and validation", arg="tokens"
        )
    return tokens[:-n_val], tokens[-n_val:]


def get_batch(
    tokens: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``block_size`` tokens: inputs x and next-token targets y.

    Returns x, y of shape (batch_size, block_size) with y[:, t] = x[:, t + 1] shifted
    by one in the source text: every position is a training example at once.
    """
    _check_tokens(tokens)
    for name, value in (("batch_size", batch_size), ("block_size", block_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadValue(f"{name} must be an int >= 1, got {value!r}", arg=name)
    if len(tokens) < block_size + 1:
        raise BadValue(
            f"a window of {block_size} tokens needs at least {block_size + 1} tokens of text, "
            f"got {len(tokens)}; use a smaller block_size or more text",
            arg="block_size",
        )
    starts = torch.randint(0, len(tokens) - block_size, (batch_size,), generator=generator)
    offsets = torch.arange(block_size + 1)
    windows = tokens[starts[:, None] + offsets]  # (B, block_size + 1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def _check_tokens(tokens) -> None:
    if (
        not isinstance(tokens, torch.Tensor)
        or tokens.dtype.is_floating_point
        or tokens.dtype == torch.bool
    ):
        got = (
            f"a {tokens.dtype} tensor"
            if isinstance(tokens, torch.Tensor)
            else type(tokens).__name__
        )
        raise BadType(
            f"tokens must be a 1-D integer tensor of token ids (e.g. corpus_tokens()), got {got}",
            arg="tokens",
        )
    if tokens.ndim != 1:
        raise BadValue(f"tokens must be 1-D, got shape {tuple(tokens.shape)}", arg="tokens")


def benchmark_prompts(n: int = 3, length: int = 32) -> list[list[int]]:
    """``n`` prompts of up to ``length`` tokens, evenly spaced through the validation text.

    Text the models never trained on; a window that crosses a document boundary starts
    after its EOS. Chapter 07 and ``python -m ar_lab.bench speculative`` time on these.
    """
    if not isinstance(n, int) or n < 1 or not isinstance(length, int) or length < 1:
        arg = "n" if not isinstance(n, int) or n < 1 else "length"
        raise BadValue(f"n and length must be ints >= 1, got {n!r} and {length!r}", arg=arg)
    _, val = train_val_split(corpus_tokens())
    step = (len(val) - length) // n
    prompts = []
    for i in range(n):
        window = val[i * step : i * step + length].tolist()
        if EOS_ID in window:
            window = window[window.index(EOS_ID) + 1 :] or window[: window.index(EOS_ID)]
        prompts.append([t for t in window if t != EOS_ID] or encode(" "))
    return prompts
