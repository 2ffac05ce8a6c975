"""Chapter 10's tile stepper: the pure function the widget shows, and the widget driven
headlessly."""

from __future__ import annotations

import pytest

from ar_lab.base.errors import BadValue
from ar_lab.course.views.tile_view import TileStepper, tile_grid_html, tile_step
from ar_lab.model.tiled import tile_plan
from tests.raising import raises


def test_the_last_step_has_computed_every_visible_score_and_nothing_above_the_tiles():
    T, offset = 10, 3
    steps = sum(len(keys) for *_, keys in tile_plan(T, offset=offset, tile_q=4, tile_k=3))
    last = tile_step(T, offset=offset, tile_q=4, tile_k=3, step=steps - 1)
    assert last.steps == steps and last.count("todo") == 0
    for i, row in enumerate(last.grid):
        for j, state in enumerate(row):
            assert (state in ("done", "now")) == (j <= offset + i), (i, j, state)
    assert last.count("masked") > 0 and last.count("skipped") > 0
    assert last.count("done") + last.count("now") == sum(offset + i + 1 for i in range(T))


def test_each_step_computes_one_tile_and_the_first_leaves_the_rest_to_do():
    first = tile_step(8, tile_q=4, tile_k=4, step=0)
    assert first.count("now") == 4 * 4 - 6 and first.count("masked") == 6  # a diagonal tile
    assert first.count("done") == 0 and "Step 1 of 3" in first.text and "diagonal" in first.text
    second = tile_step(8, tile_q=4, tile_k=4, step=1)
    assert second.count("now") == 16 and "no mask" in second.text  # below the diagonal
    assert "<table" in tile_grid_html(second)


@pytest.mark.parametrize("kwargs, arg", [
    (dict(T=0, tile_q=2, tile_k=2, step=0), "T"),
    (dict(T=100, tile_q=2, tile_k=2, step=0), "T"),
    (dict(T=8, tile_q=0, tile_k=2, step=0), "tile_q"),
    (dict(T=8, tile_q=2, tile_k=2, step=99), "step"),
    (dict(T=8, offset=-1, tile_q=2, tile_k=2, step=0), "offset"),
])
def test_impossible_settings_are_refused_by_name(kwargs, arg):
    with raises(BadValue, arg):
        tile_step(**kwargs)


def test_the_widget_follows_its_sliders():
    w = TileStepper(12, tile_q=4, tile_k=4)
    assert w.state.step == 0 and w.step.max == w.state.steps - 1 == 5
    w.step.value = 5
    assert w.state.step == 5 and w.state.count("todo") == 0
    w.tile_k.value = 2  # more key tiles: more steps; the step slider keeps its place
    assert w.step.max == w.state.steps - 1 and w.state.steps > 6
    w.offset.value = 4
    assert len(w.state.grid[0]) == 16 and "<table" in w.output.value
    assert w.error == ""
