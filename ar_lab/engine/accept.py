"""The accept rule of speculative sampling: which drafts pass, and what the iteration's last token
is drawn from.

One iteration of speculative decoding (``ar_lab.engine.speculative``) has the target's
distributions p at the gamma draft positions and the one after, the draft's q at the gamma
positions, and gamma uniforms u. Draft x_i passes if u_i < p(x_i) / q(x_i), in order, until
the first failure; the iteration then draws its last token from the residual
norm(max(0, p - q)) at that position, or from p at the next position (the bonus token) if
every draft passed. That is what makes the output exactly p's (Leviathan et al., 2023;
Chen et al., 2023). ``accept_step`` is the rule; a rule of one's own with its signature
(``AcceptRule``, chapter 07's exercise) plugs into ``speculative_generate(..., accept=)``,
and ``checked_accept`` checks what it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ar_lab.base.errors import BadValue
from ar_lab.engine.sampling import on_generator_device
from ar_lab.engine.sides import checked_tokens


def accepted_count(p_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor) -> int:
    """How many drafts pass, in order, before the first rejection.

    ``p_x[i]``, ``q_x[i]``: the target's and the draft's probability of draft token x_i;
    ``u[i]``: a uniform draw in [0, 1). x_i passes if u_i < p(x_i) / q(x_i), which happens
    with probability min(1, p(x_i) / q(x_i)) (compared as u q < p: no division, and
    p >= q always passes).
    """
    passed = (u * q_x < p_x).tolist()
    return passed.index(False) if False in passed else len(passed)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what a rejected position draws from, so that the total is p.

    Where q over-proposed, the rejections freed exactly that mass; it is handed to the
    tokens q under-proposed. (If p <= q everywhere, p = q up to rounding and nothing
    can be rejected; p is returned for safety.)
    """
    r = (p.double() - q.double()).clamp_min(0.0)
    total = float(r.sum())
    return (r / total).float() if total > 0 else p


def draw(dist: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a probability vector (vocab,)."""
    return int(torch.multinomial(on_generator_device(dist, generator), 1, generator=generator))


def accept_step(
    p: torch.Tensor, q: torch.Tensor, drafts: list[int], u: torch.Tensor
) -> tuple[int, torch.Tensor]:
    """The accept rule of one iteration: how many drafts pass, and what its last token is drawn
    from.

    ``p`` (gamma + 1, vocab): the target's distributions at the draft positions and the one after;
    ``q`` (gamma, vocab): the draft's, each x_i was drawn from; ``u`` (gamma,) uniforms in [0, 1).
    Returns ``(n, dist)``: at the first rejection its residual norm(max(0, p - q)); if every draft
    passed, the bonus token's distribution p[gamma]. Chapter 07's learner writes the same
    (``ar_lab.engine.speculative.speculative_generate(..., accept=theirs)`` then runs on theirs).
    """
    g = len(drafts)
    rows, x = (
        torch.arange(g, device=p.device),
        torch.tensor(drafts, dtype=torch.long, device=p.device),
    )
    n = accepted_count(p[rows, x].double(), q[rows, x].double(), u.double())
    return n, (residual_distribution(p[n], q[n]) if n < g else p[n])


# An accept rule of one's own (``accept_step``'s signature): (p, q, drafts, u) -> (n, dist).
AcceptRule = Callable[[torch.Tensor, torch.Tensor, list, torch.Tensor], tuple]


def checked_accept(result, g: int, V: int) -> tuple[int, torch.Tensor]:
    """An accept rule's answer, checked: n a whole number in [0, g], dist a probability vector
    (V,)."""
    n, dist = result if isinstance(result, tuple) and len(result) == 2 else (None, None)
    if isinstance(n, torch.Tensor) and n.numel() == 1 and not n.is_floating_point():
        n = n.item()
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= g:
        raise BadValue(
            f"the accept rule must return (n, dist) with n an int in [0, {g}], got {result!r:.200}",
            arg="accept",
        )
    if not isinstance(dist, torch.Tensor) or dist.shape != (V,) or not dist.is_floating_point():
        raise BadValue(
            f"the accept rule must return dist, a float tensor of shape ({V},), got {dist!r:.200}",
            arg="accept",
        )
    if not torch.isfinite(dist).all() or (dist < 0).any() or not abs(float(dist.sum()) - 1) < 1e-3:
        raise BadValue(
            "the accept rule's dist must be a probability vector (>= 0, sum 1), got sum "
            f"{dist.sum()}",
            arg="accept",
        )
    return n, dist.float()


class Accept:
    """The accept rule as the loop hands it to an iteration: ``accept(p, qs, drafts) -> (n, dist)``.

    ``p`` (γ + 1, vocab): the target's distributions at the γ draft positions and the one after;
    ``qs``: the γ distributions (vocab,) the drafts were drawn from (a list, or a (γ, vocab)
    tensor). It draws the γ uniforms from the call's generator, runs the rule (``accept_step``, or
    one of one's own, checked) and counts the exact acceptance probability sum min(p, q) over the
    positions it decided on.
    """

    def __init__(self, rule: AcceptRule | None, vocab_size: int, generator) -> None:
        self.rule, self.checked = rule or accept_step, rule is not None
        self.vocab_size, self.generator = vocab_size, generator
        self.calls, self.last_gamma, self.alpha_sum = 0, 0, 0.0

    def __call__(self, p: torch.Tensor, qs, drafts: Sequence[int]) -> tuple[int, torch.Tensor]:
        drafts = checked_tokens("accept(p, qs, drafts): drafts", drafts, self.vocab_size)
        g, V = len(drafts), self.vocab_size
        q = qs
        if (
            g
            and isinstance(qs, (list, tuple))
            and len(qs) == g
            and all(isinstance(x, torch.Tensor) for x in qs)
        ):
            q = torch.stack(list(qs)) if all(x.shape == (V,) for x in qs) else None
        if not isinstance(p, torch.Tensor) or p.shape != (g + 1, V):
            raise BadValue(
                f"accept(p, qs, drafts): p must be the target's distributions at the {g} drafts' "
                f"positions and the one after, shape ({g + 1}, {V}), got "
                f"{getattr(p, 'shape', p)!r:.80} (the target's pass feeds the text's last token "
                "and the drafts)",
                arg="p",
            )
        self.calls, self.last_gamma = self.calls + 1, g
        if not g:
            return 0, p[0]
        if not isinstance(q, torch.Tensor) or q.shape != (g, V):
            raise BadValue(
                f"accept(p, qs, drafts): qs must be the {g} distributions the drafts were drawn "
                f"from, shape ({g}, {V}), got {getattr(q, 'shape', q)!r:.80}",
                arg="qs",
            )
        # a CPU generator serves a GPU too
        where = p.device if self.generator is None else self.generator.device
        u = torch.rand(g, generator=self.generator, device=where, dtype=torch.float64).to(p.device)
        result = self.rule(p, q, list(drafts), u)
        n, dist = checked_accept(result, g, V) if self.checked else result
        tested = min(g, n + 1)
        # sum min(p, q): alpha, exactly
        self.alpha_sum += float(torch.minimum(p[:tested], q[:tested]).sum())
        return n, dist
