"""Chapter 10's tile stepper: which query x key tiles tiled causal attention computes, one at a
time.

``tile_step`` is the pure function (the tests call it): for T queries at positions offset ..
offset + T - 1, tiles of ``tile_q`` x ``tile_k`` and a step number, the state of every (query, key)
cell of the score matrix, as ``ar_lab.model.tiled.tile_plan`` visits it (query tiles outer, key
tiles inner); ``tile_grid_html`` draws it. ``TileStepper`` is the thin ipywidgets shell over the
two.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadValue
from ar_lab.course.views.widgets import refuse
from ar_lab.model.tiled import tile_plan

MAX_T = 64  # a grid a screen shows
COLORS = {
    "done": "#a9cce3",  # computed at an earlier step
    "now": "#2471a3",  # the tile of this step
    "masked": "#f5b7b1",  # inside a visited tile, later than the query: set to -inf
    "todo": "#eaeded",  # to be computed at a later step
    "skipped": "#ffffff",  # in a tile wholly above the diagonal: never computed
}


@dataclass(frozen=True)
class TileStep:
    grid: list[list[str]]  # (T, offset + T) cell states, keys of COLORS
    step: int  # 0 .. steps - 1
    steps: int  # key tiles visited in all
    text: str  # what this step does, in a sentence

    def count(self, state: str) -> int:
        return sum(row.count(state) for row in self.grid)


def _visits(T: int, offset: int, tile_q: int, tile_k: int) -> list[tuple[int, int, int, int, bool]]:
    return [(i0, i1, j0, j1, masked)
            for i0, i1, keys in tile_plan(T, offset=offset, tile_q=tile_q, tile_k=tile_k)
            for j0, j1, masked in keys]


def tile_step(T: int, *, offset: int = 0, tile_q: int, tile_k: int, step: int) -> TileStep:
    """The score matrix's cells at ``step`` (0-based) of tiled causal attention over T queries at
    positions offset .. offset + T - 1 and offset + T keys."""
    T = positive_int("T", T)
    if T > MAX_T:
        raise BadValue(f"T must be at most {MAX_T} to draw, got {T}", arg="T")
    offset = positive_int("offset", offset, minimum=0)
    if offset > MAX_T:
        raise BadValue(f"offset must be at most {MAX_T} to draw, got {offset}", arg="offset")
    visits = _visits(T, offset, positive_int("tile_q", tile_q), positive_int("tile_k", tile_k))
    step = positive_int("step", step, minimum=0)
    if step >= len(visits):
        raise BadValue(
            f"step must be below {len(visits)} (the tiles visited), got {step}", arg="step"
        )
    grid = [["skipped"] * (offset + T) for _ in range(T)]
    for n, (i0, i1, j0, j1, _) in enumerate(visits):
        state = "done" if n < step else "now" if n == step else "todo"
        for i in range(i0, i1):
            for j in range(j0, j1):
                grid[i][j] = "masked" if j > offset + i and n <= step else state
    i0, i1, j0, j1, masked = visits[step]
    how = ("it crosses the diagonal: keys later than a query are masked" if masked
           else "wholly below the diagonal: no mask")
    text = (f"Step {step + 1} of {len(visits)}: queries {i0}–{i1 - 1} (positions {offset + i0}–"
            f"{offset + i1 - 1}) × keys {j0}–{j1 - 1}; {how}. The running max, sum and output of "
            f"these {i1 - i0} rows are rescaled and updated.")
    return TileStep(grid, step, len(visits), text)


def tile_grid_html(state: TileStep, cell: int = 9) -> str:
    """The grid as an HTML table of coloured cells (rows: queries, columns: keys), a legend and the
    step's sentence."""
    rows = "".join(
        "<tr>" + "".join(f"<td title='{s}' style='width:{cell}px;height:{cell}px;padding:0;"
                         f"background:{COLORS[s]};border:1px solid #d5d8dc'></td>" for s in row)
        + "</tr>" for row in state.grid)
    legend = " ".join(f"<span style='background:{c};border:1px solid #999;padding:0 6px'></span> "
                      f"{name}" for name, c in COLORS.items())
    never = state.count("skipped")
    cells = len(state.grid) * len(state.grid[0])
    summary = f"{never} of {cells} scores ({never / cells:.0%}) are never computed."
    return (f"<div>{html.escape(state.text)}</div><table style='border-collapse:collapse;"
            f"margin:6px 0'>{rows}</table><div>{legend}</div><div>{summary}</div>")


class TileStepper:
    """Sliders for T, the offset, the tile sizes and the step over ``tile_step``; ``state`` holds
    the last result (None after a refused setting, with ``error`` saying why)."""

    def __init__(self, T: int = 16, *, offset: int = 0, tile_q: int = 4, tile_k: int = 4) -> None:
        import ipywidgets as W

        self.T = W.IntSlider(T, min=1, max=MAX_T, description="T")
        self.offset = W.IntSlider(offset, min=0, max=MAX_T, description="offset")
        self.tile_q = W.IntSlider(tile_q, min=1, max=MAX_T, description="tile_q")
        self.tile_k = W.IntSlider(tile_k, min=1, max=MAX_T, description="tile_k")
        self.step = W.IntSlider(0, min=0, max=0, description="step")
        self.output = W.HTML()
        self.state: TileStep | None = None
        self.error, self.refused = "", None
        for control in (self.T, self.offset, self.tile_q, self.tile_k):
            control.observe(lambda _change: self._reshaped(), names="value")
        self.step.observe(lambda _change: self.update(), names="value")
        controls = W.VBox([self.T, self.offset, self.tile_q, self.tile_k, self.step])
        self.widget = W.HBox([controls, self.output])
        self._reshaped()

    def _reshaped(self) -> None:
        steps = len(_visits(self.T.value, self.offset.value, self.tile_q.value, self.tile_k.value))
        self.step.max = max(steps - 1, 0)  # (the slider clamps its value into range)
        self.update()

    def update(self) -> None:
        try:
            self.state = tile_step(self.T.value, offset=self.offset.value, tile_q=self.tile_q.value,
                                   tile_k=self.tile_k.value, step=self.step.value)
        except ValueError as e:
            self.state = None
            self.output.value = refuse(self, e)
            return
        self.error, self.refused = "", None
        self.output.value = tile_grid_html(self.state)

    def _repr_mimebundle_(self, **kwargs):  # shows its widget when left last in a cell
        return self.widget._repr_mimebundle_(**kwargs)
