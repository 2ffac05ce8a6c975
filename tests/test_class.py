"""A class on JupyterHub, end to end: an instructor and three learners, nbgrader's exchange, the
course's grading.

``make test-class`` runs this (it installs requirements/class.txt and the proxy first; ``make test``
skips it). JupyterHub (requirements/class.txt) starts on 127.0.0.1 with its proxy,
configurable-http-proxy from the npm registry (installed by the Makefile into .class-tools/),
``DummyAuthenticator`` and ``SimpleLocalProcessSpawner``: each user's server runs in a home of its
own in a temporary folder. nbgrader's exchange is a temporary folder too. nbgrader checks course
membership with the Hub (``JupyterHubAuthPlugin``: the Hub groups ``nbgrader-ar_lab`` and
``formgrade-ar_lab``), each user with a Hub token of their own.

How the users act. The Hub starts every user's server (its REST API, as an admin service would); a
learner opens the fetched notebook and saves an answer *through their own server* (Jupyter's
contents API, via the Hub's proxy, with that learner's token). nbgrader's commands run as each user
would type them in a terminal of their server: nbgrader's CLI with the user's home as the working
folder and ``HOME``, the user's ``~/.jupyter/nbgrader_config.py``, and the Hub's environment
(``JUPYTERHUB_USER``, ``JUPYTERHUB_API_URL``, the user's token), while the Hub and the servers are
up. Running them inside the servers (a terminal over a websocket) would add a websocket client and
prove nothing more about nbgrader: the server's terminal is a shell in the same home with the same
environment.

The chapter is 00, cut to its exercises (as tests/test_grading.py): the instructor lays out the
course (``python -m ar_lab.course.grading.exercises course``), generates and releases it; each
learner fetches it; one solves it, one gives a wrong answer to the first exercise (code points
instead of UTF-8 bytes), one submits it untouched; the instructor collects, autogrades, runs the
course's grading step (``python -m ar_lab.course.grading``), generates and releases feedback; each
learner fetches theirs.

What this proves about who reads what, and what it cannot. ``SimpleLocalProcessSpawner`` runs every
server as the Unix user running the test, and nbgrader's exchange relies on Unix permissions, so a
learner's kernel here could read another home directly. That isolation (separate Unix users with
``LocalProcessSpawner``, or a volume per user on Zero to JupyterHub) is not tested here. What is
proved: the exchange, the one folder the learners share with the instructor, never holds a solution
region or a hidden test (released, fetched and feedback copies included) and the source notebooks
never leave the instructor's home; nbgrader's permissions on it are the ones that hide one learner's
work from another (the inbound folder writable but not listable by others, submissions under
unguessable names, the feedback folder not listable and each feedback file named by a secret only
its learner's cache holds); when the test runs as root, a process of another Unix user (``nobody``)
is refused the listing of both folders; nbgrader's own collect warns that every submission is owned
by one Unix user (what it would flag as cheating on a real Hub); the Hub refuses a learner who
submits under another learner's name and a user outside the course.
"""

from __future__ import annotations

import copy
import html
import json
import os
import pwd
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

from ar_lab.course.grading.exercises import NOTEBOOKS, exercises_only, nbgrader_meta

if os.environ.get("AR_LAB_CLASS_TEST") != "1":
    pytest.skip("the JupyterHub class test runs with `make test-class`", allow_module_level=True)

import requests  # noqa: E402 - nbgrader's dependency; only once the test runs

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROXY = ROOT / ".class-tools" / "node_modules" / ".bin" / "configurable-http-proxy"
ASSIGNMENT = "00_start_here"
COURSE_ID = "ar_lab"
INSTRUCTOR, LEARNERS, OUTSIDER = "instructor", ("solver", "wrong", "blank"), "outsider"
WRONG = (
    'def to_tokens(text: str) -> list[int]:\n    """The byte values of text encoded as UTF-8."""\n'
    "    return [ord(c) for c in text]  # code points, not bytes"
)
BUDGET_S = 180  # the whole class, Hub start to the last feedback fetched


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HUB_CONFIG = """\
c = get_config()  # noqa: F821
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {port}
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api_port}"
c.ConfigurableHTTPProxy.command = [{proxy!r}]
c.JupyterHub.db_url = "sqlite:///{hub_dir}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "{hub_dir}/jupyterhub_cookie_secret"
c.JupyterHub.pid_file = "{hub_dir}/jupyterhub.pid"
c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allowed_users = {users!r}
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = "{homes}/{{username}}"
c.Spawner.cmd = [{singleuser!r}]
c.Spawner.args = {args!r}
c.Spawner.start_timeout = 60
c.Spawner.http_timeout = 60
c.JupyterHub.services = [{{"name": "class-test", "api_token": {token!r}}}]
c.JupyterHub.load_roles = [{{"name": "class-test", "services": ["class-test"],
                             "scopes": ["admin:users", "admin:servers", "admin:groups", "tokens"]}}]
"""

