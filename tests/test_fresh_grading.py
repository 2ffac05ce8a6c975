"""Record in the kernel, judge in a fresh process: the record/replay pieces, fast and in this process.

A "test" here is a function of this module that runs the learner's callables inside ``no_delegation``
as a notebook's test cell does. It runs once with recording on (``AR_LAB_RECORD=1``, in a temporary
folder: the record lands in ``.ar_lab_grading/``), then again with the learner's callables replaced by
``replay_stub`` objects and ``AR_LAB_REPLAY`` naming that folder: what the fresh kernel of
``python -m ar_lab.course.grading`` does (tests/test_grading_fresh.py runs it end to end with nbgrader).
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch

from ar_lab.course import plain, record
from ar_lab.course.checks import CheckFailed, check_close, check_equal, no_delegation
from ar_lab.course.exercises import NOTEBOOKS, nbgrader_meta
from ar_lab.course.grading import replay_notebook
from ar_lab.course.record import RECORD, REPLAY, ReplayMismatch, replay_finished, replay_stub
from ar_lab.engine.sampling import filter_top_k
from tests.raising import delegated


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """Record into tmp_path/.ar_lab_grading; ``replay()`` then switches this process to replaying it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(REPLAY, raising=False)
    monkeypatch.setenv(RECORD, "1")
    record.forget()

    def replay():
        monkeypatch.delenv(RECORD)
        monkeypatch.setenv(REPLAY, str(tmp_path / record.FOLDER))
        record.forget()

    yield Folder(tmp_path / record.FOLDER, replay)
    record.forget()


class Folder(type(Path())):
    """The records' folder, with ``replay()``: switch this process from recording to replaying it."""

    def __new__(cls, path, replay):
        self = super().__new__(cls, path)
        self.replay = replay
        return self


def the_key() -> str:
    """The key of every record this module makes: the test cell is this file."""
    return record.file_key(__file__)


def scale(x, factor=2.0):
    torch.rand(3)  # moves the random state: the replay must put it where the kernel left it
    return x * factor


def mean_or_raise(x):
    if x.numel() == 0:
        raise ValueError("an empty tensor has no mean")
    return float(x.mean())


def a_test(scale, mean_or_raise):
    """What a test cell does: inputs drawn inside the block, reference values, checks; an expected error."""
    with no_delegation(scale, mean_or_raise, exercise="scale"):
        x = torch.randn(5)
        check_close("scale(x)", scale(x), x * 2)
        check_close("scale(x, 3)", scale(x, factor=3.0), x * 3)
        check_equal("mean_or_raise", round(mean_or_raise(torch.ones(4)), 6), 1.0)
        try:
            mean_or_raise(torch.ones(0))
            raise CheckFailed("an empty tensor should raise ValueError")
        except ValueError:
            pass
    return torch.rand(2)  # the random state after the test


def test_a_replay_returns_the_recorded_results_in_order_and_the_test_passes_again(folder):
    after = a_test(scale, mean_or_raise)
    data = torch.load(folder / f"{the_key()}.pt", weights_only=True)
    assert [e["kind"] for e in data["events"]] == ["enter", "call", "call", "call", "call"]
    assert data["events"][-1]["raised"] == ("builtins", "ValueError", "an empty tensor has no mean")
    folder.replay()
    torch.manual_seed(1234)  # another process: another random state until the block restores it
    assert torch.equal(a_test(replay_stub("scale"), replay_stub("mean_or_raise")), after)
    replay_finished(the_key())


def test_a_wrong_answer_recorded_fails_the_fresh_test_whatever_the_kernel_said(folder):
    patched = globals()["check_close"]
    globals()["check_close"] = lambda *args, **kwargs: None  # the kernel's checker, patched by the answer
    try:
        a_test(lambda x, factor=2.0: x * factor + 0.5, mean_or_raise)  # wrong, and passed in the kernel
    finally:
        globals()["check_close"] = patched
    folder.replay()
    with pytest.raises(CheckFailed, match=r"scale\(x\): values differ"):
        a_test(replay_stub("scale"), replay_stub("mean_or_raise"))


