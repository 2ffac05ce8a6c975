"""The kernel's delegation gate: while a graded test runs, the references its exercise forbids raise
when the learner's code calls them, by whatever route reaches them.

Each test is a route a learner could take from a notebook: an import, a name in their namespace, a
default argument, a saved method, a snapshot of a module's dict, a thread, a C function,
``torch.ops.aten``, a private helper. The test's own reference calls in the block still run, and the
block leaves nothing swapped behind. A builtin captured before the block, or a copy of the
reference's code, escapes the gate: the grade's guarantee is the grading step's answer process
(tests/test_sandbox.py, tests/test_grading_fresh.py)."""

import concurrent.futures
import functools
import inspect
import re
import sys
import threading
import types

import nbformat
import pytest
import torch
import torch.nn.functional as F

from ar_lab.base.errors import BadValue
from ar_lab.course.checkers.checks import no_delegation, own_work
from ar_lab.course.grading.exercises import NOTEBOOKS, graded_cells
from ar_lab.course.grading.forbidden import FORBIDDEN
from ar_lab.engine import sampling
from ar_lab.engine.sampling import filter_top_k
from ar_lab.model.cache import KVCache
from tests.raising import delegated, raises

SDPA = "torch.nn.functional.scaled_dot_product_attention"
TOP_K = "ar_lab.engine.sampling.filter_top_k"
q, k, v = torch.randn(3, 1, 2, 5, 4).unbind(0)
logits = torch.tensor([1.0, 3.0, 2.0, 0.5])


def caught(fn, *args, forbid, reaches=""):
    with delegated(reaches):
        own_work("the exercise", fn, *args, forbidden=forbid)


# the worker's Delegated
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_started_by_the_answer_is_watched():
    def on_a_thread(logits, k):
        out = []
        worker = threading.Thread(target=lambda: out.append(filter_top_k(logits, k)))
        worker.start()
        worker.join()
        return out[0] if out else logits

    caught(on_a_thread, logits, 2, forbid=[TOP_K])


def test_a_thread_already_running_library_code_is_not_the_learners():
    """A worker thread alive before the block (the kernel's, say) that reaches the reference through
    library code only keeps working; the same route on a thread started in the block is the
    learner's."""
    def started_in_the_block(logits, k):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(sampling.filter_top_k, logits, k).result()

    with concurrent.futures.ThreadPoolExecutor(1) as running:
        running.submit(int).result()  # its worker thread is alive now
        with no_delegation(written, forbid=[TOP_K]):
            assert torch.equal(
                running.submit(sampling.filter_top_k, logits, 2).result(), filter_top_k(logits, 2)
            )
    caught(started_in_the_block, logits, 2, forbid=[TOP_K])


def test_a_python_reference_captured_before_the_test_is_caught():
    """A Python function runs the stand-in as its own code: a default argument, a saved method, a
    snapshot of a module's dict and a partial reach it too."""
    update = KVCache.update
    snapshot = dict(vars(sampling))
    cache = KVCache(1, 1, 1, 4, 2)
    partial = functools.partial(filter_top_k, k=2)

    def captured(logits, k, keep=filter_top_k):
        return keep(logits, k)

    def saved_method(x):
        return update(cache, 0, 0, x, x)[0]

    def from_the_snapshot(logits, k):
        return snapshot["filter_top_k"](logits, k)

    caught(captured, logits, 2, forbid=[TOP_K])
    caught(saved_method, torch.ones(1, 1, 1, 2), forbid=["ar_lab.model.cache.KVCache.update"])
    caught(from_the_snapshot, logits, 2, forbid=[TOP_K])
    caught(lambda x: partial(x), logits, forbid=[TOP_K])


def test_a_captured_builtin_and_a_copy_of_the_code_escape_the_kernels_gate_only():
    """What the gate does not see; the grading step's answer process has no reference to capture or
    copy (tests/test_sandbox.py: every route finds a stub)."""
    namespace = dict(vars(sampling))
    exec(inspect.getsource(sampling._top_k), namespace)  # the private helper's source, run again

    def captured(q, k, v, attend=F.scaled_dot_product_attention):
        return attend(q, k, v, is_causal=True)

    own_work("attention", captured, q, k, v, forbidden=[SDPA])
    own_work("top-k", lambda x: namespace["_top_k"](x, 2), logits, forbidden="ch06-sampler")


def test_low_level_routes_to_the_same_kernel_are_caught():
    def via_c(q, k, v):
        # the object F's name points to
        return torch._C._nn.scaled_dot_product_attention(q, k, v, is_causal=True)

    def via_aten(q, k, v):
        return torch.ops.aten.scaled_dot_product_attention.default(q, k, v, is_causal=True)

    caught(via_c, q, k, v, forbid=[SDPA])
    caught(via_aten, q, k, v, forbid=[SDPA, "aten::scaled_dot_product_attention"])


