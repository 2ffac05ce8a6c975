"""No silent wrong results, round two: quality measures, files and commands, huge sizes, objects.

Each class of mistake a new user makes, probed from the public API:

- ``QUALITY``: the quality measures refuse what they cannot measure (models of different
  vocabularies, a model without a KV cache, None) instead of returning a number.
- ``OBJECTS``: None or a name where a model, a generator, a clock or stats are expected gives an
  error that names the argument, not an AttributeError from inside.
- ``HUGE``: valid but huge sizes either run fast (``simulate`` counts events, not steps) or are
  refused with their documented limit.
- ``COMMANDS``: a command line that cannot honour its options, or cannot write its output, stops
  with one ``error:`` line and exit status 2 before any measuring or training.
- Files: ``release``/``course`` take one chapter as one chapter and refuse an empty folder;
  ``check_writable`` refuses what cannot be written.

A case's name is the call as a learner would type it.
"""

from __future__ import annotations

import functools
import os
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest
import torch

from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.course.grading import exercises
from ar_lab.engine import serving, speculative
from ar_lab.engine.quant import quantize_model
from ar_lab.engine.serving import Request
from ar_lab.model import bigram, data, train
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.model.train import presets
from ar_lab.perf import quality, roofline, serving_measure
from tests.raising import raises
from tests.test_bad_input import Call, check_call

# --- what the cases run on -----------------------------------------------------------------


@functools.cache
def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=16)).eval()


@functools.cache
def other_vocab() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=16, vocab_size=300)).eval()


@functools.cache
def bigram_model() -> bigram.BigramModel:
    return bigram.BigramModel.from_tokens(data.corpus_tokens()[:2000], block_size=64)


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(0))


TOO_LONG = "x" * 300 + ".json"  # longer than any file system's name limit (255 bytes)




REQS = [Request("hi", 2)]
QUALITY = [
    Call(
        "greedy_agreement(m, other vocabulary)",
        lambda: quality.greedy_agreement(tiny(), other_vocab(), n_tokens=2),
        BadValue,
        "other",
    ),
    Call(
        "greedy_agreement(None, m)",
        lambda: quality.greedy_agreement(None, tiny()),
        BadType,
        "reference",
    ),
    Call(
        "greedy_agreement(m, None)",
        lambda: quality.greedy_agreement(tiny(), None),
        BadType,
        "other",
    ),
    Call(
        "greedy_agreement(m, 'int3')",
        lambda: quality.greedy_agreement(tiny(), "int3"),
        BadValue,
        "other",
    ),
    Call(
        "kv_cache_agreement(bigram)",
        lambda: quality.kv_cache_agreement(bigram_model()),
        BadType,
        "model",
    ),
    Call("kv_cache_agreement(None)", lambda: quality.kv_cache_agreement(None), BadType, "model"),
    Call("bits_per_byte(None)", lambda: quality.bits_per_byte(None), BadType, "model"),
    Call(
        "bits_per_byte(m, 4096)", lambda: quality.bits_per_byte(tiny(), 4096), BadType, "protocol"
    ),
    Call(
        "bits_per_byte(64-token model)",
        lambda: quality.bits_per_byte(tiny()),
        ContextFull,
        "protocol",
    ),
    Call(
        "self_draft_acceptance(m, None)",
        lambda: quality.self_draft_acceptance(tiny(), None),
        BadType,
        "draft",
    ),
    Call(
        "self_draft_acceptance(None, m)",
        lambda: quality.self_draft_acceptance(None, tiny()),
        BadType,
        "target",
    ),
    Call(
        "self_draft_acceptance(m, m, seed=-1)",
        lambda: quality.self_draft_acceptance(tiny(), tiny(), n_tokens=2, seed=-1),
        BadValue,
        'seed',
    ),
]

