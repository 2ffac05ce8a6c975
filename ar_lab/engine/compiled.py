"""A compiled decode step: the lean step's arithmetic traced into one graph by ``torch.compile``.

The lean engine (``ar_lab.engine.lean``) took the module layers out of the decode step; what is left
above the weights' reads is a chain of about fifty PyTorch calls per token, each a trip through
Python and the dispatcher and a kernel of its own for a few hundred numbers (the norms, biases,
GELU, residual adds). ``torch.compile`` traces the same ``block`` (TorchDynamo) and inductor writes
the graph as a few fused C++ loops on a CPU: the elementwise work between
the products fuses, the Python between the calls is gone; the products and attention stay library
kernels. The tokens are the lean step's (tests: the same greedy tokens, logits within 1e-4).

Three things a compiled step must get right, each handled here:

- **Shapes.** The cache's filled length grows by one per step, and a graph specialised to one
  length would recompile at every token. The position is a *dynamic* int (``dynamic=True``): one
  graph serves every length and every cache size. Torch specialises the values 0 and 1, and a
  read that reaches the buffer's end: those positions (a one-token prompt's first step, a full
  cache's last) run the eager step instead of compiling again.
- **Weights.** The graph takes the parameters as inputs, not constants (no ``freezing``), so an
  edit of the weights is what the next step computes with, as in ``GPT.forward``.
- **Threads.** Inductor's CPU loops would fix torch's thread count when they are generated; they
  are generated to read it at each call (``cpp.dynamic_threads``), so ``torch.set_num_threads``
  holds for the fused loops as for the library kernels.

Compiling costs seconds (about 10 s for the course model on a 2-core CPU, once per model and
process, kept for the ``_KEEP`` most recent models; inductor's disk cache shortens later ones).
Where no compiler is available (inductor needs a C++ compiler on a CPU), ``CompiledStep`` raises
``CompileUnavailable`` with the reason, unless asked to fall back to the eager lean step
(``fallback=True``).

On a CUDA device the step is not traced but recorded: ``ar_lab.engine.graphed`` replays it as one
CUDA graph per cache, what a GPU engine does at every token (the launches are what a small model's
GPU step waits on). A recording that fails is reported the same way.
"""

from __future__ import annotations

import functools
import warnings
from collections import OrderedDict

import torch

from ar_lab.base.errors import BadType, BadValue
from ar_lab.engine import graphed
from ar_lab.engine.decoder import LeanDecoder
from ar_lab.engine.lean import LeanGPT, NotLean
from ar_lab.engine.quant import QuantizedLinear
from ar_lab.model.cache import Buffers, KVCache

_KEEP = 4  # compiled steps kept (one per model), the most recently made


class CompileUnavailable(BadValue):
    """``torch.compile`` cannot build the step on this machine (and no fallback was asked for)."""


def _traced(engine: LeanGPT, token: torch.Tensor, k: list, v: list, pos: int) -> torch.Tensor:
    """The step's arithmetic over the cache's buffers: the function ``torch.compile`` traces (the
    token as a tensor, so its value is data, not a guard)."""
    return engine.one(engine.wte[token].view(-1), Buffers(k, v), pos)


def compile_once(step, **options):
    """``step(token, cache, pos)`` under ``torch.compile`` with its sizes and ints as symbols
    (``dynamic=True``): one graph serves every position past 1, where the default compile would take
    the first position it sees as a constant and compile again at the next (appendix A1's exercise).
    ``options``: inductor's (see ``torch._inductor.list_options()``)."""
    return torch.compile(step, dynamic=True, options=options or None)


@functools.cache
def _compiled():
    """``_traced`` compiled once for every position (made at first use: TorchDynamo takes a while
    to import)."""
    return compile_once(_traced, **{"cpp.dynamic_threads": True})


def _records(device: torch.device) -> bool:
    """Whether the step on ``device`` is recorded as a CUDA graph rather than compiled."""
    return device.type == "cuda"


def _reason(e: Exception) -> str:
    """The first line of what went wrong (inside dynamo's wrapper, where there is one)."""
    inner = getattr(e, "inner_exception", None) or e
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    return f"{type(inner).__name__}: {lines[0]}"[:300] if lines else type(inner).__name__


