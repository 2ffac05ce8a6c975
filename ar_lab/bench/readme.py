"""The README's figures, generated from what produced them, so they cannot drift.

Two tables of the README are written by this module and nowhere else:
- the benchmark table, from the JSON each benchmark wrote (``python -m ar_lab.bench NAME
  --json data/bench/NAME.json``; each file records its command, machine and date);
- the checkpoint table, from the training record stored inside each shipped checkpoint
  (its rows: ``ar_lab.bench.checkpoint_table``).

``python -m ar_lab.bench.readme`` rewrites both tables between their markers in README.md;
``--check`` only compares (exit status 1 and a diff when the README is stale). A test runs
the check, so a figure typed into either table by hand fails ``make test``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable
from pathlib import Path

from ar_lab.base.errors import BadValue
from ar_lab.bench.checkpoint_table import checkpoint_table
from ar_lab.bench.decode_report import CACHED, COMPILED, PEER
from ar_lab.bench.serving import serving_summary

# name -> what the benchmark compares (the table's second column)
COMPARES = {
    "decode": "1,000 greedy tokens, batch 1, on 1 thread and on all cores: ar_lab cached (lean "
    "step) vs the lean step compiled (`torch.compile`) vs the same steps through `GPT.forward()` "
    "vs uncached vs Hugging Face `transformers` `generate` (same weights, identical tokens "
    "asserted)",
    "roofline": "measured matmul peak and streaming bandwidth; prefill and decode of a "
    "random-init model read from main memory",
    "batched": "one decode step for B rows vs one batch-1 step of chapter 05's 100 M-parameter "
    "model (weights from main memory), through ar_lab's decoder (weights packed for a few rows) "
    "and through `GPT.forward()` (equal logits asserted)",
    "sampler": "one sampler step vs one cached (lean) decode step, batch 1",
    "constrained": "JSON records sampled at T = 1 from the course model, free vs under a grammar "
    "(a JSON object with fixed keys): valid share, time per step on equal steps, mean "
    "log-probability per token",
    "speculative": (
        "speculative vs plain cached decoding, γ = 1…8, greedy and T = 1, against theory"
    ),
    "selfspec": "greedy speculative decoding where the step is memory-bound: the course model "
    "widened 5x (same text, 80 M dense weights streamed from memory) drafted by its own int4 "
    "copy, vs plain decoding; the verify pass alone in decode steps, weights packed for a few "
    "rows vs (in, out) copies",
    "lookup": "greedy decoding with prompt lookup (no draft model) vs the draft checkpoint vs "
    "plain, on prompts that repeat their context and on fresh text; ar_lab's lookup vs "
    "`transformers`' `prompt_lookup_num_tokens` (same weights, identical tokens asserted)",
    "serving": "continuous vs static batching on a mixed workload; tokens/s vs batch size; "
    "prefix cache; chunked prefill's inter-token gaps",
    "paged": "KV memory in contiguous max-length slots vs paged blocks on a mixed workload "
    "(identical tokens asserted): memory reserved vs used, requests at once in a fixed budget, "
    "the cost per step of the bookkeeping and gather; Llama-3-8B on an 80 GB GPU",
    "quant": "fp32 vs bf16 vs int8 vs int4 weights, batch-1 cached decode of the course model "
    "and of a random-init model that streams from main memory, against the roofline's bytes "
    "ratio; quality of each; an int8 KV cache",
}
BENCH_START = (
    "<!-- benchmark table: written by `python -m ar_lab.bench.readme` from data/bench/*.json -->"
)
BENCH_END = "<!-- end of benchmark table -->"
CHECKPOINT_START = (
    "<!-- checkpoint table: written by `python -m ar_lab.bench.readme` from the checkpoints -->"
)
CHECKPOINT_END = "<!-- end of checkpoint table -->"


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _decode(res: dict) -> str:
    settings = res["settings"] if "settings" in res else [res]
    one = min(settings, key=lambda s: s["threads"])
    most = max(settings, key=lambda s: s["threads"])
    r1, rm = one["ratios"], most["ratios"]
    n = one["new_tokens"]
    ms = {k: 1000 * v["median_s"] / n for k, v in one["runs"].items()}
    over = r1["overhead_ms_per_token"]
    target, goal = one["target_ar_lab_vs_transformers"], one["target_compiled_over_floor"]
    return (
        f"cache {r1['cached_vs_uncached']:.0f}× faster than recomputing (for "
        f"{r1['positions_uncached_vs_cached']:.0f}× fewer positions); the lean step "
        f"{r1['lean_vs_forward']:.2f}× the tokens/s of `forward()`, compiled "
        f"{r1['compiled_vs_lean']:.2f}× the lean step's; on one thread ar_lab compiled **"
        f"{r1['compiled_vs_transformers']:.2f}×** the tokens/s of `transformers` (target "
        f"{target:.0f}× {_met(r1['compiled_vs_transformers'] >= target)}; "
        f"{rm['compiled_vs_transformers']:.2f}× on {most['threads']} threads), the lean step "
        f"{r1['ar_lab_vs_transformers']:.2f}×. Per token: compiled {ms[COMPILED]:.2f} ms, lean "
        f"{ms[CACHED]:.2f}, `transformers` {ms[PEER]:.2f}, reading the weights alone "
        f"{r1['floor_ms_per_token']:.2f} (compiled {r1['compiled_over_floor']:.2f}× that floor, "
        f"goal ≤ {goal}× {_met(r1['compiled_over_floor'] <= goal)}; above it the lean step "
        f"spends {over[CACHED]:.2f} ms, compiled {over[COMPILED]:.2f}, `transformers` "
        f"{over[PEER]:.2f})" + _reads(one)
    )


def _reads(res: dict) -> str:
    """Why the compiled step is above the weights-only floor: the floor with the KV cache's reads
    (absent from a JSON measured before it was)."""
    r = res["ratios"]
    return "" if "compiled_over_reads_floor" not in r else (
        f". That floor leaves out the KV cache each step reads "
        f"({res['kv_bytes_per_step'] / res['weight_bytes']:.0%} of the weights' bytes on average "
        f"over the {res['new_tokens']:,} tokens): with those reads, by the step's own attention "
        f"kernel, the floor is {r['reads_floor_ms_per_token']:.2f} ms and compiled "
        f"{r['compiled_over_reads_floor']:.2f}× it" + _goals(res)
    )


def _goals(res: dict) -> str:
    """The goals as times per token, placed against the floor with the cache's reads."""
    goals, reads = res["ratios"].get("goal_ms_per_token", {}), res["ratios"].get(
        "reads_floor_ms_per_token"
    )
    names = {
        "vs_transformers": f"{res['target_ar_lab_vs_transformers']:.0f}× `transformers`",
        "over_floor": f"{res['target_compiled_over_floor']}× the weights-only floor",
    }
    said = [
        f"{names[k]} allows {ms:.2f} ms, "
        + ("below that floor: out of reach here" if ms < reads else f"{ms - reads:.2f} ms above it")
        for k, ms in goals.items()
    ]
    return "" if not said else ". As times per token, " + "; ".join(said)


