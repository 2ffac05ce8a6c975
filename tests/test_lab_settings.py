"""The learner's JupyterLab (``make lab``) hides the instructor's tools: the released course folder
carries settings that turn nbgrader's server pages off and disable its JupyterLab extension, and
``make lab`` points JupyterLab at them. Checked on a running JupyterLab, beside one started without
them (where nbgrader's pages answer)."""

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ar_lab.course.grading import lab_settings
from ar_lab.course.grading.exercises import release

ROOT = Path(__file__).resolve().parents[1]
JUPYTER = Path(sys.executable).parent / "jupyter"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status_and_page(folder: Path, env: dict) -> tuple[int, str]:
    """Start JupyterLab on ``folder``; (the status of /formgrader, the /lab page)."""
    port = _free_port()
    server = subprocess.Popen(
        [str(JUPYTER), "lab", "--no-browser", "--allow-root", f"--port={port}",
         "--IdentityProvider.token=t", f"--ServerApp.root_dir={folder}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                page = urllib.request.urlopen(f"{base}/lab?token=t", timeout=5).read().decode()
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.1)
        else:
            raise AssertionError("JupyterLab did not start")
        opener = urllib.request.build_opener(_NoRedirect)
        try:
            status = opener.open(f"{base}/formgrader?token=t", timeout=5).status
        except urllib.error.HTTPError as e:
            status = e.code
        return status, page
    finally:
        server.terminate()
        server.wait(timeout=30)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def _disabled(page: str) -> list[str]:
    found = re.search(r'"disabledExtensions":\s*(\[[^\]]*\])', page)
    return json.loads(found.group(1)) if found else []


@pytest.mark.slow
def test_the_learners_lab_has_no_nbgrader_menus_or_pages(tmp_path):
    pytest.importorskip("nbgrader", reason="without nbgrader there is nothing to hide")
    course = tmp_path / "course"
    release(out=course, chapters=["00"])
    config = course / lab_settings.CONFIG_DIR
    env = {k: v for k, v in os.environ.items() if k != "JUPYTER_CONFIG_PATH"}
    # without the settings, nbgrader's formgrader answers (a redirect to its page) and its
    # extension is enabled: what the settings must change
    status, page = _status_and_page(course, env)
    assert status in (200, 302) and lab_settings.NBGRADER_LAB not in _disabled(page)
    status, page = _status_and_page(course, {**env, "JUPYTER_CONFIG_PATH": str(config)})
    assert status == 404
    assert lab_settings.NBGRADER_LAB in _disabled(page)


def test_make_lab_starts_jupyterlab_with_the_released_settings():
    recipe = (ROOT / "Makefile").read_text().split("\nlab:", 1)[1].split("\n\n", 1)[0]
    assert "release --out course" in recipe
    assert f"JUPYTER_CONFIG_PATH=$(CURDIR)/course/{lab_settings.CONFIG_DIR}" in recipe
