"""Grading a class, measured: seconds of nbgrader's autograde plus the course's grading step per
submission.

    python -m ar_lab.course.grading.timing [--chapter 06 ...]
                                         [--parallel-chapter 01 --students 4 --processes 2]
                                         [--json data/grading_time.json] [--write INSTRUCTORS.md]
    python -m ar_lab.course.grading.timing --write INSTRUCTORS.md --from-json data/grading_time.json

For each source notebook with graded cells, in a temporary nbgrader course folder
(``exercises.course``): ``nbgrader generate_assignment``, the source notebook itself as one
learner's submission, then, timed, ``nbgrader autograde`` (the whole command: nbgrader's start, the
gradebook, one kernel running the whole chapter) and the course's grading step split as it works
(``judge.plan``: once per assignment, the instructor's solution judged as a submission;
``judge.judge``: per submission, the judge notebook in a fresh kernel with an answer process per
test). A class of N costs ``N * (autograde + judge) + plan`` seconds per chapter on one process; the
autograde figure holds nbgrader's start, which a class's single autograde pays once, so it errs
long.

``--no-once`` leaves the once-per-assignment part untimed (the judge notebook is then built from the
source notebook without running it), which halves the measurement.

Then nbgrader's own per-student commands in parallel, on one chapter: ``--students`` copies of the
solution autograded by one ``nbgrader autograde``, against ``--processes`` workers at the same time,
each running ``nbgrader autograde ASSIGNMENT --student ID`` for its share of the students, one after
another. The JSON records the machine and the date; ``--write`` puts the table between its markers
in INSTRUCTORS.md (tests/test_grading_time.py checks that it matches the JSON).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

from ar_lab.base.errors import BadValue
from ar_lab.course.grading.exercises import NOTEBOOKS, course, graded_cells, select_notebooks

TABLE_START = (
    "<!-- grading time table: written by `python -m ar_lab.course.grading.timing --write` from "
    "its JSON -->"
)
TABLE_END = "<!-- end of grading time table -->"
CLASS = 300  # the class the table's hours are for
LEARNER = "learner"


def _nbgrader(folder: Path, *args: str) -> tuple[float, subprocess.CompletedProcess]:
    """Seconds and result of ``nbgrader ARGS`` run in ``folder`` (the venv's bin on PATH: nbgrader
    runs alembic)."""
    env = dict(
        os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    )
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "nbgrader", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
    )
    return time.perf_counter() - start, result


def _ok(result: subprocess.CompletedProcess, what: str) -> None:
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{(result.stdout + result.stderr)[-3000:]}")


def _scores(folder: Path, assignment: str) -> dict[str, tuple[float, float]]:
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{(folder / 'gradebook.db').resolve()}") as gb:
        return {
            s.id: (
                gb.find_submission(assignment, s.id).score,
                gb.find_submission(assignment, s.id).max_score,
            )
            for s in gb.students
        }


def _submit(folder: Path, name: str, students: list[str]) -> None:
    """The source notebook as each student's submission (what nbgrader collect leaves in
    submitted/)."""
    for student in students:
        target = folder / "submitted" / student / name / f"{name}.ipynb"
        target.parent.mkdir(parents=True)
        shutil.copyfile(folder / "source" / name / f"{name}.ipynb", target)


def time_chapter(path: Path, workdir: Path, *, timeout: int = 120, once: bool = True) -> dict:
    """One chapter: autograde and the grading step (plan once, judge per submission) of one
    submission. ``once=False`` skips timing the once-per-assignment part (one more run of the
    solution): the judge notebook the submission is judged by is built from the source notebook
    without running it."""
    from ar_lab.course.grading.judge import Plan, judge, judge_notebook, plan

    folder, name = workdir / path.stem, path.stem
    course(folder, src=path.parent, chapters=[name[:2]], timeout=timeout)
    seconds, result = _nbgrader(folder, "generate_assignment", name)
    _ok(result, f"nbgrader generate_assignment {name}")
    _submit(folder, name, [LEARNER])
    autograde_s, result = _nbgrader(folder, "autograde", name)
    _ok(result, f"nbgrader autograde {name}")
    source = folder / "source" / name / f"{name}.ipynb"
    start = time.perf_counter()
    if once:
        p = plan(source, timeout=timeout)
    else:
        nb = nbformat.read(source, as_version=4)
        judge_nb, tests, answers = judge_notebook(nb)
        p = Plan(name, nb, judge_nb, tests, {}, answers)
    plan_s = time.perf_counter() - start
    start = time.perf_counter()
    verdicts = judge(p, folder / "autograded" / LEARNER / name, timeout=timeout)
    judge_s = time.perf_counter() - start
    score, max_score = _scores(folder, name)[LEARNER]
    failed = sorted(g for g, v in verdicts.items() if not v.passed) if once else []
    # the solution must earn full marks, or the seconds measured a failure
    if score != max_score or failed:
        raise RuntimeError(
            f"{name}: the solution scored {score}/{max_score}; fresh run failed {failed}"
        )
    return {
        "notebook": name,
        "autograde_s": round(autograde_s, 1),
        "grading_once_s": round(plan_s, 1) if once else None,
        "grading_per_submission_s": round(judge_s, 1),
        "per_submission_s": round(autograde_s + judge_s, 1),
        "judged_tests": len(p.tests),
        "kernel_only_tests": len(p.kernel_only) if once else None,
        "score": score,
    }


def _worker(folder: Path, name: str, students: list[str]) -> subprocess.Popen:
    """One worker: nbgrader's per-student autograde for each of ``students``, one after another."""
    bin_dir = Path(sys.executable).parent
    steps = [f"{sys.executable} -m nbgrader autograde {name} --student {s}" for s in students]
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.Popen(
        ["bash", "-c", " && ".join(steps)],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def time_parallel(
    path: Path, workdir: Path, *, students: int, processes: int, timeout: int = 120
) -> dict:
    """``students`` submissions of one chapter autograded, wall-clock seconds: one ``nbgrader
    autograde`` against ``processes`` workers of nbgrader's per-student ``autograde --student`` at
    the same time."""
    name, ids = path.stem, [f"s{i + 1}" for i in range(students)]
    walls = {}
    for mode in ("one process", f"{processes} processes"):
        folder = workdir / f"{name}-{mode.split()[0]}"
        course(folder, src=path.parent, chapters=[name[:2]], timeout=timeout)
        _ok(_nbgrader(folder, "generate_assignment", name)[1], "generate_assignment")
        _submit(folder, name, ids)
        start = time.perf_counter()
        if mode == "one process":
            _ok(_nbgrader(folder, "autograde", name)[1], "autograde")
        else:
            jobs = [_worker(folder, name, ids[k::processes]) for k in range(processes)]
            logs = [job.communicate()[0] for job in jobs]
            if any(job.returncode for job in jobs):
                raise RuntimeError(f"{mode} failed:\n" + "\n".join(log[-2000:] for log in logs))
        walls[mode] = time.perf_counter() - start
        scores = _scores(folder, name)
        if sorted(scores) != ids or any(s != m for s, m in scores.values()):
            raise RuntimeError(f"{mode}: not every copy of the solution got full marks: {scores}")
    one, many = walls["one process"], walls[f"{processes} processes"]
    return {
        "notebook": name,
        "students": students,
        "processes": processes,
        "one_process_s": round(one, 1),
        "parallel_s": round(many, 1),
        "speedup": round(one / many, 2),
    }


def machine() -> dict:
    import nbgrader
    import torch

    model = platform.processor()
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {
        "cpus": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "cpu": model,
        "system": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "nbgrader": nbgrader.__version__,
    }


def hours(chapters: list[dict], n: int = CLASS, speedup: float = 1.0) -> float:
    """Hours to grade ``n`` learners on every chapter: n * (autograde + judge) + plan (where timed),
    over ``speedup``."""
    return (
        sum(n * c["per_submission_s"] + (c["grading_once_s"] or 0) for c in chapters)
        / 3600
        / speedup
    )


def _measured_on(data: dict, day: str, cpu: str) -> str:
    """The notebooks whose rows were measured on ``day`` on ``cpu`` (``--update`` stamps its
    rows)."""
    return ", ".join(f"`{r['notebook']}`" for r in data["chapters"]
                     if r.get("date", "")[:10] == day and _cpu(data, r) == cpu)


def _cpu(data: dict, row: dict) -> str:
    return row.get("cpu", data["machine"]["cpu"])  # (rows stamped before cpus were: the same)


def table(data: dict) -> str:
    """The Markdown table INSTRUCTORS.md shows, from the JSON's data."""
    rows = data["chapters"]
    # the once-per-assignment column, when measured
    timed = any(c["grading_once_s"] is not None for c in rows)
    head = ["notebook", "autograde (s)", "grading step, per submission (s)", "per submission (s)",
            *(["grading step, once (s)"] if timed else []), f"a class of {CLASS} (hours)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in rows:
        once = (
            ["not timed" if c["grading_once_s"] is None else f"{c['grading_once_s']:.1f}"]
            if timed
            else []
        )
        cells = [
            f"`{c['notebook']}`",
            f"{c['autograde_s']:.1f}",
            f"{c['grading_per_submission_s']:.1f}",
            f"{c['per_submission_s']:.1f}",
            *once,
            f"{hours([c]):.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    total = [
        f"{sum(c['per_submission_s'] for c in rows):.0f}",
        *([""] if timed else []),
        f"{hours(rows):.1f}",
    ]
    lines.append("| " + " | ".join(["every chapter", "", "", *total]) + " |")
    m, par = data["machine"], data.get("parallel")
    later = sorted({(r["date"][:10], _cpu(data, r)) for r in data["chapters"]
                    if r.get("date", data["date"])[:10] != data["date"][:10]})
    lines += [
        "",
        f"Measured {data['date'][:10]} on {m['cpus']} cores ({m['cpu']}), torch {m['torch']} "
        f"with {m['torch_threads']} threads, nbgrader {m['nbgrader']} (the 1-minute load average "
        f"{data['load_before'][0]:.1f} before, {data['load_after'][0]:.1f} after): one "
        "submission per chapter, the source notebook itself (full marks), one process. "
        "`autograde` includes nbgrader's own start (a class's single `autograde` pays it once). "
        "The grading step also judges your solution once per assignment"
        + (
            ", not timed here: add about one submission's grading step per chapter"
            if not timed
            else ""
        )
        + "."
        + "".join(f" Rows measured later, "
                  f"{'on the same machine' if cpu == m['cpu'] else f'on {cpu}'}: "
                  f"{_measured_on(data, d, cpu)} on {d}." for d, cpu in later),
    ]
    if par:
        lines.append(
            f"In parallel ({par['notebook']}, {par['students']} submissions, autograde): one "
            f"`nbgrader autograde` {par['one_process_s']:.0f} s, {par['processes']} processes of "
            f"nbgrader's per-student `autograde --student` {par['parallel_s']:.0f} s (x"
            f"{par['speedup']:.2f}); at that rate a class of {CLASS} takes "
            f"{hours(rows, speedup=par['speedup']):.1f} hours on this machine."
        )
    return "\n".join(lines)


def write_table(document: Path, data: dict) -> bool:
    text = document.read_text()
    if TABLE_START not in text or TABLE_END not in text:
        raise BadValue(
            f"the document {document} has no grading time markers ({TABLE_START!r} ... "
            f"{TABLE_END!r})",
            arg="document",
        )
    head, rest = text.split(TABLE_START, 1)
    new = f"{head}{TABLE_START}\n{table(data)}\n{TABLE_END}{rest.split(TABLE_END, 1)[1]}"
    if new != text:
        document.write_text(new)
    return new != text


def measure(
    chapters: list[str] | None,
    *,
    parallel: str | None,
    students: int,
    processes: int,
    once: bool = True,
    out=print,
    save=None,
) -> dict:
    """Time ``chapters`` (None: every chapter with exercises; []: none) and the parallel grading of
    ``parallel``."""
    paths = [] if chapters == [] else [p for p in select_notebooks(NOTEBOOKS, chapters)
                                       if graded_cells(nbformat.read(p, as_version=4))]
    data = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "chapters": [],
    }
    with tempfile.TemporaryDirectory(prefix="ar_lab_grading_time_") as tmp:
        for path in paths:
            row = time_chapter(path, Path(tmp), once=once)
            data["chapters"].append(row)
            out(json.dumps(row))
            if save:  # what is measured so far survives an interruption
                save(data)
        if parallel:
            path = select_notebooks(NOTEBOOKS, [parallel])[0]
            data["parallel"] = time_parallel(
                path, Path(tmp), students=students, processes=processes
            )
            data["parallel"]["date"] = datetime.datetime.now(datetime.UTC).isoformat(
                timespec="seconds"
            )
            out(json.dumps(data["parallel"]))
    data["load_after"] = [round(x, 2) for x in os.getloadavg()]
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ar_lab.course.grading.timing", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--chapter", action="append", help="only this chapter (e.g. 06); repeatable"
    )
    parser.add_argument(
        "--parallel-chapter", default="01", help="the chapter timed in parallel ('' for none)"
    )
    parser.add_argument(
        "--students", type=int, default=4, help="submissions in the parallel timing (default 4)"
    )
    parser.add_argument(
        "--processes", type=int, default=2, help="workers in the parallel timing (default 2)"
    )
    parser.add_argument(
        "--json", type=Path, help="write the results here (e.g. data/grading_time.json)"
    )
    parser.add_argument(
        "--from-json", type=Path, help="measure nothing: read the results from this JSON"
    )
    parser.add_argument(
        "--write", type=Path, help="write the table between its markers in this file"
    )
    parser.add_argument(
        "--no-once",
        action="store_true",
        help="do not time the grading step's once-per-assignment part (halves the time)",
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="keep the --json file's other rows: measure only --chapter (none if not given), and "
        "the parallel timing",
    )
    args = parser.parse_args(argv)
    if args.update and not (args.json and args.json.exists()):
        parser.error("--update needs an existing --json file")
    if args.students < 1 or args.processes < 1:
        parser.error("--students and --processes must be >= 1")
    if args.from_json:
        data = json.loads(args.from_json.read_text())
    else:
        data = measure(
            args.chapter or ([] if args.update else None),
            parallel=args.parallel_chapter or None,
            students=args.students,
            processes=args.processes,
            once=not args.no_once,
            save=None
            if args.update or not args.json
            else lambda d: args.json.write_text(json.dumps(d, indent=1) + "\n"),
        )
        if args.update:  # the new rows (and parallel timing) into the JSON's
            old = json.loads(args.json.read_text())
            today = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
            rows = {c["notebook"]: c for c in old["chapters"]} | {
                c["notebook"]: {**c, "date": today, "cpu": data["machine"]["cpu"]}
                for c in data["chapters"]
            }
            data = old | ({"parallel": data["parallel"]} if "parallel" in data else {})
            data["chapters"] = sorted(rows.values(), key=lambda c: c["notebook"])
        if args.json:
            args.json.write_text(json.dumps(data, indent=1) + "\n")
    print(table(data))
    if args.write and write_table(args.write, data):
        print(f"wrote the grading time table into {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
