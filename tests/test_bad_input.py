"""A learner's mistakes, probed across the package: every one gives an error that says what to do.

Three tables, one test each:

- ``CALLS``: a public function called wrongly (wrong types, empty inputs, negative, zero, NaN or
  infinite numbers, out-of-range token ids, prompts longer than the window, unknown devices,
  missing or corrupted files) raises the named error type carrying the argument at fault (``.arg``,
  also named in its message; ``tests/raising.py``), whatever the message's wording.
- ``WIDGETS``: an explorer control set to an out-of-range value shows the error in the widget
  (its ``error``, also in the status it displays) instead of clamping the value or raising; the
  error names the control.
- ``COMMANDS``: a command line given a bad option prints one error line naming the option, argument
  or file at fault (argparse's usage lines may come before it) and exits with status 2, without a
  traceback.

A case's name is the call as a learner would type it.
"""

from __future__ import annotations

import atexit
import functools
import html
import json
import math
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from ar_lab.base import timing
from ar_lab.base.errors import ArLabError, BadType, BadValue, ContextFull
from ar_lab.course.views import kv_calculator, quiz, speculative_view, widgets
from ar_lab.course.views.sampler_view import sampler_view
from ar_lab.engine import beam, lean, prefix_cache, prompts, sampling, serving, speculative
from ar_lab.engine.generate import generate, sample_batch, stream, token_steps
from ar_lab.engine.lean import NotLean
from ar_lab.engine.sampling import SamplingParams
from ar_lab.model import bigram, cache, data, tokenizer, train
from ar_lab.model.checkpoint import CheckpointError
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.perf import kv_sizing, measure, peaks, roofline, serving_measure, side_by_side
from tests.raising import check_error

# --- what the cases run on -----------------------------------------------------------------


@functools.cache
def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()


def mixed() -> GPT:
    """A model with one block cast to float64, the rest float32."""
    model = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=16)).eval()
    model.blocks[0].double()
    return model


def logits() -> torch.Tensor:
    return torch.randn(257, generator=torch.Generator().manual_seed(0))


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(0))