class CompiledStep:
    """``LeanGPT.step`` with its arithmetic compiled, for one model.

    ``step(token, cache)`` keeps the lean step's checks and bookkeeping; a plain ``KVCache`` at a
    position past 1 runs the compiled graph (on a CUDA device: any position, replayed from a CUDA
    graph, ``graphed.GraphStep``), anything else the eager step (an int8 or paged store: their own
    arithmetic). Made by ``compiled_step`` (which compiles once, at construction, on a scratch
    cache, so a missing compiler or a failed recording is reported before any token)."""

    def __init__(self, model, *, fallback: bool = False) -> None:
        self.engine = LeanGPT(model)  # NotLean for a model the lean engine does not run
        if any(isinstance(m, QuantizedLinear) for m in model.modules()):
            raise NotLean(
                "the compiled step runs float weights: a quantized model's own kernels are "
                "stepped eagerly (generate with compile=False)",
                arg="model",
            )
        self.compiled = True
        self.graph = graphed.GraphStep(self.engine) if _records(self.engine.device) else None
        try:
            self._warm_up(model)
        except Exception as e:  # inductor's failures have no common type (compiler, codegen, ...)
            reason = _reason(e)
            if not fallback:
                raise CompileUnavailable(
                    (
                        f"the decode step cannot be recorded as a CUDA graph here ({reason}): "
                        if self.graph is not None
                        else f"torch.compile cannot build the decode step here ({reason}); on a "
                        "CPU it needs a C++ compiler (e.g. apt install g++): install one, or "
                    )
                    + "pass fallback=True to decode with the eager lean step",
                    arg="compile",
                ) from None
            warnings.warn(f"compiled step unavailable, stepping eagerly: {reason}", stacklevel=3)
            self.compiled = False

    def _warm_up(self, model) -> None:
        """One compiled step on a scratch cache at a position past 1, short of its end (the graph's
        sizes are symbolic, so every real cache reuses it). Torch takes sizes of equal value for
        one symbol, so the scratch's length and position differ from the cache's other sizes."""
        cfg = model.config
        taken = {cfg.kv_heads, cfg.head_dim}
        n = next(n for n in range(4, 4 + 2 * len(taken) + 2) if not {n, n - 2} & taken)
        if cfg.block_size < n:
            return  # a context this short: its few steps run eagerly
        with torch.inference_mode():  # (where the decode loops make their caches)
            scratch = KVCache.for_model(model, max_len=n)
            if self.graph is not None:  # a recording, then let go (each cache gets its own)
                self.graph(0, scratch, n - 2)
                self.graph.release()
                return
            _compiled()(self.engine, self._token(0), scratch.k, scratch.v, n - 2)

    def _token(self, token: int) -> torch.Tensor:
        return torch.tensor([token], device=self.engine.device)

    def _run(self, token: int, cache, pos: int) -> torch.Tensor:
        if self.graph is not None:  # (a recording's shapes do not depend on the position)
            return self.graph(token, cache, pos)
        # Torch specialises the values 0 and 1, and a cache read to its very end: one graph for the
        # rest, the edges eager.
        if pos < 2 or pos + 1 >= cache.max_len:
            return self.engine.eager(token, cache, pos)
        return _compiled()(self.engine, self._token(token), cache.k, cache.v, pos)

    def step(self, token: int, cache) -> torch.Tensor:
        """Logits (vocab,) after one token at ``cache.length``; the cache advances by one."""
        if not self.compiled or type(cache) is not KVCache:
            return self.engine.step(token, cache)
        return self.engine.step(token, cache, self._run)


_steps: OrderedDict[int, CompiledStep] = OrderedDict()


def compiled_step(model, *, fallback: bool = False) -> CompiledStep:
    """The compiled step of ``model``: made (and compiled) at the first call, kept for the next
    calls (the ``_KEEP`` most recent; an entry holds its model, so an id is never reused while it
    is kept)."""
    if not isinstance(fallback, bool):
        raise BadType(f"fallback must be True or False, got {fallback!r}", arg="fallback")
    key = id(model)
    found = _steps.get(key)
    if found is not None and found.engine.model is model:  # (only compiled steps are kept)
        _steps.move_to_end(key)
        return found
    made = CompiledStep(model, fallback=fallback)
    if made.compiled:
        _steps[key] = made
        while len(_steps) > _KEEP:
            _steps.popitem(last=False)
    return made


class CompiledDecoder(LeanDecoder):
    """A ``LeanDecoder`` whose batch-1 steps on a ``KVCache`` run the compiled graph
    (``compiled_step``); prompts, verify passes, batched rows and other stores as the lean decoder
    runs them. ``generate(..., compile=True)`` decodes with one. ``fallback``: where the step
    cannot be compiled, step eagerly (with a warning) instead of raising ``CompileUnavailable``."""

    def __init__(self, model, *, fallback: bool = False) -> None:
        super().__init__(model)  # NotLean for a model the lean engine does not run
        self.stepper = compiled_step(model, fallback=fallback)

    @property
    def compiled(self) -> bool:
        """Whether the steps run compiled (False only after a fallback)."""
        return self.stepper.compiled
