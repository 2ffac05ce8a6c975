"""Generation in production: many users, one model (chapter 08).

- ``ar_lab.engine.serving.requests``: requests, results and reports; TTFT / TPOT arithmetic.
- ``ar_lab.engine.serving.server``: ``serve`` (batched decoding, static or continuous batching, a
  contiguous or paged KV cache, prefix caching), ``generate_batch`` and ``simulate``.
- ``ar_lab.engine.serving.step``: one step of the server (``serve_step``; ``chunked_step``, with
  chunked prefill, ``serve(..., chunk=...)``) and the ``ServerState`` it works on;
  ``serve(..., step=...)`` runs a step of one's own.

Streaming lives in ``ar_lab.engine.generate.stream``; the workloads and measurements of chapter 08
in ``ar_lab.perf.serving_measure``.
"""

from ar_lab.engine.scheduling import POLICIES
from ar_lab.engine.serving.requests import (
    Request,
    RequestResult,
    ServeReport,
    StreamSummary,
    latency_budget,
    tokens_within,
)
from ar_lab.engine.serving.server import KV_LAYOUTS, generate_batch, serve, simulate
from ar_lab.engine.serving.step import ServerState, StepError, chunked_step, serve_step

__all__ = [
    "KV_LAYOUTS",
    "POLICIES",
    "Request",
    "RequestResult",
    "ServeReport",
    "ServerState",
    "StepError",
    "StreamSummary",
    "chunked_step",
    "generate_batch",
    "latency_budget",
    "serve",
    "serve_step",
    "simulate",
    "tokens_within",
]
