"""The verdicts a graded check raises: ``CheckFailed`` (an ``AssertionError``, so nbgrader counts a
failed test) and its kinds, ``Delegated`` (the learner's code reached the package's reference) and
``NoAnswer`` (there is no answer of the learner's to check). ``ar_lab.course.checkers.checks``
raises them and re-exports the first two; the checkers import them from there.
"""

from __future__ import annotations

import traceback


class CheckFailed(AssertionError):
    """A graded check's verdict: what was checked, what was expected, what came, and a hint.

    In a notebook the verdict is all a learner needs, not the checkers' own frames: IPython shows
    ``_render_traceback_`` instead of the traceback (nbgrader still sees an error and scores 0).
    Where the learner's code raised, the lines of that error inside the learner's own cells come
    after it."""

    def __init__(self, message: str = "", mistake: str | None = None) -> None:
        super().__init__(message)
        self.mistake = mistake  # the named mistake the answer matched (its description), if one did

    def _render_traceback_(self) -> list[str]:
        lines = [
            f"\N{HEAVY BALLOT X} {type(self).__name__}: "
            f"{str(self).splitlines()[0] if str(self) else ''}"
        ]
        lines += str(self).splitlines()[1:]
        cause = self.__cause__
        if cause is not None:
            lines.append(f"Your code raised {type(cause).__name__}: {cause}")
            lines += [
                f"  in your cell, line {f.lineno}: {(f.line or '').strip()}"
                for f in traceback.extract_tb(cause.__traceback__)
                if _learner_file(f.filename)
            ]
        return lines


def _learner_file(filename: str) -> bool:
    """A frame of a notebook cell (ipykernel names them after a temporary file or
    ``<ipython-input-…>``)."""
    return "ipykernel_" in filename or filename.startswith("<ipython-input")


class Delegated(CheckFailed):
    """The learner's code called the reference implementation the exercise asks them to write;
    ``reference`` names what it reached (as the verdict does)."""

    def __init__(self, message: str = "", reference: str | None = None) -> None:
        super().__init__(message)
        self.reference = reference


class NoAnswer(Delegated):
    """The learner's answer is not there: None (a hook would run the package's own version in its
    place), or the package's own function (or a thin wrapper of it) instead of code of their own
    (``answers.require_answer``). A ``Delegated``: either way the package's code would be graded;
    ``reference`` names it (None for a missing answer)."""
