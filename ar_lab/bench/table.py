"""Plain-text output shared by the benchmarks: a right-aligned table."""

from __future__ import annotations


def format_table(headers: list[str], rows: list[list[object]]) -> str:
    """A plain-text table with right-aligned columns (floats to 3 significant digits)."""
    cells = [[str(h) for h in headers]] + [
        [f"{v:,.3g}" if isinstance(v, float) else str(v) for v in r] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)

