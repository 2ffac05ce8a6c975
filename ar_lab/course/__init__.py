"""The course layer, in three rooms: ``grading/`` (student versions, the delegation guard, the
grading step and its sandbox), ``checkers/`` (verdicts, checkers and named mistakes, claims) and
``views/`` (the explorers' views and widgets, quizzes, plots); ``budget`` measures the notebooks. It
calls every layer below it; nothing below imports it."""
