"""Every command line parses its arguments (issue 64): ``--help`` prints the usage and does nothing
else.

``python site/build.py --help`` used to start a build, emptying the previous one. The entry points
are found, not listed: every module of ar_lab and script of site/ with ``if __name__ ==
"__main__"``, so a new command is held to this too. Each runs with ``--help`` in an empty folder,
which stays empty; the site's build folder is left as it was.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAIN = re.compile(r"""^if __name__ == ["']__main__["']:""", re.M)


def entry_points() -> list[list[str]]:
    """The command that runs each entry point: ``-m module`` for ar_lab's, the script's path for
    site/'s."""
    found = []
    for path in sorted((ROOT / "ar_lab").rglob("*.py")):
        if MAIN.search(path.read_text()):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found.append(["-m", module.removesuffix(".__main__")])
    found += [[str(p)] for p in sorted((ROOT / "site").rglob("*.py")) if MAIN.search(p.read_text())]
    return found


COMMANDS = entry_points()


def test_the_entry_points_are_found():
    names = {c[-1] for c in COMMANDS}
    assert {"ar_lab.bench", "ar_lab.model.train", str(ROOT / "site" / "build.py")} <= names, names


def _state(folder: Path) -> list[tuple[str, int]] | None:
    return sorted((str(p.relative_to(folder)), p.stat().st_mtime_ns) for p in folder.rglob("*")) \
        if folder.exists() else None


# One process runs every command's --help in turn (a process each cost about four seconds of torch
# imports apiece): argv set as the command would see it, stdout captured, the exit code and what the
# folder holds afterwards recorded.
_DRIVER = """
import contextlib, io, json, os, runpy, sys
results = []
for command in json.loads(sys.argv[1]):
    out, code = io.StringIO(), None
    sys.argv = [command[-1], "--help"]
    try:
        with contextlib.redirect_stdout(out):
            if command[0] == "-m":
                runpy.run_module(command[1], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(command[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    except Exception as error:
        code = repr(error)
    results.append({"command": command, "code": code, "stdout": out.getvalue()[:300],
                    "files": sorted(os.listdir("."))})
print(json.dumps(results))
"""


def test_help_prints_the_usage_and_does_nothing_else(tmp_path):
    import json

    site_build = ROOT / "build" / "site"
    before = _state(site_build)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # what jupyter-book would set for the theme's renderer
    for name in ("CONTENT_CDN", "BUILD_DIRECTORY"):
        env.pop(name, None)
    run = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(COMMANDS)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-1000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert [r["command"] for r in results] == COMMANDS
    for r in results:
        command = r["command"][-1]
        assert r["code"] in (0, None), f"{command} --help exited {r['code']!r}"
        assert r["stdout"].startswith("usage:"), f"{command} --help printed {r['stdout']!r}"
        assert r["files"] == [], f"{command} --help wrote {r['files']}"
    assert _state(site_build) == before, f"a --help changed {site_build}"
