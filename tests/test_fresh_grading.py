"""The grading step's pieces, fast: the judge notebook and the answer programs built from a
notebook, the gradebook's update, the command's refusals, and which tests the instructor's solution
lets it judge (``python -m ar_lab.course.grading``; tests/test_grading_fresh.py runs it end to end
with nbgrader, and tests/test_sandbox.py the answer process itself).
"""

from __future__ import annotations

import nbformat
import pytest

from ar_lab.course.grading.exercises import NOTEBOOKS, nbgrader_meta


def _notebook(cells) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    for meta, source in cells:
        cell = nbformat.v4.new_code_cell(source)
        if meta:
            cell.metadata["nbgrader"] = meta
        nb.cells.append(cell)
    return nb


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
    from ar_lab.course.grading.exercises import CellResult
    from ar_lab.course.grading.judge import COMMENT, Plan, record_verdicts

    tests = ["a-tests", "b-tests", "c-tests", "d-tests"]
    plan = Plan("nb", None, None, tests, {}, {t: t.removesuffix("-tests") for t in tests})
    grades = {
        # passed in the kernel: fails fresh -> 0
        "a-tests": _Row(auto_score=2.0, manual_score=None),
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
    assert comments["a"].manual_comment.startswith(
        f"{COMMENT} the test `a-tests` failed when run again outside"
    )
    assert record_verdicts(gb, "ch", "bob", plan, fresh) == []  # run again: nothing changes
    # after autograde --force, it passes: the zero goes
    fresh["a-tests"] = CellResult("a-tests", 0, True, "")
    assert record_verdicts(gb, "ch", "bob", plan, fresh) == [
        "bob ch a-tests: back to autograde's 2 points (the fresh run passes now)"
    ]
    assert grades["a-tests"].manual_score is None and comments["a"].manual_comment is None


# (nbgrader metadata or None, source): a setup cell, three exercises and cells between
SYNTHETIC = [
    (
        None,
        (
            "import torch\nfrom ar_lab.course.checkers.checks import check_close, check_equal, "
            "no_delegation"
        ),
    ),
    (
        {"solution": True, "grade_id": "layer"},
        "class Layer(torch.nn.Module):\n    ### BEGIN SOLUTION\n    def forward(self, "
        "x):\n        return x\n    ### END SOLUTION",
    ),
    (
        {"grade": True, "grade_id": "layer-tests", "points": 1},
        (
            "with no_delegation(Layer, exercise='Layer'):\n    check_close('Layer', "
            "Layer()(torch.ones(2)), torch.ones(2))"
        ),
    ),
    (None, "noise = torch.rand(100)  # no test needs it: the judge skips it"),
    (
        None,
        (
            "x = torch.randn(3)\nscale = 2.0  # a test's input, and a value the answer reads: "
            "the judge's"
        ),
    ),
    (
        {"solution": True, "grade_id": "double"},
        "def double(x):\n    ### BEGIN SOLUTION\n    return scale * x\n    ### END SOLUTION",
    ),
    (
        {"grade": True, "grade_id": "double-tests", "points": 1},
        (
            "with no_delegation(double, exercise='double'):\n    check_close('double', "
            "double(x), 2 * x)"
        ),
    ),
    (
        {"solution": True, "grade_id": "grad"},
        "def tripled(w):\n    ### BEGIN SOLUTION\n    return 3 * w\n    ### END SOLUTION",
    ),
    (
        {"grade": True, "grade_id": "grad-tests", "points": 1},
        "with no_delegation(tripled, exercise='grad'):\n    w = torch.ones(2, "
        "requires_grad=True)\n    tripled(w).sum().backward()\n    check_equal('w.grad', None if "
        "w.grad is None else w.grad.tolist(), [3.0, 3.0])",
    ),
]


def test_the_judge_notebook_holds_handles_for_the_answers_and_an_answer_process_per_test():
    from ar_lab.course.grading.judge import judge_notebook

    judge, tests, answers = judge_notebook(_notebook(SYNTHETIC))
    assert tests == ["layer-tests", "double-tests", "grad-tests"]
    assert answers == {"layer-tests": "layer", "double-tests": "double", "grad-tests": "grad"}
    sources = [c.source for c in judge.cells]
    # no answer, no cell no test needs
    assert not any("BEGIN SOLUTION" in s or "noise" in s for s in sources)
    assert "Layer = answer('Layer')" in sources[1] and "double = answer('double')" in "".join(
        sources
    )
    starts = [i for i, s in enumerate(sources) if s.endswith("answer_process('double-tests')")]
    checks = [i for i, s in enumerate(sources) if "answers_checked('layer-tests')" in s]
    # one test's process ends before the next one starts
    assert checks and starts and checks[0] < starts[0]
    marked = [
        c.metadata.get("ar_lab_grade_id") for c in judge.cells if "ar_lab_grade_id" in c.metadata
    ]
    assert marked == [
        "layer-tests",
        "layer-tests (answers)",
        "double-tests",
        "double-tests (answers)",
        "grad-tests",
        "grad-tests (answers)",
    ]


def test_an_answer_program_runs_the_learners_cells_only_and_reads_the_rest_from_the_judge():
    from ar_lab.course.grading.judge import answer_programs

    source = _notebook(SYNTHETIC)
    submission = _notebook(SYNTHETIC)
    submission.cells.insert(
        5, nbformat.v4.new_code_cell("def helper(v):\n    return v  # a cell the learner added")
    )
    submission.cells[
        4
    ].source = "x = torch.ones(3)  # an instructor's cell, edited: the learner's now"
    programs = answer_programs(submission, source, ["layer-tests", "double-tests"])
    assert programs["layer-tests"]["cells"] == ["import torch", submission.cells[1].source + "\n"]
    double = programs["double-tests"]
    assert [c.splitlines()[0] for c in double["cells"]] == [
        "import torch",
        "class Layer(torch.nn.Module):",
        "x = torch.ones(3)  # an instructor's cell, edited: the learner's now",
        "def helper(v):",
        "def double(x):",
    ]
    # read by an answer, bound by an instructor's cell: the judge's value
    assert double["needs"] == ["scale"]
    assert double["forbid"] == [] and "noise" not in "".join(double["cells"])


def test_the_judge_binds_for_the_answer_only_names_the_instructors_cells_bind():
    """Issue 66: an answer that reads the shell's own names (get_ipython, In, Out, open, exit) gets
    none of the judge's: a handle on its get_ipython would run code in the judge's shell."""
    from ar_lab.course.grading.judge import answer_programs

    source = _notebook(SYNTHETIC)
    submission = _notebook(SYNTHETIC)
    submission.cells[5].source = (
        "def double(x):\n    get_ipython().run_cell('x = 1')\n    print(In, Out, exit)\n    "
        "open('f', 'w')\n    return scale * x"
    )
    assert answer_programs(submission, source, ["double-tests"])["double-tests"]["needs"] == [
        "scale"
    ]


@pytest.mark.slow
def test_the_instructors_solution_settles_which_tests_keep_the_kernels_verdict(tmp_path):
    from ar_lab.course.grading.judge import plan

    nbformat.write(_notebook(SYNTHETIC), tmp_path / "synthetic.ipynb")
    p = plan(tmp_path / "synthetic.ipynb", timeout=60)
    # a class of the learner's too, through handles
    assert p.tests == ["layer-tests", "double-tests"]
    # a tensor crosses as a copy: no autograd graph spans the two
    assert list(p.kernel_only) == ["grad-tests"]
    assert p.kernel_only["grad-tests"].startswith(
        "the instructor's solution does not pass it in the fresh run ("
    )


def test_the_command_refuses_a_folder_without_the_assignment_or_its_autograde(tmp_path, capsys):
    from ar_lab.course.grading.judge import main

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
    start = text.index("that keep the kernel's verdict on this repository's chapters")
    listed = text[start : text.index("\n\n", start)]
    return set(re.findall(r"`((?:ch\d\d|a\d)-[a-z0-9-]+-tests)`", listed))


# Chapters 01 and 02 are planned by tests/test_grading_fresh.py's grading run, which checks the same
# list.
GRADED_ELSEWHERE = {"01_the_autoregressive_loop", "02_attention_and_the_causal_mask"}
WITH_TESTS = sorted(p for p in NOTEBOOKS.glob("*.ipynb")
                    if "BEGIN SOLUTION" in p.read_text() and p.stem not in GRADED_ELSEWHERE)


@pytest.mark.slow
@pytest.mark.parametrize("path", WITH_TESTS, ids=[p.stem for p in WITH_TESTS])
def test_the_tests_instructors_md_says_keep_the_kernels_verdict_are_those_the_command_finds(
    path, tmp_path, monkeypatch
):
    """INSTRUCTORS.md names the tests whose verdict the fresh run cannot judge: the command's own
    plan of each chapter (cut to its exercises, run with the solutions) finds exactly those of that
    chapter."""
    from ar_lab.course.grading.exercises import exercises_only
    from ar_lab.course.grading.judge import plan

    # the plan's kernels only grade (tests/conftest.py: one_thread_env)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(path, as_version=4)
    nbformat.write(exercises_only(nb), tmp_path / path.name)
    found = set(plan(tmp_path / path.name, timeout=300).kernel_only)
    ours = {nbgrader_meta(c)["grade_id"] for c in nb.cells if nbgrader_meta(c).get("grade")}
    assert found == kernel_only_in_instructors_md() & ours


# -- the course's configuration, read as nbgrader reads it
# ---------------------------------------------------


def _config(folder, *lines):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "nbgrader_config.py").write_text("\n".join(["c = get_config()", *lines]) + "\n")
    return folder