OBJECTS = [
    Call(
        "speculative_generate(m, None)",
        lambda: speculative.speculative_generate(tiny(), None, "ab", 4),
        BadType,
        'draft',
    ),
    Call(
        "speculative_generate(None, m)",
        lambda: speculative.speculative_generate(None, tiny(), "ab", 4),
        BadType,
        'target',
    ),
    Call(
        "speculative_generate(m, 'draft')",
        lambda: speculative.speculative_generate(tiny(), "draft", "ab", 4),
        BadType,
        'draft',
    ),
    Call(
        "speculative_generate(m, m, generator='x')",
        lambda: speculative.speculative_generate(tiny(), tiny(), "ab", 4, generator="x"),
        BadType,
        'generator',
    ),
    Call(
        "speculative_generate(m, m, clock=None)",
        lambda: speculative.speculative_generate(tiny(), tiny(), "ab", 4, clock=None),
        BadType,
        'clock',
    ),
    Call(
        "total_variation([0.5], [0.5])",
        lambda: speculative.total_variation([0.5], [0.5]),
        BadType,
        "p",
    ),
    Call("token_sources(None)", lambda: speculative.token_sources(None), BadType, "stats"),
    Call(
        "alpha_for_speedup('2', 4, 0.1)",
        lambda: speculative.alpha_for_speedup("2", 4, 0.1),
        BadValue,
        "speedup",
    ),
    Call(
        "alpha_for_speedup(2, 4, 0.1, verify_cost='a')",
        lambda: speculative.alpha_for_speedup(2, 4, 0.1, verify_cost="a"),
        BadValue,
        'verify_cost',
    ),
    Call(
        "serve(m, reqs, clock=None)",
        lambda: serving.serve(tiny(), REQS, clock=None),
        BadType,
        "clock",
    ),
    Call(
        "StreamSummary.from_stats(None)",
        lambda: serving.StreamSummary.from_stats(None),
        BadType,
        "stats",
    ),
    Call(
        "predicted_speedup(None, m)",
        lambda: roofline.predicted_speedup(None, tiny()),
        BadType,
        "reference",
    ),
    Call(
        "predicted_speedup(m, None)",
        lambda: roofline.predicted_speedup(tiny(), None),
        BadType,
        "other",
    ),
    Call(
        "predicted_speedup(m, 'int3')",
        lambda: roofline.predicted_speedup(tiny(), "int3"),
        BadValue,
        "other",
    ),
    Call(
        "predicted_speedup(m, bigram)",
        lambda: roofline.predicted_speedup(tiny(), bigram_model()),
        BadType,
        "other",
    ),
    Call("decode_step_bytes(None)", lambda: roofline.decode_step_bytes(None), BadType, "model"),
    Call(
        "decode_step_bytes(bigram)",
        lambda: roofline.decode_step_bytes(bigram_model()),
        BadType,
        "model",
    ),
    Call(
        "decode_throughput(None, [1])",
        lambda: serving_measure.decode_throughput(None, [1]),
        BadType,
        "model",
    ),
    Call(
        "decode_throughput(m, 8)",
        lambda: serving_measure.decode_throughput(tiny(), 8),
        BadType,
        "batch_sizes",
    ),
    Call(
        "prefix_ttft(None, 'abc', ['q'])",
        lambda: serving_measure.prefix_ttft(None, "abc", ["q"]),
        BadType,
        "model",
    ),
    Call("evaluate(None, t, 8)", lambda: train.evaluate(None, tokens(), 8), BadType, "model"),
    Call(
        "train(None, ...)",
        lambda: train.train(
            None, tokens(), tokens(), train.TrainConfig(steps=1, block_size=8), progress=False
        ),
        BadType,
        'model',
    ),
    Call(
        "train(m, ..., teacher='course')",
        lambda: train.train(
            tiny(), tokens(), tokens(), train.TrainConfig(steps=1, block_size=8), teacher="course"
        ),
        BadType,
        'teacher',
    ),
]

