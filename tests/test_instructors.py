"""The instructor guide lists every graded exercise with its real points, and its commands are the
tested ones."""

import ast
import re
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest

from ar_lab.course.grading.exercises import main as exercises_main

ROOT = Path(__file__).resolve().parent.parent
GUIDE = (ROOT / "INSTRUCTORS.md").read_text()
COMMAND_LINES = [
    line.split("  #")[0].strip()
    for block in re.findall(r"```bash\n(.*?)```", GUIDE, re.S)
    for line in block.splitlines()
    if line.strip() and not line.lstrip().startswith("#")
]


def test_every_graded_cell_is_listed_with_its_points():
    listed = dict(re.findall(r"`((?:ch\d\d|a\d)-[a-z0-9-]+)` \((\d+)\)", GUIDE))
    found = {}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if meta.get("grade"):
                found[meta["grade_id"]] = str(meta["points"])
                assert path.stem in GUIDE, f"{path.stem} is not in INSTRUCTORS.md"
    assert listed == found


def _template(command: str) -> str:
    """A guide command with its assignment and student as the end-to-end test writes them."""
    command = re.sub(r"\b\d\d_[a-z_]+\b", "{assignment}", command)
    return re.sub(r"--student \S+", "--student {student}", command)


def test_the_guides_nbgrader_commands_are_the_ones_the_end_to_end_test_runs():
    source = (ROOT / "tests" / "test_grading.py").read_text()
    tested = {
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith("nbgrader ")
    }
    shown = [line for line in COMMAND_LINES if line.startswith("nbgrader ")]
    assert {"generate_assignment", "autograde", "generate_feedback", "export"} <= {
        c.split()[1] for c in shown
    }
    for command in shown:
        assert _template(command) in tested, (
            f"INSTRUCTORS.md shows `{command}`, which tests/test_grading.py never runs"
        )


def test_the_guides_project_commands_exist(capsys):
    shown = [line for line in COMMAND_LINES if "python -m ar_lab.course.grading.exercises" in line]
    assert {line.split("ar_lab.course.grading.exercises ")[1].split()[0] for line in shown} == {
        "release",
        "course",
    }
    for line in shown:
        sub, *args = line.split("ar_lab.course.grading.exercises ")[1].split()
        with pytest.raises(SystemExit) as stop:
            exercises_main([sub, "--help"])
        assert stop.value.code == 0
        help_text = capsys.readouterr().out
        for option in [a for a in args if a.startswith("--")]:
            assert option in help_text, f"`{line}`: {sub} has no {option}"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_guides_make_target_calls_the_course_command():
    [line] = [line for line in COMMAND_LINES if line.startswith("make grading-course")]
    dry_run = subprocess.run(
        ["make", "-n", *line.split()[1:]], cwd=ROOT, capture_output=True, text=True
    )
    assert dry_run.returncode == 0, dry_run.stderr
    assert '-m ar_lab.course.grading.exercises course "grading" --chapter 06' in dry_run.stdout
