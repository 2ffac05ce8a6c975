"""Grading a class, measured: data/grading_time.json covers every chapter and INSTRUCTORS.md shows
exactly it.

The measurement itself (``make grading-time``, ~15 minutes) is not run here; these checks take
milliseconds.
"""

import json
from pathlib import Path

import nbformat
import pytest

from ar_lab.base.errors import BadValue
from ar_lab.course.grading.exercises import NOTEBOOKS, graded_cells
from ar_lab.course.grading.timing import TABLE_END, TABLE_START, hours, main, table, write_table
from tests.raising import raises

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "data" / "grading_time.json"


def test_the_results_cover_every_chapter_with_exercises():
    data = json.loads(RESULTS.read_text())
    assert data["date"][:2] == "20" and data["machine"]["cpus"] >= 1 and data["machine"]["cpu"]
    graded = sorted(
        p.stem for p in NOTEBOOKS.glob("*.ipynb") if graded_cells(nbformat.read(p, as_version=4))
    )
    assert sorted(c["notebook"] for c in data["chapters"]) == graded
    for c in data["chapters"]:
        assert c["autograde_s"] > 0 and c["grading_per_submission_s"] > 0, c
        # None: not timed (--no-once)
        assert c["grading_once_s"] is None or c["grading_once_s"] > 0, c
        assert c["per_submission_s"] == pytest.approx(
            c["autograde_s"] + c["grading_per_submission_s"], abs=0.11
        )
        # the solution got full marks (the command refuses to record anything else)
        assert c["score"] > 0
    par = data["parallel"]
    assert par["processes"] >= 2 and par["speedup"] == pytest.approx(
        par["one_process_s"] / par["parallel_s"], 0.01
    )


def test_instructors_md_shows_the_json():
    guide = (ROOT / "INSTRUCTORS.md").read_text()
    shown = guide.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()
    assert shown == table(json.loads(RESULTS.read_text())), (
        "run python -m ar_lab.course.grading.timing --write ..."
    )


def test_hours_for_a_class():
    chapter = {"per_submission_s": 12.0, "grading_once_s": 36.0}
    assert hours([chapter], n=300) == pytest.approx((300 * 12 + 36) / 3600)
    assert hours([chapter, chapter], n=300, speedup=2) == pytest.approx(hours([chapter], n=300))


def test_write_table_replaces_only_between_the_markers(tmp_path, capsys):
    data = json.loads(RESULTS.read_text())
    doc = tmp_path / "guide.md"
    doc.write_text(f"before\n{TABLE_START}\nold\n{TABLE_END}\nafter\n")
    assert write_table(doc, data) is True and write_table(doc, data) is False
    assert doc.read_text() == f"before\n{TABLE_START}\n{table(data)}\n{TABLE_END}\nafter\n"
    (tmp_path / "none.md").write_text("no markers")
    with raises(BadValue, 'document'):
        write_table(tmp_path / "none.md", data)
    assert main(["--from-json", str(RESULTS)]) == 0
    assert capsys.readouterr().out.strip() == table(data)
