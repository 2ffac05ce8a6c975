"""The answer process of the grading step (ar_lab.course.grading.sandbox): the reference does not
exist there, and a test driven from here through handles behaves as it would in one process.

One answer process serves most tests (a module fixture); its cells are the "learner's"."""

from __future__ import annotations

import os
import pickle
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from ar_lab.course.grading import jail, plain, sandbox
from ar_lab.course.grading.channel import (
    CURRENT,
    AnswerGone,
    AnswerRaised,
    Channel,
    Refused,
    Remote,
)
from ar_lab.course.grading.plain import Unexposed
from ar_lab.course.grading.sandbox import answer
from ar_lab.engine.sampling import SamplingParams

LEARNER = [
    "import torch, inspect, importlib, os, shutil, subprocess, sys",
    "from ar_lab.engine.sampling import SamplingParams, filter_top_p, filter_top_k",
    "import ar_lab.engine.sampling as sampling",
    textwrap.dedent("""
        def top_p(logits, p):
            return filter_top_p(logits, p)

        def top_k(logits, k):
            return filter_top_k(logits, k)

        def reloaded(logits, p):
            return importlib.reload(sampling).filter_top_p(logits, p)

        def from_source(logits, p):
            namespace = {}
            exec(inspect.getsource(sampling), namespace)
            return namespace["filter_top_p"](logits, p)

        # the kernel's gate does not see these three
        def captured(logits, p, keep=sampling.filter_top_p):
            return keep(logits, p)

        _snapshot = dict(vars(sampling))

        def snapshot(logits, p):
            return _snapshot["filter_top_p"](logits, p)

        def on_a_thread(logits, p):
            import concurrent.futures
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                return pool.submit(filter_top_p, logits, p).result()

        def copied(logits, p):
            shutil.copy(sampling.__file__, "my_sampling.py")
            sys.path.insert(0, os.getcwd())
            return importlib.import_module("my_sampling").filter_top_p(logits, p)

        def child():  # a new Python started the usual way imports the withheld copy too
            code = ("import torch, ar_lab.engine.sampling as s; "
                    "print(s.filter_top_p(torch.zeros(3), 0.5))")
            run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            return run.stderr

        def isolated():  # python -I ignores PYTHONPATH: only an installed package could answer
            code = ("import inspect, ar_lab.engine.sampling as s; "
                    "print(inspect.getsource(s.filter_top_p))")
            run = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True)
            return run.stdout + run.stderr

        # a Python whose path lacks the withheld copy: the package imported afresh
        def fresh_path():
            code = ("import inspect, sys; sys.path[:] = [p for p in sys.path if p != sys.argv[1]]; "
                    "import ar_lab.engine.sampling as s; print(inspect.getsource(s.filter_top_p))")
            run = subprocess.run([sys.executable, "-c", code, sys.path[0]], capture_output=True,
                                 text=True)
            return run.stdout + run.stderr

        def by_path(path):  # the real module's file, read by its path
            try:
                with open(path) as f:
                    return f.read()
            except OSError as e:
                return type(e).__name__

        def listing(folder):
            try:
                return sorted(os.listdir(folder))
            except OSError as e:
                return type(e).__name__

        def sdpa(q):
            return torch.nn.functional.scaled_dot_product_attention(q, q, q)

        def child_sdpa():  # PyTorch's forbidden function, in a new Python started the usual way
            code = ("import torch; q = torch.ones(1, 2, 3); "
                    "torch.nn.functional.scaled_dot_product_attention(q, q, q)")
            run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            return run.stderr

        def aten_sdpa(q):
            return torch.ops.aten.scaled_dot_product_attention(q, q, q)

        def draws(probs, generator, n):
            return [int(torch.multinomial(probs, 1, generator=generator)) for _ in range(n)]

        def through(fn, generator):  # a callback of the test's, with the test's generator
            first = fn(generator)  # in this order: the callback draws, the answer, the callback
            drawn = int(torch.randint(100, (1,), generator=generator))
            return [first, drawn, fn(generator)]

        def fill(buffer):
            buffer[0] = 7.0
            return buffer.sum()

        def write_into(holder):  # a tensor read from the test's object, written in place
            buffer = holder.buffer
            buffer[1] = 5.0
            return holder.total()  # the test's own method sees the write already

        def rand():
            return torch.rand(2)

        def prefix(buffer, n):  # a view of the test's tensor
            buffer[:n] = 1.0
            return buffer[:n], buffer[1:n]

        class Tied(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Linear(2, 2)
                self.b = torch.nn.Linear(2, 2)
                self.b.weight = self.a.weight

        def grad_on():
            return torch.is_grad_enabled()

        def threads():
            return torch.get_num_threads()

        def raises(kind):
            raise {"value": ValueError, "mine": type("Oops", (Exception,), {})}[kind]("bad input")

        def use(obj, method, *args):
            return getattr(obj, method)(*args)

        def poke(obj, name):
            return getattr(obj, name)

        def kind(obj):
            return f"{type(obj).__module__}.{type(obj).__qualname__}"

        class Smuggled(torch.Tensor):  # unpickled, it would run code in the judge's process
            def __reduce_ex__(self, protocol):
                return (exec, ("import builtins; builtins.SMUGGLED = True",))

        def smuggled():
            return torch.ones(3).as_subclass(Smuggled)

        def frames():  # every module the answer's own call stack runs in
            names, frame = set(), sys._getframe()
            while frame is not None:
                names.add(frame.f_globals.get("__name__"))
                frame = frame.f_back
            return sorted(n for n in names if n)

        class Doubler(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = torch.nn.Identity()

            def forward(self, x):
                return 2 * self.inner(x)
        """),
]


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    folder = tmp_path_factory.mktemp("answer") / "process"
    errors = sandbox.start(
        LEARNER,
        [
            "ar_lab.engine.sampling.filter_top_p",
            "torch.nn.functional.scaled_dot_product_attention",
            "aten::scaled_dot_product_attention",
        ],
        folder,
    )
    assert errors == [""] * len(LEARNER)
    yield folder
    sandbox.stop()