@pytest.mark.parametrize(("lines", "seconds"), [
    (["c.Execute.timeout = 1e3"], 1000),
    (["c.Execute.timeout = 60 * 5"], 300),
    (["c.Execute.timeout = None"], None),  # nbgrader's Execute: no limit
    (["c.Execute.timeout = 30", "c.Execute.timeout = 45"], 45),  # the last assignment wins
    ([], 30),  # nbgrader's own default
], ids=["float", "expression", "none", "last-wins", "default"])
def test_the_grading_step_reads_the_time_limit_as_nbgrader_does(tmp_path, lines, seconds):
    from ar_lab.course.grading.judge import course_settings

    folder = _config(tmp_path / "course", *lines)
    assert course_settings(folder) == (
        seconds,
        f"sqlite:///{(folder / 'gradebook.db').resolve()}",
        False,
    )


def test_the_grading_step_sees_whether_autograde_ran_in_the_sandbox(tmp_path):
    from ar_lab.course.grading.exercises import course
    from ar_lab.course.grading.judge import course_settings

    folder = tmp_path / "course"
    course(folder, chapters=["00"], timeout=7)
    assert course_settings(folder) == (7, f"sqlite:///{(folder / 'gradebook.db').resolve()}", True)


def _course(folder, *config, gradebook=True):
    """A course folder the grading step gets as far as its configuration and gradebook in."""
    (folder / "source" / "02_x").mkdir(parents=True)
    nbformat.write(nbformat.v4.new_notebook(), folder / "source" / "02_x" / "02_x.ipynb")
    (folder / "autograded" / "s" / "02_x").mkdir(parents=True)
    if gradebook:
        import sqlite3

        sqlite3.connect(folder / "gradebook.db").close()
    return _config(folder, *config)


@pytest.mark.parametrize(("config", "gradebook", "error"), [
    (["c.Execute.timeout = 0"], "present", "c.Execute.timeout is 0"),
    (["c.Execute.timeout = -5"], "present", "c.Execute.timeout is -5"),
    (["c.Execute.timeout = 'soon'"], "present", "expected an int"),
    ([], "missing", "no gradebook at"),
    ([], "read-only", "is read-only"),
], ids=["zero", "negative", "text", "no-gradebook", "read-only-gradebook"])
def test_a_bad_limit_or_an_unwritable_gradebook_is_an_error_exit(
    tmp_path, capsys, config, gradebook, error
):
    from ar_lab.course.grading.judge import main

    folder = _course(tmp_path / "course", *config, gradebook=gradebook != "missing")
    if gradebook == "read-only":
        (folder / "gradebook.db").chmod(0o444)
    assert main([str(folder), "02_x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and error in err, err
