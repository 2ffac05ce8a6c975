import pytest
import torch

from ar_lab.base.errors import BadValue
from ar_lab.model.data import (
    builtin_corpus,
    builtin_documents,
    corpus_tokens,
    get_batch,
    load_text,
    tokenize_documents,
    train_val_split,
)
from ar_lab.model.tokenizer import EOS_ID, decode
from tests.raising import raises


def test_builtin_corpus_is_the_python_docs():
    docs = builtin_documents()
    assert len(docs) > 50
    text = builtin_corpus()
    assert len(text) > 100_000 and "assert" in text


def test_documents_are_separated_by_eos():
    ids = tokenize_documents(["ab", "c"])
    assert ids.tolist() == [97, 98, EOS_ID, 99, EOS_ID]
    assert (corpus_tokens() == EOS_ID).sum() == len(builtin_documents())


def test_user_text_file(tmp_path):
    p = tmp_path / "mine.txt"
    p.write_text("héllo wörld\n", encoding="utf-8")
    assert decode(corpus_tokens(p).tolist()) == "héllo wörld\n"


def test_bad_files_give_actionable_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such text file"):
        load_text(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with raises(BadValue, 'path'):
        load_text(tmp_path / "empty.txt")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00abc")
    with raises(BadValue, 'path'):
        load_text(tmp_path / "bin.txt")
    with pytest.raises(IsADirectoryError):
        load_text(tmp_path)


def test_split_is_deterministic_and_contiguous():
    t = torch.arange(1000)
    tr, va = train_val_split(t, 0.1)
    assert len(tr) == 900 and len(va) == 100
    assert torch.equal(torch.cat([tr, va]), t)
    with raises(BadValue, 'val_fraction'):
        train_val_split(t, 1.5)
    with raises(BadValue, 'tokens'):
        train_val_split(torch.arange(2), 0.5)


def test_batches_are_shifted_windows_and_seeded():
    t = torch.arange(500)
    x, y = get_batch(t, 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    x2, _ = get_batch(t, 4, 16, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)
    with raises(BadValue, 'block_size'):
        get_batch(torch.arange(10), 1, 16)