def test_a_call_with_other_arguments_than_recorded_fails(folder):
    with no_delegation(scale, exercise="scale"):
        scale(torch.ones(3))
    folder.replay()
    with pytest.raises(ReplayMismatch, match="gets another `x` than in the kernel"):
        with no_delegation(replay_stub("scale"), exercise="scale"):
            replay_stub("scale")(torch.zeros(3))


def test_a_call_the_record_does_not_hold_and_calls_left_over_fail(folder):
    with no_delegation(scale, exercise="scale"):
        scale(torch.ones(3))
        scale(torch.ones(3))
    folder.replay()
    stub = replay_stub("scale")
    with no_delegation(stub, exercise="scale"):
        stub(torch.ones(3))
    with pytest.raises(ReplayMismatch, match="made 2 of the 3"):
        replay_finished(the_key())
    stub(torch.ones(3))
    with pytest.raises(ReplayMismatch, match="has nothing more there"):
        stub(torch.ones(3))


def test_an_argument_changed_in_place_is_changed_again_on_replay(folder):
    def fill(buffer, value):
        buffer.fill_(value)

    buffer = torch.zeros(4)
    with no_delegation(fill, exercise="fill"):
        fill(buffer, 7.0)
    folder.replay()
    again = torch.zeros(4)
    with no_delegation(replay_stub("fill"), exercise="fill"):
        assert replay_stub("fill")(again, 7.0) is None
    assert torch.equal(again, torch.full((4,), 7.0))


def test_a_value_that_is_not_plain_makes_the_record_kernel_verdict_only(folder):
    def build(n):
        return torch.nn.Linear(n, n)

    with no_delegation(build, exercise="build"):
        build(3)
    data = torch.load(folder / f"{the_key()}.pt", weights_only=True)
    assert data["events"] == [] and data["kernel_only"] == "`build` returned a torch.nn.modules.linear.Linear"
    folder.replay()
    with pytest.raises(ReplayMismatch, match="holds no values: `build` returned a torch.nn"):
        replay_finished(the_key())


def test_a_missing_or_unreadable_record_fails(folder):
    folder.replay()
    with pytest.raises(ReplayMismatch, match="no record of this test's calls"):
        replay_finished(the_key())
    folder.mkdir()
    (folder / f"{the_key()}.pt").write_bytes(b"not a record")
    record.forget()
    with pytest.raises(ReplayMismatch, match="cannot be read as plain data"):
        replay_finished(the_key())


def test_a_record_holding_code_is_refused(folder):
    folder.mkdir()
    torch.save({"format": record.FORMAT, "events": [], "kernel_only": None, "x": Fraction(1, 3)}, folder / "k.pt")
    with pytest.raises(ReplayMismatch, match="cannot be read as plain data"):
        record.load(folder / "k.pt")


