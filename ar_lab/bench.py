"""Benchmarks: ``python -m ar_lab.bench NAME``.

Each benchmark measures the things it compares side by side in one process, repeats
them, and prints medians with the *ratios* as the key figures: this machine (and a
learner's laptop) is shared and noisy, and a ratio measured in one run survives
that far better than an absolute time.

Benchmarks register themselves in ``BENCHMARKS`` (name -> (function, help)); each
function takes the parsed arguments and returns a dict of results (also written as
JSON with ``--json PATH``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def synchronize(device: torch.device | str | None = None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_call(fn: Callable[[], object], repeats: int = 5, warmup: int = 1, device=None) -> list[float]:
    """Wall-clock seconds of ``fn()`` for each of ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def format_table(headers: list[str], rows: list[list[object]]) -> str:
    """A plain-text table with right-aligned columns."""
    cells = [[str(h) for h in headers]] + [[f"{v:,.3g}" if isinstance(v, float) else str(v) for v in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def machine_info() -> dict:
    import platform

    info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version()}
    info["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return info


# name -> (function(args) -> dict, one-line help, function(parser) adding options)
BENCHMARKS: dict[str, tuple[Callable, str, Callable[[argparse.ArgumentParser], None]]] = {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ar_lab.bench", description="Side-by-side benchmarks.")
    sub = parser.add_subparsers(dest="name", required=True)
    for name, (_, help_text, add_options) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
        add_options(p)
    args = parser.parse_args(argv)
    fn = BENCHMARKS[args.name][0]
    results = fn(args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"results written to {args.json}")
    return 0


# --- benchmarks (each section owned by its chapter) ------------------------------

if __name__ == "__main__":
    sys.exit(main())
