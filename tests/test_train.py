import json
import math

import pytest
import torch
from safetensors.torch import save_file

from ar_lab.base.errors import BadValue
from ar_lab.model.data import corpus_tokens, train_val_split
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.model.train import (
    CheckpointError,
    TrainConfig,
    checkpoint_path,
    evaluate,
    load_checkpoint,
    load_pretrained,
    lr_at,
    save_checkpoint,
    train,
)
from tests.raising import raises


def short_corpus(monkeypatch, train_module, n=40_000):
    """train_preset on the corpus' first ``n`` tokens: each phase ends with a full pass of the
    protocol over the validation split, and these tests are about phases, resuming and teachers, not
    about the corpus."""
    tokens = corpus_tokens()[:n]
    monkeypatch.setattr(train_module, "corpus_tokens", lambda: tokens)


@pytest.mark.slow
def test_training_lowers_the_loss():
    tr, va = train_val_split(corpus_tokens())
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=32))
    before = evaluate(model, va, 64, batches=2)
    assert before == pytest.approx(math.log(257), abs=0.3)  # random init: near uniform
    result = train(
        model, tr, va, TrainConfig(steps=40, block_size=64, eval_every=20, lr=3e-3), progress=False
    )
    assert result.val_loss[-1] < before - 1.0
    assert len(result.train_loss) == 40 and result.eval_steps == [19, 39]


def test_lr_schedule():
    tc = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, tc) == pytest.approx(0.1) and lr_at(9, tc) == pytest.approx(1.0)
    assert lr_at(99, tc) == pytest.approx(0.1, abs=0.01)


def test_checkpoint_round_trip(tmp_path, tiny_model):
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, tiny_model, {"note": "test"})
    loaded = load_checkpoint(path, "cpu")
    assert loaded.config == tiny_model.config and loaded.checkpoint_record == {"note": "test"}
    x = torch.randint(0, 257, (1, 16))
    with torch.no_grad():
        assert torch.equal(loaded(x), tiny_model(x))
    assert loaded.lm_head.weight.data_ptr() == loaded.wte.weight.data_ptr()  # still tied


