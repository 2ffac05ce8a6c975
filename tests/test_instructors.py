"""The instructor guide lists every graded exercise with its real points, and its commands exist."""

import re
from pathlib import Path

import nbformat

from ar_lab.exercises import main as exercises_main

ROOT = Path(__file__).resolve().parent.parent
GUIDE = (ROOT / "INSTRUCTORS.md").read_text()


def test_every_graded_cell_is_listed_with_its_points():
    listed = dict(re.findall(r"`(ch\d\d-[a-z0-9-]+)` \((\d+)\)", GUIDE))
    found = {}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if meta.get("grade"):
                found[meta["grade_id"]] = str(meta["points"])
                assert path.stem in GUIDE, f"{path.stem} is not in INSTRUCTORS.md"
    assert listed == found


def test_documented_commands_and_options_exist(capsys):
    for sub, options in [("release", ["--chapter", "--out"]), ("validate", ["--invert"]), ("autograde", ["--out"])]:
        assert f"python -m ar_lab.exercises {sub}" in GUIDE
        try:
            exercises_main([sub, "--help"])
        except SystemExit as e:
            assert e.code == 0
        help_text = capsys.readouterr().out
        for option in options:
            assert option in help_text and option in GUIDE
