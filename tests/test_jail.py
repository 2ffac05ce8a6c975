"""The sandbox learner code runs in when it is graded (ar_lab.course.grading.jail): bubblewrap, or a
clear refusal."""

import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

from ar_lab.course.grading import jail
from ar_lab.course.grading.judge import main as grading_main

needs_bwrap = pytest.mark.skipif(
    not jail.confining(), reason="bubblewrap cannot confine a process here"
)


@pytest.fixture
def no_bwrap(monkeypatch, tmp_path):
    """A PATH without bwrap (the probe's answer forgotten before and after)."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.delenv(jail.OPT_OUT, raising=False)
    jail._probe.cache_clear()
    yield
    jail._probe.cache_clear()


def _course(folder, assignment="02_x"):
    """A course folder the grading step gets past its first checks in: a source notebook and its
    autograde."""
    (folder / "source" / assignment).mkdir(parents=True)
    nbformat.write(
        nbformat.v4.new_notebook(), folder / "source" / assignment / f"{assignment}.ipynb"
    )
    (folder / "autograded" / "s" / assignment).mkdir(parents=True)
    return folder


def test_without_bubblewrap_grading_refuses_unless_the_instructor_opts_out(
    no_bwrap, tmp_path, capsys, monkeypatch
):
    with pytest.raises(jail.SandboxMissing, match=f"{jail.OPT_OUT}=off"):
        jail.require()
    # what autograde's kernel manager and the fork
    with pytest.raises(jail.SandboxMissing, match="bubblewrap"):
        jail.command(cwd=tmp_path)  # server start their process with: no unconfined start
    assert grading_main([str(_course(tmp_path / "course")), "02_x"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "bubblewrap (bwrap) is not installed" in err
        and "AR_LAB_SANDBOX=off" in err
    )
    monkeypatch.setenv(jail.OPT_OUT, "off")  # the instructor's explicit choice
    jail.require()
    assert jail.command(cwd=tmp_path) == []


@needs_bwrap
def test_a_confined_process_writes_only_its_scratch_and_sees_no_course_or_solutions(tmp_path):
    course = tmp_path / "course"
    (course / "source").mkdir(parents=True)
    (course / "gradebook.db").write_text("grades")
    readable, scratch = tmp_path / "readable", tmp_path / "scratch"
    readable.mkdir()
    scratch.mkdir()
    # another copy of the course on this machine, in no folder the sandbox was told about
    clone = tmp_path / "clone" / "ar_lab" / "engine" / "sampling.py"
    clone.parent.mkdir(parents=True)
    clone.write_text("def filter_top_p(): ...")
    probe = textwrap.dedent(f"""
        import os
        def write(path):
            try:
                with open(path, "a") as f:
                    f.write("x")
                return "written"
            except OSError as e:
                return type(e).__name__
        print(write({str(course / "gradebook.db")!r}),
              write({str(course / "source" / "new.ipynb")!r}),
              write({str(readable / "f")!r}), write({str(scratch / "f")!r}),
              write({str(jail.ROOT / "x")!r}),
              os.path.exists({str(course / "gradebook.db")!r}),
              os.path.exists({str(jail.ROOT / "notebooks")!r}),
              os.path.exists({str(jail.PACKAGE / "engine" / "sampling.py")!r}),
              os.path.exists({str(clone)!r}), os.path.exists({str(Path.home())!r} + "/.cache"),
              write("/new"))
        """)
    cmd = jail.command(
        cwd=scratch, readable=[readable], writable=[scratch], hidden=[course], package=False
    )
    out = subprocess.run(
        [*cmd, sys.executable, "-I", "-c", probe], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["OSError", "FileNotFoundError", "OSError", "written", "OSError",
                                  "False", "False", "False", "False", "False", "OSError"]
    assert (course / "gradebook.db").read_text() == "grades" and not (readable / "f").exists()


@needs_bwrap
def test_a_confined_process_keeps_torch_compiles_cache_in_its_scratch(tmp_path):
    """Inductor writes its folder into os.environ at first use, so a grader that compiled before
    (a test, a notebook) hands a folder outside the sandbox to the kernels it starts: the scratch
    environment sends the cache to the scratch folder, where appendix A1's compile can write."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {"PATH": "/usr/bin:/bin", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "outside")}
    env |= jail.scratch_env(scratch / "tmp")
    probe = "from torch._inductor.runtime.cache_dir_utils import cache_dir; print(cache_dir())"
    cmd = jail.command(cwd=scratch, writable=[scratch], package=False)
    out = subprocess.run([*cmd, sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).is_relative_to(scratch) and Path(out.stdout.strip()).is_dir()
    assert not (tmp_path / "outside").exists()
