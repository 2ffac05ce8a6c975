"""Whose code is a frame running? Library code (the standard library, installed packages, ar_lab) or
a notebook's (a cell, or source a learner ran with ``exec``): what the kernel's delegation gate asks
when it walks up from a call to the test or the learner that made it."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2]  # ar_lab/


def _library_roots() -> tuple[str, ...]:
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= {str(PACKAGE), os.path.realpath(PACKAGE), os.path.abspath(PACKAGE)}
    return tuple(os.path.join(r, "") for r in roots)


_LIBRARY = _library_roots()


def is_library(filename: str) -> bool:
    """Code from the standard library, an installed package or ar_lab (not a notebook cell, not
    ``exec``)."""
    return filename.startswith(_LIBRARY) or filename.startswith("<frozen")