def _header(raw: bytes) -> tuple[dict, bytes]:
    """A safetensors file's header (JSON) and its tensor data."""
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _with_header(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + body


def _edited(raw: bytes, **metadata: str | None) -> bytes:
    """The checkpoint ``raw`` with header metadata entries replaced (None: removed), tensors
    untouched."""
    header, body = _header(raw)
    for key, value in metadata.items():
        if value is None:
            header["__metadata__"].pop(key, None)
        else:
            header["__metadata__"][key] = value
    return _with_header(header, body)


@functools.cache
def files() -> Path:
    """A folder of good and broken files, made once and removed at exit."""
    d = Path(tempfile.mkdtemp(prefix="ar_lab_bad_input_"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    good = d / "good.safetensors"
    train.save_checkpoint(good, tiny(), {"preset": "test"})
    raw = good.read_bytes()
    config = json.loads(_header(raw)[0]["__metadata__"]["config"])
    broken = {
        "truncated": raw[: len(raw) // 2],
        "header_only": raw[: 8 + int.from_bytes(raw[:8], "little")],
        "random": bytes(
            torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1)).tolist()
        ),
        "empty": b"",
        "text": b"this is not a checkpoint\n",
        "config_edited": _edited(raw, config=json.dumps({**config, "n_head": 1})),
        "record_edited": _edited(raw, record=json.dumps({"preset": "course"})),
        "config_not_json": _edited(raw, config="{n_layer: 1"),
        "record_not_json": _edited(raw, record="{'preset': 'test'"),
        "config_not_a_dict": _edited(raw, config="[1, 2]"),
        "not_ar_lab": _edited(raw, format=None),
    }
    for name, content in broken.items():
        (d / f"{name}.safetensors").write_bytes(content)
    body = bytearray(raw)
    body[-5] ^= 0xFF  # one flipped byte in the last tensor
    (d / "flipped.safetensors").write_bytes(bytes(body))
    (d / "folder.safetensors").mkdir()
    (d / "binary.txt").write_bytes(b"\xff\xfe\x00 not utf-8 \xc3")
    (d / "blank.txt").write_text("   \n")
    (d / "a_file").write_text("a file, not a folder")
    (d / "not_json.json").write_text("{oops")
    (d / "list.json").write_text("[1, 2]")
    result = {
        "schema": measure.SCHEMA,
        "device": {},
        "dtype": "float32",
        "versions": {},
        "date": "",
    }
    (d / "bad_peaks.json").write_text(json.dumps({**result, "peaks": "fast", "points": []}))
    (d / "corrupt_data").mkdir()
    for name in ("course", "draft"):
        (d / "corrupt_data" / f"{name}.safetensors").write_bytes(broken["truncated"])
    (d / "empty_data").mkdir()
    return d


def f(name: str) -> Path:
    return files() / name


def report(total_time: float) -> serving.ServeReport:
    result = serving.RequestResult(serving.Request("hi", 2), [104, 105], [1, 2], [0.0, 0.0])
    return serving.ServeReport("static", 1, [result], total_time, [0.0], [1], [0.0])


def greedy_view(prompt: str = "ab", **kw):
    return speculative_view.speculation_view(
        tiny(), tiny(), prompt, max_new_tokens=3, repeats=1, **kw
    )


# --- 1. calls --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    name: str
    run: Callable[[], object]
    error: type[BaseException]
    # the argument an ar_lab error names (its .arg); for a built-in error, what its message names
    arg: str | None


def check_call(case: Call) -> None:
    """``case`` raises its error type naming its argument (``tests/raising.check_error``), not a
    given wording."""
    with pytest.raises(case.error) as info:
        case.run()
    if isinstance(info.value, ArLabError):
        check_error(info.value, case.error, case.arg)
    else:  # a missing file: the built-in error, whose message names what was asked for
        assert case.arg in str(info.value), (
            f"{case.name}: {type(info.value).__name__}: {info.value}"
        )


NAN, INF = math.nan, math.inf

CALLS = [
    # tokenizer
    Call("decode('hello')", lambda: tokenizer.decode("hello"), BadType, "ids"),
    Call("decode([104.0, 105.0])", lambda: tokenizer.decode([104.0, 105.0]), BadType, "ids"),
    Call("decode([1.5])", lambda: tokenizer.decode([1.5]), BadType, "ids"),
    Call("decode([True, False])", lambda: tokenizer.decode([True, False]), BadType, "ids"),
    Call("decode([300])", lambda: tokenizer.decode([300]), BadValue, "ids"),
    Call("decode([-1])", lambda: tokenizer.decode([-1]), BadValue, "ids"),
    Call("decode(104)", lambda: tokenizer.decode(104), BadType, "ids"),
    Call("decode(None)", lambda: tokenizer.decode(None), BadType, "ids"),
    Call("decode(float tensor)", lambda: tokenizer.decode(torch.tensor([104.0])), BadType, "ids"),
    Call(
        "decode(2-D tensor)", lambda: tokenizer.decode(torch.tensor([[104, 105]])), BadValue, "ids"
    ),
    Call(
        "decode([104], stop_at_eos='no')",
        lambda: tokenizer.decode([104], "no"),
        BadType,
        "stop_at_eos",
    ),
    Call("encode(123)", lambda: tokenizer.encode(123), BadType, "text"),
    Call("encode(None)", lambda: tokenizer.encode(None), BadType, "text"),
    Call(
        "StreamDecoder().feed('a')",
        lambda: tokenizer.StreamDecoder().feed("a"),
        BadType,
        "token_id",
    ),
    Call(
        "StreamDecoder().feed(1.5)",
        lambda: tokenizer.StreamDecoder().feed(1.5),
        BadType,
        "token_id",
    ),
    Call(
        "StreamDecoder().feed(999)",
        lambda: tokenizer.StreamDecoder().feed(999),
        BadValue,
        "token_id",
    ),
    # data
    Call(
        "load_text('missing.txt')",
        lambda: data.load_text(f("missing.txt")),
        FileNotFoundError,
        "missing.txt",
    ),
    Call("load_text(folder)", lambda: data.load_text(files()), IsADirectoryError, "folder"),
    Call("load_text(binary file)", lambda: data.load_text(f("binary.txt")), BadValue, 'path'),
    Call("load_text(blank file)", lambda: data.load_text(f("blank.txt")), BadValue, 'path'),
    Call("load_text(123)", lambda: data.load_text(123), BadType, 'path'),
    Call(
        "corpus_tokens('missing.txt')",
        lambda: data.corpus_tokens(f("missing.txt")),
        FileNotFoundError,
        "missing.txt",
    ),
    Call(
        "tokenize_documents('one text')",
        lambda: data.tokenize_documents("a text"),
        BadType,
        "documents",
    ),
    Call("tokenize_documents([])", lambda: data.tokenize_documents([]), BadValue, "documents"),
    Call(
        "tokenize_documents([1, 2])", lambda: data.tokenize_documents([1, 2]), BadType, "documents"
    ),
    Call("train_val_split([1, 2, 3])", lambda: data.train_val_split([1, 2, 3]), BadType, "tokens"),
    Call(
        "train_val_split(t, 1.5)",
        lambda: data.train_val_split(tokens(), 1.5),
        BadValue,
        "val_fraction",
    ),
    Call(
        "train_val_split(t, nan)",
        lambda: data.train_val_split(tokens(), NAN),
        BadValue,
        "val_fraction",
    ),
    Call(
        "train_val_split(t, '0.1')",
        lambda: data.train_val_split(tokens(), "0.1"),
        BadValue,
        "val_fraction",
    ),
    Call(
        "train_val_split(2-D)",
        lambda: data.train_val_split(tokens().view(10, 20)),
        BadValue,
        "tokens",
    ),
    Call("get_batch(t, 2.5, 8)", lambda: data.get_batch(tokens(), 2.5, 8), BadValue, "batch_size"),
    Call("get_batch(t, 0, 8)", lambda: data.get_batch(tokens(), 0, 8), BadValue, "batch_size"),
    Call(
        "get_batch(t, 2, 1000)", lambda: data.get_batch(tokens(), 2, 1000), BadValue, "block_size"
    ),
    Call("get_batch([1, 2], 1, 1)", lambda: data.get_batch([1, 2, 3], 1, 1), BadType, "tokens"),
    # model config
    Call("GPTConfig(n_kv_heads=True)", lambda: GPTConfig(n_kv_heads=True), BadValue, 'n_kv_heads'),
    Call("GPTConfig(n_layer=True)", lambda: GPTConfig(n_layer=True), BadValue, 'n_layer'),
    Call("GPTConfig(n_head=2.0)", lambda: GPTConfig(n_head=2.0), BadValue, 'n_head'),
    Call("GPTConfig(n_head=3)", lambda: GPTConfig(n_head=3), BadValue, 'n_head'),
    Call("GPTConfig(n_kv_heads=3)", lambda: GPTConfig(n_kv_heads=3), BadValue, 'n_kv_heads'),
    Call("GPTConfig(n_kv_heads=0)", lambda: GPTConfig(n_kv_heads=0), BadValue, 'n_kv_heads'),
    Call("GPTConfig(block_size=0)", lambda: GPTConfig(block_size=0), BadValue, 'block_size'),
    Call("GPTConfig(dropout=1.5)", lambda: GPTConfig(dropout=1.5), BadValue, 'dropout'),
    Call("GPTConfig(dropout=nan)", lambda: GPTConfig(dropout=NAN), BadValue, 'dropout'),
    Call("GPTConfig(dropout='0.1')", lambda: GPTConfig(dropout="0.1"), BadValue, 'dropout'),
    Call("GPTConfig(dropout=False)", lambda: GPTConfig(dropout=False), BadValue, 'dropout'),
    # prompts (shared by every decode loop)
    Call("prompt_ids('')", lambda: prompts.prompt_ids(""), BadValue, "prompt"),
    Call("prompt_ids([])", lambda: prompts.prompt_ids([]), BadValue, "prompt"),
    Call("prompt_ids([1.5])", lambda: prompts.prompt_ids([1.5]), BadType, "prompt"),
    Call("prompt_ids(None)", lambda: prompts.prompt_ids(None), BadType, "prompt"),
    Call("prompt_ids(b'abc')", lambda: prompts.prompt_ids(b"abc"), BadType, "prompt"),
    Call(
        "prompt_ids(float tensor)",
        lambda: prompts.prompt_ids(torch.tensor([1.0])),
        BadType,
        "prompt",
    ),
    Call(
        "checked_prompt(m, [300], 1)",
        lambda: prompts.checked_prompt(tiny(), [300], 1),
        BadValue,
        "prompt",
    ),
    Call(
        "checked_prompt(m, 'x' * 40, 1)",
        lambda: prompts.checked_prompt(tiny(), "x" * 40, 1),
        ContextFull,
        "prompt",
    ),
    Call("check_budget(0)", lambda: prompts.check_budget(0), BadValue, "max_new_tokens"),
    # generate (the loops themselves)
    Call("generate(m, 'hi', 0)", lambda: generate(tiny(), "hi", 0), BadValue, "max_new_tokens"),
    Call("generate(m, 'hi', -1)", lambda: generate(tiny(), "hi", -1), BadValue, "max_new_tokens"),
    Call("generate(m, 'hi', 2.5)", lambda: generate(tiny(), "hi", 2.5), BadValue, "max_new_tokens"),
    Call("generate(m, 'hi', nan)", lambda: generate(tiny(), "hi", NAN), BadValue, "max_new_tokens"),
    Call("generate(m, '', 5)", lambda: generate(tiny(), "", 5), BadValue, "prompt"),
    Call("generate(m, [300], 5)", lambda: generate(tiny(), [300], 5), BadValue, "prompt"),
    Call(
        "generate(m, long prompt, 5)", lambda: generate(tiny(), "x" * 40, 5), ContextFull, "prompt"
    ),
    Call(
        "generate(m with one block in float64, 'hi', 2)",
        lambda: generate(mixed(), "hi", 2),
        BadValue,
        "model",
    ),
    Call(
        "sample_batch(mixed, ['hi'], 2)",
        lambda: sample_batch(mixed(), ["hi"], 2),
        BadValue,
        "model",
    ),
    Call(
        "generate(m, 'hi', 100)", lambda: generate(tiny(), "hi", 100), ContextFull, "max_new_tokens"
    ),
    Call(
        "generate(m, 'hi', sampling='greedy')",
        lambda: generate(tiny(), "hi", 2, sampling="greedy"),
        BadType,
        'sampling',
    ),
    Call(
        "generate(m, 'hi', stop_strings='\\n')",
        lambda: generate(tiny(), "hi", 2, stop_strings="\n"),
        BadValue,
        'stop_strings',
    ),
    Call(
        "generate(m, 'hi', stop_strings=[''])",
        lambda: generate(tiny(), "hi", 2, stop_strings=[""]),
        BadValue,
        'stop_strings',
    ),
    Call("stream(m, 'hi', 0)", lambda: stream(tiny(), "hi", 0), BadValue, 'max_new_tokens'),
    Call(
        "sample_batch(m, ['ab', 'abc'], 2)",
        lambda: sample_batch(tiny(), ["ab", "abc"], 2),
        BadValue,
        'prompts',
    ),
    Call("sample_batch(m, 'ab', 2)", lambda: sample_batch(tiny(), "ab", 2), BadValue, 'prompts'),
    Call(
        "sampler_view(m, '', params)",
        lambda: sampler_view(tiny(), "", SamplingParams()),
        BadValue,
        'prompt',
    ),
    Call(
        "sampler_view(m, 'hi', 'T=1')",
        lambda: sampler_view(tiny(), "hi", "T=1"),
        BadType,
        'params',
    ),
    # sampling
    Call(
        "SamplingParams(temperature=-1)",
        lambda: SamplingParams(temperature=-1),
        BadValue,
        "temperature",
    ),
    Call(
        "SamplingParams(temperature=nan)",
        lambda: SamplingParams(temperature=NAN),
        BadValue,
        "temperature",
    ),
    Call(
        "SamplingParams(temperature=inf)",
        lambda: SamplingParams(temperature=INF),
        BadValue,
        "temperature",
    ),
    Call(
        "SamplingParams(temperature='1')",
        lambda: SamplingParams(temperature="1"),
        BadValue,
        "temperature",
    ),
    Call("SamplingParams(top_k=0)", lambda: SamplingParams(top_k=0), BadValue, "top_k"),
    Call("SamplingParams(top_k=2.5)", lambda: SamplingParams(top_k=2.5), BadValue, "top_k"),
    Call("SamplingParams(top_k=True)", lambda: SamplingParams(top_k=True), BadValue, "top_k"),
    Call("SamplingParams(top_p=0)", lambda: SamplingParams(top_p=0), BadValue, "top_p"),
    Call("SamplingParams(top_p=1.5)", lambda: SamplingParams(top_p=1.5), BadValue, "top_p"),
    Call("SamplingParams(top_p=nan)", lambda: SamplingParams(top_p=NAN), BadValue, "top_p"),
    Call("SamplingParams(min_p=-0.1)", lambda: SamplingParams(min_p=-0.1), BadValue, "min_p"),
    Call("SamplingParams(min_p=nan)", lambda: SamplingParams(min_p=NAN), BadValue, "min_p"),
    Call(
        "SamplingParams(repetition_penalty=0)",
        lambda: SamplingParams(repetition_penalty=0),
        BadValue,
        'repetition_penalty',
    ),
    Call(
        "SamplingParams(repetition_penalty=inf)",
        lambda: SamplingParams(repetition_penalty=INF),
        BadValue,
        'repetition_penalty',
    ),
    Call("sample([0.1, 0.9])", lambda: sampling.sample([0.1, 0.9]), BadType, "logits"),
    Call("sample(int tensor)", lambda: sampling.sample(torch.tensor([1, 2])), BadType, "logits"),
    Call("sample(3-D logits)", lambda: sampling.sample(torch.zeros(1, 1, 5)), BadValue, "logits"),
    Call("sample(NaN logits)", lambda: sampling.sample(torch.full((5,), NAN)), BadValue, "logits"),
    Call(
        "sample(-inf logits)", lambda: sampling.sample(torch.full((5,), -INF)), BadValue, "logits"
    ),
    Call(
        "sample(logits, 'greedy')", lambda: sampling.sample(logits(), "greedy"), BadType, "params"
    ),
    Call(
        "sample(logits, generator=0)",
        lambda: sampling.sample(logits(), generator=0),
        BadType,
        "generator",
    ),
    Call(
        "apply_temperature(logits, -1)",
        lambda: sampling.apply_temperature(logits(), -1),
        BadValue,
        "temperature",
    ),
    Call("filter_top_k(logits, 0)", lambda: sampling.filter_top_k(logits(), 0), BadValue, "k"),
    Call("filter_top_p(logits, 2)", lambda: sampling.filter_top_p(logits(), 2), BadValue, "p"),
    Call(
        "filter_min_p(logits, -1)", lambda: sampling.filter_min_p(logits(), -1), BadValue, "min_p"
    ),
    Call(
        "apply_repetition_penalty(logits, [1], 0)",
        lambda: sampling.apply_repetition_penalty(logits(), [1], 0),
        BadValue,
        'penalty',
    ),
    Call(
        "apply_repetition_penalty(logits, [1], -2)",
        lambda: sampling.apply_repetition_penalty(logits(), [1], -2),
        BadValue,
        'penalty',
    ),
    Call(
        "apply_repetition_penalty(logits, [1], nan)",
        lambda: sampling.apply_repetition_penalty(logits(), [1], NAN),
        BadValue,
        'penalty',
    ),
    Call(
        "apply_repetition_penalty(logits, [300], 1.2)",
        lambda: sampling.apply_repetition_penalty(logits(), [300], 1.2),
        BadValue,
        'history',
    ),
    Call(
        "apply_repetition_penalty(logits, [1.5], 1.2)",
        lambda: sampling.apply_repetition_penalty(logits(), [1.5], 1.2),
        BadType,
        'history',
    ),
    Call("entropy_bits([0.5, 0.5])", lambda: sampling.entropy_bits([0.5, 0.5]), BadType, "probs"),
    Call(
        "repeated_ngram_fraction('abc')",
        lambda: sampling.repeated_ngram_fraction("abcd"),
        BadType,
        "tokens",
    ),
    Call(
        "repeated_ngram_fraction([1, 2], 0)",
        lambda: sampling.repeated_ngram_fraction([1, 2], 0),
        BadValue,
        "n",
    ),
    # beam search
    Call(
        "beam_search(m, 'hi', 2, num_beams=0)",
        lambda: beam.beam_search(tiny(), "hi", 2, num_beams=0),
        BadValue,
        'num_beams',
    ),
    Call(
        "beam_search(m, 'hi', 2, length_penalty=nan)",
        lambda: beam.beam_search(tiny(), "hi", 2, length_penalty=NAN),
        BadValue,
        'length_penalty',
    ),
    Call(
        "beam_search(m, 'hi', 2, eos_id=999)",
        lambda: beam.beam_search(tiny(), "hi", 2, eos_id=999),
        BadValue,
        'eos_id',
    ),
    Call(
        "beam_search(m, 'hi', 2, eos_id='.')",
        lambda: beam.beam_search(tiny(), "hi", 2, eos_id="."),
        BadValue,
        'eos_id',
    ),
    Call("beam_search(m, '', 2)", lambda: beam.beam_search(tiny(), "", 2), BadValue, "prompts"),
    Call(
        "beam_search(m, 'hi', 0)",
        lambda: beam.beam_search(tiny(), "hi", 0),
        BadValue,
        "max_new_tokens",
    ),
    Call(
        "beam_search(m, long prompt, 2)",
        lambda: beam.beam_search(tiny(), "x" * 40, 2),
        ContextFull,
        "prompts",
    ),
    Call(
        "beam_search_batch(m, 'hi', 2)",
        lambda: beam.beam_search_batch(tiny(), "hi", 2),
        BadValue,
        "prompts",
    ),
    Call(
        "length_normalised(-1.0, 0, 1.0)",
        lambda: beam.length_normalised(-1.0, 0, 1.0),
        BadValue,
        "length",
    ),
    # bigram
    Call("bigram_counts([1, 2, 3])", lambda: bigram.bigram_counts([1, 2, 3]), BadType, 'tokens'),
    Call(
        "bigram_counts(tensor([1, 300]))",
        lambda: bigram.bigram_counts(torch.tensor([1, 300])),
        BadValue,
        'tokens',
    ),
    Call(
        "bigram_counts(float tensor)",
        lambda: bigram.bigram_counts(torch.tensor([1.0, 2.0])),
        BadType,
        "tokens",
    ),
    Call(
        "bigram_counts(tensor([5]))",
        lambda: bigram.bigram_counts(torch.tensor([5])),
        BadValue,
        "tokens",
    ),
    Call(
        "BigramModel.from_tokens(t, smoothing=-1)",
        lambda: bigram.BigramModel.from_tokens(tokens(), smoothing=-1),
        BadValue,
        'smoothing',
    ),
    Call(
        "BigramModel.from_tokens(t, smoothing=nan)",
        lambda: bigram.BigramModel.from_tokens(tokens(), smoothing=NAN),
        BadValue,
        'smoothing',
    ),
    Call(
        "BigramModel([[1, 2], [3, 4]])",
        lambda: bigram.BigramModel([[1, 2], [3, 4]]),
        BadType,
        "counts",
    ),
    # quiz
    Call("questions('99')", lambda: quiz.questions("99"), BadValue, "chapter"),
    Call("questions(None)", lambda: quiz.questions(None), BadValue, "chapter"),
    Call(
        "check_answer(q, 10)",
        lambda: quiz.check_answer(quiz.questions("01")[0], 10),
        BadValue,
        "choice",
    ),
    Call(
        "check_answer(q, -1)",
        lambda: quiz.check_answer(quiz.questions("01")[0], -1),
        BadValue,
        "choice",
    ),
    Call(
        "check_answer(q, '1')",
        lambda: quiz.check_answer(quiz.questions("01")[0], "1"),
        BadType,
        "choice",
    ),
    Call(
        "check_answer(q, 1.5)",
        lambda: quiz.check_answer(quiz.questions("01")[0], 1.5),
        BadType,
        "choice",
    ),
    Call(
        "check_answer(q, True)",
        lambda: quiz.check_answer(quiz.questions("01")[0], True),
        BadType,
        "choice",
    ),
    Call("show('01').check(99)", lambda: quiz.show("01").check(99), BadValue, "i"),
    # prefix cache
    Call("PrefixCache(m, '')", lambda: prefix_cache.PrefixCache(tiny(), ""), BadValue, "prefix"),
    Call(
        "PrefixCache(m, 'x' * 40)",
        lambda: prefix_cache.PrefixCache(tiny(), "x" * 40),
        ContextFull,
        "prefix",
    ),
    Call(
        "PrefixCache(m, 'ab').cache_for('abc', 0)",
        lambda: prefix_cache.PrefixCache(tiny(), "ab").cache_for("abc", 0),
        BadValue,
        'max_new_tokens',
    ),
    Call(
        "PrefixCache(m, 'ab').cache_for('abc', -5)",
        lambda: prefix_cache.PrefixCache(tiny(), "ab").cache_for("abc", -5),
        BadValue,
        'max_new_tokens',
    ),
    Call(
        "PrefixCache(m, 'ab').cache_for('abc', 100)",
        lambda: prefix_cache.PrefixCache(tiny(), "ab").cache_for("abc", 100),
        ContextFull,
        'max_new_tokens',
    ),
    Call(
        "reusable_length([1], [])",
        lambda: prefix_cache.reusable_length([1], []),
        BadValue,
        "prompt",
    ),
    # serving
    Call(
        "latency_budget(nan, 0.1, 5)", lambda: serving.latency_budget(NAN, 0.1, 5), BadValue, "ttft"
    ),
    Call(
        "latency_budget('1', 0.1, 5)", lambda: serving.latency_budget("1", 0.1, 5), BadValue, "ttft"
    ),
    Call(
        "latency_budget(0.1, 0.1, 0)",
        lambda: serving.latency_budget(0.1, 0.1, 0),
        BadValue,
        "n_tokens",
    ),
    Call(
        "tokens_within(nan, 0.1, 0.01)",
        lambda: serving.tokens_within(NAN, 0.1, 0.01),
        BadValue,
        "budget",
    ),
    Call(
        "tokens_within(inf, 0.1, 0.01)",
        lambda: serving.tokens_within(INF, 0.1, 0.01),
        BadValue,
        "budget",
    ),
    Call(
        "tokens_within(-1, 0.1, 0.01)",
        lambda: serving.tokens_within(-1, 0.1, 0.01),
        BadValue,
        "budget",
    ),
    Call("tokens_within(1, 0.1, 0)", lambda: serving.tokens_within(1, 0.1, 0), BadValue, "tpot"),
    Call(
        "tokens_within('1', 0.1, 0.01)",
        lambda: serving.tokens_within("1", 0.1, 0.01),
        BadValue,
        "budget",
    ),
    Call(
        "ServeReport(total_time=0).throughput",
        lambda: report(0.0).throughput,
        BadValue,
        "total_time",
    ),
    Call(
        "StreamSummary(total=0).tokens_per_s",
        lambda: serving.StreamSummary(0.0, 0.0, 3, 0.0).tokens_per_s,
        BadValue,
        'total',
    ),
    Call(
        "StreamSummary(tpot=0).decode_tokens_per_s",
        lambda: serving.StreamSummary(0.1, 0.0, 3, 0.1).decode_tokens_per_s,
        BadValue,
        'tpot',
    ),
    Call("serve(m, [])", lambda: serving.serve(tiny(), []), BadValue, 'requests'),
    Call("serve(m, ['hi'])", lambda: serving.serve(tiny(), ["hi"]), BadType, 'requests'),
    Call(
        "serve(m, [Request('hi', 0)])",
        lambda: serving.serve(tiny(), [serving.Request("hi", 0)]),
        BadValue,
        'requests',
    ),
    Call(
        "serve(m, [Request(long, 2)])",
        lambda: serving.serve(tiny(), [serving.Request("x" * 40, 2)]),
        ContextFull,
        'requests',
    ),
    Call(
        "serve(m, reqs, max_batch=0)",
        lambda: serving.serve(tiny(), [serving.Request("hi", 2)], max_batch=0),
        BadValue,
        'max_batch',
    ),
    Call(
        "serve(m, reqs, policy='fifo')",
        lambda: serving.serve(tiny(), [serving.Request("hi", 2)], policy="fifo"),
        BadValue,
        'policy',
    ),
    Call(
        "serve(m, reqs, eos_id='.')",
        lambda: serving.serve(tiny(), [serving.Request("hi", 2)], eos_id="."),
        BadValue,
        'eos_id',
    ),
    Call(
        "serve(m, reqs, prefix='hi')",
        lambda: serving.serve(tiny(), [serving.Request("hi", 2)], prefix="hi"),
        BadType,
        'prefix',
    ),
    Call(
        "serve(m, [Request('hi', 2, seed='a')])",
        lambda: serving.serve(
            tiny(), [serving.Request("hi", 2, seed="a")], sampling=SamplingParams()
        ),
        BadValue,
        'requests',
    ),
    Call(
        "generate_batch(m, ['a', 'b'], 2.5)",
        lambda: serving.generate_batch(tiny(), ["a", "b"], 2.5),
        BadValue,
        'max_new_tokens',
    ),
    Call(
        "generate_batch(m, ['a', 'b'], [2])",
        lambda: serving.generate_batch(tiny(), ["a", "b"], [2]),
        BadValue,
        'max_new_tokens',
    ),
    Call("simulate(5, 2)", lambda: serving.simulate(5, 2), BadValue, 'steps_needed'),
    Call("simulate([1, -1], 2)", lambda: serving.simulate([1, -1], 2), BadValue, 'steps_needed'),
    Call("simulate([1], 0)", lambda: serving.simulate([1], 0), BadValue, 'max_batch'),
    # serving measured
    Call("mixed_workload(0)", lambda: serving_measure.mixed_workload(0), BadValue, 'n_requests'),
    Call(
        "compare_policies(m, reqs, 2, repeats=0)",
        lambda: serving_measure.compare_policies(tiny(), [serving.Request("hi", 2)], 2, repeats=0),
        BadValue,
        'repeats',
    ),
    Call(
        "decode_throughput(m, [0])",
        lambda: serving_measure.decode_throughput(tiny(), [0]),
        BadValue,
        "batch_sizes",
    ),
    Call(
        "decode_throughput(m, [1], context=8, steps=0)",
        lambda: serving_measure.decode_throughput(tiny(), [1], context=8, steps=0),
        BadValue,
        'steps',
    ),
    Call(
        "decode_throughput(m, [1], context=8, repeats=0)",
        lambda: serving_measure.decode_throughput(tiny(), [1], context=8, repeats=0),
        BadValue,
        'repeats',
    ),
    Call(
        "decode_throughput(m, [1], context=100)",
        lambda: serving_measure.decode_throughput(tiny(), [1], context=100),
        ContextFull,
        'context',
    ),
    Call(
        "prefix_ttft(m, 'ab', 'cd')",
        lambda: serving_measure.prefix_ttft(tiny(), "ab", "cd"),
        BadType,
        'suffixes',
    ),
    Call(
        "prefix_ttft(m, 'ab', [])",
        lambda: serving_measure.prefix_ttft(tiny(), "ab", []),
        BadValue,
        "suffixes",
    ),
    # roofline arithmetic
    Call("parameter_count('small')", lambda: roofline.parameter_count("small"), BadType, "cfg"),
    Call(
        "forward_cost(cfg, 0, 1, 0)",
        lambda: roofline.forward_cost(GPTConfig(), 0, 1, 0),
        BadValue,
        "batch",
    ),
    Call(
        "forward_cost(cfg, 1, 1, -1)",
        lambda: roofline.forward_cost(GPTConfig(), 1, 1, -1),
        BadValue,
        "past",
    ),
    Call(
        "forward_cost(cfg, 1, 1, True)",
        lambda: roofline.forward_cost(GPTConfig(), 1, 1, True),
        BadValue,
        "past",
    ),
    Call(
        "prefill_cost(cfg, 5000)",
        lambda: roofline.prefill_cost(GPTConfig(), 5000),
        ContextFull,
        "prompt_len",
    ),
    Call("decode_cost(cfg, 0)", lambda: roofline.decode_cost(GPTConfig(), 0), BadValue, "context"),
    Call("ridge_point(0, 1e9)", lambda: roofline.ridge_point(0, 1e9), BadValue, "peak_flops"),
    Call("ridge_point(inf, 1e9)", lambda: roofline.ridge_point(INF, 1e9), BadValue, "peak_flops"),
    Call(
        "ridge_point('1e12', 1e9)",
        lambda: roofline.ridge_point("1e12", 1e9),
        BadValue,
        "peak_flops",
    ),
    Call(
        "attainable_flops(nan, 1e12, 1e9)",
        lambda: roofline.attainable_flops(NAN, 1e12, 1e9),
        BadValue,
        "intensity",
    ),
    Call(
        "attainable_flops(-1, 1e12, 1e9)",
        lambda: roofline.attainable_flops(-1, 1e12, 1e9),
        BadValue,
        "intensity",
    ),
    Call(
        "attainable_flops('a', 1e12, 1e9)",
        lambda: roofline.attainable_flops("a", 1e12, 1e9),
        BadType,
        "intensity",
    ),
    Call(
        "approx_prefill_flops(-1, 5)",
        lambda: roofline.approx_prefill_flops(-1, 5),
        BadValue,
        "n_params",
    ),
    Call(
        "approx_ttft(1e6, 10, 0)", lambda: roofline.approx_ttft(1e6, 10, 0), BadValue, "peak_flops"
    ),
    Call("approx_tpot(1e6, 0)", lambda: roofline.approx_tpot(1e6, 0), BadValue, "bandwidth"),
    Call(
        "approx_decode_bytes(nan)", lambda: roofline.approx_decode_bytes(NAN), BadValue, "n_params"
    ),
    Call(
        "prefill_cost(cfg, 8).time_at(0, 1e9)",
        lambda: roofline.prefill_cost(GPTConfig(), 8).time_at(0, 1e9),
        BadValue,
        'peak_flops',
    ),
    Call("format_si('a', 'B')", lambda: roofline.format_si("a", "B"), BadType, 'value'),
    # timing and devices
    Call("synchronize('banana')", lambda: timing.synchronize("banana"), BadValue, "device"),
    Call("steady_clock('banana')", lambda: timing.steady_clock("banana"), BadValue, "device"),
    Call("device_name('banana')", lambda: timing.device_name("banana"), BadValue, "device"),
    Call("machine('mps')", lambda: timing.machine("mps"), BadValue, "device"),
    Call("time_call('f')", lambda: timing.time_call("f"), BadType, "fn"),
    Call(
        "time_call(f, repeats=0)",
        lambda: timing.time_call(lambda: None, repeats=0),
        BadValue,
        "repeats",
    ),
    Call(
        "time_call(f, device='banana')",
        lambda: timing.time_call(lambda: None, device="banana"),
        BadValue,
        'device',
    ),
    Call("median([])", lambda: timing.median([]), BadValue, 'values'),
    # peaks and measurements
    Call(
        "measure_matmul_peak('banana')",
        lambda: peaks.measure_matmul_peak("banana"),
        BadValue,
        "device",
    ),
    Call(
        "measure_matmul_peak('mps')", lambda: peaks.measure_matmul_peak("mps"), BadValue, "device"
    ),
    Call(
        "measure_matmul_peak('cpu', size=0)",
        lambda: peaks.measure_matmul_peak("cpu", size=0),
        BadValue,
        "size",
    ),
    Call(
        "measure_bandwidth('cpu', nbytes=10)",
        lambda: peaks.measure_bandwidth("cpu", nbytes=10),
        BadValue,
        'nbytes',
    ),
    Call("measure_peaks('banana')", lambda: peaks.measure_peaks("banana"), BadValue, "device"),
    Call("default_dtype('banana')", lambda: peaks.default_dtype("banana"), BadValue, "device"),
    Call(
        "measure_prefill(m, 0)", lambda: measure.measure_prefill(tiny(), 0), BadValue, "prompt_len"
    ),
    Call(
        "measure_prefill(m, 100)",
        lambda: measure.measure_prefill(tiny(), 100),
        ContextFull,
        "prompt_len",
    ),
    Call("measure_decode(m, 0)", lambda: measure.measure_decode(tiny(), 0), BadValue, "context"),
    Call(
        "measure_decode(m, 8, repeats=0)",
        lambda: measure.measure_decode(tiny(), 8, repeats=0),
        BadValue,
        "repeats",
    ),
    Call(
        "fastest_threads(m, candidates=[0])",
        lambda: measure.fastest_threads(tiny(), 8, [0]),
        BadValue,
        "candidates",
    ),
    Call(
        "build_model(cfg, 'banana')",
        lambda: measure.build_model(GPTConfig(n_layer=1), "banana"),
        BadValue,
        'device',
    ),
    Call("build_model('small')", lambda: measure.build_model("small"), BadType, 'cfg'),
    Call(
        "run_roofline(m, prompt_lens=[100], peaks=...)",
        lambda: measure.run_roofline(
            tiny(), [100], peaks={"matmul_flops_per_s": 1.0, "bandwidth_bytes_per_s": 1.0}
        ),
        ContextFull,
        'prompt_lens',
    ),
    Call(
        "run_roofline(m, peaks={})",
        lambda: measure.run_roofline(tiny(), [4], [1], 8, peaks={}),
        BadValue,
        "peaks",
    ),
    Call(
        "decode_bandwidth_fraction(m, pairs=0)",
        lambda: side_by_side.decode_bandwidth_fraction(tiny(), 8, pairs=0),
        BadValue,
        'pairs',
    ),
    Call(
        "load_result('missing.json')",
        lambda: measure.load_result(f("missing.json")),
        FileNotFoundError,
        "no roofline result",
    ),
    Call(
        "load_result(folder)",
        lambda: measure.load_result(files()),
        FileNotFoundError,
        "no roofline result",
    ),
    Call(
        "load_result(binary file)", lambda: measure.load_result(f("binary.txt")), BadValue, "path"
    ),
    Call(
        "load_result(not json)", lambda: measure.load_result(f("not_json.json")), BadValue, "path"
    ),
    Call("load_result(a list)", lambda: measure.load_result(f("list.json")), BadValue, "path"),
    Call(
        "load_result(peaks='fast')",
        lambda: measure.load_result(f("bad_peaks.json")),
        BadValue,
        "path",
    ),
    Call(
        "reference_files('missing_dir')",
        lambda: measure.reference_files(f("missing_dir")),
        FileNotFoundError,
        "no folder",
    ),
    # speculative explorer's function
    Call("speculation_view(m, d, '')", lambda: greedy_view(""), BadValue, "prompt"),
    Call(
        "speculation_view(m, d, 'ab', gamma=100)", lambda: greedy_view(gamma=100), BadValue, "gamma"
    ),
    Call(
        "speculation_view(m, d, 'ab', gamma=-1)", lambda: greedy_view(gamma=-1), BadValue, "gamma"
    ),
    Call(
        "speculation_view(m, d, long prompt)", lambda: greedy_view("x" * 40), ContextFull, "prompt"
    ),
    Call(
        "speculation_view(m, d, 'ab', repeats=0)",
        lambda: speculative_view.speculation_view(tiny(), tiny(), "ab", repeats=0),
        BadValue,
        'repeats',
    ),
    Call("benchmark_prompts(0)", lambda: data.benchmark_prompts(0), BadValue, 'n'),
    # widgets' pure functions and builders
    Call(
        "kv_cache_table_html(shape, -1, 1, 'float32')",
        lambda: kv_calculator.kv_cache_table_html(widgets_shape(), -1, 1, "float32"),
        BadValue,
        'seq_len',
    ),
    Call(
        "kv_cache_table_html(shape, 8, 1, 'fp7')",
        lambda: kv_calculator.kv_cache_table_html(widgets_shape(), 8, 1, "fp7"),
        BadValue,
        'dtype',
    ),
    Call(
        "kv_cache_calculator('GPT-9')",
        lambda: kv_calculator.kv_cache_calculator("GPT-9"),
        BadValue,
        "preset",
    ),
    Call(
        "kv_cache_calculator(dtype='fp7')",
        lambda: kv_calculator.kv_cache_calculator(dtype="fp7"),
        BadValue,
        "dtype",
    ),
    Call("sampler_explorer(None)", lambda: widgets.sampler_explorer(None), BadType, "model"),
    Call(
        "speculation_explorer(m, {})",
        lambda: widgets.speculation_explorer(tiny(), {}),
        BadValue,
        "drafts",
    ),
    # checkpoints
    Call(
        "load_checkpoint('missing')",
        lambda: train.load_checkpoint(f("missing.safetensors")),
        FileNotFoundError,
        "no checkpoint",
    ),
    Call(
        "load_checkpoint(folder)",
        lambda: train.load_checkpoint(f("folder.safetensors")),
        FileNotFoundError,
        "no checkpoint",
    ),
    *[
        Call(
            f"load_checkpoint({name} file)",
            lambda name=name: train.load_checkpoint(f(f"{name}.safetensors")),
            CheckpointError,
            "path",
        )
        for name in [
            "truncated",
            "header_only",
            "random",
            "empty",
            "text",
            "flipped",
            "config_edited",
            "record_edited",
            "config_not_json",
            "record_not_json",
            "config_not_a_dict",
            "not_ar_lab",
        ]
    ],
    Call(
        "read_checkpoint_metadata(config edited)",
        lambda: train.read_checkpoint_metadata(f("config_edited.safetensors")),
        CheckpointError,
        'path',
    ),
    Call(
        "read_checkpoint_metadata(record not json)",
        lambda: train.read_checkpoint_metadata(f("record_not_json.safetensors")),
        CheckpointError,
        'path',
    ),
    Call(
        "load_checkpoint(good, 'banana')",
        lambda: train.load_checkpoint(f("good.safetensors"), "banana"),
        BadValue,
        'device',
    ),
    Call(
        "load_checkpoint(good, 'mps')",
        lambda: train.load_checkpoint(f("good.safetensors"), "mps"),
        BadValue,
        'device',
    ),
    Call("load_pretrained('gpt2')", lambda: train.load_pretrained("gpt2"), BadValue, 'name'),
    Call(
        "load_pretrained('course', 'banana')",
        lambda: train.load_pretrained("course", "banana"),
        BadValue,
        'device',
    ),
    Call(
        "save_checkpoint(path, 'model')",
        lambda: train.save_checkpoint(f("x.safetensors"), "model"),
        BadType,
        "model",
    ),
    Call(
        "save_checkpoint(path, m, record={'f': print})",
        lambda: train.save_checkpoint(f("y.safetensors"), tiny(), {"f": print}),
        BadValue,
        'record',
    ),
    Call(
        "save_checkpoint(folder, m)",
        lambda: train.save_checkpoint(files(), tiny()),
        BadValue,
        "path",
    ),
    # training
    Call("TrainConfig(steps=0)", lambda: train.TrainConfig(steps=0), BadValue, "steps"),
    Call("TrainConfig(steps=True)", lambda: train.TrainConfig(steps=True), BadValue, "steps"),
    Call("TrainConfig(lr=nan)", lambda: train.TrainConfig(lr=NAN), BadValue, "lr"),
    Call("TrainConfig(lr=inf)", lambda: train.TrainConfig(lr=INF), BadValue, "lr"),
    Call("TrainConfig(lr='1e-3')", lambda: train.TrainConfig(lr="1e-3"), BadValue, "lr"),
    Call(
        "TrainConfig(warmup_steps=-5)",
        lambda: train.TrainConfig(warmup_steps=-5),
        BadValue,
        "warmup_steps",
    ),
    Call(
        "TrainConfig(min_lr_ratio=-1)",
        lambda: train.TrainConfig(min_lr_ratio=-1),
        BadValue,
        "min_lr_ratio",
    ),
    Call(
        "TrainConfig(weight_decay=-0.1)",
        lambda: train.TrainConfig(weight_decay=-0.1),
        BadValue,
        "weight_decay",
    ),
    Call("TrainConfig(grad_clip=0)", lambda: train.TrainConfig(grad_clip=0), BadValue, "grad_clip"),
    Call("TrainConfig(seed='a')", lambda: train.TrainConfig(seed="a"), BadValue, "seed"),
    Call("TrainConfig(teacher=1)", lambda: train.TrainConfig(teacher=1), BadValue, "teacher"),
    Call(
        "train(m, t, t, tc='fast')",
        lambda: train.train(tiny(), tokens(), tokens(), "fast"),
        BadType,
        "tc",
    ),
    Call(
        "train(m, [1, 2], t)",
        lambda: train.train(tiny(), [1, 2, 3], tokens(), train.TrainConfig(block_size=8)),
        BadType,
        'train_tokens',
    ),
    Call(
        "train(m, t, t, block_size > window)",
        lambda: train.train(tiny(), tokens(), tokens(), train.TrainConfig()),
        ContextFull,
        'tc',
    ),
    Call(
        "evaluate(m, t, 8, batches=0)",
        lambda: train.evaluate(tiny(), tokens(), 8, batches=0),
        BadValue,
        "batches",
    ),
    Call(
        "evaluate(m, t, 100)",
        lambda: train.evaluate(tiny(), tokens(), 100),
        ContextFull,
        "block_size",
    ),
    Call("checkpoint_path('gpt2')", lambda: train.checkpoint_path("gpt2"), BadValue, "name"),
    Call("train_preset('gpt2')", lambda: train.train_preset("gpt2"), BadValue, "name"),
]


# The other decode-loop files (cache, lean, generate, speculative, model.forward): probed here too.
CALLS += [
    Call("GPT('small')", lambda: GPT("small"), BadType, 'config'),
    Call("model(float idx)", lambda: tiny()(torch.zeros(1, 4)), BadType, 'idx'),
    Call("model(1-D idx)", lambda: tiny()(torch.tensor([1, 2])), BadValue, 'idx'),
    Call(
        "model(idx longer than the window)",
        lambda: tiny()(torch.zeros(1, 40, dtype=torch.long)),
        ContextFull,
        'idx',
    ),
    Call(
        "KVCache.for_model(m, max_len=0)",
        lambda: cache.KVCache.for_model(tiny(), max_len=0),
        BadValue,
        "max_len",
    ),
    Call(
        "KVCache.for_model(m, batch_size=0)",
        lambda: cache.KVCache.for_model(tiny(), batch_size=0),
        BadValue,
        'batch_size',
    ),
    Call(
        "KVCache.for_model(m, max_len=100)",
        lambda: cache.KVCache.for_model(tiny(), max_len=100),
        ContextFull,
        'max_len',
    ),
    Call(
        "KVCache.truncate(-1)", lambda: cache.KVCache.for_model(tiny()).truncate(-1), BadValue, "n"
    ),
    Call(
        "kv_cache_bytes(-1, 1, 1, 1)",
        lambda: cache.kv_cache_bytes(-1, 1, 1, 1),
        BadValue,
        "n_layer",
    ),
    Call(
        "kv_cache_bytes(True, 1, 1, 1)",
        lambda: cache.kv_cache_bytes(True, 1, 1, 1),
        BadValue,
        "n_layer",
    ),
    Call(
        "cache_sizes(shape, -1)",
        lambda: kv_sizing.cache_sizes(widgets_shape(), -1),
        BadValue,
        "seq_len",
    ),
    Call("format_bytes(nan)", lambda: kv_sizing.format_bytes(NAN), BadValue, "n"),
    Call(
        "BatchKVCache.for_model(m, 0)",
        lambda: cache.BatchKVCache.for_model(tiny(), 0),
        BadValue,
        "max_batch",
    ),
    Call(
        "BatchKVCache.slot(99)",
        lambda: cache.BatchKVCache.for_model(tiny(), 2).slot(99),
        BadValue,
        "slot",
    ),
    Call(
        "BatchKVCache.remove(5)",
        lambda: cache.BatchKVCache.for_model(tiny(), 2).remove(5),
        BadValue,
        "i",
    ),
    Call("lean step past the window", lambda: lean_step_past_the_window(), ContextFull, "cache"),
    Call(
        "speculative_generate(m, m, 'hi', 5, gamma=-1)",
        lambda: speculative.speculative_generate(tiny(), tiny(), "hi", 5, -1),
        BadValue,
        'gamma',
    ),
    Call(
        "speculative_generate(m, m, 'hi', 5, gamma=2.5)",
        lambda: speculative.speculative_generate(tiny(), tiny(), "hi", 5, 2.5),
        BadValue,
        'gamma',
    ),
    Call(
        "speculative_generate(m, m, long prompt, 5)",
        lambda: speculative.speculative_generate(tiny(), tiny(), "x" * 40, 5),
        ContextFull,
        'prompt',
    ),
    Call(
        "speculative_generate(m, m, 'hi', 0)",
        lambda: speculative.speculative_generate(tiny(), tiny(), "hi", 0),
        BadValue,
        'max_new_tokens',
    ),
    Call(
        "speculative_generate(m, m, 'hi', sampling='greedy')",
        lambda: speculative.speculative_generate(tiny(), tiny(), "hi", 5, sampling="greedy"),
        BadType,
        'sampling',
    ),
    Call(
        "speculative_generate(m, draft of another vocabulary)",
        lambda: speculative.speculative_generate(
            tiny(),
            GPT(GPTConfig(vocab_size=100, block_size=32, n_layer=1, n_head=2, n_embd=16)),
            "hi",
            5,
        ),
        BadValue,
        'draft',
    ),
    Call(
        "expected_speedup(nan, 2, 0.1)",
        lambda: speculative.expected_speedup(NAN, 2, 0.1),
        BadValue,
        "alpha",
    ),
    Call(
        "expected_speedup(0.5, 2, inf)",
        lambda: speculative.expected_speedup(0.5, 2, INF),
        BadValue,
        "c",
    ),
    Call(
        "alpha_for_speedup(nan, 2, 0.1)",
        lambda: speculative.alpha_for_speedup(NAN, 2, 0.1),
        BadValue,
        "speedup",
    ),
    Call(
        "generate(m, 'hi', 5, generator=0)",
        lambda: generate(tiny(), "hi", 5, sampling=SamplingParams(), generator=0),
        BadType,
        'generator',
    ),
    Call(
        "generate(m, 'hi', 5, cache='x')",
        lambda: generate(tiny(), "hi", 5, cache="x"),
        BadType,
        "cache",
    ),
    Call(
        "generate(m, 'hi', 5, cache too small)",
        lambda: generate(tiny(), "hi", 5, cache=cache.KVCache.for_model(tiny(), max_len=3)),
        ContextFull,
        'cache',
    ),
    Call("generate('model', 'hi', 5)", lambda: generate("model", "hi", 5), BadType, 'model'),
    Call(
        "sample_batch(m, ['a', 'b'], 2, generator=0)",
        lambda: sample_batch(tiny(), ["a", "b"], 2, generator=0),
        BadType,
        'generator',
    ),
]


def lean_step_past_the_window():
    c = cache.KVCache.for_model(tiny())
    c.length = tiny().config.block_size
    return lean.for_model(tiny()).step(1, c)


# Mistakes in the decode loop's own files (model, cache, lean, generate, speculative).
ELSEWHERE = [
    Call(
        "model(idx holding id 300)  [model.py forward]",
        lambda: tiny()(torch.tensor([[300]])),
        BadValue,
        "idx",
    ),
    Call(
        "AttentionShape(..., rope_dim=True)  [cache.py]",
        lambda: kv_sizing.AttentionShape(1, 1, 1, 1, 1, True),
        BadValue,
        'rope_dim',
    ),
    Call("format_bytes(inf)  [cache.py]", lambda: kv_sizing.format_bytes(INF), BadValue, 'n'),
    Call("format_bytes('1')  [cache.py]", lambda: kv_sizing.format_bytes("1"), BadValue, 'n'),
    Call("lean.for_model('x')  [lean.py]", lambda: lean.for_model("x"), NotLean, 'model'),
    Call(
        "lean step(300, cache)  [lean.py]",
        lambda: lean.for_model(tiny()).step(300, cache.KVCache.for_model(tiny())),
        BadValue,
        'token',
    ),
    Call(
        "weights_only_pass(m, 0)  [lean.py]",
        lambda: lean.weights_only_pass(tiny(), 0),
        BadValue,
        "steps",
    ),
    Call(
        "speculative_generate(m, m, 'hi', 5, eos_id='.')  [speculative.py]",
        lambda: speculative.speculative_generate(tiny(), tiny(), "hi", 5, eos_id="."),
        BadValue,
        'eos_id',
    ),
    Call(
        "acceptance_rate([0.5, 0.5], [0.5, 0.5])  [speculative.py]",
        lambda: speculative.acceptance_rate([0.5, 0.5], [0.5, 0.5]),
        BadType,
        'p',
    ),
    Call(
        "generate(m, 'hi', 5, eos_id='.')  [generate.py]",
        lambda: generate(tiny(), "hi", 5, eos_id="."),
        BadValue,
        'eos_id',
    ),
    Call(
        "generate(m, 'hi', 5, eos_id=999)  [generate.py]",
        lambda: generate(tiny(), "hi", 5, eos_id=999),
        BadValue,
        'eos_id',
    ),
    Call(
        "generate(m, 'hi', 5, use_cache='no')  [generate.py]",
        lambda: generate(tiny(), "hi", 5, use_cache="no"),
        BadType,
        'use_cache',
    ),
    Call(
        "sampler_view(m, 'hi', params, seed=2**70)  [generate.py]",
        lambda: sampler_view(tiny(), "hi", SamplingParams(), seed=2**70),
        BadValue,
        'seed',
    ),
    Call(
        "sampler_view(m, 'hi', params, seed='a')  [generate.py]",
        lambda: sampler_view(tiny(), "hi", SamplingParams(), seed="a"),
        BadValue,
        'seed',
    ),
    Call(
        "token_steps(m, 'hi', 5, stats='x')  [generate.py]",
        lambda: list(token_steps(tiny(), "hi", 5, stats="x")),
        BadType,
        'stats',
    ),
]


def widgets_shape():
    from ar_lab.perf.kv_sizing import KV_PRESETS

    return KV_PRESETS["Llama 2 7B"]


# --- 2. widgets ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Edit:
    """Build an explorer, set ``control`` to ``value``; the explorer must refuse it with an error
    naming ``arg`` (the control as its label or the argument it sets) and show that error in
    place."""

    name: str
    build: Callable[[], object]
    control: str
    value: object
    arg: str


def calculator():
    return kv_calculator.KVCacheCalculator("Llama 2 7B")


def sampler():
    return widgets.SamplerExplorer(tiny(), "ab", n_samples=1, max_new_tokens=2)


def speculator(gamma: int = 2):
    return widgets.SpeculationExplorer(
        tiny(), {"itself": tiny()}, "ab", gamma=gamma, max_new_tokens=3
    )


WIDGETS = [
    *[
        Edit(f"kv calculator: {control} = {value}", calculator, control, value, arg)
        for control, value, arg in [
            ("layers", -5, "layers"),
            ("layers", 0, "layers"),
            ("heads", 0, "query heads"),
            ("kv_heads", -1, "KV heads (GQA)"),
            ("kv_heads", 3, "n_kv_heads"),
            ("head_dim", 0, "head dim"),
            ("latent", 0, "MLA latent"),
            ("rope", -1, "MLA RoPE key"),
            ("seq_len", -1, "sequence"),
            ("batch", 0, "batch"),
        ]
    ],
    *[
        Edit(f"sampler explorer: {control} = {value}", sampler, control, value, arg)
        for control, value, arg in [
            ("temperature", -0.5, "temperature"),
            ("top_k", -3, "top_k"),
            ("top_p", 0.0, "top_p"),
            ("top_p", 1.5, "top_p"),
            ("min_p", -0.1, "min_p"),
            ("min_p", 1.5, "min_p"),
            ("seed", 2**70, "seed"),
        ]
    ],
    *[
        Edit(f"speculative explorer: {control} = {value!r}", speculator, control, value, arg)
        for control, value, arg in [
            ("gamma", 100, "gamma"),
            ("gamma", 0, "gamma"),
            ("gamma", -1, "gamma"),
            ("temperature", -1.0, "temperature"),
            ("seed", 2**70, "seed"),
            ("prompt", "x" * 40, "prompt"),
        ]
    ],
    Edit(
        "speculation_explorer(m, d, gamma=100)",
        lambda: speculator(100),
        "",
        None,
        "gamma",
    ),
]


# --- 3. command lines ------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    module: str  # run as python -m MODULE ARGV...
    argv: list[str]
    names: str  # what the error line must name: the option, argument or file at fault
    # values made when the case runs
    env: dict[str, Callable[[], str]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return " ".join(["python -m", self.module, *self.argv])


def _corrupt_data() -> str:
    return str(f("corrupt_data"))


def _empty_data() -> str:
    return str(f("empty_data"))


def _under_a_file() -> str:
    return str(f("a_file") / "out.json")


BENCH, TRAIN = "ar_lab.bench", "ar_lab.model.train"
COMMANDS = [
    Command(BENCH, [], "name"),
    Command(BENCH, ["nope"], "name"),
    Command(BENCH, ["decode", "--tokens", "0"], "tokens"),
    Command(BENCH, ["decode", "--tokens", "-5"], "tokens"),
    Command(BENCH, ["decode", "--tokens", "abc"], "--tokens"),
    Command(BENCH, ["decode", "--repeats", "0"], "repeats"),
    Command(BENCH, ["decode", "--threads", "0"], "--threads"),
    Command(BENCH, ["decode", "--prompt", ""], "prompt"),
    Command(BENCH, ["decode", "--tokens", "5000"], "max_new_tokens"),
    Command(BENCH, ["decode", "--prompt", "x" * 2000], "prompt"),
    Command(BENCH, ["decode"], "course.safetensors", {"AR_LAB_DATA": _corrupt_data}),
    Command(BENCH, ["roofline", "--device", "banana"], "device"),
    Command(BENCH, ["roofline", "--device", "mps"], "device"),
    Command(BENCH, ["roofline", "--device", "cuda"], "device"),
    Command(BENCH, ["roofline", "--config", "huge"], "--config"),
    Command(BENCH, ["roofline", "--quick", "--prompt-lens", "0"], "prompt_lens"),
    Command(BENCH, ["roofline", "--quick", "--prompt-lens", "5000"], "prompt_lens"),
    Command(BENCH, ["roofline", "--quick", "--batches", "0"], "batches"),
    Command(BENCH, ["roofline", "--quick", "--context", "0"], "context"),
    Command(BENCH, ["roofline", "--quick", "--context", "5000"], "context"),
    Command(BENCH, ["roofline", "--quick", "--contexts", "5000"], "contexts"),
    Command(BENCH, ["roofline", "--quick", "--pairs", "0"], "pairs"),
    Command(BENCH, ["roofline", "--quick", "--threads", "0"], "threads"),
    Command(BENCH, ["roofline", "--quick", "--buffer-mb", "-1"], "buffer"),
    Command(BENCH, ["roofline", "--quick", "--repeats", "0"], "repeats"),
    Command(BENCH, ["sampler", "--context", "0"], "context"),
    Command(BENCH, ["sampler", "--context", "5000"], "context"),
    Command(BENCH, ["sampler", "--rounds", "0"], "rounds"),
    Command(BENCH, ["sampler", "--calls", "-1"], "calls"),
    Command(BENCH, ["sampler", "--threads", "0"], "--threads"),
    Command(BENCH, ["sampler", "--json", "OUT"], "--json", {"OUT": _under_a_file}),
    Command(BENCH, ["sampler"], "course.safetensors", {"AR_LAB_DATA": _corrupt_data}),
    Command(BENCH, ["serving", "--batch-sizes", "a,b"], "--batch-sizes"),
    Command(BENCH, ["serving", "--batch-sizes", "0"], "batch_sizes"),
    Command(BENCH, ["serving", "--requests", "0"], "n_requests"),
    Command(BENCH, ["serving", "--max-batch", "0"], "max_batch"),
    Command(BENCH, ["serving", "--long", "5000"], "max_new_tokens"),
    Command(BENCH, ["serving", "--context", "5000"], "context"),
    Command(BENCH, ["serving", "--prefix-tokens", "0"], "prefix_tokens"),
    Command(BENCH, ["serving", "--repeats", "0"], "repeats"),
    Command(BENCH, ["serving", "--threads", "0"], "--threads"),
    Command(BENCH, ["serving", "--chunks", "64,x"], "--chunks"),
    Command(BENCH, ["serving", "--chunks", "0"], "chunks"),
    Command(BENCH, ["speculative", "--gammas", "0"], "gammas"),
    Command(BENCH, ["speculative", "--tokens", "0"], "tokens"),
    Command(BENCH, ["speculative", "--prompts", "0"], "prompts"),
    Command(BENCH, ["speculative", "--tokens", "5000"], "max_new_tokens"),
    Command(BENCH, ["speculative", "--prompt-tokens", "5000"], "prompt"),
    Command(BENCH, ["speculative", "--device", "banana"], "device"),
    Command(BENCH, ["speculative", "--device", "cuda"], "device"),
    Command(BENCH, ["speculative"], "course.safetensors", {"AR_LAB_DATA": _empty_data}),
    Command(BENCH, ["speculative"], "course.safetensors", {"AR_LAB_DATA": _corrupt_data}),
    Command(TRAIN, [], "--preset"),
    Command(TRAIN, ["--preset", "gpt2"], "--preset"),
    Command(TRAIN, ["--preset", "draft", "--threads", "0"], "--threads"),
    Command(TRAIN, ["--preset", "draft", "--threads", "x"], "--threads"),
    Command(TRAIN, ["--preset", "draft", "--resume", "missing.safetensors"], "missing.safetensors"),
    Command(
        TRAIN,
        ["--preset", "draft", "--resume", "BAD"],
        "random.safetensors",
        {"BAD": lambda: str(f("random.safetensors"))},
    ),
    Command(TRAIN, ["--preset", "draft", "--out", "DIR"], "--out", {"DIR": lambda: str(files())}),
    Command(TRAIN, ["--preset", "draft", "--out", "OUT"], "--out", {"OUT": _under_a_file}),
    Command(TRAIN, ["--preset", "draft"], "course.safetensors", {"AR_LAB_DATA": _corrupt_data}),
]
# exercises.py is being rewritten by another helper (issue 20): probed, not fixed here.
EXERCISES = [
    Command(
        "ar_lab.course.grading.exercises",
        ["release", "--chapter", "abc", "--out", "OUT"],
        "chapter",
        {"OUT": lambda: str(f("released"))},
    )
]


def resolved(cmd: Command) -> tuple[list[str], dict[str, str]]:
    """The argv with placeholders replaced, and the environment variables to set."""
    values = {k: make() for k, make in cmd.env.items()}
    argv = [values.get(a, a) for a in cmd.argv]
    return argv, {k: v for k, v in values.items() if k.isupper() and k.startswith("AR_LAB")}


def main_of(module: str) -> Callable[[list[str]], object]:
    import importlib

    return importlib.import_module(module + (".__main__" if module in (BENCH, TRAIN) else "")).main


def lines_ok(text: str) -> bool:
    """Only argparse's usage lines, then one line saying ``prog: error: ...``."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or "error:" not in lines[-1]:
        return False
    usage = lines[:-1]
    return not usage or (
        usage[0].startswith("usage:") and all(line.startswith(" ") for line in usage[1:])
    )


# --- the tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CALLS, ids=[c.name for c in CALLS])
def test_a_mistaken_call_raises_an_actionable_error(case: Call):
    check_call(case)


@pytest.mark.parametrize("case", ELSEWHERE, ids=[c.name for c in ELSEWHERE])
def test_mistakes_in_the_decode_loop_files(case: Call):
    check_call(case)


@pytest.mark.parametrize("case", WIDGETS, ids=[c.name for c in WIDGETS])
def test_an_out_of_range_control_is_refused_in_the_widget(case: Edit):
    explorer = case.build()
    if case.control:
        getattr(explorer, case.control).value = case.value
        assert getattr(explorer, case.control).value == case.value, (
            "the value was changed (clamped), not refused"
        )
    check_error(explorer.refused, ValueError, case.arg)
    assert explorer.error == str(explorer.refused)
    shown = explorer.status.value if hasattr(explorer, "status") else explorer.output.value
    assert html.escape(explorer.error) in shown


def test_a_refused_value_clears_once_corrected():
    explorer = speculator()
    explorer.gamma.value = 100
    assert explorer.error and explorer.view.gamma == 2  # the last good view stays
    explorer.gamma.value = 3
    assert explorer.error == "" and explorer.view.gamma == 3


@pytest.mark.parametrize("case", COMMANDS, ids=[c.name for c in COMMANDS])
def test_a_command_line_mistake_gives_one_line_and_exit_2(case: Command, capsys, monkeypatch):
    argv, env = resolved(case)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as info:
        main_of(case.module)(argv)
    out = capsys.readouterr()
    assert info.value.code == 2, out
    assert "Traceback" not in out.err + out.out
    assert lines_ok(out.out + out.err), (out.out, out.err)
    assert case.names in out.err.splitlines()[-1], out.err


@pytest.mark.parametrize("case", EXERCISES, ids=[c.name for c in EXERCISES])
def test_exercises_command_mistake(case: Command, capsys):
    argv, _ = resolved(case)
    try:
        code = main_of(case.module)(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    assert code == 2 and lines_ok(out.out + out.err) and case.names in out.err, (code, out.err)


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["ar_lab.bench", "roofline", "--device", "banana"],
        ["ar_lab.bench", "sampler", "--context", "5000"],
        ["ar_lab.model.train", "--preset", "draft", "--threads", "0"],
    ],
)
def test_as_a_real_command(argv):
    """The same through ``python -m`` in a fresh interpreter: status 2, one line, no traceback."""
    done = subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert lines_ok(done.stdout + done.stderr), (done.stdout, done.stderr)
