"""``python -m ar_lab.course.grading COURSE_FOLDER ASSIGNMENT``: the grading step
(``judge.main``)."""

import sys

from ar_lab.course.grading.judge import main

if __name__ == "__main__":
    sys.exit(main())