LOGITS = torch.tensor([3.0, 1.0, 0.5, -1.0])


@pytest.mark.parametrize(
    "route", ["top_p", "captured", "snapshot", "on_a_thread", "reloaded", "from_source", "copied"]
)
def test_the_forbidden_reference_is_a_stub_by_every_route(learner, route):
    with pytest.raises(
        RuntimeError, match="filter_top_p is withheld while this exercise is graded"
    ):
        answer(route)(LOGITS, 0.5)


def test_a_python_the_answer_starts_finds_the_stub_too(learner):
    assert "filter_top_p is withheld" in answer("child")()
    assert "scaled_dot_product_attention is withheld" in answer("child_sdpa")()


@pytest.mark.skipif(
    not jail.confining(), reason="the real package is hidden by the sandbox (bubblewrap)"
)
def test_the_real_package_cannot_be_found_from_the_answer_process(learner):
    """Issue 66: python -I, a fresh sys.path, the module's file by path, the repository's folder:
    the answer process finds the withheld copy or nothing, never the real reference's code or the
    source notebooks."""
    import inspect

    from ar_lab.engine import sampling

    real = inspect.getsource(sampling.filter_top_p)
    for route in ("isolated", "fresh_path"):
        out = answer(route)()
        assert real not in out and ("ModuleNotFoundError" in out or "withheld" in out), (
            route,
            out[-300:],
        )
    assert answer("by_path")(sampling.__file__) == "FileNotFoundError"
    root = answer("listing")(str(jail.ROOT))
    assert "notebooks" not in root and ".git" not in root and "ar_lab" not in root


def test_what_the_exercise_does_not_forbid_works(learner):
    from ar_lab.engine.sampling import filter_top_k

    assert torch.equal(answer("top_k")(LOGITS, 2), filter_top_k(LOGITS, 2))


