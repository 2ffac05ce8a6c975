"""Learner code confined by bubblewrap: the kernel ``nbgrader autograde`` runs a submission in, and
the grading step's judge kernel and answer processes, write nowhere but a scratch folder of their
own and see no course.

    bwrap --ro-bind /usr /usr ... --ro-bind PYTHON PYTHON --tmpfs COURSE --bind SCRATCH SCRATCH ...
        python -m ipykernel_launcher ...

``bwrap`` (bubblewrap, the sandbox Flatpak uses; Debian's ``bubblewrap`` package) gives the process
an empty, read-only root in which only what it needs is shown, read-only: the operating system
(``SYSTEM``), this Python's installation and environment, the shipped data, the package (not in the
grading step's answer processes, which get the withheld copy instead) and the folders a caller
names. Homes, ``/tmp`` and every other folder of the machine are absent, so no search of the file
system finds another copy of the course. Private folders inside what is shown are hidden behind
empty ones (``hidden``): the course folder (``source/`` with the solutions, every ``submitted/``
and ``autograded/`` copy, ``gradebook.db``, ``nbgrader_config.py``), the repository's notebooks and
history when ar_lab runs from a checkout, Jupyter's runtime folder and the folders of other kernels
(``KERNELS``: their connection files and sockets). It gets its own network (none: a kernel on this
machine cannot be reached), processes and IPC, and one writable folder.

``SandboxedKernelManager`` starts a Jupyter kernel that way (the course folder's
``nbgrader_config.py`` gives it to nbgrader's ``Execute``; ``exercises.execute(..., sandbox=...)``
to the judge); the kernel talks to its client over Unix sockets in its own folder. Without
bubblewrap, or where it cannot run, both refuse (``SandboxMissing``) unless the instructor sets
``AR_LAB_SANDBOX=off``: then learner code runs with the instructor's permissions.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

from jupyter_client.manager import AsyncKernelManager
from traitlets import Bool, List, Unicode

OPT_OUT = "AR_LAB_SANDBOX"  # "off": the instructor's explicit choice to run learner code unconfined
# set in a confined process (a sandbox started there nests: no new PID namespace)
INSIDE = "AR_LAB_SANDBOXED"
PACKAGE = Path(__file__).resolve().parents[2]  # the real ar_lab/
ROOT = PACKAGE.parent
# This user's folder of confined kernels (one each: sockets, connection file, temporary files),
# private to the user.
KERNELS = (
    Path(tempfile.gettempdir()) / f"ar_lab_kernels-{os.getuid() if hasattr(os, 'getuid') else 0}"
)
INSTALL = "apt-get install -y bubblewrap"


class SandboxMissing(RuntimeError):
    """Learner code would run unconfined: bubblewrap is missing or cannot start here."""


def enabled() -> bool:
    """Whether learner code is to be confined (everything but ``AR_LAB_SANDBOX=off``)."""
    return os.environ.get(OPT_OUT, "").strip().lower() != "off"


@functools.cache
def _probe() -> str:
    """'' when bwrap starts a confined process here, else why not."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed"
    try:
        run = subprocess.run(
            [bwrap, *_base(nested=os.environ.get(INSIDE) == "1"), "true"],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"bwrap could not start: {error}"
    return (
        ""
        if run.returncode == 0
        else f"bwrap cannot confine a process here: {run.stderr.strip()[:300]}"
    )


def available() -> bool:
    """Whether bwrap confines a process here."""
    return not _probe()


def reason() -> str:
    """Why bwrap cannot confine a process here ('' when it can)."""
    return _probe()


def confining() -> bool:
    """Whether learner code is confined now: bwrap works and the instructor has not opted out."""
    return enabled() and available()


def require() -> None:
    """Raise ``SandboxMissing`` (with what to do) unless bwrap works here or the instructor opted
    out."""
    why = _probe() if enabled() else ""
    if why:
        raise SandboxMissing(
            f"{why}. ar_lab runs learner code for grading in a bubblewrap sandbox: "
            f"install it ({INSTALL} on "
            "Debian/Ubuntu, as root). To grade without it, learner code then running "
            "with your permissions, set "
            f"{OPT_OUT}=off."
        )


# What every sandbox shows of the machine, read-only: the operating system (programs, libraries,
# its configuration, /sys for PyTorch's CPU detection), nothing of anyone's files. Homes, /tmp,
# /work, /srv, /mnt and the rest are absent: another checkout of the course, or an instructor's
# notes, cannot be found by searching the file system.
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/sys")


def _base(*, nested: bool) -> list[str]:
    """bwrap's options that every sandbox starts with: an empty root with the operating system
    (``SYSTEM``) and this Python's installation shown read-only, private /dev, /proc, shared memory
    and namespaces (a nested sandbox keeps its parent's PID namespace: a new one needs rights the
    parent dropped)."""
    unshare = [
        "--unshare-user-try",
        "--unshare-ipc",
        "--unshare-net",
        "--unshare-uts",
        "--unshare-cgroup-try",
    ]
    if not nested:
        unshare.append("--unshare-pid")
    system = []
    for name in SYSTEM:
        path = Path(name)
        if path.is_symlink():  # /bin -> usr/bin on a merged-/usr system
            system += ["--symlink", os.readlink(path), name]
        elif path.is_dir():
            system += ["--ro-bind", name, name]
    # this Python and its environment (a venv, pyenv's or the runner's install, outside /usr)
    for prefix in dict.fromkeys(
        Path(p).resolve() for p in (sys.base_prefix, sys.base_exec_prefix, sys.prefix)
    ):
        system += ["--ro-bind", str(prefix), str(prefix)]
    return [
        *system,
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/dev/shm",
        *unshare,
        "--die-with-parent",
        "--setenv",
        INSIDE,
        "1",
    ]


def private_paths(*, package: bool) -> tuple[list[Path], list[Path]]:
    """(folders to hide, folders inside them to show again read-only) in every sandbox: from a
    checkout of the repository, all of it (the source notebooks hold the solutions; ``.git`` their
    history) but the Python environment, the shipped data and, unless ``package`` is False, the
    package; without one, the package itself when ``package`` is False (the answer process sees only
    the withheld copy). Jupyter's runtime folder and ``KERNELS``, always."""
    from jupyter_core.paths import jupyter_runtime_dir

    from ar_lab.model.data import data_dir

    hide, show = [Path(jupyter_runtime_dir()), KERNELS], [data_dir()]
    if (ROOT / "pyproject.toml").is_file() and (ROOT / "notebooks").is_dir():  # a checkout
        hide.append(ROOT)
        show += [Path(sys.prefix)] + ([PACKAGE] if package else [])
    elif not package:
        hide.append(PACKAGE)
    return hide, show


def command(*, cwd: Path | None = None, writable: list[Path] = (), readable: list[Path] = (),
            hidden: list[Path] = (), package: bool = True) -> list[str]:
    """The bwrap command line (before the program's own) of a sandbox: ``hidden`` folders (and
    ``private_paths``) behind empty ones, then ``readable`` shown read-only and ``writable``
    read-write, the program started in ``cwd``. ``package``: whether the real ar_lab is visible."""
    require()
    if not enabled():
        return []
    hide, show = private_paths(package=package)
    args = [shutil.which("bwrap"), *_base(nested=os.environ.get(INSIDE) == "1")]
    empty = [
        str(p) for p in dict.fromkeys(Path(p).resolve() for p in [*hide, *hidden]) if p.is_dir()
    ]
    for path in empty:
        args += ["--tmpfs", path]
    for flag, paths in (("--ro-bind", [*show, *readable]), ("--bind", writable)):
        for path in paths:
            path = Path(path).resolve()
            if path.exists():
                args += [flag, str(path), str(path)]
    # read-only too: a write there, or in the empty root, fails as it would anywhere else
    for path in [*empty, "/"]:
        args += ["--remount-ro", path]
    if cwd is not None:
        args += ["--chdir", str(Path(cwd).resolve())]
    return args


def ignoring_interrupts(cmd: list[str]) -> list[str]:
    """``cmd`` started with SIGINT ignored: an interrupt for the kernel's process group (a cell's
    time limit) would end bwrap, and the kernel with it; the kernel sets its own handler while a
    cell runs."""
    return (
        ["/bin/sh", "-c", 'trap "" INT; exec "$@"', "sh", *cmd]
        if cmd and cmd[0] != "/bin/sh"
        else cmd
    )


def scratch_env(tmp: Path) -> dict[str, str]:
    """The environment that sends a confined process's temporary and cache files to ``tmp``
    (writable), with matplotlib's font list copied there (rebuilding it takes seconds)."""
    caches = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    fonts = Path(os.environ.get("MPLCONFIGDIR") or caches / "matplotlib")
    (tmp / "matplotlib").mkdir(parents=True, exist_ok=True)
    for font_list in fonts.glob("fontlist-*.json"):
        shutil.copyfile(font_list, tmp / "matplotlib" / font_list.name)
    return {
        "TMPDIR": str(tmp),
        "IPYTHONDIR": str(tmp / "ipython"),
        "MPLCONFIGDIR": str(tmp / "matplotlib"),
        "XDG_CACHE_HOME": str(tmp / "cache"),
        # torch.compile's caches (appendix A1): inductor sets its folder in os.environ at first use,
        # so a process that compiled before would hand its own, outside the sandbox, to the kernel
        "TORCHINDUCTOR_CACHE_DIR": str(tmp / "torchinductor"),
        "TRITON_CACHE_DIR": str(tmp / "triton"),
    }


class SandboxedKernelManager(AsyncKernelManager):
    """A Jupyter kernel in a sandbox (``command``): the system and Python shown read-only, the
    course folder (``course``, default the folder this process runs in: nbgrader's course folder)
    and ``private_paths`` hidden, the kernel's working folder shown read-only (read-write with
    ``writable_cwd``), a fresh folder under ``KERNELS`` for its sockets, connection file and
    temporary files (``TMPDIR``)."""

    course = List(
        Unicode(), help="folders the kernel must not see (default: this process's folder)"
    ).tag(config=True)
    writable_cwd = Bool(False, help="whether the kernel may write in its working folder").tag(
        config=True
    )

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        KERNELS.mkdir(mode=0o700, exist_ok=True)
        # made by someone else, to watch ours
        if KERNELS.is_symlink() or KERNELS.stat().st_uid != os.getuid():
            raise SandboxMissing(
                f"{KERNELS} is not this user's own folder: remove it, then grade again"
            )
        self.scratch = Path(tempfile.mkdtemp(prefix="kernel-", dir=KERNELS))
        # removed at shutdown, and in any case with the manager (a kernel that died, a launch
        # refused)
        weakref.finalize(self, shutil.rmtree, self.scratch, ignore_errors=True)
        self.transport = "ipc"  # Unix sockets in its folder: the kernel has no network
        self.ip = str(self.scratch / "ipc")
        self.connection_file = str(self.scratch / "kernel.json")

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw) -> None:
        cwd = Path(kw.get("cwd") or os.getcwd())
        course = [Path(p) for p in self.course] or [Path.cwd()]
        course += [
            Path(p)
            for p in [self.config.get("CourseDirectory", {}).get("root")]
            if isinstance(p, str)
        ]
        tmp = self.scratch / "tmp"
        tmp.mkdir(exist_ok=True)
        prefix = command(cwd=cwd, hidden=course, readable=[] if self.writable_cwd else [cwd],
                         writable=[self.scratch, *([cwd] if self.writable_cwd else [])])
        # its parent in the sandbox is bwrap's init, PID 1: ipykernel must not take that for an
        # orphan
        if prefix:
            prefix += ["--setenv", "JPY_PARENT_PID", "1"]
        env = dict(kw.get("env") or os.environ)
        env.update(scratch_env(tmp))
        kw["env"] = env
        await super()._async_launch_kernel(
            ignoring_interrupts(prefix) + kernel_cmd if prefix else kernel_cmd, **kw
        )

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        await super()._async_cleanup_resources(restart=restart)
        if not restart:
            shutil.rmtree(self.scratch, ignore_errors=True)