def test_nothing_is_recorded_unless_grading_is_on(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(RECORD, raising=False)
    monkeypatch.delenv(REPLAY, raising=False)
    a_test(scale, mean_or_raise)
    assert not (tmp_path / record.FOLDER).exists()


@pytest.mark.parametrize("value", [
    None, True, 3, 2.5, "text", b"bytes", b"", [1, (2.0, "a")], {"k": torch.arange(3)}, {"b", "a"}, frozenset({3}),
    torch.Size([2, 3]), torch.float16,
    torch.randn(2, 3, requires_grad=True), np.arange(4.0), np.float32(1.5), np.int64(7),
])
def test_plain_values_come_back_equal_and_of_the_same_type(value, tmp_path):
    torch.save(plain.encode(value), tmp_path / "v.pt")
    back = plain.decode(torch.load(tmp_path / "v.pt", weights_only=True))
    assert type(back) is type(value)
    assert plain.same(plain.encode(value), back)
    if isinstance(value, torch.Tensor):
        assert back.requires_grad == value.requires_grad and torch.equal(back.detach(), value.detach())


@pytest.mark.parametrize("value", [torch.nn.Linear(2, 2), object(), {1.5: 2}, np.array([object()]), lambda: 0])
def test_other_values_are_not_plain(value):
    with pytest.raises(plain.NotPlain):
        plain.encode(value)


def test_same_tolerates_float_rounding_only():
    x = torch.randn(100)
    assert plain.same(plain.encode(x), x * (1 + 1e-7))
    assert not plain.same(plain.encode(x), x + 1e-3)
    assert not plain.same(plain.encode(x), x.double())
    assert not plain.same(plain.encode(torch.arange(3)), torch.tensor([0, 1, 3]))


def test_the_replay_notebook_stubs_every_answer_and_checks_every_record():
    source = nbformat.read(NOTEBOOKS / "02_attention_and_the_causal_mask.ipynb", as_version=4)
    nb, keys, answers = replay_notebook(source)
    text = "\n".join(c.source for c in nb.cells)
    assert "### BEGIN SOLUTION" not in text and "return torch.ones(T, T, dtype=torch.bool).tril()" not in text
    for name in ["embed", "causal_mask", "attention", "multi_head_attention"]:
        assert f"{name} = replay_stub({name!r})" in text
    tests = [c for c in source.cells if nbgrader_meta(c).get("grade")]
    assert list(keys) == [nbgrader_meta(c)["grade_id"] for c in tests] == list(answers)
    assert answers["ch02-causal-mask-tests"] == "ch02-causal-mask"
    for cell in tests:  # each test cell as written (hidden tests included), then the check of its record
        at = next(i for i, c in enumerate(nb.cells) if c.source == cell.source)
        assert nb.cells[at + 1].source.endswith(f"replay_finished({record.cell_key(cell.source)!r})")
    assert all("nbgrader" not in c.metadata for c in nb.cells)


def test_a_model_argument_is_compared_by_fingerprint_and_a_config_field_by_field(folder):
    from ar_lab.model.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=17, block_size=8, n_layer=1, n_head=2, n_embd=8)
    torch.manual_seed(0)
    model = GPT(config)

    def width(model, config):
        return config.n_embd * len(list(model.parameters()))

    with no_delegation(width, exercise="width"):
        width(model, config)
    folder.replay()
    stub = replay_stub("width")
    with no_delegation(stub, exercise="width"):
        assert stub(model, GPTConfig(**vars(config))) == width(model, config)  # an equal config, the same model
    record.forget()
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1
    with pytest.raises(ReplayMismatch, match="gets another `model`"), no_delegation(stub, exercise="width"):
        stub(model, config)


def test_a_call_that_changes_the_model_passed_to_it_is_kernel_verdict_only(folder):
    model = torch.nn.Linear(2, 2)

    def zero(model):
        with torch.no_grad():
            model.weight.zero_()
        return 0

    with no_delegation(zero, exercise="zero"):
        zero(model)
    data = torch.load(folder / f"{the_key()}.pt", weights_only=True)
    assert data["kernel_only"] == "`zero` changed the model passed to it as `model`"


class _Row:
    def __init__(self, **fields):
        self.__dict__.update(fields)


class _Gradebook:
    """What ``record_verdicts`` uses of nbgrader's Gradebook: grades, comments, commit."""

    def __init__(self, grades: dict, comments: dict):
        self.grades, self.comments = grades, comments
        self.db = _Row(commit=lambda: None)

    def find_grade(self, grade_id, notebook, assignment, student):
        return self.grades[grade_id]

    def find_comment(self, grade_id, notebook, assignment, student):
        return self.comments[grade_id]