@pytest.mark.parametrize("route", ["sdpa", "aten_sdpa"])
def test_pytorchs_forbidden_function_and_operator_are_stubbed(learner, route):
    with pytest.raises(RuntimeError, match="is withheld while this exercise is graded"):
        answer(route)(torch.ones(1, 2, 3))


def test_the_private_helpers_only_the_references_reach_go_with_them(tmp_path):
    from ar_lab.course.grading.forbidden import FORBIDDEN

    sandbox.withheld_package(list(FORBIDDEN["ch06-top-p"]), tmp_path)
    text = (tmp_path / "ar_lab" / "engine" / "sampling.py").read_text()
    # _top_p: reached by these only (not by top-k's)
    for name in ("filter_top_p", "probabilities", "_top_p"):
        assert f"raise RuntimeError('ar_lab.engine.sampling.{name} is withheld" in text, name
    # sample draws through probabilities: a stub when called
    for name in ("filter_top_k", "_top_k", "sample"):
        assert f"ar_lab.engine.sampling.{name} is withheld" not in text, name
    view = (tmp_path / "ar_lab" / "course" / "views" / "sampler_view.py").read_text()
    assert "ar_lab.course.views.sampler_view.sampler_view is withheld" in view
    assert not list(tmp_path.rglob("*.pyc"))  # no compiled copy of the reference either


def test_generators_draw_as_one_across_the_two_processes(learner):
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    g, same = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert answer("draws")(probs, g, 5) == [
        int(torch.multinomial(probs, 1, generator=same)) for _ in range(5)
    ]
    # moved on as the answer moved it
    assert torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=same))

    def callback(generator):  # the test's code, called back from the answer, on the same generator
        return int(torch.randint(100, (1,), generator=generator))

    g, same = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    assert answer("through")(callback, g) == [callback(same) for _ in range(3)]
    torch.manual_seed(5)
    first = answer("rand")()
    torch.manual_seed(5)
    assert torch.equal(first, torch.rand(2)) and not torch.equal(answer("rand")(), first)


def test_in_place_changes_grad_mode_and_the_thread_count_cross_back(learner):
    buffer = torch.zeros(3)
    assert float(answer("fill")(buffer)) == 7.0 and buffer.tolist() == [7.0, 0.0, 0.0]

    class Holder:
        def __init__(self):
            self.buffer = torch.zeros(3)

        def total(self):
            return float(self.buffer.sum())

    holder = Holder()
    assert answer("write_into")(holder) == 5.0 and holder.buffer.tolist() == [0.0, 5.0, 0.0]
    assert answer("grad_on")() is True
    with torch.no_grad():
        assert answer("grad_on")() is False
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert answer("threads")() == 1
    finally:
        torch.set_num_threads(before)


def test_a_view_of_the_tests_tensor_comes_back_as_that_view_and_one_tensor_as_one_copy(learner):
    buffer = torch.zeros(2, 4)[1]  # itself a view, of a contiguous row
    head, middle = answer("prefix")(buffer, 3)
    assert head.data_ptr() == buffer.data_ptr() and middle.data_ptr() == buffer[1:].data_ptr()
    assert head.tolist() == [1.0] * 3 and middle.shape == (2,)
    head[0] = 9.0  # the test's own memory
    assert buffer[0] == 9.0
    tied = answer("Tied")()
    assert tied.a.weight is tied.b.weight
    assert tied.a.bias is not tied.b.bias


def test_the_learners_exception_comes_back_as_its_type(learner):
    with pytest.raises(ValueError, match="bad input"):
        answer("raises")("value")
    with pytest.raises(AnswerRaised, match="Oops: bad input"):
        answer("raises")("mine")
    with pytest.raises(NameError, match="'nowhere' is not defined"):
        answer("nowhere")()


