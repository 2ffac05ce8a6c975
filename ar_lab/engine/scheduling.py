"""Admission policies: when a server with free slots takes requests from its queue (chapter 08).

Before every decode step, ``ar_lab.engine.serving.serve`` asks its policy how many of the waiting
requests to admit now (each is prefilled and joins the batch), given how many wait, how many
run, and how many slots there are. *Static* batching admits a whole new batch only when nothing
runs any more; *continuous* batching (Orca's iteration-level scheduling, Yu et al., OSDI 2022)
fills every free slot at once. A policy of one's own (the learner's, in chapter 08) is any
function with that signature (``AdmissionPolicy``); ``admitted`` checks what it answers.
"""

from __future__ import annotations

from collections.abc import Callable

from ar_lab.base.errors import BadValue

# (requests waiting, requests running, slots) -> how many more requests join the batch before the
# next step (the server admits waiting requests in order until that many have joined: one that its
# prefill alone finishes takes no slot, and the next one is admitted in its place)
AdmissionPolicy = Callable[[int, int, int], int]


def static_admit(waiting: int, running: int, max_batch: int) -> int:
    """A new batch only when the previous one has completely finished: as many as fit, else none."""
    return min(waiting, max_batch) if running == 0 else 0


def continuous_admit(waiting: int, running: int, max_batch: int) -> int:
    """Every free slot refilled before the next step, as long as requests wait."""
    return min(waiting, max_batch - running)


ADMISSION = {"static": static_admit, "continuous": continuous_admit}
POLICIES = tuple(ADMISSION)  # the policies known by name


def policy_function(policy) -> AdmissionPolicy:
    """``policy`` as a function: a name of ``POLICIES``, or a function of one's own
    (``AdmissionPolicy``)."""
    if callable(policy):
        return policy
    if policy not in ADMISSION:
        raise BadValue(
            f"policy must be one of {POLICIES} or a function (waiting, running, max_batch) -> "
            f"int, got {policy!r}",
            arg="policy",
        )
    return ADMISSION[policy]


def policy_name(policy) -> str:
    """How a report names ``policy``: its name, or the function's."""
    return policy if isinstance(policy, str) else getattr(policy, "__name__", type(policy).__name__)


def admitted(policy: AdmissionPolicy, waiting: int, running: int, max_batch: int) -> int:
    """``policy``'s answer for this state, checked: a whole number that fits the free slots and the
    queue, and not 0 while nothing runs and requests wait (the server would wait forever)."""
    n = policy(waiting, running, max_batch)
    most = min(waiting, max_batch - running)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= most:
        raise BadValue(
            f"the admission policy answered {n!r} for {waiting} waiting, {running} running, "
            f"{max_batch} slots: it must be an int from 0 to {most} (the waiting requests that "
            "fit the free slots)",
            arg="policy",
        )
    if n == 0 and running == 0 and waiting:
        raise BadValue(
            f"the admission policy admitted nothing while nothing runs and {waiting} requests "
            "wait: the server would wait forever",
            arg="policy",
        )
    return n