def test_the_gradebook_gets_a_zero_only_where_the_kernel_gave_points_and_no_person_graded():
    from ar_lab.course.exercises import CellResult
    from ar_lab.course.grading import COMMENT, Plan, record_verdicts

    tests = ["a-tests", "b-tests", "c-tests", "d-tests"]
    plan = Plan("nb", None, {t: "key" for t in tests}, {}, {t: t.removesuffix("-tests") for t in tests})
    grades = {
        "a-tests": _Row(auto_score=2.0, manual_score=None),  # passed in the kernel: fails fresh -> 0
        "b-tests": _Row(auto_score=0.0, manual_score=None),  # the kernel's 0 stays as it is
        "c-tests": _Row(auto_score=3.0, manual_score=1.5),  # a person's manual score is kept
        "d-tests": _Row(auto_score=1.0, manual_score=None),  # passes fresh: nothing to do
    }
    comments = {t.removesuffix("-tests"): _Row(manual_comment=None) for t in tests}
    fresh = {t: CellResult(t, 0, t == "d-tests", "CheckFailed: wrong") for t in tests}
    gb = _Gradebook(grades, comments)
    lines = record_verdicts(gb, "ch", "bob", plan, fresh)
    assert lines == ["bob ch a-tests: 2 -> 0 points (fresh run: CheckFailed: wrong)"]
    assert [grades[t].manual_score for t in tests] == [0.0, None, 1.5, None]
    assert comments["a"].manual_comment.startswith(f"{COMMENT} the test `a-tests` failed when run again outside")
    assert record_verdicts(gb, "ch", "bob", plan, fresh) == []  # run again: nothing changes
    fresh["a-tests"] = CellResult("a-tests", 0, True, "")  # after autograde --force, it passes: the zero goes
    assert record_verdicts(gb, "ch", "bob", plan, fresh) == ["bob ch a-tests: back to autograde's 2 points "
                                                             "(the fresh run passes now)"]
    assert grades["a-tests"].manual_score is None and comments["a"].manual_comment is None


def test_a_generator_argument_is_compared_by_state_and_moved_on_as_the_answer_moved_it(folder):
    def draw(probs, generator):
        return int(torch.multinomial(probs, 1, generator=generator))

    probs = torch.tensor([0.2, 0.3, 0.5])
    with no_delegation(draw, exercise="draw"):
        g = torch.Generator().manual_seed(5)
        first = [draw(probs, g), draw(probs, g)]
        after = torch.rand(3, generator=g)
    folder.replay()
    stub = replay_stub("draw")
    with no_delegation(stub, exercise="draw"):
        g = torch.Generator().manual_seed(5)
        assert [stub(probs, g), stub(probs, g)] == first
        assert torch.equal(torch.rand(3, generator=g), after)  # the stub moved the generator as the answer did
    record.forget()
    with pytest.raises(ReplayMismatch, match="gets another `generator`"), no_delegation(stub, exercise="draw"):
        stub(probs, torch.Generator().manual_seed(6))


def test_an_instance_of_the_learners_class_is_not_plain_and_a_recording_error_leaves_the_guard_on(folder):
    class MyLayer(torch.nn.Module):  # the learner's class: its instances are never fingerprinted
        def __init__(self, n):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(n))

        def forward(self, x):
            return x * self.w

    with no_delegation(MyLayer, exercise="MyLayer"):
        MyLayer(3)(torch.ones(3))
    data = torch.load(folder / f"{the_key()}.pt", weights_only=True)
    assert data["kernel_only"].startswith("an argument of `__init__` is a ")
    record.forget()

    def cheat(logits):
        return filter_top_k(logits, 2)

    original = record.CellRecord.call
    record.CellRecord.call = lambda self, frame: 1 / 0  # recording breaks at the first call
    try:
        with delegated("filter_top_k"):
            with no_delegation(cheat, forbid=["ar_lab.engine.sampling.filter_top_k"], exercise="cheat"):
                cheat(torch.tensor([1.0, 3.0, 2.0]))
    finally:
        record.CellRecord.call = original
    data = torch.load(folder / f"{the_key()}.pt", weights_only=True)
    assert data["kernel_only"] == "recording failed (ZeroDivisionError: division by zero)"


SYNTHETIC = [  # (nbgrader metadata or None, source): a setup cell, three exercises and two cells between
    (None, "import torch\nfrom ar_lab.course.checks import check_close, check_equal, no_delegation"),
    ({"solution": True, "grade_id": "layer"}, "class Layer(torch.nn.Module):\n    ### BEGIN SOLUTION\n"
                                              "    def forward(self, x):\n        return x\n    ### END SOLUTION"),
    ({"grade": True, "grade_id": "layer-tests", "points": 1},
     "with no_delegation(Layer, exercise='Layer'):\n    check_close('Layer', Layer()(torch.ones(2)), torch.ones(2))"),
    (None, "noise = torch.rand(100)  # no test needs it: the fresh run skips it"),
    (None, "x = torch.randn(3)  # a test's input: in the fresh run it starts from the kernel's random state"),
    ({"solution": True, "grade_id": "double"}, "def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n"
                                               "    ### END SOLUTION"),
    ({"grade": True, "grade_id": "double-tests", "points": 1},
     "with no_delegation(double, exercise='double'):\n    check_close('double', double(x), 2 * x)"),
    ({"solution": True, "grade_id": "view"}, "def view(buffer):\n    ### BEGIN SOLUTION\n    return buffer[:2]\n"
                                             "    ### END SOLUTION"),
    ({"grade": True, "grade_id": "view-tests", "points": 1},
     "with no_delegation(view, exercise='view'):\n    b = torch.zeros(4)\n"
     "    check_equal('same memory', view(b).data_ptr(), b.data_ptr())"),
]


