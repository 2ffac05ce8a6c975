"""No default passes for a missing answer (issue 64), and graded checks read back values of the
stated kind.

A hook of the package given None runs the package's own version
(``speculative_generate(iteration=None)``, ``serve(step=None)``): a graded test handed None, the
package's own function or a thin wrapper of it must fail with ``answers.NoAnswer`` ("no answer yet")
before anything runs, in the learner's kernel and in the grading step's answer process. A value that
only converts to the right one (a str of a number, a float for a count, a bool) fails the check that
reads it.
"""

from __future__ import annotations

import copy
import functools
import math
from pathlib import Path

import nbformat
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ar_lab.course.checkers import roofline_checks
from ar_lab.course.checkers.answers import (
    NoAnswer,
    package_origin,
    real_number,
    require_answer,
    whole_number,
)
from ar_lab.course.checkers.checks import CheckFailed, Delegated, no_delegation
from ar_lab.course.checkers.mistakes import check_exact, check_loop
from ar_lab.course.checkers.serving_checks import check_server_step
from ar_lab.engine.scheduling import static_admit
from ar_lab.engine.serving import serve_step
from ar_lab.engine.speculative import Speculation, speculative_iteration

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


# a learner's own (its body is not run)
def my_iteration(target, draft, seq, gamma, accept, probs, generator):
    return [0]


class MyAllocator:  # a learner's own class
    pass


@functools.wraps(speculative_iteration)
def wrapped(*args, **kwargs):  # a thin wrapper that says what it wraps
    return speculative_iteration(*args, **kwargs)


PACKAGES_OWN = {
    "the function itself": speculative_iteration,
    "a partial of it": functools.partial(serve_step),
    "a partial of a partial": functools.partial(functools.partial(static_admit, 1), 0),
    "a functools.wraps wrapper": wrapped,
    "a method of the package's class": Speculation.iteration,
    "the package's class": Speculation,
}


@pytest.mark.parametrize("answer", [None, *PACKAGES_OWN.values()], ids=["None", *PACKAGES_OWN])
def test_none_or_the_packages_own_is_no_answer_yet(answer):
    with pytest.raises(NoAnswer, match="no answer yet"):
        require_answer("my_iteration", answer)
    # every graded test's guard refuses it before running
    with pytest.raises(NoAnswer, match="no answer yet"):
        with no_delegation(my_iteration, answer, exercise="my_iteration"):
            pytest.fail("the block ran on a missing answer")
    # nbgrader: a failed test
    assert issubclass(NoAnswer, Delegated) and issubclass(NoAnswer, CheckFailed)


def test_the_learners_own_code_is_an_answer():
    require_answer(
        "x", my_iteration, MyAllocator, lambda server: None, functools.partial(my_iteration, None)
    )
    assert package_origin(my_iteration) is None and package_origin(MyAllocator) is None
    assert package_origin(wrapped) == "ar_lab.engine.speculative.speculative_iteration"


@pytest.mark.parametrize("answer", [None, speculative_iteration])
def test_the_speculative_loop_check_refuses_what_would_run_ar_labs_loop(answer):
    """speculative_generate(iteration=None) runs ar_lab's loop: the check refuses it before running
    anything (the models are never touched here)."""
    with pytest.raises(NoAnswer):
        check_loop("greedy, γ = 1", answer, None, None, [1, 2], 8, 1)


@pytest.mark.parametrize("answer", [None, serve_step, functools.partial(serve_step, mask=None)])
def test_the_server_step_check_refuses_what_would_run_ar_labs_step(answer):
    with pytest.raises(NoAnswer):
        check_server_step(None, [], answer, max_batch=2, policy="continuous", eos_id=None)


def test_the_other_checkers_handed_a_learners_callable_refuse_none_and_the_packages_own():
    from ar_lab.course.checkers.grammar_checks import check_allowed_next
    from ar_lab.course.checkers.paged_checks import check_allocator_ops
    from ar_lab.engine.paged import BlockAllocator
    from ar_lab.perf import peaks

    for answer in (None, BlockAllocator):
        with pytest.raises(NoAnswer):
            check_allocator_ops(answer, [("allocate", "a", 1)], num_blocks=2, block_size=4)
    for answer in (None, peaks.stream_probe):
        with pytest.raises(NoAnswer):
            roofline_checks.check_probe_rates(answer, answer, "cpu", None)
    with pytest.raises(NoAnswer):
        check_allowed_next("my_allowed_next", None, None, [b""])