def test_corrupted_checkpoints_give_clear_errors(tmp_path, tiny_model):
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, tiny_model)
    data = path.read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(data[: len(data) // 2])
    with raises(CheckpointError, 'path'):
        load_checkpoint(tmp_path / "trunc.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 100)
    with raises(CheckpointError, 'path'):
        load_checkpoint(tmp_path / "junk.safetensors")
    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with raises(CheckpointError, 'path'):
        load_checkpoint(tmp_path / "other.safetensors")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nope.safetensors")


def test_mismatched_checkpoint_gives_clear_error(tmp_path, tiny_model):
    state = {k: v.contiguous() for k, v in tiny_model.state_dict().items() if k != "lm_head.weight"}
    wrong = dict(tiny_model.config.to_dict(), n_embd=64)
    save_file(
        state,
        str(tmp_path / "w.safetensors"),
        {"format": "ar_lab-gpt-1", "config": json.dumps(wrong)},
    )
    with raises(CheckpointError, 'path'):
        load_checkpoint(tmp_path / "w.safetensors")


def test_unknown_checkpoint_name():
    with raises(BadValue, 'name'):
        checkpoint_path("gpt5")


@pytest.mark.parametrize("name", ["course", "modern", "draft"])
def test_shipped_checkpoints_load_and_beat_chance(name):
    model = load_pretrained(name, "cpu")
    record = model.checkpoint_record
    assert record["preset"] == name and record["val_loss_nats"] < 2.0  # chance is ln 257 = 5.55
    _, va = train_val_split(corpus_tokens())
    assert evaluate(model, va, 256, batches=2) < 2.5


def test_preset_phases_resume_gives_the_same_weights(tmp_path, monkeypatch):
    """Training in phases, resumed from the saved phase-1 checkpoint, equals one uninterrupted
    run."""
    from ar_lab.model.train import presets as train_module

    tiny = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=16)
    phases = [
        TrainConfig(steps=6, batch_size=2, block_size=32, eval_every=3, eval_batches=1),
        TrainConfig(steps=4, batch_size=2, block_size=16, eval_every=2, eval_batches=1, seed=7),
    ]
    monkeypatch.setitem(train_module.PRESETS, "tiny", (tiny, phases))
    short_corpus(monkeypatch, train_module)
    full = train_module.train_preset("tiny", tmp_path / "full.safetensors", progress=False)
    assert (tmp_path / "full.phase1.safetensors").exists()
    resumed = train_module.train_preset(
        "tiny",
        tmp_path / "resumed.safetensors",
        progress=False,
        resume=tmp_path / "full.phase1.safetensors",
    )
    assert full["train_steps"] == resumed["train_steps"] == 10 and len(full["phases"]) == 2
    a, b = (
        load_checkpoint(tmp_path / "full.safetensors", "cpu"),
        load_checkpoint(tmp_path / "resumed.safetensors", "cpu"),
    )
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    with raises(BadValue, 'resume'):
        train_module.train_preset(
            "course", tmp_path / "x.safetensors", resume=tmp_path / "full.safetensors"
        )


def _mean_tv(p_model, q_model, tokens, block=32):
    g = torch.Generator().manual_seed(5)
    from ar_lab.model.data import get_batch

    x, _ = get_batch(tokens, 4, block, g)
    with torch.no_grad():
        p, q = p_model(x).softmax(-1), q_model(x).softmax(-1)
    return float((p - q).abs().sum(-1).mean() / 2)


@pytest.mark.slow
def test_distillation_pulls_the_student_to_the_teacher():
    """A teacher phase: the loss is KL(teacher || student), so the student's distributions approach
    the teacher's (training on the text alone, same steps, does not)."""
    tr, va = train_val_split(corpus_tokens())
    cfg = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    teacher = GPT(cfg).eval()
    with torch.no_grad():
        teacher.wte.weight.mul_(5)  # distributions of its own, nothing the text alone would teach
    tc = TrainConfig(steps=60, batch_size=4, block_size=32, lr=3e-3, eval_every=30, eval_batches=1)
    students = {}
    for distil in (True, False):
        torch.manual_seed(1)
        students[distil] = GPT(cfg)
        before = _mean_tv(teacher, students[distil], va)
        result = train(
            students[distil], tr, va, tc, progress=False, teacher=teacher if distil else None
        )
    after = {k: _mean_tv(teacher, m, va) for k, m in students.items()}
    assert after[True] < before / 2, (before, after)
    assert after[False] > 3 * after[True]
    assert result.train_loss[-1] < result.train_loss[0]
    other_vocab = GPT(GPTConfig(vocab_size=300, block_size=32, n_layer=1, n_head=2, n_embd=16))
    with raises(BadValue, 'teacher'):
        train(students[True], tr, va, tc, progress=False, teacher=other_vocab)
    with raises(BadValue, 'teacher'):
        TrainConfig(teacher=3)


def test_preset_with_a_teacher_phase(tmp_path, monkeypatch):
    from ar_lab.model.train import presets as train_module

    tiny = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=16)
    phases = [
        TrainConfig(steps=4, batch_size=2, block_size=32, eval_every=2, eval_batches=1),
        TrainConfig(
            steps=4,
            batch_size=2,
            block_size=32,
            eval_every=2,
            eval_batches=1,
            seed=3,
            teacher="tinyteacher",
        ),
    ]
    monkeypatch.setitem(train_module.PRESETS, "tinyteacher", (tiny, phases[:1]))
    monkeypatch.setitem(train_module.PRESETS, "tinystudent", (tiny, phases))
    monkeypatch.setenv("AR_LAB_DATA", str(tmp_path))
    short_corpus(monkeypatch, train_module)
    with pytest.raises(FileNotFoundError, match="train it first"):
        train_module.train_preset("tinystudent", tmp_path / "student.safetensors", progress=False)
    assert not list(tmp_path.iterdir())  # the missing teacher was found before any phase ran
    # writes tmp_path/tinyteacher.safetensors
    train_module.train_preset("tinyteacher", progress=False)
    assert (tmp_path / "tinyteacher.safetensors").exists()  # checkpoint_path follows AR_LAB_DATA
    record = train_module.train_preset(
        "tinystudent", tmp_path / "student.safetensors", progress=False
    )
    assert record["phases"][1]["teacher"] == "tinyteacher" and "teacher" not in record["phases"][0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "draft", "--threads", "0"], "--threads must be >= 1, got 0"),
        (
            ["--preset", "draft", "--resume", "nowhere/draft.phase1.safetensors"],
            "no checkpoint at nowhere",
        ),
    ],
)
def test_command_line_mistakes_give_one_line_and_exit_2(argv, message, capsys):
    from ar_lab.model.train.presets import main

    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err and err.count("\n") == 1, err


def test_resume_from_a_finished_checkpoint_gives_one_line(tmp_path, tiny_model, capsys):
    from ar_lab.model.train.presets import main

    save_checkpoint(tmp_path / "x.safetensors", tiny_model, {"preset": "draft"})
    with pytest.raises(SystemExit) as stop:
        main(["--preset", "draft", "--resume", str(tmp_path / "x.safetensors")])
    err = capsys.readouterr().err
    assert (
        stop.value.code == 2
        and "is not a partial 'draft' checkpoint" in err
        and err.count("\n") == 1
    ), err
