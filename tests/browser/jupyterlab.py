"""Drive the course in a real JupyterLab from Chromium (Playwright), for tests/test_browser.py.

`LabServer` starts JupyterLab (this interpreter's, so the repo's .venv) on a free
loopback port in a throwaway folder, with its own settings, workspaces and runtime
dirs, a random token and no browser of its own; `stop()` shuts kernels and server
down and kills whatever is left of the process tree. `Lab` adds one Chromium
(the system's, never a Playwright download) and opens notebooks as a learner does:
each in its own page, Edit → Clear Outputs of All Cells, Run → Run All Cells from
the menu bar, then waits (event-driven, bounded) for the kernel to finish.

Everything here is bounded in time: every wait has a timeout.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# JupyterLab user settings for the test session: render every cell (no virtual
# scrolling, so every output is in the DOM), no news or update checks (no network).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}


def find_chromium() -> str | None:
    """The system Chromium: $AR_LAB_CHROMIUM, else `chromium` / `chromium-browser` on PATH."""
    explicit = os.environ.get("AR_LAB_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (kernels run in their own process groups, so killpg misses
    them)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with ipykernel
        return []
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


class LabServer:
    """JupyterLab serving ``root`` on 127.0.0.1 with a token; always stop() it."""

    def __init__(
        self, root: Path, state: Path, env: dict[str, str] | None = None, start_timeout: float = 90
    ):
        self.root, self.state = root, state
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        for sub in ("config", "data", "runtime", "ipython", "workspaces"):
            (state / sub).mkdir(parents=True, exist_ok=True)
        for plugin, values in LAB_SETTINGS.items():
            path = state / "settings" / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        self.env = dict(
            os.environ,
            JUPYTER_CONFIG_DIR=str(state / "config"),
            JUPYTER_DATA_DIR=str(state / "data"),  # no user kernelspecs or extensions leak in
            JUPYTER_RUNTIME_DIR=str(state / "runtime"),
            IPYTHONDIR=str(state / "ipython"),
            **(env or {}),
        )
        cmd = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--port-retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={root}",
            f"--LabApp.user_settings_dir={state / 'settings'}",
            f"--LabApp.workspaces_dir={state / 'workspaces'}",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
            # window.jupyterapp: read kernel state and cell models
            "--LabApp.expose_app_in_browser=True",
            "--allow-root",  # CI containers run as root
        ]
        self.log_path = state / "jupyterlab.log"
        self._log = open(self.log_path, "w")  # closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            cwd=root,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self.stop()
            raise

    def url(self, path: str) -> str:
        sep = "&" if "?" in path else "?"
        return f"{self.base}{path}{sep}token={self.token}"

    def api(self, method: str, path: str, timeout: float = 10):
        req = urllib.request.Request(
            self.url(path), method=method, data=b"" if method == "POST" else None
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if body else None

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"JupyterLab exited with code {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                self.api("GET", "/api/status", timeout=2)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.1)
        raise TimeoutError(f"JupyterLab did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def shutdown_kernel_of(self, notebook: str) -> None:
        """Delete the session (and kernel) of ``notebook``, as Kernel → Shut Down Kernel does."""
        try:
            for s in self.api("GET", "/api/sessions"):
                if s.get("path") == notebook:
                    self.api("DELETE", f"/api/sessions/{s['id']}")
        except (urllib.error.URLError, OSError):
            pass  # the server is going away; stop() kills what is left

    def stop(self) -> None:
        """Kernels, then the server (politely, then by force), then any process left below it."""
        if self.proc.poll() is None:
            leftovers = _descendants(self.proc.pid)
            try:
                for k in self.api("GET", "/api/kernels", timeout=5):
                    self.api("DELETE", f"/api/kernels/{k['id']}", timeout=10)
                self.api("POST", "/api/shutdown", timeout=5)
                self.proc.wait(timeout=15)
            except (urllib.error.URLError, OSError, subprocess.TimeoutExpired, ValueError):
                pass
            for pid in [self.proc.pid, *leftovers]:
                try:
                    os.killpg(os.getpgid(pid), signal.SIGKILL) if pid == self.proc.pid else os.kill(
                        pid, signal.SIGKILL
                    )
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
        self._log.close()


# --- the notebook page ---------------------------------------------------------------

# JavaScript run in the page. `panel(path)` finds the notebook's panel through window.jupyterapp.
_PANEL = """
const panel = (path) => {
  const app = window.jupyterapp;
  if (!app) return null;
  for (const w of app.shell.widgets('main')) {
    if (w.context && w.context.path === path && w.content && w.content.widgets) return w;
  }
  return null;
};
"""

_KERNEL_READY = (
    "(path) => {"
    + _PANEL
    + """
  const p = panel(path);
  const k = p && p.sessionContext.session && p.sessionContext.session.kernel;
  return !!(k && k.connectionStatus === 'connected' && k.status === 'idle'
            && p.content.widgets.length);
}"""
)

# null while cells are queued or running; otherwise what happened.
_RUN_STATE = (
    "(path) => {"
    + _PANEL
    + """
  const p = panel(path);
  if (!p) return null;
  const k = p.sessionContext.session && p.sessionContext.session.kernel;
  if (!k || ['dead', 'autorestarting', 'restarting'].includes(k.status))
    return {state: 'dead', status: k ? k.status : 'none'};
  if (k.status !== 'idle') return null;
  let done = 0, code = 0, errored = false;
  for (const cell of p.content.widgets) {
    const m = cell.model;
    if (m.type !== 'code') continue;
    code += 1;
    if (m.executionState === 'running') return null;
    const prompt = cell.node.querySelector('.jp-InputArea-prompt');
    if (prompt && prompt.textContent.includes('*')) return null;
    if (m.executionCount !== null) done += 1;
    // An error stops Run All, unless the cell carries the raises-exception tag (a graded test
    // cell): then the next cells still come, and the kernel may be idle for a moment in between.
    const tags = (m.getMetadata ? m.getMetadata('tags') : m.metadata && m.metadata.tags) || [];
    const goesOn = Array.isArray(tags) && tags.includes('raises-exception');
    for (let j = 0; j < m.outputs.length; j++)
      if (m.outputs.get(j).type === 'error' && !goesOn) errored = true;
  }
  if (done < code && !errored) return null;
  return {state: 'done', done: done, code: code};
}"""
)

_REPORT = (
    "(path) => {"
    + _PANEL
    + """
  const p = panel(path);
  const cells = [];
  p.content.widgets.forEach((cell, i) => {
    const m = cell.model;
    if (m.type !== 'code') return;
    const outs = [];
    for (let j = 0; j < m.outputs.length; j++) outs.push(m.outputs.get(j).toJSON());
    const rendered = cell.node.querySelectorAll('.jp-OutputArea-output .jupyter-widgets').length;
    cells.push({index: i, count: m.executionCount, source: m.sharedModel.getSource().slice(0, 120),
                outputs: outs, widgetViews: rendered,
                text: cell.node.querySelector('.jp-OutputArea') ?
                cell.node.querySelector('.jp-OutputArea').innerText : ''});
  });
  return cells;
}"""
)

_PENDING = (
    "(path) => {"
    + _PANEL
    + """
  const out = [];
  panel(path).content.widgets.forEach((cell, i) => {
    if (cell.model.type === 'code' && cell.model.executionState === 'running') {
      const lines = cell.model.sharedModel.getSource().split('\\n');
      out.push(i + ': ' + (lines.find(l => l.trim() && !l.startsWith('#')) || '').slice(0, 80));
    }
  });
  return out;
}"""
)

_WIDGETS_SETTLED = """() => !document.body.innerText.includes('Loading widget')"""

WIDGET_ERROR_TEXTS = (
    "Error displaying widget",
    "Error rendering",
    "Error creating widget",
    "model not found",
)


@dataclass
class NotebookRun:
    """What one notebook did in the browser."""

    name: str
    seconds: float  # Run All until the kernel was idle with nothing queued
    open_seconds: float  # page load until the kernel was ready
    cells: list[dict]
    console_errors: list[str]
    problems: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for c in self.cells:
            where = f"cell {c['index']} ({c['source'].splitlines()[0] if c['source'] else ''!r})"
            for o in c["outputs"]:
                if o["output_type"] == "error":
                    self.problems.append(f"{where} raised {o['ename']}: {o['evalue']}")
                elif (
                    o["output_type"] == "stream"
                    and o.get("name") == "stderr"
                    and "Traceback" in o.get("text", "")
                ):
                    self.problems.append(
                        f"{where} printed a traceback on stderr:\n{o['text'][-1500:]}"
                    )
            shown = [text for text in WIDGET_ERROR_TEXTS if text in c["text"]]
            if shown:
                self.problems.append(f"{where} shows {shown[0]!r}: {c['text'][:300]!r}")
            views = sum(
                "application/vnd.jupyter.widget-view+json" in o.get("data", {})
                for o in c["outputs"]
            )
            if views and not c["widgetViews"]:
                self.problems.append(
                    f"{where} has a widget output but no widget was drawn: {c['text'][:200]!r}"
                )
        not_run = [c["index"] for c in self.cells if c["count"] is None]
        if not_run and not self.problems:
            self.problems.append(f"cells {not_run} were never executed")


class NotebookPage:
    """One notebook open in its own browser page (its own JupyterLab workspace)."""

    def __init__(self, lab: Lab, name: str):
        """Start loading the page; ``ready()`` waits for it (so the next notebook can load during a
        run)."""
        self.lab, self.name = lab, name
        self.console_errors: list[str] = []
        self.run: NotebookRun | None = None
        self.open_seconds = 0.0
        self._run_t0: float | None = None
        self.page = lab.context.new_page()
        self.page.set_default_timeout(30_000)
        self.page.on("console", self._on_console)
        self.page.on("pageerror", lambda e: self.console_errors.append(f"uncaught: {e}"))
        self._t0 = time.perf_counter()
        # one workspace per page: pages do not share layout
        workspace = Path(name).stem.replace(".", "-")
        self.page.goto(
            lab.server.url(f"/lab/workspaces/{workspace}/tree/{name}"), wait_until="commit"
        )

    def ready(self, timeout_ms: int = 90_000) -> NotebookPage:
        """Wait until JupyterLab shows the notebook and its kernel is connected and idle."""
        self.page.wait_for_function(_KERNEL_READY, arg=self.name, polling=100, timeout=timeout_ms)
        if not self.open_seconds:
            self.open_seconds = time.perf_counter() - self._t0
        return self

    def _on_console(self, msg) -> None:
        if msg.type == "error":
            loc = msg.location or {}
            self.console_errors.append(
                f"{msg.text} [{loc.get('url', '')}:{loc.get('lineNumber', '')}]"
            )

    def menu(self, menu: str, item: str) -> None:
        """Click ``menu`` in the menu bar, then ``item`` in it, as a learner does."""
        self.page.locator(".lm-MenuBar-itemLabel", has_text=menu).first.click()
        self.page.locator(".lm-Menu-content > .lm-Menu-item", has_text=item).first.click()

    def start_run(self) -> None:
        """Edit → Clear Outputs of All Cells, then Run → Run All Cells (returns at once)."""
        self.ready()
        self.menu("Edit", "Clear Outputs of All Cells")
        self._run_t0 = time.perf_counter()
        self.menu("Run", "Run All Cells")

    def finish_run(self, timeout_s: float) -> NotebookRun:
        """Wait (bounded) until nothing is queued and the kernel is idle; gather what the notebook
        shows."""
        left = max(1.0, timeout_s - (time.perf_counter() - self._run_t0))
        try:
            state = self.page.wait_for_function(
                _RUN_STATE, arg=self.name, polling=250, timeout=left * 1000
            )
        except Exception as e:
            if "Timeout" not in type(e).__name__:
                raise
            busy = self.page.evaluate(_PENDING, self.name)
            now = (
                f"cell {busy[0]!r} and {len(busy) - 1} queued"
                if busy
                else "nothing (the kernel is busy)"
            )
            msg = (
                f"{self.name}: Run All did not finish within {timeout_s:.0f} s; still running: "
                f"{now}"
            )
            raise AssertionError(msg) from e
        seconds = time.perf_counter() - self._run_t0
        state = state.json_value()
        if state["state"] == "dead":
            raise AssertionError(
                f"{self.name}: the kernel died ({state['status']}) after {seconds:.0f} s"
            )
        # widget views appear asynchronously after the outputs; wait until none is still loading
        try:
            self.page.wait_for_function(_WIDGETS_SETTLED, polling=200, timeout=30_000)
        except Exception:
            pass  # reported below as a widget that was not drawn
        cells = self.page.evaluate(_REPORT, self.name)
        self.run = NotebookRun(
            self.name, seconds, self.open_seconds, cells, list(self.console_errors)
        )
        return self.run

    def wait_idle(self, timeout_ms: int = 60_000) -> None:
        """Wait until the kernel is idle: every widget callback has finished and sent its updates.

        Call it after the page shows the first sign of a change (the kernel handles comm
        messages in order and reports idle after the last update it sent).
        """
        self.page.wait_for_function(_KERNEL_READY, arg=self.name, polling=100, timeout=timeout_ms)

    def close(self) -> None:
        try:
            self.page.close()
        finally:
            self.lab.server.shutdown_kernel_of(self.name)


class Lab:
    """JupyterLab + one Chromium; ``notebook(name)`` opens, runs and keeps a notebook page.

    ``jobs``: how many notebooks run at once (each page has its own kernel).
    """

    def __init__(
        self,
        root: Path,
        state: Path,
        chromium: str,
        env: dict[str, str] | None = None,
        jobs: int = 1,
    ):
        from playwright.sync_api import sync_playwright

        self.root, self.pages, self.jobs = root, {}, max(1, jobs)
        self.timings: dict[str, float] = {}  # notebook -> seconds of Run All
        self.failed: dict[str, str] = {}
        self.server = LabServer(root, state, env)
        self._pw = self.context = None
        try:
            self._pw = sync_playwright().start()
            self.context = self._pw.chromium.launch_persistent_context(
                str(state / "chromium-profile"),  # a fresh user-data dir
                executable_path=chromium,
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": 1280, "height": 1000},
                timeout=60_000,
            )
        except BaseException:
            self.close()
            raise

    def open(self, name: str) -> NotebookPage:
        """The page of ``name``, loading (not waited for) if it was not open yet."""
        if name not in self.pages:
            self.pages[name] = NotebookPage(self, name)
        return self.pages[name]

    def _start(self, name: str) -> None:
        page = self.open(name)
        if page.run is None and page._run_t0 is None:
            page.start_run()

    def notebook(self, name: str, timeout_s: float = 300, ahead: list[str] = ()) -> NotebookPage:
        """The page of ``name`` after Run All (run once per session, then reused).

        ``ahead``: the notebooks that come next. While ``name`` runs, the next ``jobs - 1`` of
        them run too (each in its own page and kernel), and the one after loads.
        """
        if name in self.failed:
            raise AssertionError(f"{name} failed earlier in this session: {self.failed[name]}")
        try:
            self._start(name)
        except Exception as e:
            self._fail(name, e)
            raise
        ahead = [n for n in ahead if n not in self.failed]
        for other in ahead[: self.jobs - 1]:
            try:
                self._start(other)
            except Exception as e:  # reported by that notebook's own test
                self._fail(other, e)
        if ahead[self.jobs - 1 : self.jobs]:
            self.open(ahead[self.jobs - 1])
        page = self.pages[name]
        if page.run is None:
            try:
                self.timings[name] = page.finish_run(timeout_s).seconds
            except Exception as e:
                self._fail(name, e)
                raise
        return page

    def _fail(self, name: str, e: Exception) -> None:
        self.failed[name] = f"{type(e).__name__}: {e}"
        self.release(name)

    def release(self, name: str) -> None:
        """Close the page and shut its kernel down (frees the kernel's memory)."""
        page = self.pages.pop(name, None)
        if page is not None:
            page.close()

    def close(self) -> None:
        try:
            for name in list(self.pages):
                try:
                    self.pages.pop(name).page.close()
                except Exception:
                    pass
            if self.context is not None:
                self.context.close()
            if self._pw is not None:
                self._pw.stop()
        finally:
            self.server.stop()
