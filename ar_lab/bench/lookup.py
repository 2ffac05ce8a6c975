"""Chapter 07's second benchmark: drafts without a draft model (prompt lookup decoding).

Two kinds of prompt from the validation text: ones whose continuation repeats their context (a
passage, then the same passage quoted again from its first words: what editing code or quoting a
source looks like) and ordinary ones (``benchmark_prompts``). For each prompt, greedy decoding four
ways, timed in turns on the steady clock: plain (``ar_lab.generate``), speculative with
``PromptLookup`` proposing ``--lookahead`` tokens, speculative with the draft checkpoint (gamma 4),
and, with ``transformers`` installed, its ``generate`` on the same weights plain and with
``prompt_lookup_num_tokens`` (the same match rule: n-grams of at most 2, earliest match). Every
greedy run must give the same tokens (asserted); the figures are the acceptance rate and tokens per
target call of the lookup, each method's speedup over its own plain decoding, and ar_lab's lookup
tokens/s over transformers'.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.timing import interleaved, machine, steady_clock
from ar_lab.bench.common import checkpoints, torch_threads
from ar_lab.bench.table import format_table

QUOTE = "\n\nThe same passage, quoted:\n"  # between a passage and its repetition


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=256, help="new tokens per prompt (default 256)")
    p.add_argument("--prompts", type=int, default=3, help="prompts of each kind (default 3)")
    p.add_argument(
        "--lookahead", type=int, default=8, help="tokens a lookup proposes at most (default 8)"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="interleaved repeats; the fastest run of each counts"
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--no-peer", action="store_true", help="skip transformers' prompt lookup")


def lookup_prompts(n: int, passage: int = 240, start: int = 24) -> dict[str, list[list[int]]]:
    """``n`` prompts of each kind: "repeats its context" (a validation passage of ``passage`` bytes,
    then ``QUOTE`` and its first ``start`` bytes) and "fresh" (ordinary validation prompts of the
    same length)."""
    from ar_lab.model.data import benchmark_prompts
    from ar_lab.model.tokenizer import encode

    quote = encode(QUOTE)
    fresh = benchmark_prompts(n, passage + len(quote) + start)
    passages = benchmark_prompts(n, passage)
    return {"repeats its context": [p + quote + p[:start] for p in passages], "fresh text": fresh}


def _peer(model, lookahead: int) -> dict[str, Callable[[list[int], int], list[int]]] | None:
    """transformers' greedy ``generate`` on ``model``'s weights, plain and with prompt lookup; None
    without it."""
    from ar_lab.model.reference import have_transformers, to_hf_gpt2
    from ar_lab.model.tokenizer import EOS_ID

    if not have_transformers():
        return None
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf = to_hf_gpt2(model)

    def run(lookup: bool) -> Callable[[list[int], int], list[int]]:
        def theirs(prompt: list[int], n: int) -> list[int]:
            ids = torch.tensor([prompt])
            extra = {"prompt_lookup_num_tokens": lookahead} if lookup else {}
            with torch.inference_mode():
                out = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=EOS_ID,
                    **extra,
                )
            return out[0, len(prompt) :].tolist()

        return theirs

    return {"transformers plain": run(False), "transformers lookup": run(True)}


def _runs(
    target, draft, prompt, tokens: int, lookahead: int, peer
) -> dict[str, Callable[[], object]]:
    from ar_lab.engine.generate import generate
    from ar_lab.engine.lookup import PromptLookup
    from ar_lab.engine.speculative import speculative_generate

    lookup = PromptLookup(max_ngram=2)  # transformers' default n-gram size
    runs = {
        "plain": lambda: generate(target, prompt, tokens, eos_id=None),
        "lookup": lambda: speculative_generate(
            target, lookup, prompt, tokens, gamma=lookahead, eos_id=None
        ),
        "draft model": lambda: speculative_generate(
            target, draft, prompt, tokens, gamma=4, eos_id=None
        ),
    }
    for name, fn in (peer or {}).items():
        runs[name] = lambda fn=fn: fn(prompt, tokens)
    return runs


def lookup_benchmark(
    target,
    draft,
    *,
    tokens: int = 256,
    prompts: int = 3,
    lookahead: int = 8,
    repeats: int = 3,
    peer: bool = True,
    say: Callable[[str], None] | None = None,
) -> dict:
    """The measurements (returns data, prints nothing); see the module's docstring."""
    for name, value in (
        ("tokens", tokens),
        ("prompts", prompts),
        ("lookahead", lookahead),
        ("repeats", repeats),
    ):
        positive_int(name, value)
    say = say or (lambda _m: None)
    hf = _peer(target, lookahead) if peer else None
    clock = steady_clock(target.device)
    kinds = {}
    for kind, plist in lookup_prompts(prompts).items():
        per_prompt = []
        for i, prompt in enumerate(plist):
            say(f"{kind}: prompt {i + 1}/{len(plist)}")
            runs = _runs(target, draft, prompt, tokens, lookahead, hf)
            # warm-up, and the tokens each way gives
            outs = {name: fn() for name, fn in runs.items()}
            want = outs["plain"].tokens
            for name, out in outs.items():
                got = out if isinstance(out, list) else out.tokens
                if got != want:
                    raise AssertionError(
                        f"{name} gave other tokens than plain greedy decoding ({kind}, prompt {i})"
                    )
            times = interleaved(runs, repeats, clock=clock, device=target.device)
            best = {name: min(t) for name, t in times.items()}
            stats = outs["lookup"].stats
            per_prompt.append({
                "alpha": stats.alpha,
                "tokens_per_target_call": stats.tokens_per_target_call,
                "draft_alpha": outs["draft model"].stats.alpha,
                "seconds": best,
            })
        kinds[kind] = _summary(per_prompt, tokens, hf is not None)
    return {
        "benchmark": "lookup",
        "tokens": tokens,
        "prompts": prompts,
        "lookahead": lookahead,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "kinds": kinds,
        "identical_tokens": True,
        "machine": machine(target.device),
    }