def _roofline(res: dict) -> str:
    key, k = res["bandwidth_fraction"], res["key_figures"]
    return (
        f"batch-1 decode of a {res['model']['parameters'] / 1e6:.0f} M-parameter model moves "
        f"bytes at {key['fraction']:.0%} of the measured streaming bandwidth ({key['best']}, the "
        f"best of {' and '.join(key['by_variant'])}); {k['prefill_tokens']}-token prefill "
        f"reaches {k['prefill_compute_fraction']:.0%} of the measured matmul peak; ridge ≈ "
        f"{res['ridge_point']:.0f} FLOP/byte"
    )


def _batched(res: dict) -> str:
    rows, goal = res["batches"], res["goal"]
    four = rows[str(goal["batch"])]
    return (
        f"a batch-{goal['batch']} step takes **{four['ar_lab']['x_batch_1']:.2f}×** a batch-1 step "
        f"through ar_lab's decoder (goal ≤ {goal['at_most_x_batch_1']}×, {_met(goal['met'])}), "
        f"{four['forward']['x_batch_1']:.2f}× through `GPT.forward()`; batches "
        f"{', '.join(rows)}: {_span([r['ar_lab']['x_batch_1'] for r in rows.values()], '.2f')}× "
        f"against {_span([r['forward']['x_batch_1'] for r in rows.values()], '.2f')}×"
    )


