"""Chapter 07's second benchmark: speculative decoding where the theory's regime holds, a
memory-bound target.

The course model's decode step is not memory-bound on a CPU (its weights fit in the cache), so its
verify pass costs several decode steps and speculative decoding hardly pays (``bench speculative``).
Here the target is the course model widened ``k`` times (``ar_lab.model.widen``: the same text, with
k^2 times the weights, dense, which a decode step streams from memory) and the draft is the target's
own int4 (or int8) copy (``quantize_model``): self-speculation, a draft that agrees with its target
because it is the target with narrower weights. Greedy, side by side with plain decoding of the
target, against the theory's prediction (``speculative.speculative_benchmark`` measures both).
Beside it, the verify pass alone: ``LeanGPT.extend`` over T positions in decode steps, with the
weights packed for a few rows (``ar_lab.engine.packed``) and with plain (in, out) copies, against
the one step the bytes say.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadValue
from ar_lab.base.timing import interleaved, median, steady_clock
from ar_lab.bench.common import torch_threads
from ar_lab.bench.speculative import (
    SPEEDUP_TARGET,
    format_speculative_results,
    speculative_benchmark,
)
from ar_lab.bench.table import format_table

DRAFT_FORMATS = ("int8", "int4")


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--widen", type=int, default=5, help="widening factor of the course model (default 5: 80 M)"
    )
    p.add_argument(
        "--draft-format",
        choices=DRAFT_FORMATS,
        default="int4",
        help="the draft's weights (default int4)",
    )
    p.add_argument("--tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    p.add_argument(
        "--prompts", type=int, default=2, help="prompts from the validation text (default 2)"
    )
    p.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt (default 32)")
    p.add_argument(
        "--gammas", type=int, nargs="+", default=[2, 4, 6, 8], help="gamma values (default 2 4 6 8)"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="interleaved timing repeats; the fastest run counts"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1, as batch-1 decode)"
    )


def self_draft_pair(k: int, draft_format: str = "int4", *, course=None):
    """(target, draft): the course model widened ``k`` times, and its own ``draft_format`` copy
    (CPU)."""
    from ar_lab.engine.quant import quantize_model
    from ar_lab.model.widen import widen

    if draft_format not in DRAFT_FORMATS:
        raise BadValue(
            f"draft_format must be one of {DRAFT_FORMATS}, got {draft_format!r}", arg="draft_format"
        )
    if course is None:  # the trained weights: they set how often the draft agrees
        from ar_lab.model.train import checkpoint_path, load_checkpoint

        course = load_checkpoint(checkpoint_path("course"), "cpu").eval()
    target = widen(course, k)
    return target, quantize_model(target, weights=draft_format)


def verify_pass_costs(model, rows: list[int], *, rounds: int = 9, context: int = 32) -> dict:
    """``LeanGPT.extend`` over T positions (each T in ``rows``), in decode steps of the same model,
    timed in turns with the step: with the weights packed for a few rows, and with (in, out)
    copies."""
    from ar_lab.engine import lean, packed
    from ar_lab.model.cache import KVCache

    engine = lean.LeanGPT(model)
    layouts = {
        "packed": lean.extend_copies(model),
        "(in, out)": lean.extend_copies(model, pack=False),
    }
    cache = KVCache.for_model(model, max_len=context + max(rows))
    prompt = torch.arange(context, device=model.device)[None] % model.config.vocab_size

    def then_rewind(fn: Callable[[], object]) -> Callable[[], None]:
        return lambda: (fn(), cache.truncate(context))

    with torch.inference_mode():
        model(prompt, cache)
        runs = {"step": then_rewind(lambda: engine.step(1, cache))}
        for T in rows:
            for name, copies in layouts.items():
                runs[T, name] = then_rewind(
                    lambda T=T, c=copies: engine.extend(list(range(1, T + 1)), cache, c)
                )
        times = interleaved(
            runs, rounds, warmup=1, clock=steady_clock(model.device), device=model.device
        )
    step = median(times["step"])
    return {
        "step_s": step,
        "packed_matrices": sum(packed.packs(b.mlp.fc.weight) + packed.packs(b.attn.qkv.weight)
                               + packed.packs(b.attn.proj.weight) + packed.packs(b.mlp.proj.weight)
                               for b in model.blocks) + packed.packs(model.wte.weight),
        "rows": {T: {name: median(times[T, name]) / step for name in layouts} for T in rows},
    }


def selfspec_benchmark(
    k: int = 5,
    draft_format: str = "int4",
    *,
    tokens: int = 128,
    prompts: int = 2,
    prompt_tokens: int = 32,
    gammas: list[int] | None = None,
    repeats: int = 3,
    course=None,
    progress: Callable[[str], None] | None = None,
    iteration: Callable | None = None,
) -> dict:
    """Greedy speculative decoding of the widened course model with its own quantized copy as the
    draft, against plain decoding (``speculative_benchmark``), and the verify pass's cost in decode
    steps."""
    from ar_lab.engine.sampling import GREEDY
    from ar_lab.perf.peaks import cache_bytes

    positive_int("k (--widen)", k, arg="k")
    gammas = [2, 4, 6, 8] if gammas is None else gammas
    target, draft = self_draft_pair(k, draft_format, course=course)
    res = speculative_benchmark(
        target, draft, tokens=tokens, prompts=prompts, prompt_tokens=prompt_tokens, gammas=gammas,
        repeats=repeats, modes={"greedy": GREEDY}, progress=progress, iteration=iteration,
    )
    res["benchmark"] = "selfspec"
    res["target"]["source"] = f"course model widened {k}x"
    res["draft"]["source"] = f"its {draft_format} copy"
    res["target"]["weight_bytes"] = sum(p.numel() * p.element_size() for p in target.parameters())
    res["draft"]["weight_bytes"] = sum(
        t.numel() * t.element_size() for t in (*draft.parameters(), *draft.buffers())
    )
    res["largest_cpu_cache_bytes"] = cache_bytes()
    if progress:
        progress("the verify pass alone")
    res["verify_pass"] = verify_pass_costs(
        target, [g + 1 for g in res["modes"]["greedy"]["gammas"]]
    )
    return res


def format_selfspec_results(res: dict) -> str:
    llc = res["largest_cpu_cache_bytes"]
    size = res["target"]["weight_bytes"] / 2**20
    lines = [
        f"target: {size:.0f} MiB of fp32 weights"
        + (
            f" ({size / (llc / 2**20):.1f}x this CPU's largest cache, {llc / 2**20:.0f} MiB)"
            if llc
            else ""
        ),
        format_speculative_results(res),
        "",
        "verify pass alone: LeanGPT.extend over T positions / one decode step ("
        f"{1e3 * res['verify_pass']['step_s']:.1f} ms); reading the weights once is 1, the "
        "arithmetic of T rows adds up to T / (2 x ridge) where it does not overlap the reads",
    ]
    v = res["verify_pass"]["rows"]
    names = list(next(iter(v.values())))
    lines.append(format_table(["T", *names], [[T, *(f"{v[T][n]:.2f}" for n in names)] for T in v]))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    with torch_threads(args.threads):
        res = selfspec_benchmark(
            args.widen,
            args.draft_format,
            tokens=args.tokens,
            prompts=args.prompts,
            prompt_tokens=args.prompt_tokens,
            gammas=args.gammas,
            repeats=args.repeats,
            progress=lambda m: print("  " + m, flush=True),
        )
    print()
    print(format_selfspec_results(res))
    return res


__all__ = ["SPEEDUP_TARGET", "selfspec_benchmark", "self_draft_pair", "verify_pass_costs"]
