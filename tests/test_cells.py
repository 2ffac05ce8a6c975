"""cells.cut: a notebook cut to the cells a few chosen ones need (what the exercise checks
execute)."""

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from ar_lab.base.errors import BadType, BadValue
from ar_lab.course.grading.cells import changes, cut, names
from tests.raising import raises


@pytest.mark.parametrize(
    "source, bound, read",
    [
        ("x = x + 1", {"x"}, {"x"}),
        ("x = 1\ny = x", {"x", "y"}, set()),
        ("[p for p in ps if p > t]", set(), {"ps", "t"}),
        ("[[i * j for j in row] for row in m for i in row]", set(), {"m"}),
        ("{k: v for k, v in d.items()}", set(), {"d"}),
        ("def f(x, y=z):\n    w = x + g\n    return w", {"f"}, {"z", "g"}),
        ("f = lambda a: a + b", {"f"}, {"b"}),
        (
            "class A(Base):\n    n = 3\n    def f(self):\n        return self.n + q",
            {"A"},
            {"Base", "q"},
        ),
        ("m.x = 3\ncache[0] = v", {"m", "cache"}, {"m", "cache", "v"}),
        ("for name, v in d.items():\n    print(name, v)", {"name", "v"}, {"d"}),
        ("with open(f) as h:\n    h.read()", {"h"}, {"f"}),
        ("try:\n    pass\nexcept E as e:\n    print(e)", {"e"}, {"E"}),
        ("import numpy as np\nfrom a.b import c\nimport os.path", {"np", "c", "os"}, set()),
        ("print(len(xs))", set(), {"xs"}),  # builtins are no dependency
    ],
)
def test_names_follow_pythons_scopes_and_order(source, bound, read):
    assert names(source) == (bound, read)


def test_a_cell_that_is_not_python_is_named():
    with raises(BadValue, 'source'):
        names("def f(:\n")


def notebook(*sources):
    return new_notebook(
        cells=[
            new_markdown_cell(s[3:]) if s.startswith("md ") else new_code_cell(s) for s in sources
        ]
    )


def test_cut_keeps_the_chosen_cells_what_they_need_and_the_set_up():
    nb = notebook(
        "import torch\ntorch.manual_seed(0)",  # the set-up: always kept
        "md some prose",
        "model = make()",
        "slow = measure(model)  # an experiment nothing chosen reads",
        "model.eval()",  # no name bound: nothing it changes can be seen, so it goes
        "model.lr = 3",  # changes model: kept, since the exercise reads model
        "helper = lambda z: z + 1",
        "def answer(x):\n    return helper(x)",
        "check(answer(model))  # TEST",
        "plot(slow)",
    )
    kept = [c.source for c in cut(nb, lambda c: "TEST" in c.source).cells]
    assert kept == [nb.cells[i].source for i in (0, 2, 5, 6, 7, 8)]
    assert len(nb.cells) == 10  # the original is untouched


def test_cut_refuses_what_is_not_a_notebook():
    with raises(BadType, 'nb'):
        cut({"cells": []}, lambda c: True)


def test_cut_of_every_chapter_keeps_its_exercises_in_order():
    from pathlib import Path

    from ar_lab.course.grading.exercises import exercises_only, graded_cells, nbgrader_meta

    for path in sorted(
        (Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9][0-9]*_*.ipynb")
    ):
        nb = nbformat.read(path, as_version=4)
        if not graded_cells(nb):
            continue
        ids = [c.id for c in nb.cells]
        kept = exercises_only(nb).cells
        assert [ids.index(c.id) for c in kept] == sorted(ids.index(c.id) for c in kept)
        exercise = {
            c.id
            for c in nb.cells
            if nbgrader_meta(c).get("solution") or nbgrader_meta(c).get("grade")
        }
        assert exercise <= {c.id for c in kept} and len(kept) < len(
            [c for c in nb.cells if c.cell_type == "code"]
        )


def test_changes_names_objects_changed_in_place():
    assert changes("calc.preset.value = 'x'\nd[k] = 1\nm.n += 2\ny = 3\nxs.append(4)") == {
        "calc",
        "d",
        "m",
    }
