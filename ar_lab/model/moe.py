"""A mixture of experts in place of the MLP (``GPTConfig(n_experts=E, experts_per_token=k)``).

Each token's normed activation h goes to a router, one linear map to E logits; the k largest pick
the experts that token uses, and a softmax over those k logits alone weights their outputs (the
weights of a token's experts sum to 1, as in Mixtral's layer: equivalently the softmax over all E,
renormalised over the chosen k). Every expert is an MLP of the dense block's shape
(``ar_lab.model.gpt.MLP``, passed in): a token computes k of them, so the FLOPs per token are those
of a dense MLP k times as wide, while the weights are E times a dense MLP's.

Dispatch (``dispatch``) gathers, for each expert some token chose, the rows that chose it, runs the
expert once on them and adds its weighted output back at those rows: an expert no token chose is
neither computed nor read. So decode reads the weights of the *distinct* experts a batch touches.
With routing as good as uniform and independent, B tokens touch E (1 - (1 - k/E)^B) experts of
each layer on average (``expected_experts``): about k for one token, all E once the batch is large.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadValue


def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's decision from its logits (N, E): the k experts of each token (N, k), largest
    logit first, and their weights (N, k), a softmax over those k logits (each row sums to 1).

    Non-finite logits (a NaN from overflowing activations, say) would pick arbitrary experts:
    refused."""
    if not torch.isfinite(logits).all():
        raise BadValue(
            "router: its logits hold NaN or inf (the activations overflowed, or its weights are "
            "not finite): no expert can be picked from them",
            arg="router",
        )
    E = logits.shape[-1]
    if not 1 <= k <= E:
        raise BadValue(f"k must be in 1..{E} (the experts there are), got {k}", arg="k")
    top, experts = logits.topk(k, dim=-1)
    return experts, torch.softmax(top.float(), dim=-1).to(logits.dtype)


def dispatch(
    h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, expert_fns
) -> torch.Tensor:
    """Each token's weighted sum of its experts' outputs: h (N, C), the router's experts and
    weights (N, k), ``expert_fns`` the experts (callables on (rows, C)). Each expert some token
    chose runs once, on all the rows that chose it; the others do not run."""
    out = torch.zeros_like(h)
    for e in experts.unique().tolist():
        rows, slot = (experts == e).nonzero(as_tuple=True)
        out.index_add_(0, rows, expert_fns[e](h[rows]) * weights[rows, slot, None])
    return out


def expected_experts(batch: int, n_experts: int, k: int) -> float:
    """Distinct experts B tokens touch in one layer, on average, if each picks k distinct experts
    uniformly at random: E (1 - (1 - k/E)^B)."""
    batch, n_experts, k = (positive_int(n, v) for n, v in
                           (("batch", batch), ("n_experts", n_experts), ("k", k)))
    if k > n_experts:
        raise BadValue(f"k must be at most n_experts ({n_experts}), got {k}", arg="k")
    return n_experts * (1 - (1 - k / n_experts) ** batch)


class MoE(nn.Module):
    """``n_experts`` expert MLPs and a router; a drop-in for the block's MLP (``forward`` maps
    (..., C) to (..., C))."""

    def __init__(self, cfg, expert: type[nn.Module]) -> None:
        """``expert``: the dense MLP's module class, built from ``cfg`` for each expert."""
        super().__init__()
        self.k = cfg.experts_per_token
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(expert(cfg) for _ in range(cfg.n_experts))
        self.route, self.dispatch = route, dispatch  # (with_pieces puts one's own in their place)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])  # (N, C): every token of every row
        experts, weights = self.route(self.router(h), self.k)
        return self.dispatch(h, experts, weights, self.experts).view(x.shape)


def with_pieces(model, *, route=None, dispatch=None):
    """``model`` with every mixture layer routing through ``route(logits, k)`` and dispatching
    through ``dispatch(h, experts, weights, expert_fns)`` where given (chapter 08c's learner's);
    the model itself, changed in place."""
    layers = _layers(model)
    for fn, name in ((route, "route"), (dispatch, "dispatch")):
        if fn is not None and not callable(fn):
            raise BadValue(f"{name} must be a function, got {type(fn).__name__}", arg=name)
    for m in layers:
        m.route = m.route if route is None else route
        m.dispatch = m.dispatch if dispatch is None else dispatch
    return model


def _layers(model) -> list[MoE]:
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise BadValue("model has no mixture-of-experts layer (GPTConfig.n_experts is 0)",
                       arg="model")
    return layers


@contextlib.contextmanager
def routing(model) -> Iterator[list[torch.Tensor]]:
    """Record, while the block is open, the experts every MoE layer of ``model`` picks: the list
    gets one (N, k) tensor per layer per forward pass, in call order."""
    seen: list[torch.Tensor] = []
    layers = _layers(model)

    def hook(module, inputs, output):
        h = inputs[0].reshape(-1, inputs[0].shape[-1])
        seen.append(module.route(module.router(h), module.k)[0])

    handles = [m.register_forward_hook(hook) for m in layers]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()
