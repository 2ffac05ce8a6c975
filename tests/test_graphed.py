"""The decode step recorded once and replayed (ar_lab.engine.graphed), as a CUDA device runs it.

This machine has no GPU, so the recording is a stand-in that keeps a CUDA graph's contract: the
recorded call's output tensor is written again, in place, by every replay, from the step's own input
tensors (token, position) and buffers. What is tested is everything around the recorder: the step
with its position as data equals the lean step at every position (GPT-2's block and the Llama-shaped
one with grouped heads, a window and sinks), its shapes do not depend on the position (one traced
graph for every position), a new cache or a replaced parameter is recorded again, and
``generate(..., compile=True)`` on that route gives the lean step's tokens."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_lab import generate
from ar_lab.engine import compiled, graphed
from ar_lab.engine.compiled import CompiledDecoder, CompileUnavailable
from ar_lab.engine.graphed import GraphStep, WholeBuffers
from ar_lab.engine.lean import LeanGPT
from ar_lab.model.cache import KVCache
from ar_lab.model.gpt import GPT, GPTConfig

TINY = dict(vocab_size=40, block_size=24, n_layer=2, n_head=4, n_embd=32)
MODERN = dict(n_kv_heads=2, norm="rmsnorm", positions="rope", mlp="swiglu", bias=False)


class Recorder:
    """A CUDA graph's contract on a CPU: the step runs at recording, and each replay writes the
    recorded output in place. Counts the recordings."""

    def __init__(self) -> None:
        self.made = 0

    def __call__(self, step, device):
        self.made += 1
        out = step()
        return (lambda: out.copy_(step())), out


def _model(seed: int, **cfg) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **cfg})).eval()


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    modern=st.booleans(),
    window=st.sampled_from([None, 4, 8]),
    sinks=st.integers(0, 2),
    spare=st.integers(0, 5),
)
def test_the_replayed_step_equals_the_lean_step_at_every_position(
    seed, modern, window, sinks, spare
):
    """Logits within float rounding and the same keys and values written, from position 0 to a cache
    whose unwritten places (``spare`` of them) the causal rule must hide."""
    cfg = {**(MODERN if modern else {}), "window": window, "sinks": sinks if window else 0}
    model = _model(seed, **cfg)
    lean, record = LeanGPT(model), Recorder()
    ours = GraphStep(lean, record)
    rng = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY["vocab_size"], (12,), generator=rng)
    with torch.inference_mode():
        a, b = (KVCache.for_model(model, max_len=12 + spare) for _ in range(2))
        for t in tokens.tolist():
            want, got = lean.step(t, a), lean.step(t, b, ours)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for x, y in zip(a.k + a.v, b.k + b.v, strict=True):
            torch.testing.assert_close(y[:, :, :12], x[:, :, :12], rtol=1e-5, atol=1e-6)
    assert record.made == 1  # one recording served every position


def test_the_steps_shapes_do_not_depend_on_its_position():
    """Traced with static shapes (TorchDynamo, the eager backend), the step over ``WholeBuffers``
    makes one graph for every position: what lets one recording serve them all."""
    dynamo = pytest.importorskip("torch._dynamo")
    model = _model(3, **MODERN, window=6, sinks=1)
    ours = GraphStep(LeanGPT(model), Recorder())
    dynamo.reset()  # (an earlier test's graphs are not reused, and the count starts here)
    before = dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        cache = KVCache.for_model(model, max_len=10)
        store = WholeBuffers(cache.k, cache.v)
        step = torch.compile(lambda: ours._step(store), backend="eager", dynamic=False)
        for p in range(10):
            ours.token.fill_(p + 1)
            ours.pos.fill_(p)
            step()
    assert dynamo.utils.counters["stats"]["unique_graphs"] - before == 1


def test_a_new_cache_or_a_replaced_parameter_is_recorded_again():
    """The recording reads the cache's buffers and the parameters where they were: another cache,
    or ``p.data = t``, makes a new one, and the step then computes with the new weights; an edit in
    place needs none."""
    model = _model(5)
    lean, record = LeanGPT(model), Recorder()
    ours = GraphStep(lean, record)
    with torch.inference_mode():
        first = KVCache.for_model(model, max_len=6)
        for t in (1, 2, 3):
            lean.step(t, first, ours)
        assert record.made == 1
        second, plain = KVCache.for_model(model, max_len=6), KVCache.for_model(model, max_len=6)
        for t in (4, 5):
            torch.testing.assert_close(lean.step(t, second, ours), lean.step(t, plain))
        assert record.made == 2
        fc = model.blocks[0].mlp.fc.weight
        fc.data = fc.data * 1.5  # new storage
        torch.testing.assert_close(lean.step(6, second, ours), lean.step(6, plain))
        assert record.made == 3
        fc.data.mul_(0.5)  # in place: the same storage
        torch.testing.assert_close(lean.step(7, second, ours), lean.step(7, plain))
        assert record.made == 3


def test_generate_with_compile_on_a_cuda_device_replays_a_recording_per_generation(monkeypatch):
    """``CompiledStep`` on a CUDA device records instead of compiling (stood in here): a scratch
    recording at construction, then one per generation, and the lean step's tokens."""
    record = Recorder()
    monkeypatch.setattr(compiled, "_records", lambda device: True)
    monkeypatch.setattr(graphed, "cuda_graph", record)
    model = _model(7, **MODERN)
    decoder = CompiledDecoder(model)
    assert decoder.compiled and decoder.stepper.graph is not None and record.made == 1
    for prompt in ([1, 2], [3]):
        want = generate(model, prompt, 15, eos_id=None).tokens
        assert generate(model, prompt, 15, eos_id=None, compile=True).tokens == want
    assert record.made == 3


def test_a_failed_recording_is_one_clear_error_and_a_fallback_only_when_asked(monkeypatch):
    """A recording that raises (as capture does for work a graph cannot hold) is
    ``CompileUnavailable`` at construction, before any token; ``fallback=True`` steps eagerly."""
    def fails(step, device):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(compiled, "_records", lambda device: True)
    monkeypatch.setattr(graphed, "cuda_graph", fails)
    model = _model(9, n_embd=48)  # (a model of its own: compiled steps are kept per model)
    with pytest.raises(CompileUnavailable) as err:
        CompiledDecoder(model)
    assert err.value.arg == "compile"
    with pytest.warns(UserWarning):
        decoder = CompiledDecoder(model, fallback=True)
    assert not decoder.compiled  # and it steps eagerly:
    with torch.inference_mode():
        a, b = KVCache.for_model(model, max_len=4), KVCache.for_model(model, max_len=4)
        torch.testing.assert_close(decoder.stepper.step(1, a), LeanGPT(model).step(1, b))


def test_threads_sharing_one_models_recording_take_turns(monkeypatch):
    """One model's recording has one set of input and output tensors: generations in four threads
    at once give each its own tokens (those of the lean step), not another's."""
    monkeypatch.setattr(compiled, "_records", lambda device: True)
    monkeypatch.setattr(graphed, "cuda_graph", Recorder())
    model = _model(11, n_embd=40)
    prompts = [[1], [2, 3], [4], [5, 6, 7]]
    want = {i: generate(model, p, 18, eos_id=None).tokens for i, p in enumerate(prompts)}
    got, errors = {i: [] for i in want}, []

    def run(i: int) -> None:
        try:
            for _ in range(3):
                got[i].append(generate(model, prompts[i], 18, eos_id=None, compile=True).tokens)
        except Exception as e:  # (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == {i: [w] * 3 for i, w in want.items()}