# Every user's nbgrader configuration (~/.jupyter/nbgrader_config.py): the course, the exchange, the
# Hub's check.
USER_CONFIG = """\
c = get_config()  # noqa: F821
c.CourseDirectory.course_id = "{course}"
c.Exchange.root = "{exchange}"
c.Authenticator.plugin_class = "nbgrader.auth.JupyterHubAuthPlugin"
"""


# A learner's nbgrader takes its student id from the Unix user's name, or from JUPYTERHUB_USER where
# that name is "jovyan" (Jupyter's images). Every server here runs as the test's Unix user, so each
# learner names theirs; the Hub still checks it (JupyterHubAuthPlugin asks the Hub, with the
# learner's token, for that user's groups).
STUDENT_CONFIG = 'c.CourseDirectory.student_id = "{user}"\n'


class Hub:
    """A running JupyterHub: its REST API (as the admin service) and each user's environment."""

    def __init__(self, root: Path):
        self.root, self.exchange, self.homes = root, root / "exchange", root / "home"
        self.port, self.hub_port, self.token = _free_port(), _free_port(), os.urandom(16).hex()
        self.url, self.api_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.hub_port}/hub/api"
        self.tokens: dict[str, str] = {}

    def api(self, method: str, path: str, ok=(200, 201, 202, 204), **kwargs):
        r = requests.request(
            method,
            self.api_url + path,
            headers={"Authorization": f"token {self.token}"},
            timeout=30,
            **kwargs,
        )
        assert r.status_code in ok, (method, path, r.status_code, r.text[:500])
        return r.json() if r.text else None

    def start(self) -> subprocess.Popen:
        hub_dir = self.root / "hub"
        hub_dir.mkdir()
        self.exchange.mkdir()
        self.exchange.chmod(0o777)  # nbgrader: "writable to everyone"
        self.homes.mkdir()
        users = sorted({INSTRUCTOR, *LEARNERS, OUTSIDER})
        (hub_dir / "jupyterhub_config.py").write_text(
            HUB_CONFIG.format(
                port=self.port,
                hub_port=self.hub_port,
                proxy_api_port=_free_port(),
                proxy=str(PROXY),
                hub_dir=hub_dir,
                users=set(users),
                homes=self.homes,
                singleuser=str(BIN / "jupyterhub-singleuser"),
                args=["--allow-root"] if os.getuid() == 0 else [],
                token=self.token,
            )
        )
        log = open(hub_dir / "hub.log", "w")  # noqa: SIM115 - closed with the process
        env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
        self.process = subprocess.Popen(
            [str(BIN / "jupyterhub"), "-f", str(hub_dir / "jupyterhub_config.py")],
            cwd=hub_dir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.log = hub_dir / "hub.log"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                # through the proxy: both are up
                if requests.get(f"{self.url}/hub/api/", timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.3)
        else:
            raise AssertionError(
                f"JupyterHub did not start in 60 s:\n{self.log.read_text()[-3000:]}"
            )
        # the Hub creates the allowed users as it starts
        self.api("POST", f"/groups/nbgrader-{COURSE_ID}", json={"users": list(LEARNERS)})
        self.api("POST", f"/groups/formgrade-{COURSE_ID}", json={"users": [INSTRUCTOR]})
        # the Hub holds each request up to 10 s: ask all at once
        with ThreadPoolExecutor(len(users)) as pool:
            list(pool.map(lambda user: self.api("POST", f"/users/{user}/server"), users))
        for user in users:
            self.wait_ready(user)
            self.tokens[user] = self.api("POST", f"/users/{user}/tokens",
                                         json={"note": "nbgrader", "expires_in": 900})["token"]
            config = self.homes / user / ".jupyter" / "nbgrader_config.py"
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text(USER_CONFIG.format(course=COURSE_ID, exchange=self.exchange) + (
                "" if user == INSTRUCTOR else STUDENT_CONFIG.format(user=user)))
        return self.process

    def wait_ready(self, user: str) -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            server = self.api("GET", f"/users/{user}")["servers"].get("")
            if server and server.get("ready"):
                return
            time.sleep(0.3)
        raise AssertionError(f"{user}'s server did not start:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if getattr(self, "process", None) is None:
            return
        self.process.terminate()  # the Hub stops the users' servers and its proxy as it exits
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def env(self, user: str) -> dict[str, str]:
        """The environment of a terminal in ``user``'s server (what the spawner and the Hub set)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "XDG_"))}
        return env | {"HOME": str(self.homes / user), "USER": user, "JUPYTERHUB_USER": user,
                      "JUPYTERHUB_API_URL": self.api_url, "JUPYTERHUB_API_TOKEN": self.tokens[user],
                      "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}

    def run(
        self, user: str, *args: str, cwd: Path | None = None, ok: bool = True
    ) -> subprocess.CompletedProcess:
        """A command typed in ``user``'s terminal (``nbgrader ...`` or ``python -m ...``), from
        their home."""
        exe = [sys.executable, "-m", "nbgrader"] if args[0] == "nbgrader" else [sys.executable]
        result = subprocess.run([*exe, *args[1:]], cwd=cwd or self.homes / user, env=self.env(user),
                                capture_output=True, text=True, timeout=300)
        if ok:
            assert result.returncode == 0, (user, args, (result.stdout + result.stderr)[-3000:])
        return result

    def each(self, users, *args: str) -> None:
        """The same command typed by several users at once (each in their own terminal)."""
        with ThreadPoolExecutor(len(users)) as pool:
            list(pool.map(lambda user: self.run(user, *args), users))

    def contents(self, user: str, path: str, model: dict | None = None):
        """GET (or PUT ``model``) ``path`` through ``user``'s own server, with ``user``'s token, via
        the proxy."""
        url = f"{self.url}/user/{user}/api/contents/{path}"
        headers = {"Authorization": f"token {self.tokens[user]}"}
        r = requests.put(url, json=model, headers=headers, timeout=30) if model else \
            requests.get(url, headers=headers, timeout=30)
        assert r.ok, (user, path, r.status_code, r.text[:500])
        return r.json()


def _answer(nb: dict, grade_id: str, text: str) -> None:
    cell = next(
        c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == grade_id
    )
    cell["source"] = text


def _regions(source: nbformat.NotebookNode, kind: str) -> list[str]:
    """The lines (longer than a few characters) of every ``### BEGIN {kind}`` region of
    ``source``."""
    out = []
    for cell in source.cells:
        for region in re.findall(rf"### BEGIN {kind}[^\n]*\n(.*?)### END", cell.source, re.S):
            out += [line.strip() for line in region.splitlines() if len(line.strip()) > 12]
    return out


def _without_markers(text: str) -> str:
    """A solution as a learner types it: the region's lines, not nbgrader's markers."""
    return "\n".join(
        line for line in text.splitlines() if "### BEGIN" not in line and "### END" not in line
    )


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


@pytest.fixture(scope="module")
def term(tmp_path_factory):
    """The whole class, start to end. Returns what the tests check."""
    assert PROXY.exists(), (
        f"no {PROXY}: `make test-class` installs it (npm install --prefix .class-tools ...)"
    )
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="ar_lab_class_"))
    # another Unix user may walk to the exchange, as on a real Hub's shared volume
    root.chmod(0o755)
    hub = Hub(root)
    try:
        hub.start()
        out = _term(hub)
        out["seconds"] = time.monotonic() - started
        yield out
    finally:
        hub.stop()
        shutil.rmtree(root, ignore_errors=True)


def _term(hub: Hub) -> dict:
    course = hub.homes / INSTRUCTOR / "course"
    # the chapter cut to its exercises: seconds, not minutes, per autograde
    cut = hub.homes / INSTRUCTOR / "cut"
    cut.mkdir()
    source = exercises_only(nbformat.read(NOTEBOOKS / f"{ASSIGNMENT}.ipynb", as_version=4))
    nbformat.write(source, cut / f"{ASSIGNMENT}.ipynb")
    hub.run(
        INSTRUCTOR,
        "python",
        "-m",
        "ar_lab.course.grading.exercises",
        "course",
        "course",
        "--src",
        "cut",
        "--chapter",
        "00",
        "--timeout",
        "30",
    )
    hub.run(INSTRUCTOR, "nbgrader", "generate_assignment", ASSIGNMENT, cwd=course)
    hub.run(INSTRUCTOR, "nbgrader", "release_assignment", ASSIGNMENT, cwd=course)
    out = {"hub": hub, "source": source, "course": course}
    out["outsider_fetch"] = hub.run(OUTSIDER, "nbgrader", "fetch_assignment", ASSIGNMENT, ok=False)
    hub.each(LEARNERS, "nbgrader", "fetch_assignment", ASSIGNMENT)
    # Each learner opens the notebook in their own server and saves their answers there.
    path = f"{ASSIGNMENT}/{ASSIGNMENT}.ipynb"
    opened = {learner: hub.contents(learner, path) for learner in LEARNERS}
    out["opened"] = {learner: copy.deepcopy(model["content"]) for learner, model in opened.items()}
    solutions = {nbgrader_meta(c)["grade_id"]: _without_markers(c.source)
                 for c in source.cells if nbgrader_meta(c).get("solution")}
    answers = {"solver": solutions, "wrong": solutions | {"ch00-to-tokens": WRONG}, "blank": {}}
    for learner, model in opened.items():
        for grade_id, text in answers[learner].items():
            _answer(model["content"], grade_id, text)
        if answers[learner]:
            hub.contents(
                learner, path, {"type": "notebook", "format": "json", "content": model["content"]}
            )
    inbound = hub.exchange / COURSE_ID / "inbound"
    # A learner submitting under another learner's name: the Hub refuses the token, nbgrader stops.
    out["impersonation"] = hub.run(
        "wrong", "nbgrader", "submit", ASSIGNMENT, "--student", "solver", ok=False
    )
    out["inbound_after_impersonation"] = sorted(p.name for p in inbound.iterdir())
    hub.each(LEARNERS, "nbgrader", "submit", ASSIGNMENT)
    out["inbound"] = {p.name: p for p in inbound.iterdir()}
    out["collect"] = hub.run(INSTRUCTOR, "nbgrader", "collect", ASSIGNMENT, cwd=course)
    out["autograde"] = hub.run(INSTRUCTOR, "nbgrader", "autograde", ASSIGNMENT, cwd=course)
    out["grading"] = hub.run(
        INSTRUCTOR, "python", "-m", "ar_lab.course.grading", ".", ASSIGNMENT, cwd=course
    )
    hub.run(INSTRUCTOR, "nbgrader", "generate_feedback", ASSIGNMENT, cwd=course)
    hub.run(INSTRUCTOR, "nbgrader", "release_feedback", ASSIGNMENT, cwd=course)
    hub.each(LEARNERS, "nbgrader", "fetch_feedback", ASSIGNMENT)
    out["feedback"] = {
        learner: sorted((hub.homes / learner / ASSIGNMENT / "feedback").glob("*/*.html"))
        for learner in LEARNERS
    }
    out["unix"] = _other_user_listing(hub)
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        out["scores"] = {s.id: gb.find_submission(ASSIGNMENT, s.id).score for s in gb.students}
        out["max_score"] = gb.find_assignment(ASSIGNMENT).max_score
    return out


def _other_user_listing(hub: Hub) -> dict[str, int] | None:
    """As root: the exit status of ``ls`` on the shared folders, run as the Unix user ``nobody``
    (None otherwise)."""
    if os.getuid() != 0:
        return None
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return None
    course = hub.exchange / COURSE_ID
    return {
        name: subprocess.run(
            ["ls", str(course / name)], user="nobody", capture_output=True
        ).returncode
        for name in ("inbound", "feedback", "outbound")
    }


# --- the tests ------------------------------------------------------------------------------------


def test_the_class_runs_within_its_budget(term):
    assert term["seconds"] < BUDGET_S, f"{term['seconds']:.0f} s"


def test_scores_after_autograde_and_the_grading_step(term):
    assert term["max_score"] == 2.0
    assert term["scores"] == {"solver": 2.0, "wrong": 1.0, "blank": 0.0}
    # the course's step judged the three submissions afresh and agreed with the kernel
    assert (
        f"judged 3 submission(s) of {ASSIGNMENT} in fresh kernels; 0 score(s) changed"
        in term["grading"].stdout
    )


def test_each_learner_fetches_their_own_feedback(term):
    texts = {}
    for learner, files in term["feedback"].items():
        assert [f.name for f in files] == [f"{ASSIGNMENT}.html"], learner
        texts[learner] = html.unescape(re.sub(r"<[^>]+>", "", files[0].read_text()))
    for learner, score in {"solver": 2.0, "wrong": 1.0, "blank": 0.0}.items():
        assert re.search(rf"Score:\s*{score}\s*/\s*2\.0", texts[learner]), (
            learner,
            texts[learner][:2000],
        )
    # their own code
    assert "ord(c)" in texts["wrong"] and "ord(c)" not in texts["solver"] + texts["blank"]
    assert "NotImplementedError" in texts["blank"] and "NotImplementedError" not in texts["solver"]


def test_the_hub_decides_who_takes_part(term):
    outsider = term["outsider_fetch"]
    assert (
        outsider.returncode != 0
        and "do not have access to this course" in outsider.stdout + outsider.stderr
    )
    assert not (term["hub"].homes / OUTSIDER / ASSIGNMENT).exists()
    # the Hub answers 403 to wrong's token asking for solver's groups
    impostor = term["impersonation"]
    assert impostor.returncode != 0 and "JupyterhubApiError" in impostor.stdout + impostor.stderr
    assert term["inbound_after_impersonation"] == []


def test_learners_open_the_released_notebook_in_their_own_server(term):
    for learner, content in term["opened"].items():
        nb = nbformat.from_dict(content)
        stubs = [c.source for c in nb.cells if nbgrader_meta(c).get("solution")]
        assert len(stubs) == 2 and all("raise NotImplementedError()" in s for s in stubs), learner


def test_no_solution_leaves_the_instructor(term):
    hub, source = term["hub"], term["source"]
    solution, hidden = _regions(source, "SOLUTION"), _regions(source, "HIDDEN TESTS")
    assert solution and hidden  # chapter 00 has both
    secrets = ["### BEGIN SOLUTION", *solution, *hidden]
    course = hub.exchange / COURSE_ID
    # What a learner gets before grading: the released copy, the fetched copies as opened, an
    # untouched submission.
    given = [
        *_files(course / "outbound"),
        *_files(hub.homes / "blank"),
        *_files(hub.homes / OUTSIDER),
        *_files(term["inbound"][next(n for n in term["inbound"] if n.startswith("blank+"))]),
    ]
    given = [p for p in given if p.suffix == ".ipynb"]
    # outbound, blank's fetched copy (and its submission cache), blank's submission
    assert len(given) >= 3, given
    texts = {str(p): p.read_text() for p in given}
    texts |= {f"opened by {k}": json.dumps(v) for k, v in term["opened"].items()}
    for where, text in texts.items():
        assert not [s for s in secrets if s in text or json.dumps(s)[1:-1] in text], where
    # Anywhere on the learners' side, graded work and feedback included, no solution region's
    # marker. (Feedback shows the hidden tests as autograde ran them: that is nbgrader's design,
    # after the deadline.)
    for path in [
        *_files(hub.exchange),
        *(p for u in (*LEARNERS, OUTSIDER) for p in _files(hub.homes / u)),
    ]:
        assert "BEGIN SOLUTION" not in path.read_text(errors="replace"), path
    sources = [
        p
        for p in _files(hub.root)
        if p.parent.name == ASSIGNMENT and p.parent.parent.name == "source"
    ]
    # the instructor's only
    assert sources == [term["course"] / "source" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"]


def test_the_exchange_hides_each_learners_work_from_the_others(term):
    course = term["hub"].exchange / COURSE_ID

    def mode(path):
        return stat.S_IMODE(path.stat().st_mode)

    assert mode(course / "inbound") & 0o777 == 0o733  # others may write and enter, never list
    assert mode(course / "feedback") & 0o777 == 0o711  # others may enter, never list
    assert mode(course / "outbound") & 0o005 == 0o005  # the released assignment is for everyone
    inbound = term["inbound"]
    assert sorted(name.split("+")[0] for name in inbound) == sorted(LEARNERS)
    for name, folder in inbound.items():  # student+assignment+timestamp+random: not to be guessed
        assert re.fullmatch(rf"\w+\+{ASSIGNMENT}\+[^+]+\+[A-Za-z0-9_-]{{12}}", name), name
        assert {p.name for p in folder.iterdir()} == {f"{ASSIGNMENT}.ipynb", "timestamp.txt",
                                                       "submission_secret.txt"}
    released = list((course / "feedback").glob("*.html"))
    assert len(released) == 3 and all(
        re.fullmatch(r"[0-9a-f]{32,}\.html", p.name) for p in released
    )
    if term["unix"] is None:
        pytest.skip(
            "not root: no other Unix user to try the folders as (the modes above are checked)"
        )
    assert (
        term["unix"]["inbound"] != 0
        and term["unix"]["feedback"] != 0
        and term["unix"]["outbound"] == 0
    )


def test_nbgrader_sees_one_unix_user_behind_every_submission(term):
    """What this set-up cannot prove: every server is the same Unix user, and nbgrader's collect
    says so."""
    log = term["collect"].stdout + term["collect"].stderr
    me = pwd.getpwuid(os.getuid()).pw_name
    for learner in LEARNERS:
        assert (
            f"claims to be submitted by {learner} but is owned by {me}; cheating attempt?" in log
        ), log[-2000:]