def _sampler(res: dict) -> str:
    s = {name: v["ratio_to_decode_step"] for name, v in res["samplers"].items()}
    top_p = next(v for name, v in s.items() if "top-p" in name)
    every = next(v for name, v in s.items() if name.startswith("all"))
    return (
        f"greedy {s['greedy']:.1%}, top-p {top_p:.0%}, all filters + penalty {every:.0%} of a "
        "decode step"
    )


def _constrained(res: dict) -> str:
    v, lp = res["valid_share"], res["mean_logprob"]
    return (
        f"valid records {v['free']:.0%} free, {v['constrained']:.0%} constrained; a constrained "
        f"step takes **{res['mask_cost_ratio']:.2f}×** the time of a free one; mean "
        f"log-prob/token {lp['constrained']:.2f} nats constrained vs {lp['free']:.2f} free (the "
        f"model's top token refused at {res['top_refused_share']:.0%} of constrained steps)"
    )


def _span(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{lo:{fmt}}–{hi:{fmt}}"


def _speculative(res: dict) -> str:
    greedy, sampled = res["modes"]["greedy"], res["modes"].get("T=1")
    b = res["greedy_best"]
    rows = {int(k): v for k, v in greedy["gammas"].items()}  # JSON keys are strings
    g = int(b["gamma"])
    others = [rows[k]["speedup"] for k in rows if k != g and k >= 2]
    text = (
        f"greedy: α ≈ {rows[g]['alpha']:.2f}, c = {greedy['cost_ratio_c']:.2f}, **"
        f"{b['speedup']:.2f}× faster at γ = {g}** (target "
        f"{res['targets']['greedy_speedup_at_best_gamma']}× {_met(b['speedup_target_met'])}; "
        f"{_span(others, '.2f')}× at the other γ ≥ 2)"
    )
    if sampled is not None:
        sg = int(sampled["best_gamma_measured"])
        srow = {int(k): v for k, v in sampled["gammas"].items()}[sg]
        text += f"; T = 1: α ≈ {srow['alpha']:.2f}, {srow['speedup']:.2f}× at γ = {sg}"
    ratio = [r["measured_over_predicted"] for r in rows.values()]
    verify = [r["verify_cost"] for r in rows.values()]
    held = [r["speedup"] / r["predicted_verify_measured"] for r in rows.values()]
    tol = res["targets"]["within_of_prediction"]
    return text + (
        f". Measured/predicted {_span(ratio, '.2f')} with the paper's formula, which "
        "counts the verifying pass as one "
        f"decode step; here it costs {_span(verify, '.2f')} steps (γ + 1 rows through "
        "small matrix products): with "
        f"the measured verify cost the prediction holds to {_span(held, '.2f')} "
        f'(target "within {tol:.0%} of the '
        f"paper's formula\" at the best γ {_met(b['prediction_target_met'])})"
    )


def _lookup(res: dict) -> str:
    parts = []
    for kind, k in res["kinds"].items():
        text = (
            f"{kind}: lookup α {k['alpha']:.2f}, {k['tokens_per_target_call']:.2f} tokens per "
            f"target call, **{k['lookup_speedup']:.2f}×** plain (draft model "
            f"{k['draft_speedup']:.2f}×)"
        )
        if "ar_lab_vs_transformers_lookup" in k:
            text += (
                f"; transformers' lookup {k['transformers_lookup_speedup']:.2f}× its plain, "
                f"ar_lab's lookup {k['ar_lab_vs_transformers_lookup']:.2f}× its tokens/s"
            )
        parts.append(text)
    return "; ".join(parts)


def _paged(res: dict) -> str:
    runs, s = res["runs"], res["scale_up"]
    c, p = runs["contiguous"], runs["paged"]
    cb, pb = runs["contiguous, fixed budget"], runs["paged, fixed budget"]
    return (
        f"blocks of {res['block_size']}: reserved / used: contiguous **"
        f"{c['mean_reserved'] / c['mean_used']:.1f}×**, paged **"
        f"{p['mean_reserved'] / p['mean_used']:.2f}×**; in {res['budget_slots']} slots' memory, "
        f"{pb['mean_rows']:.1f} rows per step paged vs {cb['mean_rows']:.1f}; paged "
        f"{res['paged_vs_contiguous_tokens_per_s']:.2f}× the tokens/s with the same slots "
        f"(bookkeeping and gather); {s['model']}: {s['paged_fit']} vs {s['contiguous_fit']} "
        f"requests at once ({s['gain']:.1f}×)"
    )


def _calibrated(rows: dict) -> str:
    """int4 by AWQ and GPTQ, where the results hold them (measured since 2026-12-07)."""
    return "".join(f", {rows[w]['bits_per_byte']:.3f} ({w}: {rows[w]['recovered_of_int4_loss']:.0%}"
                   " of int4's loss recovered)" for w in ("int4 awq", "int4 gptq") if w in rows)


def _extras(res: dict) -> str:
    """The modern model's int4 and the floating-point formats' bits/byte, where the results hold
    them (measured since 2026-12-07)."""
    m = next((m["rows"] for m in res["models"] if m["label"].startswith("modern")), None)
    bpb = {} if m is None else {k: f"{m[k]['bits_per_byte']:.3f}" for k in ("fp32", "int4")}
    modern = (f" Modern model: bits/byte {bpb['fp32']} (fp32), {bpb['int4']} (int4)"
              f"{_calibrated(m)}." if bpb else "")
    listed = ", ".join(f"{name} {r['bits_per_byte']:.3f} ({r['bits_per_weight']:.2f} bits/weight)"
                       for name, r in res.get("formats", {}).items())
    return modern + (f" Rounded to each format (quality only): {listed}." if listed else "")


def _quant(res: dict) -> str:
    large = res["models"][-1]
    course = next(m for m in res["models"] if "bits_per_byte" in m["rows"]["fp32"])
    speeds = ", ".join(
        f"{w} **{r['speedup']:.2f}×** (predicted {r['predicted_speedup']:.1f}×)"
        for w, r in large["rows"].items()
        if w != "fp32"
    )
    ratios = [r["measured_vs_predicted"] for w, r in large["rows"].items() if w != "fp32"]
    q = course["rows"]
    kv = res["kv_cache"]
    ev = res.get("quality", {})
    on = (
        f" ({ev['bpb_protocol']}, the course's evaluation protocol)"
        if ev.get("bpb_protocol")
        else ""
    )
    return (
        f"{large['parameters'] / 1e6:.0f} M-parameter model, tokens/s over fp32: {speeds}: "
        f"measured/predicted {_span(ratios, '.2f')}. Course model: bits/byte{on} "
        f"{q['fp32']['bits_per_byte']:.3f} (fp32), {q['int8']['bits_per_byte']:.3f} (int8), "
        f"{q['int4']['bits_per_byte']:.3f} (int4){_calibrated(q)}; top-1 agreement with fp32 "
        f"{q['int8']['greedy_top1']:.3f} (int8), {q['int4']['greedy_top1']:.3f} (int4); as "
        f"fp32's draft, greedy acceptance {q['int8']['acceptance_greedy']:.2f} (int8), "
        f"{q['int4']['acceptance_greedy']:.2f} (int4).{_extras(res)} int8 KV cache: "
        f"{kv['nbytes']['int8'] / kv['nbytes']['fp32']:.0%} of the fp32 cache's bytes"
    )


def _selfspec(res: dict) -> str:
    greedy, b = res["modes"]["greedy"], res["greedy_best"]
    rows = {int(k): v for k, v in greedy["gammas"].items()}
    g = int(b["gamma"])
    verify = {int(t): v for t, v in res["verify_pass"]["rows"].items()}
    t = g + 1 if g + 1 in verify else max(verify)
    return (
        f"α ≈ {rows[g]['alpha']:.2f}, c = {greedy['cost_ratio_c']:.2f}: **{b['speedup']:.2f}× "
        f"faster at γ = {g}** (target {res['targets']['greedy_speedup_at_best_gamma']}× "
        f"{_met(b['speedup_target_met'])}; {_span([r['speedup'] for r in rows.values()], '.2f')}"
        f"× over γ = {_span(list(rows), 'd')}); predicted {b['predicted_verify_measured']:.2f}× "
        f"with the measured verify cost, {b['predicted']:.2f}× with the paper's one step. The "
        f"verify pass over {t} positions costs {verify[t]['packed']:.2f} decode steps on packed "
        f"weights, {verify[t]['(in, out)']:.2f} on (in, out) copies (reading the weights once: 1)"
    )


ROWS: dict[str, Callable[[dict], str]] = {
    "decode": _decode,
    "roofline": _roofline,
    "batched": _batched,
    "sampler": _sampler,
    "constrained": _constrained,
    "speculative": _speculative,
    "selfspec": _selfspec,
    "lookup": _lookup,
    "serving": serving_summary,
    "paged": _paged,
    "quant": _quant,
}


def _machine(res: dict) -> dict:
    return res["settings"][0]["machine"] if "settings" in res else res["machine"]


def bench_table(folder: Path) -> str:
    """The README's benchmark table from ``folder/NAME.json`` for every benchmark in ``ROWS``."""
    results = {}
    for name in ROWS:
        path = folder / f"{name}.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: run python -m ar_lab.bench {name} --json {path}"
            )
        results[name] = json.loads(path.read_text())
    described = [_machine(r) for r in results.values()]
    machines = {
        (m["device"]["name"], m["device"]["cpus"], m["versions"]["torch"]) for m in described
    }
    dates = sorted(m["date"][:10] for m in described)
    where = "; ".join(f"{n} ({cpus} cores), torch {t}" for n, cpus, t in sorted(machines))
    when = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    loads = [m["device"].get("load_1min") for m in described]
    loads = [x for x in loads if x is not None]
    cores = min(cpus for _, cpus, _ in machines)
    busy = (
        f" Load average (1 min) recorded with the results: {_span(loads, '.1f')}"
        + (
            f"; above {cores}, they shared the cores with other jobs."
            if max(loads) > cores
            else "."
        )
        if loads
        else ""
    )
    lines = [
        f"Measured on {where}, {when}; the command of each row wrote `data/bench/NAME.json`.{busy}",
        "",
        "| command | what it compares | measured |",
        "|---|---|---|",
    ]
    for name, row in ROWS.items():
        text = row(results[name])
        if name not in ("decode", "roofline"):  # those two say their thread counts themselves
            threads = _machine(results[name])["device"]["threads"]
            text += f" ({threads} thread{'s' if threads != 1 else ''})"
        lines.append(f"| `python -m ar_lab.bench {name}` | {COMPARES[name]} | {text} |")
    return "\n".join(lines)


