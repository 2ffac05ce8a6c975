"""The pinned versions live in requirements/; the conda files must agree with them."""

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"pytorch": "torch"}  # conda-forge name -> PyPI name


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            name, version = line.split("==")
            out[name.strip().lower()] = version.strip()
    return out


def conda_pins(path: Path) -> dict[str, str]:
    env = yaml.safe_load(path.read_text())
    assert env["channels"] == ["conda-forge"]
    out = {}
    for dep in env["dependencies"]:
        if isinstance(dep, str) and "=" in dep and not dep.startswith(("python=", "pip")):
            name, version = dep.split("=")[:2]
            out[CONDA_NAMES.get(name, name)] = version
    return out


def test_conda_and_binder_environments_agree_with_the_pins():
    course = pins(ROOT / "requirements/course.txt")
    assert course["torch"]
    for path in [ROOT / "environment.yml", ROOT / "binder/environment.yml"]:
        assert conda_pins(path) == course, f"{path.name} disagrees with requirements/course.txt"


def test_binder_gets_a_cpu_build_of_torch():
    text = (ROOT / "binder/environment.yml").read_text()
    assert re.search(r"^\s*- pytorch=[\d.]+=cpu\*$", text, re.M)
    assert (ROOT / "binder/postBuild").stat().st_mode & 0o111


def test_dev_pins_include_the_course_and_the_ranges_admit_the_pins():
    dev = (ROOT / "requirements/dev.txt").read_text()
    assert "-r course.txt" in dev
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    from packaging.requirements import Requirement

    ranges = {
        Requirement(r).name.lower(): Requirement(r).specifier for r in project["dependencies"]
    }
    ranges |= {
        Requirement(r).name.lower(): Requirement(r).specifier
        for r in project["optional-dependencies"]["dev"]
    }
    all_pins = pins(ROOT / "requirements/course.txt") | pins(ROOT / "requirements/dev.txt")
    for name, version in all_pins.items():
        assert name in ranges, f"{name} is pinned but not declared in pyproject.toml"
        assert ranges[name].contains(version), (
            f"{name}=={version} is outside pyproject's range {ranges[name]}"
        )


def test_every_stated_python_version_is_the_one_ci_tests():
    """pyproject, the Makefile's check, the README, the conda and Binder files and CI's workflow
    name one minimum: the version CI runs (the course layer uses 3.11's code.co_qualname)."""
    ci = re.search(
        r'python-version: "(3\.\d+)"', (ROOT / ".github/workflows/test.yml").read_text()
    ).group(1)
    major, minor = ci.split(".")
    stated = {
        "pyproject": re.search(
            r'requires-python = ">=(3\.\d+)"', (ROOT / "pyproject.toml").read_text()
        ).group(1),
        "ruff": "3."
        + re.search(r'target-version = "py3(\d+)"', (ROOT / "pyproject.toml").read_text()).group(1),
        "Makefile": ".".join(
            re.search(r"version_info >= \((3), (\d+)\)", (ROOT / "Makefile").read_text()).groups()
        ),
        "README": re.search(r"with Python (3\.\d+)\+", (ROOT / "README.md").read_text()).group(1),
        "conda": re.search(r"python=(3\.\d+)", (ROOT / "environment.yml").read_text()).group(1),
        "binder": re.search(
            r"python=(3\.\d+)", (ROOT / "binder/environment.yml").read_text()
        ).group(1),
    }
    assert stated == dict.fromkeys(stated, f"{major}.{minor}"), stated
