"""The submissions report (ar_lab.course.grading.report): each kind of cheat is flagged where it is,
and the course's own solutions and plain torch code are not flagged at all.

Synthetic submissions are built as nbgrader writes a learner's copy: the solution cell keeps
its ``nbgrader`` metadata (``solution: true``, a ``grade_id``) while the markers are gone.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from ar_lab.course.grading import report
from ar_lab.course.grading.report import scan_course, scan_notebook, solution_cells

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
SETUP = "\n".join(
    ["import sys, gc", "import numpy as np", "import torch", "from pathlib import Path",
     "from ar_lab.perf import roofline as rl"]
)


def submission(*answers: str, setup: str = SETUP) -> nbformat.NotebookNode:
    """A learner's copy: a setup cell, one solution cell per answer and a locked test cell."""
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(setup))
    for i, answer in enumerate(answers):
        meta = {"grade": False, "grade_id": f"ex-{i}", "locked": False, "schema_version": 3,
                "solution": True, "task": False}
        nb.cells.append(nbformat.v4.new_code_cell(answer, metadata={"nbgrader": meta}))
    test = {"grade": True, "grade_id": "ex-test", "locked": True, "points": 1, "schema_version": 3,
            "solution": False, "task": False}
    nb.cells.append(
        nbformat.v4.new_code_cell("import threading\nassert f(1) == 2", metadata={"nbgrader": test})
    )
    return nb


def kinds_and_lines(answer: str, setup: str = SETUP) -> list[tuple[str, int]]:
    return [(f.kind, f.line) for f in scan_notebook(submission(answer, setup=setup))]


@pytest.mark.parametrize(
    "path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem.split("_")[0]
)
def test_the_courses_own_solutions_give_no_flags(path):
    nb = nbformat.read(path, as_version=4)
    assert solution_cells(nb), "the notebook should have solution cells to scan"
    assert scan_notebook(path) == []


def test_there_are_twelve_chapters_and_an_appendix_with_one_exercise():
    assert len(list(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))) == 12
    appendices = sorted(NOTEBOOKS.glob("A[0-9]_*.ipynb"))
    assert [p.stem for p in appendices] == ["A1_measuring_time"]
    assert len(solution_cells(nbformat.read(appendices[0], as_version=4))) == 1


CHEATS = [
    ("import threading\nt = threading.Thread(target=f)", [("threads", 1), ("threads", 2)]),
    ("from concurrent.futures import ThreadPoolExecutor", [("threads", 1)]),
    ("import multiprocessing as mp", [("threads", 1)]),
    ("import inspect\ntext = inspect.getsource(f)", [("inspect", 1), ("inspect", 2)]),
    ("def f(x):\n    return eval('x + 1')", [("dynamic-code", 2)]),
    ("x = 1\nexec(code)\ncompile('1', 'f', 'eval')", [("dynamic-code", 2), ("dynamic-code", 3)]),
    ("import importlib\nimportlib.reload(torch)", [("importlib", 1), ("importlib", 2)]),
    ("m = __import__('os')", [("importlib", 1)]),
    ("sys.modules['ar_lab.engine.sampling'] = None", [("interpreter", 1)]),
    ("sys.settrace(tracer)\nsys.setprofile(tracer)", [("interpreter", 1), ("interpreter", 2)]),
    ("objs = gc.get_objects()", [("interpreter", 1)]),
    (
        "ip = get_ipython()\nip.events.register('pre_run_cell', f)",
        [("ipython-hook", 1), ("ipython-hook", 2)],
    ),
    ("shell.input_transformers_post.append(f)", [("ipython-hook", 1)]),
    ("shell.set_custom_exc((AssertionError,), handler)", [("ipython-hook", 1)]),
    ("sys.excepthook = handler", [("ipython-hook", 1), ("monkeypatch", 1)]),
    ("text = open('/etc/passwd').read()", [("file-read", 1)]),
    ("t = Path('../../autograded/bob/04/x.ipynb').read_text()", [("file-read", 1)]),
    ("w = torch.load(path)\na = np.load('answers.npy')", [("file-read", 1), ("file-read", 2)]),
    ("from ar_lab.engine.sampling import _softmax", [("internal-import", 1)]),
    ("import ar_lab.model._impl", [("internal-import", 1)]),
    ("from ar_lab.course.checkers.checks import passed", [("grader-import", 1)]),
    ("import ar_lab.course.grading.exercises as ex", [("grader-import", 1)]),
    ("from ar_lab.course.checkers import checks", [("grader-import", 1)]),
    ("torch.softmax = lambda *a, **k: None", [("monkeypatch", 1)]),
    ("x = 1\nsetattr(rl, 'matmul_parameters', fake)", [("monkeypatch", 2)]),
    ("def f():\n    pass\nf.__code__ = g.__code__", [("function-internals", 3)]),
    ("d = getattr(f, '__defaults__')", [("function-internals", 1)]),
    ("x = 1\n!cat /etc/passwd", [("magic", 2)]),
]


@pytest.mark.parametrize(
    "answer,expected", CHEATS, ids=[c[0].splitlines()[-1][:40] for c in CHEATS]
)
def test_each_kind_of_cheat_is_flagged_on_its_line(answer, expected):
    assert kinds_and_lines(answer) == expected