HUGE = [
    Call(
        "best_gamma(0.8, 0.1, max_gamma=10**7)",
        lambda: speculative.best_gamma(0.8, 0.1, 10**7),
        BadValue,
        "max_gamma",
    ),
    Call(
        "expected_tokens_per_iteration(0.5, 10**400)",
        lambda: speculative.expected_tokens_per_iteration(0.5, 10**400),
        BadValue,
        'gamma',
    ),
    Call(
        "expected_speedup(0.5, 10**400, 0.1)",
        lambda: speculative.expected_speedup(0.5, 10**400, 0.1),
        BadValue,
        'gamma',
    ),
    Call(
        "tokens_within(1e308, 0, 1e-300)",
        lambda: serving.tokens_within(1e308, 0, 1e-300),
        BadValue,
        "tpot",
    ),
    Call(
        "latency_budget(0.1, 0.01, 10**400)",
        lambda: serving.latency_budget(0.1, 0.01, 10**400),
        BadValue,
        "n_tokens",
    ),
]


@pytest.mark.parametrize(
    "case", QUALITY + OBJECTS + HUGE, ids=[c.name for c in QUALITY + OBJECTS + HUGE]
)
def test_a_mistaken_call_names_the_argument(case: Call):
    check_call(case)


# --- accepted inputs: a weight format names the quantized copy ------------------------------


def test_a_weight_format_stands_for_the_quantized_copy():
    m = tiny()
    assert roofline.predicted_speedup(m, "int8") == roofline.predicted_speedup(
        m, quantize_model(m, weights="int8")
    )
    by_name = quality.greedy_agreement(m, "bf16", n_tokens=2)
    assert by_name == quality.greedy_agreement(m, quantize_model(m, weights="bf16"), n_tokens=2)


# --- huge sizes: fast, and the same as stepping one decode step at a time ---------------------


def _stepped(steps_needed: list[int], max_batch: int, policy: str) -> list[int]:
    """The schedule counted one decode step at a time (what serve does)."""
    queue, left, finish, step = deque(range(len(steps_needed))), {}, [0] * len(steps_needed), 0
    while queue or left:
        if policy == "continuous" or not left:
            while queue and len(left) < max_batch:
                i = queue.popleft()
                if steps_needed[i] == 0:
                    finish[i] = step
                else:
                    left[i] = steps_needed[i]
            if not left:
                continue
        step += 1
        for i in list(left):
            left[i] -= 1
            if left[i] == 0:
                finish[i] = step
                del left[i]
    return finish


def test_simulate_matches_stepping_and_is_fast_for_huge_steps():
    rng = random.Random(0)
    for _ in range(3000):
        steps = [rng.choice([0, 0, 1, 2, 3, 5, 8]) for _ in range(rng.randint(0, 10))]
        batch, policy = rng.randint(1, 4), rng.choice(serving.POLICIES)
        assert serving.simulate(steps, batch, policy) == _stepped(steps, batch, policy), (
            steps,
            batch,
            policy,
        )
    start = time.perf_counter()
    assert serving.simulate([10**8], 1) == [10**8]
    assert serving.simulate([10**8] * 3, 2, "static") == [10**8, 10**8, 2 * 10**8]
    assert serving.simulate([10**8] * 3, 2) == [10**8, 10**8, 2 * 10**8]
    assert time.perf_counter() - start < 1.0


def test_best_gamma_up_to_its_limit():
    assert (
        speculative.best_gamma(0.8, 0.1, speculative.MAX_GAMMA)
        == speculative.best_gamma(0.8, 0.1)
        == 6
    )
    assert (
        speculative.best_gamma(1.0, 0.0, max_gamma=speculative.MAX_GAMMA) == speculative.MAX_GAMMA
    )


# --- files: checked before the work -----------------------------------------------------------


def _read_only_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        (folder / "probe").touch()
    except OSError:
        return folder
    pytest.skip("this user writes into read-only folders (root): no unwritable folder to test with")


