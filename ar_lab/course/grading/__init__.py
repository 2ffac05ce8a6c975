"""The grading machinery: student versions and nbgrader course folders (``exercises``), the
delegation guard and its forbid lists (``guard``, ``library``, ``forbidden``), the grading step that
judges each test again in a fresh process (``judge``, with ``cells``, ``sandbox``, ``channel``,
``plain``) inside bubblewrap (``jail``), the instructor's report on submissions (``report``) and the
timing of it all (``timing``). ``python -m ar_lab.course.grading`` runs the grading step
(``judge.main``)."""
