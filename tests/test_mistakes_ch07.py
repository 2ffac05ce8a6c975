"""Chapter 07's named mistakes for the speculative loop: each classic slip, written out by hand as a
learner would, fails the graded test's check (``check_loop``: greedy on the course model against
plain greedy decoding) with the slip named; the right loop passes."""

import pytest
import torch

import ar_lab
from ar_lab.course.checkers.checks import CheckFailed
from ar_lab.course.checkers.mistakes import LOOP_SLIPS, check_loop
from ar_lab.engine.accept import draw
from ar_lab.model.data import benchmark_prompts


def propose(draft, seq, gamma, probs, generator, *, last_only=False):
    """The draft's gamma tokens and their q, as a learner writes it (``last_only``: the lagging
    draft's slip)."""
    drafts, qs = [], []
    for _ in range(gamma):
        text = seq + drafts
        # the slip: only the last token, whatever is lacking
        fed = [text[-1]] if last_only else text[draft.length :]
        qs.append(probs(draft.feed(fed)[-1], text))
        drafts.append(draw(qs[-1], generator))
    return drafts, qs


def verify(target, seq, drafts, qs, accept, probs):
    """The target's one pass and the accept rule: (n, dist)."""
    return accept(probs(target.feed(seq[-1:] + drafts), seq + drafts), qs, drafts)


def roll_back(target, draft, keep):
    target.truncate(keep)
    draft.truncate(min(draft.length, keep))


def right(target, draft, seq, gamma, accept, probs, generator):
    drafts, qs = propose(draft, seq, gamma, probs, generator)
    n, dist = verify(target, seq, drafts, qs, accept, probs)
    roll_back(target, draft, len(seq) + n)
    return drafts[:n] + [draw(dist, generator)]


def forgot_rollback(target, draft, seq, gamma, accept, probs, generator):
    drafts, qs = propose(draft, seq, gamma, probs, generator)
    n, dist = verify(target, seq, drafts, qs, accept, probs)
    # WRONG: no truncate, the rejected drafts stay in both caches
    return drafts[:n] + [draw(dist, generator)]


def dropped_bonus(target, draft, seq, gamma, accept, probs, generator):
    drafts, qs = propose(draft, seq, gamma, probs, generator)
    n, dist = verify(target, seq, drafts, qs, accept, probs)
    roll_back(target, draft, len(seq) + n)
    if n == len(drafts):
        return drafts  # WRONG: every draft passed, and the bonus token is left out
    return drafts[:n] + [draw(dist, generator)]


def lagging_draft(target, draft, seq, gamma, accept, probs, generator):
    drafts, qs = propose(draft, seq, gamma, probs, generator, last_only=True)  # WRONG: see propose
    n, dist = verify(target, seq, drafts, qs, accept, probs)
    roll_back(target, draft, len(seq) + n)
    return drafts[:n] + [draw(dist, generator)]


@pytest.fixture(scope="module")
def models():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield (
        ar_lab.load_pretrained("course"),
        ar_lab.load_pretrained("draft"),
        benchmark_prompts(1, length=24)[0],
    )
    torch.set_num_threads(before)


@pytest.mark.parametrize("wrong, slip", [(forgot_rollback, "rollback"), (dropped_bonus, "bonus"),
                                         (lagging_draft, "lag")], ids=["rollback", "bonus", "lag"])
def test_each_slip_of_the_loop_fails_with_its_name(models, wrong, slip):
    target, draft, prompt = models
    named = []
    for gamma in (1, 4):  # the graded test's greedy cases
        try:
            check_loop(f"greedy, γ = {gamma}", wrong, target, draft, prompt, 40, gamma)
        except CheckFailed as e:
            named.append(LOOP_SLIPS[slip] in str(e))
    assert named and all(named), f"{slip}: failed {len(named)} of 2 cases, named in {sum(named)}"


def test_the_right_loop_passes_and_another_error_is_explained(models):
    target, draft, prompt = models
    for gamma in (1, 4):
        check_loop(f"greedy, γ = {gamma}", right, target, draft, prompt, 40, gamma)

    # WRONG: ignores the drafts
    def greedy_target_only(target, draft, seq, gamma, accept, probs, generator):
        return [int(target.feed(seq[target.length :])[-1].argmax()) + 1]

    with pytest.raises(CheckFailed, match="differ from plain greedy decoding's from token 0"):
        check_loop("greedy, γ = 4", greedy_target_only, target, draft, prompt, 40, 4)
