"""Checkers and named mistakes: the verdicts a graded test shows (``verdicts``, ``checks``,
``answers``), the classic slips each exercise names (``mistakes`` and the chapters' ``*_checks``),
and the notebooks' claims checked where they are measured (``claims``)."""
