"""ar_lab.base.timing.interleaved: sides timed in turns, on the clock it is given."""

import itertools
import time

import pytest

from ar_lab.base.errors import BadType, BadValue
from ar_lab.base.timing import interleaved
from tests.raising import raises


def recorder(calls: list, *names: str) -> dict:
    """{name: a function that appends its name to ``calls``}."""
    return {name: (lambda name=name: calls.append(name)) for name in names}


def fake_clock(readings: list | None = None):
    """A clock reading 0, 1, 3, 6, 10, 15, ...: each reading one second further on from the last
    than the one before."""
    ticks = itertools.accumulate(itertools.count())

    def clock() -> float:
        t = float(next(ticks))
        if readings is not None:
            readings.append(t)
        return t

    return clock


def test_the_sides_take_turns_and_each_round_starts_one_later():
    calls = []
    times = interleaved(recorder(calls, "a", "b", "c"), 3, clock=fake_clock())
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert list(times) == ["a", "b", "c"]  # in the order given, whatever order they ran in


def test_without_rotation_every_round_keeps_the_given_order():
    calls = []
    interleaved(recorder(calls, "probe", "step"), 3, rotate=False, clock=fake_clock())
    assert calls == ["probe", "step"] * 3


def test_warm_up_rounds_run_first_untimed_and_count_in_the_rotation():
    calls, rounds = [], []
    times = interleaved(
        recorder(calls, "a", "b"), 2, warmup=1, clock=fake_clock(), progress=rounds.append
    )
    # round 0 warms up, then rounds 1 and 2 are timed
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert rounds == [0, 1, 2]
    assert {k: len(v) for k, v in times.items()} == {"a": 2, "b": 2}


def test_each_call_is_timed_on_the_given_clock():
    readings = []
    times = interleaved(recorder([], "a", "b"), 2, clock=fake_clock(readings))
    # clock reads 0 1 | 3 6 | 10 15 | 21 28: calls a, b, b, a took 1, 3, 5, 7 seconds
    assert readings == [0, 1, 3, 6, 10, 15, 21, 28]
    assert times == {"a": [1.0, 7.0], "b": [3.0, 5.0]}


def test_the_default_clock_is_the_wall_clock_on_the_cpu():
    # sleeping takes no CPU time: only a wall clock sees it
    times = interleaved(
        {"sleep": lambda: time.sleep(0.002), "nothing": lambda: None}, 2, device="cpu"
    )
    assert all(t >= 0.002 for t in times["sleep"]) and all(t >= 0 for t in times["nothing"])


def test_a_cpu_time_clock_can_be_chosen():
    times = interleaved({"sleep": lambda: time.sleep(0.005)}, 2, clock=time.thread_time)
    assert all(t < 0.005 for t in times["sleep"])  # the thread slept: almost no CPU time passed


def test_names_may_be_tuples_and_a_single_side_works():
    calls = []
    times = interleaved({(0, "plain"): lambda: calls.append(1)}, 3, warmup=2, clock=fake_clock())
    assert calls == [1] * 5 and len(times[0, "plain"]) == 3


@pytest.mark.parametrize(
    ("kwargs", "kind", "arg"),
    [
        ({"runs": {}}, BadValue, "runs"),
        ({"runs": [lambda: None]}, BadValue, "runs"),  # a list, not a dict
        ({"runs": {"a": 3}}, BadType, "runs"),  # runs['a'] is not a function
        ({"rounds": 0}, BadValue, "rounds"),
        ({"rounds": 2.0}, BadValue, "rounds"),
        ({"rounds": True}, BadValue, "rounds"),
        ({"warmup": -1}, BadValue, "warmup"),
        ({"clock": 1.5}, BadType, "clock"),
        ({"device": "banana"}, BadValue, "device"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(kwargs, kind, arg):
    calls = []
    args = {"runs": recorder(calls, "a"), "rounds": 1, **kwargs}
    with raises(kind, arg):
        interleaved(args.pop("runs"), args.pop("rounds"), **args)
    assert calls == []
