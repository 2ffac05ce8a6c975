"""The checkers say what is wrong, and an answer that calls the package's reference fails."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from ar_lab.base.errors import BadValue
from ar_lab.course.checkers import checks
from ar_lab.course.checkers.checks import (
    CheckFailed,
    Delegated,
    check_cases,
    check_close,
    check_matches,
    no_delegation,
    own_work,
)
from ar_lab.engine.sampling import filter_top_k
from ar_lab.model.gpt import MLP, GPTConfig
from tests.raising import delegated, raises

SDPA = "torch.nn.functional.scaled_dot_product_attention"


def written_attention(q, k, v):
    T = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    return att.softmax(-1) @ v


def delegating_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_an_answer_written_out_passes_and_a_delegating_one_fails():
    q, k, v = torch.randn(3, 1, 2, 5, 4).unbind(0)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    check_close(
        "attention", own_work("attention", written_attention, q, k, v, forbidden=[SDPA]), expected
    )
    with delegated("torch.nn.functional.scaled_dot_product_attention"):
        own_work("attention", delegating_attention, q, k, v, forbidden=[SDPA])
    # Everything is put back afterwards.
    assert torch.allclose(delegating_attention(q, k, v), expected)


def test_names_imported_into_the_learners_namespace_are_caught():
    namespace = {"top_k": filter_top_k}
    exec("def mine(logits, k):\n    return top_k(logits, k)\n", namespace)
    with delegated("filter_top_k"):
        own_work(
            "top-k",
            namespace["mine"],
            torch.randn(10),
            3,
            forbidden=["ar_lab.engine.sampling.filter_top_k"],
        )
    assert namespace["top_k"] is filter_top_k


def test_a_module_class_is_caught_through_its_forward_even_if_the_error_is_swallowed():
    mlp = MLP(GPTConfig(n_embd=8, n_head=2))

    def swallowing(x):
        try:
            return mlp(x)
        except Exception:
            return x

    with pytest.raises(Delegated, match="caught the error"):
        own_work("MLP", swallowing, torch.randn(2, 8), forbidden=[MLP])
    assert "forward" in vars(MLP) and mlp(torch.randn(2, 8)).shape == (2, 8)


def test_check_cases_forbids_too_and_reports_a_stub():
    cases = [
        ((torch.tensor([1.0, 3.0, 2.0]), 1), torch.tensor([float("-inf"), 3.0, float("-inf")]))
    ]
    with pytest.raises(Delegated):
        check_cases("filter_top_k", filter_top_k, cases, forbidden=[filter_top_k])

    def stub(logits, k):
        raise NotImplementedError()

    with pytest.raises(CheckFailed, match="not implemented yet"):
        check_cases("filter_top_k", stub, cases, forbidden=[filter_top_k])

    def mine(logits, k):
        kth = logits.topk(k).values[-1]
        return logits.masked_fill(logits < kth, float("-inf"))

    check_cases("filter_top_k", mine, cases, forbidden=[filter_top_k])


def test_an_untouched_stub_fails_its_test_with_one_verdict_not_a_traceback():
    """The stub nbgrader leaves raises NotImplementedError inside the test's block: the verdict is
    one line and a hint (IPython shows ``_render_traceback_``), still an error for nbgrader."""

    def my_filter(logits, k):
        raise NotImplementedError()

    with pytest.raises(CheckFailed, match="my_filter: not implemented yet") as info:
        with no_delegation(my_filter, exercise="my_filter"):
            my_filter(torch.zeros(3), 1)
    shown = info.value._render_traceback_()
    assert shown == [
        "\N{HEAVY BALLOT X} CheckFailed: my_filter: not implemented yet",
        "Hint: replace `raise NotImplementedError()` with your code",
    ]

    def calls_the_reference(logits, k):  # reached the reference first: that is the verdict
        filter_top_k(logits, k)
        raise NotImplementedError()

    with pytest.raises(Delegated):
        with no_delegation(calls_the_reference, exercise="x", forbid=[filter_top_k]):
            calls_the_reference(torch.zeros(3), 1)


def test_an_unknown_reference_is_a_clear_error():
    with raises(BadValue, 'reference'):
        with no_delegation(forbid=["ar_lab.engine.sampling.nope"]):
            pass
    # nbgrader counts it as a failed test (AssertionError)
    assert checks.Delegated.__mro__[1] is CheckFailed


def test_a_method_and_a_constructor_can_be_forbidden():
    from ar_lab.model.cache import KVCache

    cache = KVCache(1, 1, 1, 4, 2)

    def via_method(k):
        return cache.update(0, 0, k, k)[0]

    def via_constructor(k):
        return KVCache(1, 1, 1, 4, 2).update(0, 0, k, k)[0]

    k = torch.ones(1, 1, 1, 2)
    for fn in (via_method, via_constructor):
        with delegated("KVCache"):
            own_work("cache write", fn, k, forbidden=["ar_lab.model.cache.KVCache.update", KVCache])
    assert (
        torch.equal(via_constructor(k), k)
        and "update" in vars(KVCache)
        and "__init__" in vars(KVCache)
    )


def test_inside_the_block_the_test_may_call_the_reference_and_the_learner_may_not():
    q, k, v = torch.randn(3, 1, 2, 5, 4).unbind(0)
    with no_delegation(written_attention, forbid=[SDPA], exercise="attention"):
        # the test's own reference: allowed
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        check_close("attention", written_attention(q, k, v), expected)
    with pytest.raises(Delegated, match="attention"):
        with no_delegation(delegating_attention, forbid=[SDPA], exercise="attention"):
            delegating_attention(q, k, v)


def test_a_learners_module_class_and_nested_helpers_count_as_theirs():
    cfg = GPTConfig(n_embd=8, n_head=2)
    reference = MLP(cfg)

    class MyMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = MLP(cfg)  # built before the check: allowed

        def forward(self, x):
            def helper(y):
                return self.inner(y)  # the package's MLP, called from the learner's code

            return helper(x)

    mine = MyMLP()
    x = torch.randn(2, 8)
    with pytest.raises(Delegated, match="MLP"):
        with no_delegation(MyMLP, forbid=[MLP], exercise="the MLP"):
            reference(x)  # the test's own call passes
            mine(x)
    assert mine(x).shape == (2, 8)  # restored afterwards


def test_a_subclass_of_the_reference_is_delegation():
    class Mine(MLP):
        pass

    with delegated("ar_lab.model.gpt.MLP"):
        with no_delegation(Mine, forbid=["ar_lab.model.gpt.MLP"], exercise="the MLP"):
            pass


def test_first_mismatch_names_the_first_differing_index_along_a_dimension():
    expected = torch.zeros(2, 5, 3)
    got = expected.clone()
    assert checks.first_mismatch(got, expected, dim=1) is None
    got[1, 3, 0] = 1.0
    got[0, 4, 2] = 1.0
    assert checks.first_mismatch(got, expected, dim=1) == 3
    assert checks.first_mismatch(got, expected, dim=0) == 0


def test_check_matches_names_a_known_mistake_the_scale_and_the_first_position():
    expected = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(0))
    check_matches("piece", expected + 1e-7, expected)
    with pytest.raises(CheckFailed, match=r"piece: your output is what no residual gives"):
        check_matches(
            "piece",
            expected - 1,
            expected,
            mistakes={"no residual": expected - 1, "other": 3 * expected},
        )
    with pytest.raises(CheckFailed, match=r"2x the expected size"):
        check_matches("piece", 2 * expected, expected)
    leaky = expected.clone()
    leaky[:, 4:] += 0.5
    with pytest.raises(
        CheckFailed, match=r"the first position that differs is 4 \(positions 0 to 3 agree\)"
    ):
        check_matches("piece", leaky, expected, dim=1)
    with pytest.raises(CheckFailed, match=r"the first step that differs is 1 \(step 0 agrees\)"):
        check_matches(
            "losses", torch.tensor([5.0, 4.0]), torch.tensor([5.0, 4.5]), dim=0, dim_name="step"
        )
    with pytest.raises(CheckFailed, match=r"expected shape \(2, 6, 4\), got \(6, 2, 4\)"):
        check_matches("piece", expected.transpose(0, 1), expected)
    broken = expected.clone()
    broken[0, 2, 1] = float("nan")
    with pytest.raises(CheckFailed, match="1 of its values are NaN or infinite"):
        check_matches("piece", broken, expected)


def test_check_sequence_says_where_two_token_lists_part():
    checks.check_sequence("tokens", [1, 2, 3], [1, 2, 3])
    with pytest.raises(
        CheckFailed, match=r"token 2 differs: expected 3, got 9 \(tokens 0 to 1 agree\)"
    ):
        checks.check_sequence("tokens", [1, 2, 9, 4], [1, 2, 3, 4])
    with pytest.raises(CheckFailed, match=r"expected 3 tokens, got 2 \(the first 2 agree\)"):
        checks.check_sequence("tokens", [1, 2], [1, 2, 3])
    with pytest.raises(
        CheckFailed,
        match=r"token 0 differs: expected 1, got 7 \(the very first token: none agree\)$",
    ):
        checks.check_sequence("tokens", [7, 2, 3], [1, 2, 3])
    with pytest.raises(
        CheckFailed, match=r"token 1 differs: expected 2, got 7 \(token 0 agrees\)$"
    ):
        checks.check_sequence("tokens", [1, 7, 3], [1, 2, 3])
    with pytest.raises(CheckFailed, match=r"expected 3 tokens, got 0$"):
        checks.check_sequence("tokens", [], [1, 2, 3])


def warning_answer(x):
    """A correct answer that makes libraries warn (torch's float(loss) warning is shown once per
    process, so tests/test_exercises.py proves that one in a fresh kernel)."""
    warnings.warn("this API is deprecated", FutureWarning, stacklevel=1)
    return torch.tensor(x)  # torch: "To copy construct from a tensor, it is recommended to ..."


def test_a_librarys_warning_in_the_learners_code_goes_to_stdout_not_stderr(capsys):
    x = torch.ones(3)
    # outside: warnings (stderr)
    with pytest.warns(UserWarning, match="sourceTensor"), pytest.warns(FutureWarning):
        warning_answer(x)
    with no_delegation(warning_answer, exercise="train_step"):
        assert torch.equal(warning_answer(x), x)
        warning_answer(x)
    out, err = capsys.readouterr()
    assert err == ""
    assert (
        "note: a warning while checking train_step (it does not affect the grade): UserWarning: "
        "To copy"
    ) in out
    # each distinct warning once
    assert "FutureWarning: this API is deprecated" in out and out.count("\n") == 2
    # a failing check too
    with pytest.raises(CheckFailed), no_delegation(warning_answer, exercise="again"):
        warning_answer(x)
        checks.check_equal("loss", 1, 2)
    out, err = capsys.readouterr()
    assert err == "" and "while checking again" in out


def test_check_dtype_refuses_a_float_mask_and_names_the_dtype():
    checks.check_dtype("causal_mask(3)", torch.ones(3, 3, dtype=torch.bool).tril(), torch.bool)
    float_mask = torch.ones(3, 3).tril()
    # equal values: check_equal alone passes
    checks.check_equal("causal_mask(3)", float_mask, float_mask.bool())
    with pytest.raises(
        CheckFailed, match=r"causal_mask\(3\): expected dtype torch.bool, got torch.float32: ~mask"
    ):
        checks.check_dtype("causal_mask(3)", float_mask, torch.bool, why="~mask needs torch.bool")
    with pytest.raises(CheckFailed, match="expected a tensor of dtype torch.bool, got list"):
        checks.check_dtype("causal_mask(3)", [[1]], torch.bool)


def test_check_log_prob_names_a_product_of_probabilities_that_underflowed():
    pairs = torch.full((1000,), -2.5)  # log-probabilities of 1000 pairs
    checks.check_log_prob("sum", float(pairs.sum()), pairs.sum())
    checks.check_log_prob("one token", 0.0, torch.tensor(0.0))
    product = pairs.double().exp().prod()  # 0.0 even in float64
    for answer in [product.log(), float(product.log()), product]:
        with pytest.raises(
            CheckFailed, match="you multiply probabilities and the product underflows.*add log-prob"
        ):
            checks.check_log_prob("sequence_log_prob(1001 tokens)", answer, pairs.sum())
    with pytest.raises(CheckFailed, match="values differ"):
        checks.check_log_prob("sum", -2400.0, pairs.sum())


def test_check_same_names_lists_what_is_missing_unexpected_or_misshapen():
    cfg = GPTConfig(n_embd=8, n_head=2)
    reference = MLP(cfg)
    checks.check_same_names("MLP", MLP(cfg), reference)

    class Renamed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = torch.nn.Linear(8, 32)
            self.proj = torch.nn.Linear(32, 4)

    names = r"missing \['fc.bias', 'fc.weight'\]; unexpected \['c_fc.bias', 'c_fc.weight'\]"
    with pytest.raises(CheckFailed, match=names):
        checks.check_same_names("MLP", Renamed(), reference)
    with pytest.raises(CheckFailed, match=r"`proj.weight` has shape \(4, 32\), expected \(8, 32\)"):
        checks.check_same_names("MLP", Renamed(), reference)


def test_check_parameters_names_the_mistake_or_the_first_differing_parameter():
    torch.manual_seed(0)
    a = MLP(GPTConfig(n_embd=8, n_head=2))
    b, c = (MLP(GPTConfig(n_embd=8, n_head=2)) for _ in range(2))
    b.load_state_dict(a.state_dict())
    c.load_state_dict(a.state_dict())
    checks.check_parameters("after training", b, a)
    with torch.no_grad():
        b.proj.bias += 0.1
        c.proj.bias += 0.1
    with pytest.raises(CheckFailed, match="parameter `proj.bias` is the first that differs"):
        checks.check_parameters("after training", b, a)
    with pytest.raises(CheckFailed, match="what training without clipping gives"):
        checks.check_parameters("after training", b, a, mistakes={"training without clipping": c})


def test_yours_or_ours_follows_the_verdict_of_the_exercises_test(capsys):
    """A later cell gets the learner's piece only once its test passed on that very object."""
    import pytest

    from ar_lab.course.checkers.checks import (
        CheckFailed,
        check_equal,
        exercise_passed,
        no_delegation,
        yours_or_ours,
    )

    def double(x):
        return 2 * x

    def ours(x):
        return x + x

    assert yours_or_ours("double (never tested)", double, ours) is ours
    assert "has not been tested" in capsys.readouterr().out
    with pytest.raises(CheckFailed), no_delegation(double, exercise="double"):
        check_equal("double(2)", double(2), 5)
    assert not exercise_passed("double", double)
    assert yours_or_ours("double", double, ours) is ours
    assert "does not pass its test yet: this runs on ar_lab's" in capsys.readouterr().out
    with no_delegation(double, exercise="double"):
        check_equal("double(2)", double(2), 4)
    assert exercise_passed("double", double)
    assert yours_or_ours("double", double, ours) is double
    assert "▶ this runs on your double (its test passed)" in capsys.readouterr().out

    def double(x):  # noqa: F811  redefined after its test passed: not the object tested
        return 3 * x

    assert yours_or_ours("double", double, ours) is ours
    assert "changed since its test passed" in capsys.readouterr().out
    pair = (double, ours)
    with no_delegation(*pair, exercise="pair"):
        pass
    assert yours_or_ours("pair", pair, (ours, ours)) == pair
    made = yours_or_ours("pair", lambda: "made from them", None, tested=pair)
    assert made == "made from them"
    # not the pair tested
    assert yours_or_ours("pair", lambda: 1 / 0, "ours", tested=(ours, double)) == "ours"
