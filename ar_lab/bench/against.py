"""This tree's batch-1 decode against another checkout's, in alternating processes.

``python -m ar_lab.bench against --checkout PATH`` times the lean decode step (``generate`` with the
KV cache, greedy, ``--tokens`` tokens, one thread) of the ``ar_lab`` in this tree and of the one in
``PATH`` (e.g. ``git worktree add /tmp/old HEAD~3``), each in a fresh Python process, the two taking
turns ``--rounds`` times so that whatever else the machine does falls on both. Each side is timed by
the CPU time of its one thread, the wall time kept beside (on the shared 2-core virtual machine this
was written on, the two agreed, and both moved by up to 2x between consecutive runs: take the ratio
over many rounds, and more than one run, before reading a few percent into it). It reports each
side's median seconds per token and the median of the per-round ratios, and checks that both gave
the same tokens. A refactor of the engine is measured this way before it lands.

``--instructions``: instead of time, the instructions one decode step executes, counted by
valgrind's callgrind (which must be installed): each side generates ``SHORT`` and then ``--tokens``
tokens under it, and the difference over the extra tokens is one step's count, the start-up and the
prompt cancelling. A count does not move with the machine's load, so a few percent are visible in
one run; it weighs an instruction alike whatever it waits for, so it sees the Python and dispatch
work around the products (what a refactor changes), not the weights' memory traffic (the same on
both sides).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadValue
from ar_lab.base.timing import machine, median
from ar_lab.bench.table import format_table

# The measuring process: imports whichever ar_lab its sys.path finds first, decodes, prints JSON.
_SIDE = """
import json, sys, time, torch
torch.set_num_threads(1)
import ar_lab
model = ar_lab.load_pretrained("course", device="cpu")
prompt, n = sys.argv[1], int(sys.argv[2])
ar_lab.generate(model, prompt, 20, eos_id=None)  # warm-up
t0, c0 = time.perf_counter(), time.process_time()
out = ar_lab.generate(model, prompt, n, eos_id=None)
seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({"s_per_token": cpu / n, "wall_s_per_token": seconds / n, "tokens": out.tokens,
                  "package": ar_lab.__file__}))
"""


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkout", type=Path, required=True,
                   help="the other checkout's root (the folder holding its ar_lab/ and data/)")
    p.add_argument(
        "--tokens", type=int, default=500, help="new tokens per generation (default 500)"
    )
    p.add_argument("--rounds", type=int, default=7, help="turns each side takes (default 7)")
    p.add_argument("--prompt", default="Python ", help="prompt text (default 'Python ')")
    p.add_argument(
        "--instructions",
        action="store_true",
        help="count each side's instructions per decode step with valgrind's callgrind, not time",
    )


SHORT = 20  # tokens of the shorter run whose count --instructions subtracts


def _instructions(root: Path, prompt: str, tokens: int) -> int:
    """Instructions a run of ``_SIDE`` for ``tokens`` new tokens executes in the side at ``root``
    (callgrind)."""
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out",
                               sys.executable, "-c", _SIDE, prompt, str(tokens)],
                              env=env, cwd=root, capture_output=True, text=True, check=False)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"the side in {root} failed under callgrind:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def instructions_benchmark(other: Path, *, tokens: int, prompt: str, say=print) -> dict:
    """Instructions per decode step of each side: (count at ``tokens`` - count at ``SHORT``) / the
    difference."""
    if shutil.which("valgrind") is None:
        raise BadValue(
            "--instructions needs valgrind (e.g. apt-get install valgrind)", arg="instructions"
        )
    if tokens <= SHORT:
        raise BadValue(f"--instructions needs --tokens above {SHORT}, got {tokens}", arg="tokens")
    here = Path(__file__).resolve().parents[2]
    per_step = {}
    for name, root in (("this tree", here), ("other", other)):
        counts = [_instructions(root, prompt, n) for n in (SHORT, tokens)]
        per_step[name] = (counts[1] - counts[0]) / (tokens - SHORT)
        say(f"{name}: {per_step[name]:,.0f} instructions per decode step")
    return {
        "benchmark": "against",
        "other": str(other),
        "tokens": tokens,
        "counter": "valgrind callgrind, instructions (Ir) of the whole process, 1 thread, "
        "PYTHONHASHSEED=0",
        "instructions_per_step": per_step,
        "this_over_other_instructions": per_step["this tree"] / per_step["other"],
        "machine": machine(),
    }


def _side(root: Path, prompt: str, tokens: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _SIDE, prompt, str(tokens)], env=env, cwd=root,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the side in {root} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def against_benchmark(other: Path, *, tokens: int, rounds: int, prompt: str, say=print) -> dict:
    """Both sides ``rounds`` times in turns (this tree first in odd rounds, the other first in even
    ones)."""
    here = Path(__file__).resolve().parents[2]
    times: dict[str, list[float]] = {"this tree": [], "other": []}
    wall: dict[str, list[float]] = {"this tree": [], "other": []}
    tokens_seen: dict[str, list[int]] = {}
    for r in range(rounds):
        order = [("this tree", here), ("other", other)]
        for name, root in order if r % 2 == 0 else order[::-1]:
            got = _side(root, prompt, tokens)
            times[name].append(got["s_per_token"])
            wall[name].append(got["wall_s_per_token"])
            tokens_seen[name] = got["tokens"]
        say(f"round {r + 1}/{rounds}: this tree {times['this tree'][-1] * 1e3:.3f} ms/token, "
            f"other {times['other'][-1] * 1e3:.3f} ms/token")
    ratios = [a / b for a, b in zip(times["this tree"], times["other"], strict=True)]
    return {
        "benchmark": "against",
        "other": str(other),
        "tokens": tokens,
        "rounds": rounds,
        "threads": 1,
        "s_per_token": {k: median(v) for k, v in times.items()},
        "runs": times,
        "wall_runs": wall,
        "clock": "CPU time of the side's process (one thread)",
        "this_over_other_median_ratio": median(ratios),
        "same_tokens": tokens_seen["this tree"] == tokens_seen["other"],
        "machine": machine(),
    }


def format_against(res: dict) -> str:
    if "instructions_per_step" in res:
        rows = [[name, f"{n:,.0f}"] for name, n in res["instructions_per_step"].items()]
        table = format_table(["side", "instructions per decode step (callgrind)"], rows)
        return f"{table}\nthis tree / other: {res['this_over_other_instructions']:.3f}"
    rows = [[name, f"{s * 1e3:.3f}"] for name, s in res["s_per_token"].items()]
    table = format_table(["side", "ms per token (median, CPU time)"], rows)
    return (
        f"{table}\nthis tree / other, median of the per-round ratios: "
        f"{res['this_over_other_median_ratio']:.3f} ({res['rounds']} rounds of {res['tokens']} "
        f"tokens, 1 thread); same tokens: {res['same_tokens']}"
    )


def run(args: argparse.Namespace) -> dict:
    positive_int("tokens", args.tokens)
    positive_int("rounds", args.rounds)
    other = args.checkout.resolve()
    if (
        not (other / "ar_lab" / "__init__.py").is_file()
        or not (other / "data" / "course.safetensors").exists()
    ):
        raise BadValue(
            f"--checkout {other} is not an ar_lab checkout with its data/course.safetensors",
            arg="checkout",
        )
    if getattr(args, "instructions", False):
        res = instructions_benchmark(other, tokens=args.tokens, prompt=args.prompt)
    else:
        res = against_benchmark(other, tokens=args.tokens, rounds=args.rounds, prompt=args.prompt)
    print(format_against(res))
    return res