def test_a_class_of_the_learners_is_built_and_used_through_handles(learner):
    doubler = answer("Doubler")()
    assert torch.equal(doubler(torch.ones(2)), torch.full((2,), 2.0))
    doubler.inner = torch.nn.Linear(2, 2)  # a layer of the test's, set in the learner's module
    with torch.no_grad():
        expected = 2 * doubler.inner(torch.ones(2))
    assert torch.allclose(doubler(torch.ones(2)), expected)
    with pytest.raises(AttributeError, match="private attribute '_modules' is not shared"):
        getattr(doubler, "_modules")  # noqa: B009 (the attribute read is the point)


def test_a_handles_dunder_attributes_lead_nowhere_in_the_judge(learner):
    """Issue 66: the judge's class, a method's function, its object and globals, an object's
    namespace: each refused; what the handle's own ``__class__`` and ``__module__`` give is the
    answer process's proxy, none of the judge's."""
    box = torch.nn.Linear(2, 2)
    with pytest.raises(AttributeError):  # (refused: "private attribute ... is not shared")
        answer("poke")(box, "__dict__")
    forward = answer("poke")(box, "forward")
    assert forward == box.forward  # the judge's own method, handed back
    for name in ("__func__", "__self__", "__globals__"):
        with pytest.raises(AttributeError):
            answer("poke")(forward, name)
    assert answer("kind")(box) == "ar_lab.course.grading.channel.Remote"
    assert answer("poke")(box, "__module__") == "ar_lab.course.grading.channel"
    assert answer("poke")(box, "__class__") is not torch.nn.Linear


def test_a_value_that_would_run_code_when_unpickled_and_the_answers_frames_reach_nothing_here(
    learner,
):
    """Issue 66: a returned tensor whose pickling names ``exec`` runs nothing in the judge: it
    comes back as a handle on the answer's object, never unpickled here; the answer's call stack
    is its own process's."""
    import builtins

    value = answer("smuggled")()
    assert isinstance(value, Remote) and not isinstance(value, torch.Tensor)
    assert not hasattr(builtins, "SMUGGLED")
    stack = answer("frames")()
    assert __name__ not in stack and "ar_lab.course.grading.judge" not in stack, stack


def test_the_answer_cannot_reach_a_private_attribute_or_a_forbidden_reference_via_the_tests_objects(
    learner,
):
    class Box:  # what a test might hand over
        secret = 1

        def __init__(self):
            self._private = 2

        def filter(self, logits):
            from ar_lab.engine.sampling import filter_top_p

            return filter_top_p

    params = SamplingParams(top_p=0.5)
    assert answer("poke")(Box(), "secret") == 1 and answer("poke")(params, "top_p") == 0.5
    with pytest.raises(AttributeError, match="private attribute '_private' is not shared"):
        answer("poke")(Box(), "_private")  # the handle refuses; a request made by hand too (below)
    channel = sandbox.current()
    with pytest.raises(Refused, match="filter_top_p` is withheld"):
        answer("use")(Box(), "filter", LOGITS)
    # the test fails even if it was caught
    assert channel.refused == ["ar_lab.engine.sampling.filter_top_p"]
    with pytest.raises(Refused, match="withheld"):
        sandbox.answers_checked("some-tests")
    assert "channel" not in CURRENT  # answers_checked ends the process


def test_the_judge_unpickles_plain_data_only_and_serves_no_cell(pair):
    judge, learner = pair

    class Evil:
        def __reduce__(self):
            return (print, ("ran code",))

    data = pickle.dumps((True, {}, {}, ("request", "call", Evil())), protocol=4)
    learner.writer.write(struct.pack("<Q", len(data)) + data)
    learner.writer.flush()
    with pytest.raises(
        pickle.UnpicklingError, match="names builtins.print: only plain data may cross"
    ):
        judge._receive()
    # the judge serves calls and attributes, not these
    for op in ("run", "bind", "name", "close", "delattr"):
        judge._serve(op, judge._out((None, "import os")))
        _, ok, (module, kind, message) = learner._receive()
        assert (ok, kind) == (False, "Refused") and f"no request {op!r} is served here" in message
    box = torch.nn.Linear(2, 2)
    # as if handed to the answer: a request by hand for its private attribute
    judge.objects[id(box)] = box
    judge._serve("getattr", ({"__ar_lab_sandbox__": "yours", "id": id(box)}, "_parameters"))
    _, ok, (module, kind, message) = learner._receive()
    assert (ok, kind) == (False, "Refused") and "private attributes are not shared" in message