def test_in_the_grading_step_a_name_holding_none_or_never_defined_is_no_answer_yet(tmp_path):
    """The grading step's judge holds handles on the learner's names (``sandbox.answer``): a handle
    on None would reach ``speculative_generate(iteration=...)`` as a true object and run ar_lab's
    loop if nothing asked first."""
    from ar_lab.course.grading import sandbox
    from ar_lab.course.grading.sandbox import answer

    errors = sandbox.start(["my_iteration = None", "def mine(x):\n    return x + 1"],
                           ["ar_lab.engine.speculative.speculative_iteration"], tmp_path / "answer")
    try:
        assert errors == ["", ""]
        for name in ("my_iteration", "never_defined"):
            with pytest.raises(NoAnswer, match="no answer yet"):
                with no_delegation(answer(name), exercise=name):
                    pytest.fail(f"the block ran on {name}")
        with no_delegation(answer("mine"), exercise="mine"):
            assert answer("mine")(1) == 2
    finally:
        sandbox.stop()


# --- what a graded check reads back ---------------------------------------------------------------


@given(st.integers(-10**15, 10**15))
def test_an_int_is_read_as_itself_and_nothing_else_is(n):
    assert whole_number("n", n) == n and type(whole_number("n", n)) is int
    for other in (float(n), str(n), n != 0):
        with pytest.raises(CheckFailed, match="expected an int"):
            whole_number("n", other)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_a_finite_number_is_read_and_its_text_is_not(x):
    assert real_number("x", x) == x
    for other in (str(x), repr(x), x > 0):
        with pytest.raises(CheckFailed, match="expected a finite float"):
            real_number("x", other)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, None, [1.0], "0.0077"])
def test_nan_infinity_and_containers_are_not_numbers(bad):
    with pytest.raises(CheckFailed):
        real_number("predict_tpot(...)", bad)


@given(count=st.integers(1, 10**12), seconds=st.floats(1e-9, 1e3))
def test_a_probe_returning_strings_or_a_float_count_fails(count, seconds):
    """Chapter 05's probes: (bytes or FLOPs, seconds) as (int, float); their text, or a float count,
    is not read."""
    assert roofline_checks.probe_result("stream_probe(8)", (count, seconds)) == (count, seconds)
    for got in [
        (str(count), str(seconds)),
        (count, str(seconds)),
        (str(count), seconds),
        (float(count), seconds),
        (True, seconds),
    ]:
        with pytest.raises(CheckFailed, match=r"expected a pair \(count, seconds\)"):
            roofline_checks.probe_result("stream_probe(8)", got)


PLAN = {"tpot": 0.0123, "max_batch": 37, "matmul_batch": 296, "attention_intensity": 4.0}


@pytest.mark.parametrize(
    "key, bad",
    [
        ("max_batch", 37.0),
        ("max_batch", "37"),
        ("max_batch", True),
        ("matmul_batch", 296.0),
        ("tpot", "0.0123"),
        ("tpot", math.nan),
        ("attention_intensity", "4"),
    ],
)
def test_a_decode_plan_of_the_wrong_kinds_fails(key, bad):
    """decode_plan's max_batch as a float or a str was read back with int(...) and passed."""
    assert roofline_checks.read_plan("decode_plan(...)", PLAN) == PLAN
    with pytest.raises(CheckFailed, match=key):
        roofline_checks.read_plan("decode_plan(...)", {**PLAN, key: bad})
    with pytest.raises(CheckFailed, match="keys"):
        roofline_checks.read_plan("decode_plan(...)", {k: v for k, v in PLAN.items() if k != key})


@given(st.integers(0, 10**9))
def test_an_exact_count_must_be_an_int(n):
    check_exact("positions_processed(...)", n, n, {})
    for other in (float(n), str(n)):
        with pytest.raises(CheckFailed, match="expected an int"):
            check_exact("positions_processed(...)", other, n, {})