def test_check_writable_refuses_what_cannot_be_written(tmp_path):
    for bad in [tmp_path, tmp_path / TOO_LONG, tmp_path / TOO_LONG / "out.json"]:
        with raises(BadValue, '--json'):
            data.check_writable(bad, "--json")
    existing = tmp_path / "kept.json"
    existing.write_text("old")
    data.check_writable(existing, "--json")  # writable, and left as it was
    data.check_writable(tmp_path / "new" / "deeper" / "out.json", "--json")
    assert existing.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == [
        "kept.json"
    ]


def test_check_writable_refuses_a_read_only_folder(tmp_path):
    with raises(BadValue, "--out"):
        data.check_writable(_read_only_folder(tmp_path) / "out.json", "--out")


def _never(what: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} started before the bad path was refused")

    return fail


def test_train_preset_checks_out_before_training(tmp_path, monkeypatch):
    monkeypatch.setattr(presets, "train", _never("training"))
    with raises(BadValue, 'out'):
        train.train_preset("draft", out=tmp_path / TOO_LONG, progress=False)
    with raises(BadValue, 'out'):
        train.train_preset("draft", out=tmp_path, progress=False)


def _notebooks(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("00_start.ipynb", "04_cache.ipynb", "06_sampling.ipynb"):
        nbformat.write(nbformat.v4.new_notebook(), src / name)
    return src


def test_one_chapter_is_one_chapter(tmp_path):
    src = _notebooks(tmp_path)
    assert exercises.release(src, tmp_path / "a", chapters="04") == [
        tmp_path / "a" / "04_cache.ipynb"
    ]
    assert exercises.release(src, tmp_path / "b", chapters=4) == [tmp_path / "b" / "04_cache.ipynb"]
    written = exercises.course(tmp_path / "c", src=src, chapters="06")
    assert [p.name for p in written if p.suffix == ".ipynb"] == ["06_sampling.ipynb"]


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        ({"chapters": []}, "chapters"),
        ({"chapters": True}, "chapters"),
        ({"out": ""}, "out"),
        ({"out": None}, "out"),
        ({"src": None}, "src"),
    ],
)
def test_release_refuses_an_empty_choice(tmp_path, monkeypatch, kwargs, arg):
    monkeypatch.chdir(tmp_path)
    kwargs = {"src": _notebooks(tmp_path), "out": tmp_path / "out", **kwargs}
    with raises(BadValue, arg):
        exercises.release(**kwargs)
    assert not list(tmp_path.glob("*.ipynb")) and not (tmp_path / "out").exists()


# --- command lines: one error line and exit 2, before any work --------------------------------

BENCH, TRAIN, EXERCISES = "ar_lab.bench", "ar_lab.model.train", "ar_lab.course.grading.exercises"


@dataclass(frozen=True)
class Command:
    module: str
    argv: list[str]
    names: str  # what the error line must name: the option or argument at fault
    # (module, function) that must not run
    never: list[tuple[str, str]] = field(default_factory=list)


def main_of(module: str) -> Callable[[list[str]], object]:
    import importlib

    return importlib.import_module(module + (".__main__" if module in (BENCH, TRAIN) else "")).main


