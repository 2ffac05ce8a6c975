"""Chapter 07's benchmark: speculative vs plain decoding, measured against the theory.

For each sampler mode, prompt and gamma, a plain run and a speculative run of the same
prompt side by side; the measured speedup next to the prediction (Leviathan et al., 2023)
from the acceptance rate alpha and the cost ratio c measured in the same runs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadValue
from ar_lab.base.timing import interleaved, machine, steady_clock
from ar_lab.bench.common import checked_device, checkpoints, torch_threads
from ar_lab.bench.table import format_table

SPEEDUP_TARGET = 1.5  # greedy, at the best gamma
PREDICTION_TOLERANCE = 0.15  # measured / predicted within 1 +- this


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=200, help="new tokens per prompt (default 200)")
    p.add_argument(
        "--prompts", type=int, default=3, help="prompts from the validation text (default 3)"
    )
    p.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt (default 32)")
    p.add_argument(
        "--gammas",
        type=int,
        nargs="+",
        default=list(range(1, 9)),
        help="gamma values (default 1..8)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="interleaved timing repeats; the fastest run of each counts",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1, as batch-1 decode)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled runs (default 0)")
    p.add_argument(
        "--device",
        default="cpu",
        help="device for both checkpoints (default cpu; cuda where a GPU is present: there a "
        "verify pass of a few positions costs about one decode step, the regime the theory "
        "assumes)",
    )


def _checked_sizes(gammas, **sizes) -> list[int]:
    from ar_lab.engine.speculative import MAX_GAMMA

    gammas = list(range(1, 9)) if gammas is None else list(gammas)
    if not gammas or any(
        isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= MAX_GAMMA for g in gammas
    ):
        raise BadValue(
            f"gammas must be ints >= 1 (at most {MAX_GAMMA:,}), got {gammas!r}", arg="gammas"
        )
    for name, value in sizes.items():
        positive_int(name, value)
    return gammas


def _prompts(target, draft, n: int, length: int, tokens: int) -> list[list[int]]:
    """The ``n`` validation prompts, each checked to fit both models' windows with ``tokens`` new
    tokens."""
    from ar_lab.engine.prompts import checked_prompt
    from ar_lab.model.data import benchmark_prompts

    prompts = benchmark_prompts(n, length)
    for p in prompts:  # checked before anything runs, not when its turn comes
        checked_prompt(target, p, tokens)
        checked_prompt(draft, p, tokens)
    return prompts


def _plain_steps(
    target, draft, prompt: list[int], tokens: int, repeats: int, clock
) -> tuple[float, float]:
    """One plain greedy decode step of each model (fastest of ``repeats``, after one warm-up
    round)."""
    from ar_lab.engine.generate import generate

    def plain(model) -> Callable[[], object]:
        return lambda: generate(model, prompt, tokens, eos_id=None)

    times = interleaved(
        {"target": plain(target), "draft": plain(draft)},
        repeats,
        warmup=1,
        clock=clock,
        device=target.device,
    )
    return min(times["target"]) / tokens, min(times["draft"]) / tokens


def _paired_runs(
    target, draft, prompts, tokens, *, gammas, params, seed, repeats, clock, say, mode, iteration
):
    """Every speculative run right after a plain run of the same prompt; the fastest of each kept.

    Returns (fastest plain seconds per prompt, {(prompt index, gamma): (seconds, stats)}).
    """
    from ar_lab.engine.generate import generate
    from ar_lab.engine.speculative import speculative_generate

    def gen(s):
        return torch.Generator(target.device).manual_seed(s)

    say(f"{mode}: warm-up")
    generate(target, prompts[0], 8, sampling=params, generator=gen(seed), eos_id=None)
    speculative_generate(
        target,
        draft,
        prompts[0],
        8,
        gamma=max(gammas),
        sampling=params,
        generator=gen(seed),
        eos_id=None,
        iteration=iteration,
    )
    pairs = [(k, g) for k in range(len(prompts)) for g in gammas]
    outs: dict[tuple[int, int, str], list] = {
        (k, g, s): [] for k, g in pairs for s in ("plain", "spec")
    }

    def run(k: int, g: int, side: str) -> None:
        kw = {"sampling": params, "generator": gen(seed + k), "eos_id": None}
        if side == "plain":
            out = generate(target, prompts[k], tokens, **kw)
        else:
            out = speculative_generate(
                target, draft, prompts[k], tokens, gamma=g, clock=clock, iteration=iteration, **kw
            )
        outs[k, g, side].append(out)

    # Each round keeps this order (no rotation), so every speculative run follows the plain run it
    # is paired with.
    times = interleaved(
        {key: lambda key=key: run(*key) for key in outs},
        repeats,
        rotate=False,
        clock=clock,
        device=target.device,
        progress=lambda r: say(f"{mode}: repeat {r + 1}/{repeats}"),
    )
    # Load from other processes only ever adds time, so the minimum is the cleanest estimate
    # of the work itself. Runs with the same seed repeat the same tokens.
    plain_best = [float("inf")] * len(prompts)
    fastest: dict[tuple[int, int], tuple[float, object]] = {}
    for k, g in pairs:
        plain, spec = outs[k, g, "plain"], outs[k, g, "spec"]
        if params.greedy and any(a.tokens != b.tokens for a, b in zip(plain, spec, strict=True)):
            raise AssertionError(
                f"greedy speculative decoding (gamma {g}) differs from plain decoding"
            )
        plain_best[k] = min(plain_best[k], *times[k, g, "plain"])
        t = times[k, g, "spec"]
        i = t.index(min(t))  # the first of the fastest
        fastest[k, g] = (t[i], spec[i].stats)
    return plain_best, fastest


def _mode_summary(plain_best: list[float], fastest: dict, gammas: list[int], tokens: int) -> dict:
    """Per gamma: alpha, tokens per target call, verify cost, measured and predicted speedups."""
    from ar_lab.engine.speculative import (
        alpha_for_speedup,
        best_gamma,
        expected_speedup,
        expected_tokens_per_iteration,
    )

    n = len(plain_best)
    plain_s = sum(plain_best)
    # One target step: plain decoding's time per token. One draft step: the draft's mean
    # forward pass (with its pick) inside the speculative runs. c is their ratio.
    plain_step = plain_s / (tokens * n)
    all_runs = [s for _, s in fastest.values()]
    draft_in_runs = sum(s.draft_time for s in all_runs) / sum(s.draft_calls for s in all_runs)
    c = draft_in_runs / plain_step
    rows = {}
    for g in gammas:
        runs = [fastest[k, g][1] for k in range(n)]
        tested = sum(s.tested for s in runs)
        alpha = sum(s.acceptances for s in runs) / tested if tested else 0.0
        calls = sum(s.target_calls for s in runs)
        spec_s = sum(fastest[k, g][0] for k in range(n))
        measured, predicted = plain_s / spec_s, expected_speedup(alpha, g, c)
        # the target's side of an iteration (verify pass + picks) / one plain decode step
        verify = sum(s.target_time for s in runs) / calls / plain_step
        rows[g] = {
            "alpha": alpha,
            "tokens_per_target_call": sum(s.produced for s in runs) / calls,
            "expected_tokens_per_iteration": expected_tokens_per_iteration(alpha, g),
            "verify_cost": verify,
            "speedup": measured,
            "predicted_speedup": predicted,
            "measured_over_predicted": measured / predicted,
            # the same formula with the measured verify cost in place of one target step
            "predicted_verify_measured": expected_tokens_per_iteration(alpha, g) / (g * c + verify),
            "spec_s": spec_s,
        }
    best = max(gammas, key=lambda g: rows[g]["speedup"])
    # The acceptance rate a draft of this cost would need for 1.5x, with the verify costs measured
    # here.
    needs = {g: alpha_for_speedup(SPEEDUP_TARGET, g, c, rows[g]["verify_cost"]) for g in gammas}
    needs = {g: a for g, a in needs.items() if a is not None}
    need_g = min(needs, key=needs.get) if needs else None
    return {
        "plain_s": plain_s,
        "plain_step_s": plain_step,
        "draft_step_s": draft_in_runs,
        "cost_ratio_c": c,
        "gammas": rows,
        "best_gamma_measured": best,
        "best_gamma_theory": best_gamma(rows[best]["alpha"], c, max(gammas)),
        "alpha_needed_for_1.5x": None
        if need_g is None
        else {"alpha": needs[need_g], "gamma": need_g},
    }


def _greedy_best(greedy: dict) -> dict:
    """The greedy mode at its best measured gamma, against the targets."""
    g = greedy["best_gamma_measured"]
    row = greedy["gammas"][g]
    return {
        "gamma": g,
        "speedup": row["speedup"],
        "predicted": row["predicted_speedup"],
        "predicted_verify_measured": row["predicted_verify_measured"],
        "speedup_target_met": row["speedup"] >= SPEEDUP_TARGET,
        "prediction_target_met": abs(row["measured_over_predicted"] - 1) <= PREDICTION_TOLERANCE,
        "prediction_verify_measured_met": abs(row["speedup"] / row["predicted_verify_measured"] - 1)
        <= PREDICTION_TOLERANCE,
    }


def speculative_benchmark(
    target=None,
    draft=None,
    *,
    tokens: int = 200,
    prompts: int = 3,
    prompt_tokens: int = 32,
    gammas: list[int] | None = None,
    repeats: int = 3,
    seed: int = 0,
    modes: dict | None = None,
    progress: Callable[[str], None] | None = None,
    device: str | torch.device = "cpu",
    iteration: Callable | None = None,
) -> dict:
    """Plain cached decoding of the target against speculative decoding with the draft, side by
    side.

    For each sampler mode (greedy and T = 1 by default), each repeat, prompt and gamma, the prompt
    is decoded plainly (``ar_lab.generate``) and at once speculatively, both with ``tokens`` new
    tokens (no EOS stop, so the work compares). The key figure per gamma is the wall-clock speedup
    (plain time / speculative time, each the fastest of its ``repeats`` runs, summed over the
    prompts), next to the theory's prediction (Leviathan et al., 2023) from the measured acceptance
    rate alpha and the measured cost ratio c = one draft step / one target step, both measured in
    the same runs: the draft's mean time per forward pass (its sampling included) inside the
    speculative runs, over the plain run's time per token. Greedy runs must reproduce the plain
    tokens exactly. ``device``: where the shipped checkpoints are loaded when the models are not
    given. ``iteration``: a round of one's own (``speculative_generate``'s; chapter 07's learner's
    loop).
    """
    from ar_lab.base.args import check_seed
    from ar_lab.engine.sampling import GREEDY, SamplingParams

    say = progress or (lambda _m: None)
    check_seed(seed)
    gammas = _checked_sizes(
        gammas, tokens=tokens, prompts=prompts, prompt_tokens=prompt_tokens, repeats=repeats
    )
    target, draft, sources = checkpoints(target, draft, checked_device(device))
    modes = {"greedy": GREEDY, "T=1": SamplingParams(temperature=1.0)} if modes is None else modes
    prompt_ids = _prompts(target, draft, prompts, prompt_tokens, tokens)
    # CPU time of this process on a one-thread CPU run (other processes on a shared machine
    # cannot inflate it), else the wall clock; both runs of a pair are timed the same way.
    clock = steady_clock(target.device)
    # For reference: one plain decode step of the draft / one of the target, side by side.
    say("plain decoding of each model")
    target_step, draft_step = _plain_steps(target, draft, prompt_ids[0], tokens, repeats, clock)
    results = {}
    for mode, params in modes.items():
        plain_best, fastest = _paired_runs(
            target,
            draft,
            prompt_ids,
            tokens,
            gammas=gammas,
            params=params,
            seed=seed,
            repeats=repeats,
            clock=clock,
            say=say,
            mode=mode,
            iteration=iteration,
        )
        results[mode] = _mode_summary(plain_best, fastest, gammas, tokens)
    out = {
        "benchmark": "speculative",
        "target": {"source": sources["target"], "parameters": target.num_parameters()},
        "draft": {"source": sources["draft"], "parameters": draft.num_parameters()},
        "prompts": len(prompt_ids),
        "prompt_tokens": [len(p) for p in prompt_ids],
        "new_tokens": tokens,
        "repeats": repeats,
        "machine": machine(target.device),
        "clock": "wall clock" if clock is time.perf_counter else "process CPU time",
        "target_step_s": target_step,
        "draft_step_s": draft_step,
        "plain_step_ratio": draft_step / target_step,
        "modes": results,
        "targets": {
            "greedy_speedup_at_best_gamma": SPEEDUP_TARGET,
            "within_of_prediction": PREDICTION_TOLERANCE,
        },
    }
    if "greedy" in results:
        out["greedy_best"] = _greedy_best(results["greedy"])
    return out


def format_speculative_results(res: dict, *, targets: bool = True) -> str:
    """The printed report: step costs, the table per mode and gamma, the best gammas and the
    targets.

    ``targets=False`` leaves out the line judging the benchmark's targets (met / NOT met): where the
    table is read as a measurement (chapter 07), not as the benchmark's verdict.
    """
    m = res["machine"]
    lines = [
        f"speculative decoding: target {res['target']['source']} ("
        f"{res['target']['parameters'] / 1e6:.2f} M), draft {res['draft']['source']} ("
        f"{res['draft']['parameters'] / 1e6:.2f} M); {res['prompts']} prompts x "
        f"{res['new_tokens']} new tokens, {res['repeats']} repeats; {m['device']['threads']} "
        f"thread{'s' if m['device']['threads'] != 1 else ''}, torch {m['versions']['torch']} on "
        f"{m['device']['name']}; timed in {res['clock']}, fastest of the repeats",
        f"plain greedy decode step: target {1e3 * res['target_step_s']:.2f} ms, "
        f"draft {1e3 * res['draft_step_s']:.2f} ms "
        f"(ratio {res['plain_step_ratio']:.3f})",
    ]
    for mode, r in res["modes"].items():
        lines.append(
            f"{mode}: plain {1e3 * r['plain_step_s']:.2f} ms/token; draft step in the "
            f"speculative runs {1e3 * r['draft_step_s']:.3f} ms -> c = {r['cost_ratio_c']:.3f}"
        )
    lines += ["", format_table(*_gamma_table(res)), ""]
    lines.append(
        "tokens/call: measured tokens per target forward pass; theory: (1 - α^(γ+1)) / (1 - α); "
        "verify: the target's side of an iteration / one plain step (the theory assumes 1); "
        "predicted: (1 - α^(γ+1)) / ((1 - α)(γc + 1)); pred (v): the same with the measured "
        "verify cost v in place of 1"
    )
    for mode, r in res["modes"].items():
        g = r["best_gamma_measured"]
        row = r["gammas"][g]
        lines.append(
            f"{mode}: best measured γ = {g} ({row['speedup']:.2f}x, predicted "
            f"{row['predicted_speedup']:.2f}x); theory's best γ for its α and c: "
            f"{r['best_gamma_theory']}"
        )
        need = r["alpha_needed_for_1.5x"]
        if need is not None:
            lines.append(
                f"{mode}: 1.5x at this c and these verify costs needs α >= {need['alpha']:.2f} "
                f"(at γ = {need['gamma']}); measured α there: "
                f"{r['gammas'][need['gamma']]['alpha']:.2f}"
            )
    if targets and "greedy_best" in res:
        b = res["greedy_best"]
        ok = {True: "met", False: "NOT met"}
        lines.append(
            f"targets (greedy, best γ = {b['gamma']}): speedup >= 1.5x "
            f"{ok[b['speedup_target_met']]} ({b['speedup']:.2f}x); within 15% of the prediction "
            f"{ok[b['prediction_target_met']]} ({b['speedup'] / b['predicted']:.2f} of "
            f"{b['predicted']:.2f}x); of the prediction with the measured verify cost "
            f"{ok[b['prediction_verify_measured_met']]} ("
            f"{b['speedup'] / b['predicted_verify_measured']:.2f} of "
            f"{b['predicted_verify_measured']:.2f}x)"
        )
    return "\n".join(lines)


def _gamma_table(res: dict) -> tuple[list[str], list[list]]:
    headers = [
        "mode",
        "γ",
        "α",
        "tokens/call",
        "theory",
        "verify",
        "speedup",
        "predicted",
        "meas/pred",
        "pred (v)",
    ]
    rows = []
    for mode, r in res["modes"].items():
        for g, row in r["gammas"].items():
            rows.append(
                [
                    mode,
                    g,
                    f"{row['alpha']:.3f}",
                    f"{row['tokens_per_target_call']:.2f}",
                    f"{row['expected_tokens_per_iteration']:.2f}",
                    f"{row['verify_cost']:.2f}",
                    f"{row['speedup']:.2f}x",
                    f"{row['predicted_speedup']:.2f}x",
                    f"{row['measured_over_predicted']:.2f}",
                    f"{row['predicted_verify_measured']:.2f}x",
                ]
            )
    return headers, rows


def run(args: argparse.Namespace) -> dict:
    with torch_threads(args.threads):
        res = speculative_benchmark(
            tokens=args.tokens,
            prompts=args.prompts,
            prompt_tokens=args.prompt_tokens,
            gammas=args.gammas,
            repeats=args.repeats,
            seed=args.seed,
            progress=lambda m: print("  " + m, flush=True),
            device=args.device,
        )
    print()
    print(format_speculative_results(res))
    return res