@pytest.mark.parametrize(
    "value",
    [
        os,
        open,
        exec,
        getattr,
        sys._getframe(),
        Path("gradebook.db"),
        os.system,
        subprocess.run,
        "shell",
    ],
    # stable
    ids=[
        "module",
        "open",
        "exec",
        "getattr",
        "frame",
        "path",
        "os.system",
        "subprocess.run",
        "shell",
    ],
    # (ids of their own: a frame's repr holds its address, which differs between pytest-xdist's
    # workers)
)
def test_the_judge_hands_out_no_module_frame_file_or_shell(pair, value):
    """Issue 66: a handle on any of these, handed to the answer process, would reach the judge's
    machinery."""
    from IPython.core.interactiveshell import InteractiveShell

    judge, learner = pair
    with pytest.raises(Unexposed):
        judge._out(InteractiveShell if value == "shell" else value)
    with pytest.raises(Unexposed):
        judge._out([1, {"inside": InteractiveShell if value == "shell" else value}])


def test_a_request_that_would_reach_the_judges_machinery_is_refused_and_fails_the_test(pair):
    import types

    judge, learner = pair
    # a test's object holding them
    holder = types.SimpleNamespace(system=os.system, folder=Path("."), size=3)
    judge.objects[id(holder)] = holder
    for name in ("system", "folder", "size"):
        judge._serve("getattr", ({"__ar_lab_sandbox__": "yours", "id": id(holder)}, name))
        _, ok, value = learner._receive()
        assert ok == (name == "size") and (value[1] == "Unexposed" if not ok else True)
    assert judge.refused == ["builtin system", "pathlib PosixPath"]


def test_a_message_names_no_function_to_decode():
    with pytest.raises(plain.NotAValue):
        plain.decode({"__ar_lab_plain__": "dtype", "v": "load"})  # torch.load, not a dtype


@pytest.fixture
def pair():
    """Two ends of the protocol in this process: (judge, learner)."""
    a, b = os.pipe()
    c, d = os.pipe()
    ends = Channel(a, d), Channel(c, b, judge=False)
    yield ends
    for channel in ends:
        channel.reader.close()
        channel.writer.close()


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        3,
        2.5,
        1 + 2j,
        "text",
        b"bytes",
        b"",
        [1, (2.0, "a")],
        {"k": torch.arange(3)},
        {"b", "a"},
        frozenset({3}),
        torch.Size([2, 3]),
        torch.float16,
        torch.device("cpu"),
        torch.randn(2, 3, requires_grad=True),
        np.arange(4.0),
        np.float32(1.5),
        np.int64(7),
        SamplingParams(top_k=3),
    ],
)
def test_plain_values_cross_by_value_equal_and_of_the_same_type(pair, value):
    judge, learner = pair
    judge._send(("reply", True, judge._out(value)))
    back = learner._in(learner._receive()[2])
    assert type(back) is type(value) and _equal(back, value)
    if isinstance(value, torch.Tensor):
        assert back.requires_grad == value.requires_grad


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a.detach(), b.detach())
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize(
    "value", [torch.nn.Linear(2, 2), object(), {1.5: 2}, np.array([object()]), lambda: 0]
)
def test_other_values_cross_as_handles(pair, value):
    judge, learner = pair
    with pytest.raises(plain.NotPlain):
        plain.encode(value)
    judge._send(("reply", True, judge._out(value)))
    back = learner._in(learner._receive()[2])
    assert isinstance(back, Remote) and judge.objects[back._id] is value


def test_an_answer_process_that_ends_is_reported(tmp_path):
    with pytest.raises(AnswerGone, match="ended before the test"):
        sandbox.start(["import os\nos._exit(3)"], [], tmp_path / "p")
    sandbox.stop()