@pytest.mark.slow
def test_the_instructors_solution_settles_which_tests_keep_the_kernels_verdict(tmp_path):
    from ar_lab.course.grading import plan

    nb = nbformat.v4.new_notebook()
    for meta, source in SYNTHETIC:
        cell = nbformat.v4.new_code_cell(source)
        if meta:
            cell.metadata["nbgrader"] = meta
        nb.cells.append(cell)
    nbformat.write(nb, tmp_path / "synthetic.ipynb")
    p = plan(tmp_path / "synthetic.ipynb", timeout=60)
    assert list(p.keys) == ["double-tests"]
    assert set(p.kernel_only) == {"layer-tests", "view-tests"}
    assert p.kernel_only["layer-tests"] == "an argument of `forward` is a __main__.Layer"  # the learner's class
    assert p.kernel_only["view-tests"].startswith(  # a replayed tensor is a copy: another memory
        "the instructor's solution does not pass its replay (CheckFailed: same memory: expected ")


def test_the_command_refuses_a_folder_without_the_assignment_or_its_autograde(tmp_path, capsys):
    from ar_lab.course.grading import main

    assert main([str(tmp_path), "02_attention_and_the_causal_mask"]) == 2
    assert "no notebook in" in capsys.readouterr().err
    (tmp_path / "source" / "02_x").mkdir(parents=True)
    (tmp_path / "source" / "02_x" / "02_x.ipynb").write_text("{}")
    assert main([str(tmp_path), "02_x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run `nbgrader autograde 02_x` first" in err
    with pytest.raises(SystemExit):
        main([str(tmp_path), "02_x", "--timeout", "0"])


def kernel_only_in_instructors_md() -> set[str]:
    import re

    text = (NOTEBOOKS.parent / "INSTRUCTORS.md").read_text()
    start = text.index("Run on this repository's chapters, the command judges every test afresh except these")
    return set(re.findall(r"`(ch\d\d-[a-z0-9-]+-tests)`", text[start : text.index("\n\n", start)]))


# Chapters 01 and 02 are planned by tests/test_grading_fresh.py's grading run, which checks the same list.
GRADED_ELSEWHERE = {"01_the_autoregressive_loop", "02_attention_and_the_causal_mask"}
WITH_TESTS = sorted(p for p in NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb")
                    if "BEGIN SOLUTION" in p.read_text() and p.stem not in GRADED_ELSEWHERE)


@pytest.mark.slow
@pytest.mark.parametrize("path", WITH_TESTS, ids=[p.stem for p in WITH_TESTS])
def test_the_tests_instructors_md_says_keep_the_kernels_verdict_are_those_the_command_finds(
    path, tmp_path, monkeypatch
):
    """INSTRUCTORS.md names the tests whose verdict the fresh run cannot judge: the command's own plan of each
    chapter (cut to its exercises, run with the solutions) finds exactly those of that chapter."""
    from ar_lab.course.exercises import exercises_only
    from ar_lab.course.grading import plan

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the plan's kernels only grade (tests/conftest.py: one_thread_env)
    nb = nbformat.read(path, as_version=4)
    nbformat.write(exercises_only(nb), tmp_path / path.name)
    found = set(plan(tmp_path / path.name, timeout=300).kernel_only)
    ours = {nbgrader_meta(c)["grade_id"] for c in nb.cells if nbgrader_meta(c).get("grade")}
    assert found == kernel_only_in_instructors_md() & ours