BENCHMARKS = ["decode", "roofline", "sampler", "speculative", "serving", "quant"]
COMMANDS = [
    *[
        Command(
            BENCH, [name, "--json", f"TMP/{TOO_LONG}"], "--json", [(f"ar_lab.bench.{name}", "run")]
        )
        for name in BENCHMARKS
    ],
    Command(
        BENCH,
        ["decode", "--json", f"TMP/{TOO_LONG}/out.json"],
        "--json",
        [("ar_lab.bench.decode", "run")],
    ),
    Command(
        BENCH,
        ["serving", "--prefix-tokens", "5000"],
        "prefix_tokens",
        [("ar_lab.bench.serving", "_policies")],
    ),
    Command(
        BENCH,
        ["serving", "--prefix-tokens", "961"],
        "prefix_tokens",
        [("ar_lab.bench.serving", "_policies")],
    ),
    Command(
        BENCH,
        ["speculative", "--seed", "-1"],
        "seed",
        [("ar_lab.bench.speculative", "checkpoints")],
    ),
    Command(
        BENCH,
        ["speculative", "--gammas", "20000"],
        "gammas",
        [("ar_lab.bench.speculative", "checkpoints")],
    ),
    Command(
        TRAIN,
        ["--preset", "draft", "--out", f"TMP/{TOO_LONG}"],
        "--out",
        [("ar_lab.model.train.presets", "train")],
    ),
    Command(
        TRAIN,
        ["--preset", "draft", "--out", ""],
        "--out",
        [("ar_lab.model.train.presets", "train")],
    ),
    Command(
        TRAIN,
        ["--preset", "draft", "--resume", ""],
        "--resume",
        [("ar_lab.model.train.presets", "train")],
    ),
    Command(EXERCISES, ["release", "--out", "", "--chapter", "04"], "--out"),
    Command(EXERCISES, ["release", "--src", "", "--out", "TMP/out"], "--src"),
    Command(EXERCISES, ["course", "", "--chapter", "06"], "DIR"),
]


def _one_error_line(text: str) -> bool:
    """Only argparse's usage lines, then one line saying ``prog: error: ...``."""
    lines = [line for line in text.splitlines() if line.strip()]
    usage = lines[:-1]
    ok_usage = not usage or (
        usage[0].startswith("usage:") and all(line.startswith(" ") for line in usage[1:])
    )
    return bool(lines) and "error:" in lines[-1] and ok_usage


def _run(case: Command, tmp_path: Path, monkeypatch, capsys) -> tuple[object, str]:
    import importlib

    monkeypatch.chdir(tmp_path)  # a command that wrongly writes into the current folder writes here
    for module, function in case.never:
        monkeypatch.setattr(
            importlib.import_module(module), function, _never(f"{module}.{function}")
        )
    argv = [a.replace("TMP", str(tmp_path)) for a in case.argv]
    try:
        code = main_of(case.module)(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "case", COMMANDS, ids=[" ".join(["python -m", c.module, *c.argv]) for c in COMMANDS]
)
def test_a_command_refuses_before_any_work(case: Command, tmp_path, monkeypatch, capsys):
    code, err = _run(case, tmp_path, monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err and _one_error_line(err), (code, err)
    assert case.names in err.splitlines()[-1], err
    assert not list(tmp_path.rglob("*.ipynb")), "a refused command wrote notebooks"


@pytest.mark.parametrize("module", [BENCH, TRAIN])
def test_a_read_only_output_folder_is_refused_before_any_work(
    module, tmp_path, monkeypatch, capsys
):
    out = str(_read_only_folder(tmp_path) / "out.json")
    argv = ["sampler", "--json", out] if module == BENCH else ["--preset", "draft", "--out", out]
    never = (
        [("ar_lab.bench.sampler", "run")]
        if module == BENCH
        else [("ar_lab.model.train.presets", "train")]
    )
    code, err = _run(Command(module, argv, "", never), tmp_path, monkeypatch, capsys)
    assert code == 2 and _one_error_line(err) and "cannot be written" in err, (code, err)


def test_the_checks_leave_no_file_behind(tmp_path):
    data.check_writable(tmp_path / "a" / "out.json", "--json")
    assert not list(tmp_path.iterdir()) and not os.listdir(tmp_path)


def test_serving_measurements_have_documented_size_limits(tiny_model):
    from ar_lab.perf import serving_measure

    with raises(BadValue, 'n_requests'):
        serving_measure.mixed_workload(10**9)
    assert (
        len(serving_measure.mixed_workload(serving_measure.MAX_REQUESTS))
        == serving_measure.MAX_REQUESTS
    )
    with raises(BadValue, 'batch_sizes'):
        serving_measure.decode_throughput(tiny_model, [1, 10**6], context=4, steps=2, repeats=1)