def _summary(per_prompt: list[dict], tokens: int, peer: bool) -> dict:
    def total(name: str) -> float:
        return sum(p["seconds"][name] for p in per_prompt)

    out = {
        "alpha": statistics.mean(p["alpha"] for p in per_prompt),
        "tokens_per_target_call": statistics.mean(p["tokens_per_target_call"] for p in per_prompt),
        "draft_alpha": statistics.mean(p["draft_alpha"] for p in per_prompt),
        "lookup_speedup": total("plain") / total("lookup"),
        "draft_speedup": total("plain") / total("draft model"),
        "ms_per_token": {
            name: 1e3 * total(name) / (tokens * len(per_prompt))
            for name in per_prompt[0]["seconds"]
        },
        "per_prompt": per_prompt,
    }
    if peer:
        out["transformers_lookup_speedup"] = total("transformers plain") / total(
            "transformers lookup"
        )
        out["ar_lab_vs_transformers_lookup"] = total("transformers lookup") / total("lookup")
    return out


def format_lookup_results(res: dict) -> str:
    rows = []
    for kind, k in res["kinds"].items():
        rows.append(
            [
                kind,
                f"{k['alpha']:.2f}",
                f"{k['tokens_per_target_call']:.2f}",
                f"{k['lookup_speedup']:.2f}x",
                f"{k['draft_speedup']:.2f}x",
                f"{k.get('transformers_lookup_speedup', float('nan')):.2f}x",
                f"{k.get('ar_lab_vs_transformers_lookup', float('nan')):.2f}x",
            ]
        )
    return "\n".join(
        [
            f"greedy, {res['tokens']} new tokens, {res['prompts']} prompts of each kind, "
            f"lookahead {res['lookahead']}, {res['threads']} thread(s); every method gave plain "
            "decoding's tokens",
            format_table(
                [
                    "prompts",
                    "lookup α",
                    "tokens/call",
                    "lookup",
                    "draft model (γ 4)",
                    "transformers lookup",
                    "ar_lab / transformers",
                ],
                rows,
            ),
            "lookup, draft model, transformers lookup: speedup over the same engine's plain "
            "greedy decoding; ar_lab / transformers: tokens/s of ar_lab's lookup over "
            "transformers' on the same weights",
        ]
    )


def run(args: argparse.Namespace) -> dict:
    with torch_threads(args.threads):
        target, draft, sources = checkpoints(None, None, torch.device("cpu"))
        res = lookup_benchmark(
            target,
            draft,
            tokens=args.tokens,
            prompts=args.prompts,
            lookahead=args.lookahead,
            repeats=args.repeats,
            peer=not args.no_peer,
            say=print,
        )
    res["models"] = sources
    print(format_lookup_results(res))
    return res