def written(logits, k):
    kth = logits.topk(k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def test_the_tests_own_reference_calls_pass_and_no_stand_in_is_left_behind():
    sdpa, packet, update = (
        F.scaled_dot_product_attention,
        torch.ops.aten.scaled_dot_product_attention,
        KVCache.update,
    )
    code, names, update_code = filter_top_k.__code__, set(vars(sampling)), KVCache.update.__code__
    with no_delegation(
        written,
        forbid=[
            TOP_K,
            SDPA,
            "aten::scaled_dot_product_attention",
            "ar_lab.model.cache.KVCache",
            "ar_lab.model.cache.KVCache.update",
        ],
    ) as calls:
        assert filter_top_k.__code__ is not code  # its code, swapped while the block runs
        expected = filter_top_k(logits, 2)
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.ops.aten.scaled_dot_product_attention(q, k, v, is_causal=True)
        KVCache(1, 1, 1, 4, 2).update(0, 0, torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
        assert torch.equal(written(logits, 2), expected)
    assert calls == []
    assert (
        sampling.filter_top_k,
        F.scaled_dot_product_attention,
        torch.ops.aten.scaled_dot_product_attention,
        KVCache.update,
        KVCache.__init__,
    ) == (filter_top_k, sdpa, packet, update, KVCache.__dict__["__init__"])
    assert (
        filter_top_k.__code__ is code
        and set(vars(sampling)) == names
        and KVCache.update.__code__ is update_code
    )
    assert torch.equal(filter_top_k(logits, 2), expected)


def test_an_answer_that_writes_the_computation_is_not_slowed_into_a_timeout():
    def written_attention(q, k, v):
        att = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        att = att.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
        return att.softmax(-1) @ v

    out = own_work(
        "attention",
        written_attention,
        q,
        k,
        v,
        forbidden=[SDPA, "aten::scaled_dot_product_attention"],
    )
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)


def test_an_unknown_operator_is_a_clear_error():
    with raises(BadValue, 'reference'):
        with no_delegation(forbid=["aten::nope"]):
            pass


def test_a_check_inside_the_block_keeps_the_outer_watch():
    """check_cases and own_work open their own block inside the test's: the test's forbid list still
    holds."""
    from ar_lab.course.checkers.checks import check_cases

    def delegating(logits, k):
        return filter_top_k(logits, k)

    with delegated("filter_top_k"):
        with no_delegation(delegating, forbid=[TOP_K]):
            check_cases("top-k", delegating, [((logits, 2), filter_top_k(logits, 2))])


def test_forbid_lists_and_graded_cells_name_no_private_ar_lab_path():
    private = [
        (ex, ref)
        for ex, refs in FORBIDDEN.items()
        for ref in refs
        if ref.startswith("ar_lab.")
        and any(part.startswith("_") and not part.startswith("__") for part in ref.split("."))
    ]
    assert not private, private
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for i, meta in graded_cells(nb):
            private = r"ar_lab[\w.]*\._[a-z]\w*|from ar_lab[\w.]* import [^\n]*\b_[a-z]\w*"
            named = re.findall(private, nb.cells[i].source)
            assert not named, (path.name, meta["grade_id"], named)


def test_a_references_private_helpers_are_forbidden_with_it_and_shared_ones_are_not():
    with delegated("ar_lab.engine.sampling._top_p"):
        own_work("ch06-top-p", lambda x: sampling._top_p(x, 0.9), logits, forbidden="ch06-top-p")
    # SamplingParams (allowed) checks its numbers with the same helper the filters use: a learner
    # may build one
    params = own_work(
        "ch06-top-p",
        lambda: sampling.SamplingParams(temperature=0.5, top_p=0.9),
        forbidden="ch06-top-p",
    )
    assert params.top_p == 0.9


def test_renaming_an_internal_function_changes_no_verdict(monkeypatch):
    """Chapter 06's exercises, against a sampling module whose private filters have other names: a
    cheat through the renamed helper is still caught, and an answer written by hand still passes."""
    source = re.sub(
        r"\b_(temperature|top_k|top_p|min_p)\b", r"_renamed_\1", inspect.getsource(sampling)
    )
    assert "_renamed_top_p" in source and "def _top_p" not in source
    renamed = types.ModuleType(sampling.__name__)
    renamed.__file__ = sampling.__file__
    # what guard.forbidden imports the names from
    monkeypatch.setitem(sys.modules, sampling.__name__, renamed)
    exec(compile(source, sampling.__file__, "exec"), renamed.__dict__)
    for exercise, helper, cheat in [
        ("ch06-top-p", "_renamed_top_p", lambda x: renamed._renamed_top_p(x, 0.9)),
        (
            "ch06-temperature",
            "_renamed_temperature",
            lambda x: renamed._renamed_temperature(x, 0.7),
        ),
        ("ch06-sampler", "_renamed_top_k", lambda x: renamed._renamed_top_k(x, 2)),
    ]:
        with delegated(f"{sampling.__name__}.{helper}"):
            own_work(exercise, cheat, logits, forbidden=exercise)
    assert torch.equal(own_work("ch06-sampler", written, logits, 2, forbidden="ch06-sampler"),
                       renamed.filter_top_k(logits, 2))