@given(st.fractions(0, 1).map(float))
def test_a_fraction_given_as_text_is_not_the_fraction(x):
    """Chapter 06's repeated n-gram fraction (``check_ngram_cases``): "0.4" was read as 0.4 and
    passed."""
    from ar_lab.course.checkers.mistakes import check_ngram_cases

    check_ngram_cases("f", lambda tokens, n: x, [(([1, 2], 1), x)])
    for text in (str(x), repr(x)):
        with pytest.raises(CheckFailed):
            check_ngram_cases("f", lambda tokens, n, text=text: text, [(([1, 2], 1), x)])


def test_a_dequantized_matrix_must_be_the_stated_float32():
    import torch

    from ar_lab.course.checkers.quant_checks import check_dequantized

    q, scale = torch.tensor([[1, -2], [3, 4]], dtype=torch.int8), torch.tensor([0.5, 0.25])
    expected = q.float() * scale[:, None]
    check_dequantized("my_dequantize_int8", expected.clone(), expected)
    for wrong in (expected.double(), expected.half(), expected.tolist()):
        with pytest.raises(CheckFailed, match="float32"):
            check_dequantized("my_dequantize_int8", wrong, expected)


# --- the graded tests themselves, run on such answers ---------------------------------------------

# notebook -> {grade_id of the answer cell: an answer that passed its graded test before issue 64}
WRONG = {
    "05_prefill_vs_decode": {
        "ch05-probes": """
def stream_probe(n, repeats=5):
    a, b, c = (torch.rand(n, device=device, dtype=dtype) for _ in range(3))
    return str(3 * a.nbytes), str(min(_t(lambda: torch.add(a, b, out=c)) for _ in range(repeats)))


def matmul_probe(m, k, n, repeats=5):
    a = torch.rand(m, k, device=device, dtype=dtype)
    b = torch.rand(k, n, device=device, dtype=dtype)
    return str(2 * m * k * n), str(min(_t(lambda: a @ b) for _ in range(repeats)))


def _t(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
""",
        "ch05-predict-tpot": """
def predict_tpot(n_params, bytes_per_param, bandwidth, kv_cache_bytes=0.0):
    return str((n_params * bytes_per_param + kv_cache_bytes) / bandwidth)
""",
        "ch05-decode-plan": """
def decode_plan(shape, gpu, context):
    cache = context * shape.kv_values_per_token * 2
    weights_read = (shape.parameters - (shape.vocab - 1) * shape.d_model) * 2
    return {"tpot": (weights_read + cache) / gpu.bandwidth,
            "max_batch": float(math.floor((gpu.memory - shape.parameters * 2) / cache)),
            "matmul_batch": math.ceil(gpu.ridge),
            "attention_intensity": shape.q_width / shape.kv_width}
""",
    },
    "07_speculative_decoding": {"ch07-loop": "my_iteration = None"},
    "08_in_production": {"ch08-server-step": "my_server_step = None"},
    "10_attention_as_engines_compute_it": {"ch10-split-decode": "my_split_decode = None"},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(WRONG))
def test_each_graded_test_fails_a_missing_answer_or_strings_for_numbers(name):
    from ar_lab.course.grading.exercises import execute, exercises_only, grade, nbgrader_meta
    from tests.conftest import one_thread_env

    path = NOTEBOOKS / f"{name}.ipynb"
    nb = copy.deepcopy(nbformat.read(path, as_version=4))
    for cell in nb.cells:
        gid = nbgrader_meta(cell).get("grade_id")
        if nbgrader_meta(cell).get("solution") and gid in WRONG[name]:
            cell.source = WRONG[name][gid].strip()
    results = {
        r.grade_id: r for r in grade(execute(exercises_only(nb), path.parent, env=one_thread_env()))
    }
    for gid in WRONG[name]:
        result = results[f"{gid}-tests"]
        assert not result.passed, (
            f"{name}: {gid}'s graded test passes the answer {WRONG[name][gid][:60]!r}"
        )
        said = "no answer yet" if "None" in WRONG[name][gid] else "expected"
        assert said in result.error, f"{name}: {gid} failed without saying so: {result.error[:300]}"