def test_a_flag_says_where_and_what():
    (flag,) = scan_notebook(
        submission("x = 1", "text = open('/srv/answers.txt').read()"), name="04_kv_cache.ipynb"
    )
    assert (flag.notebook, flag.grade_id, flag.line, flag.kind) == (
        "04_kv_cache.ipynb",
        "ex-1",
        1,
        "file-read",
    )
    assert flag.source == "text = open('/srv/answers.txt').read()"
    assert "'/srv/answers.txt'" in flag.detail and flag.cell
    assert flag.format().startswith(
        f"04_kv_cache.ipynb cell {flag.cell} (ex-1) line 1: file-read: text = open("
    )


HARMLESS = '''\
import math
import torch
import torch.nn.functional as F
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.engine.sampling import GREEDY_EPS


def my_attention(q, k, v):
    %timeit q @ k.T
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
    weights = F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    model = GPT(GPTConfig()).eval()
    model.lm_head.weight = model.wte.weight
    pattern = re.compile("a")
    return weights @ v + rl.matmul_parameters(model.config) * GREEDY_EPS
'''


def test_a_harmless_solution_gives_no_flags():
    assert scan_notebook(submission(HARMLESS)) == []


def test_only_solution_cells_are_scanned():
    nb = submission("y = 1")  # the setup and test cells import and use things a solution may not
    nb.cells[0].source += "\nimport inspect\nexec('1')"
    assert scan_notebook(nb) == []


def test_a_cell_with_source_markers_is_a_solution_cell_too():
    nb = submission()
    nb.cells.append(
        nbformat.v4.new_code_cell("### BEGIN SOLUTION\nimport inspect\n### END SOLUTION")
    )
    assert [(f.kind, f.line, f.grade_id) for f in scan_notebook(nb)] == [("inspect", 2, None)]


def test_a_syntax_error_gives_the_parse_flag():
    flags = scan_notebook(submission("def f(x:\n    return x"))
    assert [f.kind for f in flags] == ["parse-error"]
    assert flags[0].detail.startswith("cannot parse")


def test_a_bash_cell_is_flagged_once_and_not_parsed():
    assert kinds_and_lines("%%bash\ncat /etc/passwd\nif [ x ]; then echo; fi") == [("magic", 1)]


def test_a_time_cell_magic_is_skipped_and_its_body_scanned():
    assert kinds_and_lines("%%time\nx = 1\nimport inspect") == [("inspect", 3)]


def write_course(root: Path) -> Path:
    course = root / "course"
    answers = {
        ("alice", "04_kv_cache"): ["import threading", "y = 2"],
        ("bob", "04_kv_cache"): ["y = torch.zeros(3)"],
        ("bob", "06_sampling"): ["x = 1\nfrom ar_lab.course.checkers.checks import passed"],
    }
    for (student, assignment), cells in answers.items():
        folder = course / "submitted" / student / assignment
        folder.mkdir(parents=True)
        nbformat.write(submission(*cells), folder / f"{assignment}.ipynb")
    (course / "source" / "04_kv_cache").mkdir(parents=True)  # the source folder is not scanned
    nbformat.write(
        submission("import inspect"), course / "source" / "04_kv_cache" / "04_kv_cache.ipynb"
    )
    return course


def test_the_course_report_groups_flags_by_student_and_assignment(tmp_path):
    found = scan_course(write_course(tmp_path))
    assert {key: [(f.kind, f.line) for f in flags] for key, flags in found.items()} == {
        ("alice", "04_kv_cache"): [("threads", 1)],
        ("bob", "04_kv_cache"): [],
        ("bob", "06_sampling"): [("grader-import", 2)],
    }


def test_the_command_prints_the_report(tmp_path, capsys):
    assert report.main([str(write_course(tmp_path))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "alice / 04_kv_cache: 1 flag"
    assert (
        lines[1].startswith("  04_kv_cache.ipynb cell ")
        and "(ex-0) line 1: threads: import threading" in lines[1]
    )
    assert lines[2] == "bob / 04_kv_cache: ok"
    assert lines[3] == "bob / 06_sampling: 1 flag"
    assert (
        "(ex-0) line 2: grader-import: from ar_lab.course.checkers.checks import passed" in lines[4]
    )
    assert lines[-1] == "2 flags in 2 of 3 submissions (2 students)"
    assert len(lines) == 6


def test_an_unreadable_notebook_is_a_flag_not_a_crash(tmp_path, capsys):
    folder = tmp_path / "submitted" / "carol" / "04_kv_cache"
    folder.mkdir(parents=True)
    (folder / "04_kv_cache.ipynb").write_text("{not json")
    assert report.main([str(tmp_path)]) == 0
    assert ": unreadable: " in capsys.readouterr().out


@pytest.mark.parametrize("make", [lambda p: p / "missing", lambda p: p])
def test_the_command_exits_2_on_a_missing_or_empty_folder(tmp_path, capsys, make):
    assert report.main([str(make(tmp_path))]) == 2
    out, err = capsys.readouterr()
    assert (
        out == ""
        and err.startswith("error: ")
        and len(err.splitlines()) == 1
        and "Traceback" not in err
    )
