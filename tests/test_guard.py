"""The delegation guard sees calls, not names: every route to a forbidden reference is caught.

Each test is a cheat a learner could try from a notebook (the routes issue 33 lists): the
reference called on a thread, captured before the test in a default argument, a saved method,
a snapshot of a module's dict, reached through ``torch._C`` or ``torch.ops.aten``, or copied
(``exec`` of its source, a second import of its module). The test's own reference calls in
the block still run, and the block leaves no hook behind.
"""

import importlib.util
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
from ar_lab.course.checks import Delegated, no_delegation, own_work
from ar_lab.course.exercises import NOTEBOOKS, graded_cells
from ar_lab.course.forbidden import FORBIDDEN
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


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the worker's Delegated
def test_a_thread_started_by_the_answer_is_watched():
    def on_a_thread(logits, k):
        out = []
        worker = threading.Thread(target=lambda: out.append(filter_top_k(logits, k)))
        worker.start()
        worker.join()
        return out[0] if out else logits

    caught(on_a_thread, logits, 2, forbid=[TOP_K])


def test_a_thread_left_running_before_the_test_fails_it():
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="my-worker")
    worker.start()
    try:
        with pytest.raises(Delegated, match=r"still running \(my-worker\)"):
            with no_delegation(written, forbid=[TOP_K]):
                pass
    finally:
        stop.set()
        worker.join()
    with no_delegation(written, forbid=[TOP_K]):  # once it is stopped, the test runs
        pass


def test_a_reference_captured_in_a_default_argument_is_caught():
    def captured(q, k, v, attend=F.scaled_dot_product_attention):
        return attend(q, k, v, is_causal=True)

    caught(captured, q, k, v, forbid=[SDPA])


def test_a_saved_method_and_a_module_snapshot_are_caught():
    update = KVCache.update
    snapshot = dict(vars(sampling))
    cache = KVCache(1, 1, 1, 4, 2)

    def saved_method(x):
        return update(cache, 0, 0, x, x)[0]

    def from_the_snapshot(logits, k):
        return snapshot["filter_top_k"](logits, k)

    caught(saved_method, torch.ones(1, 1, 1, 2), forbid=["ar_lab.model.cache.KVCache.update"])
    caught(from_the_snapshot, logits, 2, forbid=[TOP_K])


def test_low_level_routes_to_the_same_kernel_are_caught():
    def via_c(q, k, v):
        return torch._C._nn.scaled_dot_product_attention(q, k, v, is_causal=True)  # the object F's name points to

    def via_aten(q, k, v):
        return torch.ops.aten.scaled_dot_product_attention.default(q, k, v, is_causal=True)

    caught(via_c, q, k, v, forbid=[SDPA])
    caught(via_aten, q, k, v, forbid=[SDPA, "aten::scaled_dot_product_attention"])


def test_copies_of_the_reference_code_are_caught():
    namespace = dict(vars(sampling))
    exec(inspect.getsource(sampling._top_k), namespace)  # the private helper's source, run again
    spec = importlib.util.spec_from_file_location("a_second_sampling", sampling.__file__)
    second = importlib.util.module_from_spec(spec)  # what importlib.reload gives: the module's code, compiled again
    sys.modules[spec.name] = second  # (its dataclasses look their module up)
    try:
        spec.loader.exec_module(second)
    finally:
        del sys.modules[spec.name]

    def exec_copy(logits, k):
        return namespace["_top_k"](logits, k)

    def reloaded(logits, k):
        return second.filter_top_k(logits, k)

    caught(exec_copy, logits, 2, forbid="ch06-sampler", reaches="_top_k (a copy of its code)")  # a helper of the list's
    caught(reloaded, logits, 2, forbid=[TOP_K], reaches="filter_top_k")  # the same file and line: equal code


def written(logits, k):
    kth = logits.topk(k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def test_the_tests_own_reference_calls_pass_and_no_hook_is_left_behind():
    before = sys.getprofile()
    with no_delegation(written, forbid=[TOP_K, SDPA, "aten::scaled_dot_product_attention"]) as calls:
        expected = filter_top_k(logits, 2)
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.ops.aten.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert torch.equal(written(logits, 2), expected)
    assert calls == [] and sys.getprofile() is before
    assert torch.equal(filter_top_k(logits, 2), expected)


def test_an_answer_that_writes_the_computation_is_not_slowed_into_a_timeout():
    def written_attention(q, k, v):
        att = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        att = att.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
        return att.softmax(-1) @ v

    out = own_work("attention", written_attention, q, k, v, forbidden=[SDPA, "aten::scaled_dot_product_attention"])
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)


def test_an_unknown_operator_is_a_clear_error():
    with raises(BadValue, 'reference'):
        with no_delegation(forbid=["aten::nope"]):
            pass


def test_a_check_inside_the_block_keeps_the_outer_watch():
    """check_cases and own_work open their own block inside the test's: the test's forbid list still holds."""
    from ar_lab.course.checks import check_cases

    def delegating(logits, k):
        return filter_top_k(logits, k)

    with delegated("filter_top_k"):
        with no_delegation(delegating, forbid=[TOP_K]):
            check_cases("top-k", delegating, [((logits, 2), filter_top_k(logits, 2))])


def test_forbid_lists_and_graded_cells_name_no_private_ar_lab_path():
    private = [(ex, ref) for ex, refs in FORBIDDEN.items() for ref in refs
               if ref.startswith("ar_lab.") and any(part.startswith("_") and not part.startswith("__")
                                                     for part in ref.split("."))]
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
    # SamplingParams (allowed) checks its numbers with the same helper the filters use: a learner may build one
    params = own_work("ch06-top-p", lambda: sampling.SamplingParams(temperature=0.5, top_p=0.9), forbidden="ch06-top-p")
    assert params.top_p == 0.9


def test_renaming_an_internal_function_changes_no_verdict(monkeypatch):
    """Chapter 06's exercises, against a sampling module whose private filters have other names: a cheat
    through the renamed helper is still caught, and an answer written by hand still passes."""
    source = re.sub(r"\b_(temperature|top_k|top_p|min_p)\b", r"_renamed_\1", inspect.getsource(sampling))
    assert "_renamed_top_p" in source and "def _top_p" not in source
    renamed = types.ModuleType(sampling.__name__)
    renamed.__file__ = sampling.__file__
    monkeypatch.setitem(sys.modules, sampling.__name__, renamed)  # what guard.forbidden imports the names from
    exec(compile(source, sampling.__file__, "exec"), renamed.__dict__)
    for exercise, helper, cheat in [
        ("ch06-top-p", "_renamed_top_p", lambda x: renamed._renamed_top_p(x, 0.9)),
        ("ch06-temperature", "_renamed_temperature", lambda x: renamed._renamed_temperature(x, 0.7)),
        ("ch06-sampler", "_renamed_top_k", lambda x: renamed._renamed_top_k(x, 2)),
    ]:
        with delegated(f"{sampling.__name__}.{helper}"):
            own_work(exercise, cheat, logits, forbidden=exercise)
    assert torch.equal(own_work("ch06-sampler", written, logits, 2, forbidden="ch06-sampler"),
                       renamed.filter_top_k(logits, 2))
