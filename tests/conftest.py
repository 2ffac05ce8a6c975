import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from ar_lab.course.checkers.claims import MODE_ENV as CLAIMS_MODE
from ar_lab.course.grading import jail
from ar_lab.model.gpt import GPT, GPTConfig

settings.register_profile("ar_lab", deadline=None, max_examples=30, derandomize=True)
settings.load_profile("ar_lab")

# Grading confines learner code with bubblewrap (ar_lab.course.grading.jail), which .ci/run installs
# on Linux. Where it cannot run (macOS; a Linux without user namespaces), the grading tests opt out
# as an instructor would, and the tests of the sandbox itself are skipped, saying why.
if not jail.available() and jail.enabled():
    print(
        f"WARNING: {jail.reason()}: the grading tests run learner code unconfined ({jail.OPT_OUT}"
        "=off)",
        file=sys.stderr,
    )
    os.environ[jail.OPT_OUT] = "off"


# Every notebook the tests run holds its claims strictly (a false one fails the cell); a learner's
# kernel does not stop on a timing claim (ar_lab.course.checkers.claims). The student Run All tests
# run as a learner does (tests/test_exercises.py).
os.environ.setdefault(CLAIMS_MODE, "strict")


# Appendix A1 times a neighbour it starts itself: beside another test process its quiet baseline is
# not quiet. Chapter 05 measures this machine's roofs on every core it has (the probe's thread
# count): beside another test process its threads wait for one another (a batch-1 step 6x slower,
# batch 4 25x, seen in CI), so it runs alone too.
QUIET = {"A1_measuring_time.ipynb", "05_prefill_vs_decode.ipynb"}
# Test files whose tests share no module fixture: each test can go to whichever process is free.
SPREAD = {"test_exercises.py", "test_delegation.py", "test_fresh_grading.py"}


def pytest_collection_modifyitems(config, items):
    """Browser tests and notebook cells (nbval) are slow by nature: ``-m "not slow"`` leaves them
    out. The quiet ones are marked ``quiet``: ``make test`` runs them alone, after the others."""
    # make test-site runs these (-m site), make test-busy those (-m busy): a run whose -m names them
    for kept_out in ("site", "busy"):
        marked = [item for item in items if item.get_closest_marker(kept_out)]
        if marked and kept_out not in (config.getoption("markexpr", "") or ""):
            config.hook.pytest_deselected(items=marked)
            items[:] = [item for item in items if not item.get_closest_marker(kept_out)]
    for item in items:
        if item.get_closest_marker("browser") or type(item).__name__ == "IPyNbCell":
            item.add_marker(pytest.mark.slow)
        if item.path.name in QUIET:
            item.add_marker(pytest.mark.quiet)
    weight: dict[str, float] = {}
    for item in items:
        key = scope(item.nodeid)
        weight[key] = weight.get(key, FIXTURE_SECONDS.get(item.path.name, 0.0)) + _cost(item)
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-weight[scope(item.nodeid)], scope(item.nodeid), order[id(item)]))


# Scopes whose module fixture does most of the work, in seconds (make test --durations, 2 processes
# on 2 cores).
FIXTURE_SECONDS = {"test_grading_fresh.py": 265.0, "test_grading.py": 65.0, "test_browser.py": 60.0}
CHAPTERS = {p.stem for p in (Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb")}


def _cost(item) -> float:
    """A rough guess of an item's seconds, to start the longest scopes first so that make test's two
    processes end together (pytest-xdist's own order, by number of tests, left the one-test scopes
    that run a chapter, a minute each, for the end): a notebook cell ~3 s, a slow test that runs a
    chapter ~40 s, another slow test ~5 s, any other ~0.1 s, plus FIXTURE_SECONDS once per scope (on
    its first item)."""
    if type(item).__name__ == "IPyNbCell":
        return 3.0
    if not item.get_closest_marker("slow"):
        return 0.1
    callspec = getattr(item, "callspec", None)
    return 40.0 if callspec is not None and callspec.id in CHAPTERS else 5.0


def scope(nodeid: str) -> str:
    """What one process runs in order: a notebook's cells (one kernel), a test file's tests (its
    module fixtures computed once), or, in SPREAD, one test."""
    path = str(nodeid).split("::", 1)[0]
    return str(nodeid) if path.rsplit("/", 1)[-1] in SPREAD else path


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """With ``-n 2 --dist loadscope`` (make test), the scopes are ``scope``'s: pytest-xdist's own
    by-group scheduling marks items by rewriting their node ids, which pytest 9.2's nodes no longer
    take."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    # the items come in pytest_collection_modifyitems's order: longest first
    config.option.loadscopereorder = False
    class ByScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope(nodeid)

    return ByScope(config, log)


def one_thread_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a kernel or command that only grades: one OpenMP
    thread, since make test's two processes each start kernels on two cores (the experiments'
    kernels keep the machine's count)."""
    return {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Every test runs with one torch intra-op thread (a test that times threads sets its own count
    and puts this one back). The tests decode tiny models: a chain of small kernels, where a second
    thread mostly waits for the first, and make test runs two test processes on two cores, so that a
    kernel split over two threads waits for whichever was descheduled (a layer norm of a few hundred
    values: 15 ms instead of 15 µs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_model():
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=32)).eval()


class ScriptedModel(torch.nn.Module):
    """A stand-in model whose greedy output is a fixed script of token ids.

    At absolute position t (the token that follows t known tokens) it puts all
    its mass on script[t - prompt_len], so tests can force EOS, multi-byte
    characters or stop strings exactly. It keeps the KV-cache contract
    (updates ``cache.length``) so cached and uncached loops both work.
    """

    def __init__(self, script: list[int], prompt_len: int, block_size: int = 64) -> None:
        super().__init__()
        self.config = GPTConfig(block_size=block_size, n_layer=1, n_head=1, n_embd=4)
        self.script, self.prompt_len = script, prompt_len
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    @property
    def device(self):
        return self.dummy.device

    def forward(self, idx, cache=None):
        B, T = idx.shape
        start = 0 if cache is None else cache.length
        logits = torch.zeros(B, T, self.config.vocab_size)
        for t in range(T):
            k = start + t + 1 - self.prompt_len
            if 0 <= k < len(self.script):
                logits[:, t, self.script[k]] = 10.0
        if cache is not None:
            cache.length = start + T
        return logits
