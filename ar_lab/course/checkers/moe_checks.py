"""Chapter 08c's checkers for the mixture of experts: a learner's router and dispatch against
``ar_lab.model.moe``, with the classic slips named.

``route_mistakes`` gives what each slip picks and weighs on the same logits (the softmax over all
experts without renormalising over the chosen ones; the chosen logits as weights; the smallest
logits). A router passes when every token gets the package's experts, in any order, with their
weights. ``check_dispatch`` runs the learner's dispatch on experts that count their calls: the
output must be the weighted sum, each chosen expert must run once (on all its rows) and an expert
no token chose must not run; the slips it names are unweighted sums and a later expert's output
written over an earlier one's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ar_lab.course.checkers.checks import run_answer, verdict
from ar_lab.model.moe import dispatch, route

N_TOKENS, N_EXPERTS, WIDTH = 12, 6, 16


def route_mistakes(logits: torch.Tensor, k: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Slip -> the (experts, weights) it gives."""
    top, chosen = logits.topk(k, dim=-1)
    low = (-logits).topk(k, dim=-1).indices
    return {
        "the softmax over all experts' logits, not renormalised over the k chosen (a token's "
        "weights then sum to less than 1)": (chosen, torch.softmax(logits, -1).gather(1, chosen)),
        "the chosen logits themselves as weights, with no softmax": (chosen, top),
        "the k smallest logits chosen (an ascending sort, or topk(largest=False))":
            (low, torch.softmax(logits.gather(1, low), -1)),
    }


def _canonical(experts: torch.Tensor, weights: torch.Tensor):
    """Each token's experts in ascending order, their weights along: two routers that pick the same
    experts with the same weights in another order compare equal."""
    order = experts.argsort(dim=-1)
    return experts.gather(1, order), weights.gather(1, order)


def _same(a, b) -> bool:
    (ea, wa), (eb, wb) = _canonical(*a), _canonical(*b)
    return bool((ea == eb).all()) and torch.allclose(wa.float(), wb.float(), atol=1e-5)


def check_route(fn: Callable, k: int = 2, seed: int = 0, hint: str = "") -> None:
    """``fn(logits, k) -> (experts, weights)`` routes as a mixture's router does."""
    what = f"my_route(logits, k={k})"
    logits = torch.randn(N_TOKENS, N_EXPERTS, generator=torch.Generator().manual_seed(seed))
    got = run_answer(what, fn, logits.clone(), k, hint=hint)
    if not isinstance(got, tuple | list) or len(got) != 2:
        raise verdict(what, f"expected a pair (experts, weights), got {type(got).__name__}", hint)
    experts, weights = got
    for name, t in (("experts", experts), ("weights", weights)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (N_TOKENS, k):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise verdict(what, f"{name} must be a tensor of shape (tokens, k) = "
                                 f"({N_TOKENS}, {k}), got {shape}", hint)
    if experts.dtype.is_floating_point or experts.dtype == torch.bool:
        raise verdict(what, f"experts must hold integer expert indices, got {experts.dtype}", hint)
    experts = experts.long()
    if any(len(set(row)) < k for row in experts.tolist()):
        raise verdict(what, "a token sent to the same expert twice: its k experts must be "
                             "distinct (the k largest logits)", hint,
                       "a token sent to the same expert twice")
    mine, want = (experts, weights), route(logits, k)
    if _same(mine, want):
        return
    for mistake, output in route_mistakes(logits, k).items():
        if _same(mine, output):
            raise verdict(what, f"your output is what {mistake} gives", hint, mistake)
    raise verdict(what, f"token 0 gets experts {experts[0].tolist()} weighted "
                         f"{[round(float(w), 4) for w in weights[0]]}; expected "
                         f"{want[0][0].tolist()} weighted "
                         f"{[round(float(w), 4) for w in want[1][0]]}", hint)


class _Expert:
    """An expert that counts its calls: tanh(x W)."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w, self.calls = w, []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return torch.tanh(x @ self.w)


def _experts(seed: int) -> list[_Expert]:
    g = torch.Generator().manual_seed(seed + 100)
    return [_Expert(torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5) for _ in range(N_EXPERTS)]


def _overwritten(h, experts, weights, fns) -> torch.Tensor:
    """Dispatch that writes each expert's output over the rows instead of adding it."""
    out = torch.zeros_like(h)
    for e in experts.unique().tolist():
        rows, slot = (experts == e).nonzero(as_tuple=True)
        out[rows] = fns[e](h[rows]) * weights[rows, slot, None]
    return out


def check_dispatch(fn: Callable, seed: int = 0, hint: str = "") -> None:
    """``fn(h, experts, weights, expert_fns) -> out`` sums each token's weighted experts, running
    each chosen expert once and no other."""
    what = "my_dispatch"
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N_TOKENS, WIDTH, generator=g)
    logits = torch.randn(N_TOKENS, N_EXPERTS, generator=g)
    logits[:, -1] = -1e4  # the last expert: chosen by no token
    experts, weights = route(logits, 2)
    fns = _experts(seed)
    out = run_answer(what, fn, h.clone(), experts.clone(), weights.clone(), fns, hint=hint)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(h.shape):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise verdict(what, f"expected a tensor of h's shape {tuple(h.shape)}, got {shape}", hint)
    if fns[-1].calls:
        raise verdict(what, f"expert {N_EXPERTS - 1}, which no token chose, ran (on "
                             f"{sum(fns[-1].calls)} rows): run only the experts in `experts`",
                       hint, "every expert run, the unchosen ones too")
    chosen = set(experts.unique().tolist())
    many = {e: len(fns[e].calls) for e in chosen if len(fns[e].calls) != 1}
    if many:
        e, n = next(iter(many.items()))
        raise verdict(what, f"expert {e} ran {n} times: run each chosen expert once, on all the "
                             "rows that chose it together (one product per expert)", hint,
                       "an expert run once per token instead of once on all its rows")
    want = dispatch(h, experts, weights, _experts(seed))
    if torch.allclose(out, want, atol=1e-5):
        return
    named = {
        "the experts' outputs summed without their weights":
            dispatch(h, experts, torch.ones_like(weights), _experts(seed)),
        "each expert's output written over the rows (out[rows] = ...) instead of added: a "
        "token's later expert erases its earlier one": _overwritten(h, experts, weights,
                                                                     _experts(seed)),
    }
    for mistake, output in named.items():
        if torch.allclose(out, output, atol=1e-5):
            raise verdict(what, f"your output is what {mistake} gives", hint, mistake)
    err = float((out - want).abs().max())
    raise verdict(what, f"largest difference from the weighted sum of each token's experts: "
                         f"{err:.3g}", hint)
