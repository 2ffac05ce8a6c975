"""Every notebook fits a sitting, and the proof of its claims stays out of the learner's path
(ARCHITECTURE.md, "How a claim is checked"; ar_lab.course.budget measures)."""

import math
import re
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from ar_lab.course import budget

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("*.ipynb"))
GLOSSARY = NOTEBOOKS / "glossary.md"
IDS = [p.stem for p in CHAPTERS]


def slug(heading: str) -> str:
    """The glossary's anchor rule: lower case, spaces to '-', other characters than a-z, 0-9 and '-'
    dropped."""
    return re.sub(r"[^a-z0-9-]", "", heading.strip().lower().replace(" ", "-"))


def test_the_measure_counts_what_a_learner_reads(tmp_path):
    """A notebook built to known counts: words of markdown and of rendered Markdown, visible code
    lines (comments, blanks, magics and collapsed cells left out), lines inside claim/say calls,
    exercises and their minutes from the solution's length."""
    said = new_code_cell('x = 2\nsay(f"two words")', outputs=[
        new_output("display_data", data={"text/markdown": "Measured **three** words."})])
    hidden = new_code_cell(
        "claim('hidden', x > 1)\ny = 3\n", metadata={"jupyter": {"source_hidden": True}}
    )
    solution = new_code_cell(
        "def f():\n    ### BEGIN SOLUTION\n    a = 1\n    return a\n    ### END SOLUTION\n",
        metadata={"nbgrader": {"solution": True, "grade": False, "grade_id": "f"}},
    )
    nb = new_notebook(
        cells=[
            new_markdown_cell("# Title with four words"),
            new_code_cell(
                "%matplotlib inline\n# a comment\n\nimport torch\nclaim(\n    'a claim',\n    "
                "True,\n)"
            ),
            said,
            hidden,
            solution,
        ]
    )
    path = tmp_path / "toy.ipynb"
    nbformat.write(nb, path)
    got = budget.measure(path)
    assert (got.words, got.code_lines, got.machinery_lines, got.exercises) == (
        4 + 3,
        5 + 2 + 3,
        4 + 1,
        1,
    )
    assert (
        got.exercise_minutes == budget.EXERCISE_BASE_MINUTES + 2 * budget.EXERCISE_MINUTES_PER_LINE
    )
    expected = math.ceil(
        7 / budget.WORDS_PER_MINUTE + 10 / budget.CODE_LINES_PER_MINUTE + got.exercise_minutes
    )
    assert got.minutes == expected and got.over() == []
    big = budget.Budget("big", budget.MAX_WORDS + 1, 10, 0, budget.MAX_EXERCISES + 1, 0.0)
    assert [p.split(" (")[0] for p in big.over()] == [f"{budget.MAX_WORDS + 1} words",
                                                    f"{budget.MAX_EXERCISES + 1} graded exercises"]


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_every_notebook_fits_a_sitting(path):
    got = budget.measure(path)
    assert not got.over(), (
        f"{path.name} is past its budget: {'; '.join(got.over())} ({budget.METHOD})"
    )


def test_claim_machinery_is_at_most_3_percent_of_the_code_a_learner_reads():
    measured = [budget.measure(p) for p in CHAPTERS]
    code, machinery = sum(b.code_lines for b in measured), sum(b.machinery_lines for b in measured)
    worst = sorted(measured, key=lambda b: -b.machinery_lines)[:3]
    assert machinery <= budget.MAX_MACHINERY_SHARE * code, (
        f"{machinery} of {code} visible code lines are claim/say machinery; most in "
        + ", ".join(f"{b.name} ({b.machinery_lines})" for b in worst))


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_the_opening_lists_the_sections_and_the_minutes(path):
    nb = nbformat.read(path, as_version=4)
    opening = nb.cells[0].source
    missing = [h for h in budget.section_headings(path) if h not in opening]
    assert not missing, f"{path.name}: the opening does not list these sections: {missing}"
    minutes = 5 * math.ceil(budget.measure(path).minutes / 5)
    assert f"about {minutes} minutes" in opening, (
        f"{path.name}: the opening should say 'about {minutes} minutes'"
    )


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_collapsed_cells_show_a_summary_and_exercises_are_headings(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and budget.is_hidden(cell):
            assert cell.outputs, (
                f"{path.name} cell {i}: a collapsed cell must show what it checked (it has no "
                "output)"
            )
            assert "remove-input" in cell.metadata.get("tags", []), (
                f"{path.name} cell {i}: tag it remove-input"
            )
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert not re.search(r"^\*\*Exercise", markdown, re.M), (
        f"{path.name}: an exercise is bold text, not a heading"
    )
    if any(c.get("metadata", {}).get("nbgrader", {}).get("solution") for c in nb.cells):
        assert re.search(r"^###? Exercise \d", markdown, re.M), (
            f"{path.name}: exercises need '### Exercise N' headings"
        )


def test_every_glossary_link_names_a_term_of_the_glossary():
    terms = {slug(h) for h in re.findall(r"^### (.+)$", GLOSSARY.read_text(), re.M)}
    assert len(terms) >= 40, f"the glossary has {len(terms)} terms"
    broken = {}
    for path in CHAPTERS:
        text = "".join(
            c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown"
        )
        for target in re.findall(r"\]\(glossary\.md#([^)]+)\)", text):
            if target not in terms:
                broken.setdefault(path.stem, []).append(target)
    assert not broken, f"links to terms the glossary does not have: {broken}"
    linking = [p.stem for p in CHAPTERS if "glossary.md#" in "".join(
        c.source for c in nbformat.read(p, as_version=4).cells)]
    assert set(linking) == set(IDS), (
        f"chapters that never link the glossary: {sorted(set(IDS) - set(linking))}"
    )


def test_the_readme_and_instructors_show_each_notebooks_minutes():
    block = (
        f"{budget.TABLE_START}\n{budget.sitting_table([budget.measure(p) for p in CHAPTERS])}\n"
        f"{budget.TABLE_END}"
    )
    for name in budget.DOCUMENTS:
        text = (NOTEBOOKS.parent / name).read_text()
        assert block in text, (
            f"{name}'s sitting table is stale: run python -m ar_lab.course.budget --write"
        )
