"""The decode benchmark's runs by name, its goals, and its printed report (``python -m ar_lab.bench
decode``: ``ar_lab.bench.decode`` measures, this module says what the measurements mean)."""

from __future__ import annotations

from ar_lab.bench.table import format_table

CACHED, COMPILED, FORWARD, UNCACHED, PEER, FLOOR, READS = (
    "ar_lab cached",
    "ar_lab cached, compiled",
    "ar_lab cached, forward()",
    "ar_lab uncached",
    "transformers generate",
    "weights only (floor)",
    "weights + KV cache reads (floor)",
)
FLOORS = (FLOOR, READS)  # runs that produce no tokens
TARGET_VS_TRANSFORMERS = 3.0  # ar_lab's tokens/s over transformers', the course's goal
TARGET_OVER_FLOOR = 1.5  # the compiled step's time per token over the weights-only floor's, at most


def format_decode_results(res: dict) -> str:
    """The printed table: medians per run, then the key ratios."""
    N = res["new_tokens"]
    rows = []
    for name, run in res["runs"].items():
        rows.append(
            [
                name,
                f"{run['positions']:,}" if "positions" in run else "-",
                f"{run['median_s']:.3f}",
                f"{run['median_cpu_s']:.3f}",
                f"{run['tokens_per_s']:,.0f}",
                f"{1000 * run['median_s'] / N:.2f}",
                f"{len(run['seconds'])}",
            ]
        )
    headers = ["run", "positions", "median s", "median CPU s", "tokens/s", "ms/token", "repeats"]
    r, m = res["ratios"], res["machine"]
    lines = [
        f"decode: batch 1, greedy, {res['prompt_tokens']}-token prompt + {N:,} new tokens; "
        f"model {res['model']['source']} ({res['model']['parameters'] / 1e6:.2f} M parameters); "
        f"{res['threads']} thread{'s' if res['threads'] != 1 else ''}; "
        f"torch {m['versions']['torch']} on {m['device']['name']}",
        "",
        format_table(headers, rows),
        "",
    ]
    if r["cached_vs_uncached"] is not None:
        lines.append(
            f"KV cache: {r['cached_vs_uncached']:.1f}x faster than recomputing "
            f"(CPU time {r['cached_vs_uncached_cpu']:.1f}x) "
            f"while processing {r['positions_uncached_vs_cached']:.0f}x fewer positions"
        )
    if r["ar_lab_vs_transformers"] is not None:
        lines.append(
            f"ar_lab (lean step) vs transformers generate: {r['ar_lab_vs_transformers']:.2f}x the "
            f"tokens/s (CPU time {r['ar_lab_vs_transformers_cpu']:.2f}x); identical tokens"
        )
    lines += _compiled_lines(res)
    if r.get("lean_vs_forward") is not None:
        lines.append(
            f"lean decode step (ar_lab.engine.lean) vs the same steps through GPT.forward(): "
            f"{r['lean_vs_forward']:.2f}x the tokens/s"
        )
    if "overhead_transformers_vs_ar_lab" in r:
        over = r["overhead_ms_per_token"]
        lines.append(
            f"above the weights-only floor ({r['floor_ms_per_token']:.2f} ms/token, paid by "
            f"both): ar_lab adds {over[CACHED]:.2f} ms/token, transformers {over[PEER]:.2f} ("
            f"{r['overhead_transformers_vs_ar_lab']:.1f}x)"
        )
    return "\n".join(lines)


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def _compiled_lines(res: dict) -> list[str]:
    """The goals: ar_lab's best step (compiled where it ran, else the lean one) against
    transformers, and the compiled step against the weights-only floor."""
    r, lines = res["ratios"], []
    best = "compiled" if r.get("compiled_vs_lean") is not None else "lean"
    vs_peer = r["compiled_vs_transformers"] if best == "compiled" else r["ar_lab_vs_transformers"]
    if best == "compiled":
        lines.append(
            f"compiled step (torch.compile, ar_lab.engine.compiled): {r['compiled_vs_lean']:.2f}x "
            "the lean step's tokens/s; identical tokens"
        )
    if vs_peer is not None:
        target = res["target_ar_lab_vs_transformers"]
        lines.append(
            f"ar_lab's {best} step vs transformers generate: {vs_peer:.2f}x the tokens/s; target "
            f"{target:.0f}x {_verdict(vs_peer >= target)}"
        )
    if "compiled_over_floor" in r:
        goal = res["target_compiled_over_floor"]
        lines.append(
            f"compiled step's time per token: {r['compiled_over_floor']:.2f}x the weights-only "
            f"floor's; goal <= {goal}x {_verdict(r['compiled_over_floor'] <= goal)}"
        )
    if "compiled_over_reads_floor" in r:
        kv, weights = res["kv_bytes_per_step"], res["weight_bytes"]
        above = 1000 * (res["runs"][COMPILED]["median_s"] - res["runs"][READS]["median_s"])
        lines.append(
            f"the weights-only floor leaves out the KV cache a step reads: {kv / 1e6:.2f} MB a "
            f"step on average here, {kv / weights:.0%} of the weights' {weights / 1e6:.1f} MB. "
            f"With those reads by the step's own attention kernel the floor is "
            f"{r['reads_floor_ms_per_token']:.2f} ms/token, and the compiled step "
            f"{r['compiled_over_reads_floor']:.2f}x it; the rest, "
            f"{above / res['new_tokens']:.2f} ms/token, is the work between those kernels "
            "(norms, residual adds, the activation, picking the token, guards)"
        )
    if r.get("goal_ms_per_token"):
        lines += _goal_lines(res)
    return lines


def _goal_lines(res: dict) -> list[str]:
    """Each goal as a time per token, against what the step's reads alone take: a goal below the
    floor with the cache's reads is out of reach of any step on this machine at this length."""
    r = res["ratios"]
    reads, lines = r["reads_floor_ms_per_token"], []
    names = {
        "vs_transformers": f"{res['target_ar_lab_vs_transformers']:.0f}x transformers' tokens/s",
        "over_floor": f"{res['target_compiled_over_floor']}x the weights-only floor",
    }
    for key, ms in r.get("goal_ms_per_token", {}).items():
        if ms < reads:
            where = (
                f"{reads - ms:.2f} ms below the floor with the cache's reads: no step that "
                "reads the weights and the cache reaches it here"
            )
        else:
            where = f"{ms - reads:.2f} ms/token above the floor with the cache's reads"
            if COMPILED in res["runs"]:
                spent = 1000 * (res["runs"][COMPILED]["median_s"] - res["runs"][READS]["median_s"])
                where += f", where the compiled step spends {spent / res['new_tokens']:.2f}"
        lines.append(f"goal {names[key]}: {ms:.2f} ms/token, {where}")
    return lines