def test_answer_processes_are_forked_by_a_server_that_never_loads_ar_lab(tmp_path):
    """On Linux each answer process is forked by one server (a Python that imported torch once): two
    in a row share it, every ar_lab module a child holds comes from its own withheld copy, and the
    server holds none."""
    if sys.platform != "linux":
        pytest.skip("the fork server is Linux's (elsewhere each answer process is a new Python)")
    cell = (
        "import os, sys, ar_lab\ndef report():\n    outside = [m for m, v in "
        "sys.modules.items()\n               if m.startswith('ar_lab') and not (v.__file__ or "
        "'').startswith(sys.path[0])]\n    server = "
        "open(f'/proc/{os.getppid()}/maps').read()\n    return os.getppid(), outside, 'libtorch' "
        "in server"
    )
    parents = []
    for name in ("first", "second"):
        assert sandbox.start([cell], [], tmp_path / name) == [""]
        parent, outside, torch_loaded = answer("report")()
        assert outside == []
        assert torch_loaded  # the server has torch loaded: a child starts with it
        parents.append(parent)
        sandbox.stop()
    assert parents[0] == parents[1] != os.getpid()


# Last: it starts answer processes of its own (the module's fixture process would be ended).
def test_renaming_an_internal_function_changes_no_verdict(tmp_path, monkeypatch):
    """The package with its private top-p filter under another name (the source file and the live
    module): the forbid list (public names) still withholds it, so a cheat through the renamed
    helper meets a stub, and a top-p written by hand still passes chapter 06's own test."""
    import importlib
    import shutil
    import sys

    import nbformat

    from ar_lab.course.grading.exercises import nbgrader_meta
    from ar_lab.course.grading.forbidden import FORBIDDEN

    package = tmp_path / "renamed" / "ar_lab"
    shutil.copytree(sandbox.PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    module = package / "engine" / "sampling.py"
    module.write_text(re.sub(r"\b_top_p\b", "_nucleus_mask", module.read_text()))
    assert "def _nucleus_mask(" in module.read_text() and not re.search(
        r"\b_top_p\b", module.read_text()
    )
    spec = importlib.util.spec_from_file_location("ar_lab.engine.sampling", module)
    live = importlib.util.module_from_spec(spec)
    # what the forbid list resolves against
    monkeypatch.setitem(sys.modules, "ar_lab.engine.sampling", live)
    spec.loader.exec_module(live)
    monkeypatch.setattr(sandbox, "PACKAGE", package)
    nb = nbformat.read(
        Path(__file__).resolve().parents[1] / "notebooks" / "06_sampling.ipynb", as_version=4
    )
    test = next(
        c.source for c in nb.cells if nbgrader_meta(c).get("grade_id") == "ch06-top-p-tests"
    )
    by_hand = textwrap.dedent("""
        import torch

        def my_top_p_keep(probs, p):
            ranked, order = probs.sort(descending=True, stable=True)
            before = ranked.double().cumsum(0) - ranked.double()
            return torch.zeros_like(before, dtype=torch.bool).scatter_(0, order, before < p)
        """)
    cheat = (
        "import ar_lab.engine.sampling as s\ndef my_top_p_keep(probs, p):\n    return "
        "s._nucleus_mask(probs.log(), p) > float('-inf')"
    )
    verdicts = {}
    for name, answer_cell in [("by hand", by_hand), ("cheat", cheat)]:
        sandbox.start(
            [answer_cell], sorted(FORBIDDEN["ch06-top-p"]), tmp_path / name.replace(" ", "_")
        )
        try:
            namespace = {
                "my_top_p_keep": answer("my_top_p_keep"),
                "torch": torch,
                "filter_top_p": live.filter_top_p,
            }
            exec(test, namespace)
            verdicts[name] = "passed"
        except Exception as e:
            verdicts[name] = f"{type(e).__name__}: {e}"
        finally:
            sandbox.stop()
    assert verdicts["by hand"] == "passed"
    assert "_nucleus_mask is withheld" in verdicts["cheat"]