def _replace(text: str, start: str, end: str, body: str) -> str:
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise BadValue(
            f"the README (readme) must hold the markers {start!r} and {end!r} once each, in that "
            "order",
            arg="readme",
        )
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{body}\n{end}{tail}"


def render(readme: str, root: Path) -> str:
    """``readme`` with both generated tables rewritten from ``root``'s data folder."""
    data = root / "data"
    text = _replace(readme, BENCH_START, BENCH_END, bench_table(data / "bench"))
    checkpoints = [data / f"{name}.safetensors" for name in ("course", "modern", "draft")]
    return _replace(text, CHECKPOINT_START, CHECKPOINT_END, checkpoint_table(checkpoints))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ar_lab.bench.readme", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--readme", type=Path, default=Path("README.md"), help="the README to write (README.md)"
    )
    parser.add_argument(
        "--check", action="store_true", help="only compare; exit 1 with a diff if it is stale"
    )
    args = parser.parse_args(argv)
    try:
        old = args.readme.read_text()
        new = render(old, args.readme.resolve().parent)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    if args.check:
        if old != new:
            diff = difflib.unified_diff(
                old.splitlines(True), new.splitlines(True), "README", "generated"
            )
            sys.stdout.writelines(diff)
            return 1
        return 0
    args.readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
