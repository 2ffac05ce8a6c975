"""The decode step as one CUDA graph: one launch a token, where the eager step makes one a kernel.

On a GPU a small model's decode step is bound by launches, not by bytes: each of its few dozen
kernels costs the CPU a few microseconds to launch and the GPU about as much to run. A CUDA graph
records the step's kernels once and replays them with one call (chapter 05 measured what that
gives a 6.5 B model on an H200: 24 % of the memory bandwidth eager, 67 % as a graph). A replay
repeats the recorded work exactly: the same kernels, on the same memory, with the same sizes. So
the step that is recorded must not change shape with its position, and its inputs must be written
into the memory it was recorded with:

- **Positions as data.** ``WholeBuffers`` is the KV store of such a step: the new key and value
  are written at a position held in a tensor (``index_copy_``), and attention reads the whole
  preallocated buffer, the places after the position hidden by the causal rule (``visible``), as
  gpt-fast's static cache does. The token id and the position are copied into the graph's own
  input tensors before each replay; the logits are copied out of its output.
- **What the graph holds.** It reads the weights and the cache's buffers where they were when it
  was recorded. ``GraphStep`` records again when that changes: another cache, or a parameter whose
  storage was replaced (``p.data = t``; an edit in place is read by the next replay as by the eager
  step).

The arithmetic is the lean step's (``LeanGPT.one``, the same ``block``); reading the whole buffer
costs more reads than the filled prefix, which on a GPU is cheap beside the launches it saves.
``CompiledStep`` (``ar_lab.engine.compiled``) runs this on a CUDA device, so ``generate(...,
compile=True)`` replays a graph there. This project's CI has no GPU: the recording itself is run on
a lent GPU only; on a CPU the tests run the same step eagerly, with a stand-in for the recorder.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ar_lab.engine.lean import LeanGPT
from ar_lab.model.attention import Keys, Pos
from ar_lab.model.cache import Buffers, KVCache

# (replay, output): replay() runs the recorded step again, writing its output tensor in place
Recorder = Callable[[Callable[[], torch.Tensor], torch.device], tuple[Callable[[], None], object]]


class WholeBuffers(Buffers):
    """Per-layer key and value buffers written at positions held in a tensor and read whole: every
    step has the same shapes whatever its position (what a CUDA graph replays). ``pos`` is a long
    tensor (1, T) of the new tokens' positions, shared by the rows; the keys after a query's
    position are hidden by ``visible``'s causal rule."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: Pos) -> None:
        at = pos.reshape(-1)
        self.k[layer].index_copy_(2, at, k)
        self.v[layer].index_copy_(2, at, v)

    def keys(self, layer: int, pos: Pos, T: int) -> Keys:
        return Keys(self.k[layer], self.v[layer])


def cuda_graph(step: Callable[[], object], device: torch.device) -> tuple[Callable[[], None], Any]:
    """Record ``step`` as one CUDA graph (after two warm-up runs on the recording stream, which
    settle the allocator and the libraries' workspaces); return its replay and what the recorded
    call returned, which every replay writes again. The warm-up runs are real runs: ``step`` must be
    one whose repetition is harmless (a decode step writing the same key at the same position)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = step()
    held = (graph, step)  # the replay holds the graph and what step's closure holds (the buffers)

    def replay() -> None:
        held[0].replay()

    return replay, out


class GraphStep:
    """``run(token, cache, pos)`` for ``LeanGPT.step``: the step replayed from a recording made for
    this cache (made at its first step, and again when the cache or a parameter's storage
    changes). ``record``: how a step is recorded (``cuda_graph``; tests pass a stand-in)."""

    def __init__(self, engine: LeanGPT, record: Recorder | None = None) -> None:
        self.engine, self.record = engine, record or cuda_graph
        self.params = list(engine.model.parameters())
        device = engine.device
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.held: tuple | None = None  # (what the recording read, replay, output)
        # One recording, one set of input and output tensors: threads that share this step (one
        # model's) take turns, each filling the inputs, replaying and copying the output out.
        self.lock = threading.Lock()

    def _reads(self, cache: KVCache) -> tuple:
        """Where the recording's memory is: the cache's buffers (which the recording keeps alive, so
        another cache's are elsewhere) and every parameter's storage, with its shape (a replaced
        parameter's freed block may come back to a tensor of another shape)."""
        return (
            *(t.data_ptr() for t in cache.k),
            *(t.data_ptr() for t in cache.v),
            *((p.data_ptr(), p.shape) for p in self.params),
        )

    def release(self) -> None:
        """Let the recording go (its memory and the cache it holds); the next step records again."""
        self.held = None

    def _step(self, store: WholeBuffers) -> torch.Tensor:
        e = self.engine
        return e.one(e.wte.index_select(0, self.token).view(-1), store, self.pos)

    def __call__(self, token: int, cache: KVCache, pos: int) -> torch.Tensor:
        with self.lock:
            return self._replayed(token, cache, pos)

    def _replayed(self, token: int, cache: KVCache, pos: int) -> torch.Tensor:
        self.token.fill_(token)
        self.pos.fill_(pos)
        reads = self._reads(cache)
        if self.held is None or self.held[0] != reads:
            self.release()  # (the old recording's memory is freed before the new one is made)
            store = WholeBuffers(list(cache.k), list(cache.v))
            replay, out = self.record(lambda: self._step(store), self.engine.device)
            self.held = (reads, replay, out)
        _, replay, out = self.held
        replay()  # (a recording is not a run: the step is computed by its first replay)
        return out.clone()  # (the next replay writes into out again)
