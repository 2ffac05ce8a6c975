"""The learner's JupyterLab without the instructor's tools: settings ``release`` writes beside the
student versions, which ``make lab`` points JupyterLab at.

The course environment a learner opens may hold nbgrader (``make test`` installs it into the same
virtual environment), whose menus and server pages (formgrader, assignment and course lists) are an
instructor's. ``write(folder)`` puts a Jupyter configuration directory at ``folder/.jupyter`` that
turns nbgrader's server extensions off and disables its JupyterLab extension; ``make lab`` starts
JupyterLab with ``JUPYTER_CONFIG_PATH`` set to it, a path that outranks the environment's own
configuration and leaves the user's (``~/.jupyter``) in force.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_DIR = ".jupyter"  # under the released course folder (hidden in JupyterLab's file browser)
NBGRADER_SERVER = (
    "nbgrader.server_extensions.formgrader",
    "nbgrader.server_extensions.validate_assignment",
    "nbgrader.server_extensions.assignment_list",
    "nbgrader.server_extensions.course_list",
)
NBGRADER_LAB = "@jupyter/nbgrader"


def write(folder: Path) -> Path:
    """Write the learner's Jupyter settings under ``folder`` (replacing earlier ones: they are the
    course's, not the learner's); returns the configuration directory."""
    config = Path(folder) / CONFIG_DIR
    for sub in ("labconfig", "jupyter_server_config.d"):
        (config / sub).mkdir(parents=True, exist_ok=True)
    # (where `jupyter server extension disable` writes: a .d file of its own)
    server = {"ServerApp": {"jpserver_extensions": dict.fromkeys(NBGRADER_SERVER, False)}}
    (config / "jupyter_server_config.d" / "nbgrader.json").write_text(
        json.dumps(server, indent=1) + "\n"
    )
    page = {"disabledExtensions": {NBGRADER_LAB: True}}
    (config / "labconfig" / "page_config.json").write_text(json.dumps(page, indent=1) + "\n")
    return config
