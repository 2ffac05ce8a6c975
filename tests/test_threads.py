"""Several threads decoding with one model at once: each caller gets exactly what it gets alone.

The lean engine's working memory is per thread, its weights are the model's own, each call has its
own KV cache, and no call ever switches the model's mode (``ar_lab.model.inference``): there is no
shared state to race on. Every test compares threaded results with the same calls run one by one.
"""

from __future__ import annotations

import threading

import pytest
import torch

import ar_lab
from ar_lab.engine import lean
from ar_lab.engine.generate import generate, stream
from ar_lab.engine.sampling import SamplingParams
from ar_lab.engine.speculative import speculative_generate
from ar_lab.model.cache import KVCache
from ar_lab.model.gpt import GPT, GPTConfig

PROMPTS = ["The for statement", "import os\n", "class Point:\n", "def main():\n    "]
SAMPLED = SamplingParams(temperature=0.9, top_k=40)
N_THREADS = 4


@pytest.fixture(scope="module")
def models():
    return ar_lab.load_pretrained("course"), ar_lab.load_pretrained("draft")


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _jobs(target, draft, n: int = 24) -> list:
    """Every decode path on every prompt: generate (greedy and seeded sampling, both models), a
    stream read token by token, and speculative decoding (greedy and sampled)."""
    jobs = []
    for i, p in enumerate(PROMPTS):
        jobs += [
            lambda p=p: generate(target, p, n, eos_id=None).tokens,
            lambda p=p, i=i: (
                generate(target, p, n, eos_id=None, sampling=SAMPLED, generator=_seeded(i)).tokens
            ),
            lambda p=p: [e.token for e in stream(target, p, n, eos_id=None) if e.token >= 0],
            lambda p=p: speculative_generate(target, draft, p, n, 3, eos_id=None).tokens,
            lambda p=p, i=i: (
                speculative_generate(
                    target,
                    draft,
                    p,
                    n,
                    2,
                    eos_id=None,
                    sampling=SAMPLED,
                    generator=_seeded(100 + i),
                ).tokens
            ),
            lambda p=p, i=i: (
                generate(
                    draft, p, n, eos_id=None, sampling=SAMPLED, generator=_seeded(200 + i)
                ).tokens
            ),
        ]
    return jobs


def _run_in_threads(jobs: list, n_threads: int = N_THREADS) -> list:
    """Run ``jobs`` spread over ``n_threads`` threads that start together; their results in job
    order."""
    results: list = [None] * len(jobs)
    errors: list[BaseException] = []
    start = threading.Barrier(n_threads)

    def worker(k: int) -> None:
        try:
            start.wait()
            for j in range(k, len(jobs), n_threads):  # each thread gets a mix of the kinds of job
                results[j] = jobs[j]()
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_threads_decoding_with_one_model_get_their_own_results(models):
    target, draft = models
    jobs = _jobs(target, draft)
    alone = [job() for job in jobs]
    for _ in range(2):
        together = _run_in_threads(jobs)
        wrong = [j for j, (a, b) in enumerate(zip(alone, together, strict=True)) if a != b]
        assert not wrong, (
            f"{len(wrong)} of {len(jobs)} threaded results differ from the same calls alone: "
            f"jobs {wrong}"
        )


def test_one_engine_serves_several_threads(models):
    """An engine shared by threads (each with its own cache) steps each sequence correctly."""
    target, _ = models
    engine = lean.for_model(target)

    def greedy(prompt: str, n: int = 30) -> list[int]:
        cache = KVCache.for_model(target, max_len=64)
        with torch.inference_mode():
            logits = target(torch.tensor([ar_lab.encode(prompt)]), cache)[0, -1]
            out = []
            for _ in range(n):
                out.append(int(logits.argmax()))
                logits = engine.step(out[-1], cache)
        return out

    jobs = [lambda p=p: greedy(p) for p in PROMPTS * 2]
    assert _run_in_threads(jobs) == [job() for job in jobs]
    assert [greedy(p) for p in PROMPTS] == [
        generate(target, p, 30, eos_id=None).tokens for p in PROMPTS
    ]


def test_threads_decoding_with_a_model_in_training_mode(models):
    """A model in training mode without dropout computes what it computes in eval mode: threads
    decode it as it is, and every submodule's own flag is left as it was."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=128, n_layer=2, n_head=4, n_embd=64))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.train()
    model.blocks[1].mlp.eval()  # a child kept in eval mode on purpose stays so
    flags = [m.training for m in model.modules()]
    jobs = [
        lambda p=p, lean_=lean_: generate(model, p, 30, eos_id=None, lean=lean_).tokens
        for p in PROMPTS
        for lean_ in (True, False)
    ]
    alone = [job() for job in jobs]
    model.eval()
    evaluated = [
        generate(model, p, 30, eos_id=None, lean=lean_).tokens
        for p in PROMPTS
        for lean_ in (True, False)
    ]
    assert alone == evaluated
    model.train()
    model.blocks[1].mlp.eval()
    for _ in range(2):
        assert _run_in_threads(jobs) == alone
        assert [m.training for m in model.modules()] == flags


def test_a_model_with_active_dropout_is_refused_in_every_thread():
    """Dropout in training mode would make the text random: every call refuses it, none switches
    it."""
    model = GPT(GPTConfig(block_size=8, n_layer=1, n_head=1, n_embd=8, dropout=0.5)).train()
    errors = []

    def call() -> None:
        try:
            generate(model, "ab", 3)
        except ValueError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=call) for _ in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == N_THREADS and all("model.eval()" in e for e in errors)
    assert all(m.training for m in model.modules())
