"""Chapter 08's named mistakes: the row mask, the admission policies and the server step."""

import pytest
import torch

from ar_lab.course.checkers.checks import CheckFailed
from ar_lab.course.checkers.mistakes import check_exact
from tests.raising import fails_naming, raises


def test_chapter_08_mistakes_are_named():
    """The row mask and the two admission policies: each classic slip, written out by hand, is
    named; the right answer passes."""
    from ar_lab.course.checkers.mistakes import admission_mistakes, row_mask_mistakes
    from ar_lab.engine.scheduling import continuous_admit, static_admit
    from ar_lab.model.cache import BatchKVCache

    lengths, T = [2, 5, 3], 2
    cache = BatchKVCache(n_layer=1, max_batch=3, n_kv_heads=1, max_len=max(lengths) + T, head_dim=1)
    for n in lengths:
        cache.add(n)
    right = cache.begin(T)[1].tolist()
    # pos: (rows, T)
    keys, pos = torch.arange(max(lengths) + T), torch.tensor(lengths)[:, None] + torch.arange(T)
    wrong = {
        "does not see itself": keys < pos[:, :, None],
        "a padding position attended": (keys <= (max(lengths) + torch.arange(T))[:, None]).expand(
            3, T, -1
        ),
        "no causal part": (keys < (torch.tensor(lengths) + T)[:, None, None]).expand(3, T, -1),
    }
    for fragment, answer in wrong.items():
        fails_naming(
            fragment,
            check_exact,
            "mask",
            answer[:, None].tolist(),
            right,
            row_mask_mistakes(lengths, T),
        )
    check_exact("mask", right, right, row_mask_mistakes(lengths, T))

    fails_naming("that is continuous batching", check_exact, "static", 2, static_admit(5, 2, 4),
                  admission_mistakes("static", 5, 2, 4))
    fails_naming("not capped by the queue", check_exact, "continuous", 4, continuous_admit(1, 0, 4),
                  admission_mistakes("continuous", 1, 0, 4))
    fails_naming("one request per step", check_exact, "continuous", 1, continuous_admit(3, 0, 4),
                  admission_mistakes("continuous", 3, 0, 4))
    want = continuous_admit(3, 1, 4)
    check_exact("continuous", want, want, admission_mistakes("continuous", 3, 1, 4))


def _step(*, mask=None, retire=True, admit_one=False):
    """A server step as a learner writes it (chapter 08, exercise 3), with one classic slip switched
    on."""
    from ar_lab.model.cache import row_mask

    def step(server):
        if server.waiting:
            n = server.policy(len(server.waiting), len(server.rows), server.max_batch)
            goal = len(server.rows) + (min(n, 1) if admit_one else n)
            while server.waiting and len(server.rows) < goal and server.has_room():
                server.prefill(server.waiting.popleft())
        if server.rows:
            lengths = server.lengths
            tokens = server.pick(
                server.decode(row_mask(lengths, 1) if mask is None else mask(lengths))
            )
            done = [i for i, t in enumerate(tokens) if server.record(i, t)]
            if retire:
                server.retire(done)

    return step


@pytest.fixture(scope="module")
def course_model():
    import ar_lab

    torch.manual_seed(0)
    return ar_lab.load_pretrained("course")


def test_each_classic_wrong_server_step_fails_the_graded_check_with_its_mistake_named(course_model):
    """The graded test's own check on its workload (7 requests, 3 rows, both policies): a finished
    row left in the batch, a padding position attended (or no mask at all), a token that does not
    see itself, each fails naming its mistake; admitting one request per step fails on the schedule;
    the right step passes."""
    from ar_lab.course.checkers.serving_checks import check_server_step
    from ar_lab.engine.serving import StepError
    from ar_lab.perf.serving_measure import mixed_workload

    small = mixed_workload(n_requests=7, short=3, long=9, long_every=3)

    def keys(n):
        return torch.arange(max(n) + 1)

    # (what the failure names, the step); with T = 1, no mask at all is the longest row's mask
    wrong = [
        (
            "a padding position attended",
            _step(mask=lambda n: (keys(n) <= max(n)).expand(len(n), 1, 1, -1)),
        ),
        (
            "a padding position attended",
            _step(mask=lambda n: torch.ones(len(n), 1, 1, max(n) + 1, dtype=torch.bool)),
        ),
        (
            "does not see itself",
            _step(mask=lambda n: (keys(n) < torch.tensor(n)[:, None])[:, None, None]),
        ),
    ]
    for policy in ("static", "continuous"):
        options = {"max_batch": 3, "policy": policy, "eos_id": None}
        check_server_step(course_model, small, _step(), **options)
        for fragment, step in wrong:
            fails_naming(fragment, check_server_step, course_model, small, step, **options)
        with raises(StepError, 'step'):
            check_server_step(course_model, small, _step(retire=False), **options)
    # on the schedule
    with pytest.raises(CheckFailed, match="the decode step at which each request finished"):
        check_server_step(
            course_model,
            small,
            _step(admit_one=True),
            max_batch=3,
            policy="continuous",
            eos_id=None,
        )
