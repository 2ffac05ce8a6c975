"""Speculative decoding: a cheap draft proposes, the target verifies many tokens in one pass.

Batch-1 decoding is memory-bound (chapter 05): one decode step reads every weight to
produce one token, so scoring a handful of positions in one forward pass costs the
target about as much as scoring one. Speculative sampling (Leviathan, Kalman & Matias,
2023; Chen et al., 2023) turns that spare capacity into tokens:

1. the **draft** model q proposes gamma tokens x_1..x_gamma, one at a time (cheap);
2. the **target** model p scores all gamma + 1 positions in **one** forward pass;
3. each x_i, in order, is **accepted** with probability min(1, p(x_i) / q(x_i));
4. at the first rejection, one token is drawn from the **residual**
   norm(max(0, p - q)) at that position and the iteration ends; if all gamma pass, a
   **bonus** token is drawn from the target's next distribution p_{gamma+1}.

Every iteration emits between 1 and gamma + 1 tokens for one target call, and the
output has *exactly* the target's distribution: for any token x,
P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) * residual(x)
     = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x).
So speculative decoding changes the speed, never the text's distribution; with greedy
settings on both sides it emits the target's greedy text token for token.

p and q are the exact distributions the sampler draws from (``ar_lab.engine.sampling.probabilities``
with the same ``SamplingParams`` on both sides), so temperature, top-k/top-p/min-p and the
repetition penalty are honoured. ``speculative_generate`` keeps the budget, EOS and the stats; one
round, ``speculative_iteration`` (or chapter 07's learner's, passed as ``iteration=``), drives each
model through a ``Side`` (``ar_lab.engine.sides``: its decoder and cache at implicit positions): it
feeds what the cache lacks, and rolls both caches back (``truncate``) to the new text minus its last
token, which drops the rejected drafts; after a full accept the draft has not yet read its own last
proposal, which the next round feeds together with the bonus token.

The theory (Leviathan et al., 2023, section 3): with a per-token acceptance probability alpha =
sum_x min(p(x), q(x)) = 1 - TV(p, q), an iteration emits (1 - alpha^(gamma+1)) / (1 - alpha) tokens
on average, and if a draft step costs c target steps, the expected wall-clock speedup is that
divided by (gamma c + 1); ``ar_lab.course.views.speculative_view`` measures all of this on real
prompts (chapter 07's explorer).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ar_lab.base.args import finite_number, positive_int
from ar_lab.base.errors import BadType, BadValue
from ar_lab.base.timing import synchronize
from ar_lab.engine.accept import Accept, AcceptRule, draw
from ar_lab.engine.decoder import pick_decoder
from ar_lab.engine.lookup import is_proposer
from ar_lab.engine.prompts import check_eos, check_prompt, loop_model, prompt_ids
from ar_lab.engine.sampling import GREEDY, SamplingParams
from ar_lab.engine.sides import (
    Distributions,
    ProposerSide,
    Side,
    check_rolled_back,
    checked_emitted,
)
from ar_lab.model.cache import KVCache
from ar_lab.model.inference import inference
from ar_lab.model.tokenizer import EOS_ID, N_BYTES, decode

# --- the theory ------------------------------------------------------------------------

# the most draft tokens per iteration any function here takes (far past any useful gamma)
MAX_GAMMA = 10_000


def _check_alpha(alpha: float) -> float:
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not 0.0 <= alpha <= 1.0:
        raise BadValue(
            f"alpha (the acceptance rate) must be a number in [0, 1], got {alpha!r}", arg="alpha"
        )
    return float(alpha)


def _check_gamma(gamma: int, name: str = "gamma (draft tokens per iteration)") -> int:
    arg = name.split(" ")[0]  # the argument's name, before the gloss
    if positive_int(name, gamma, minimum=0, arg=arg) > MAX_GAMMA:
        raise BadValue(
            f"{name} must be at most {MAX_GAMMA:,} (this module's limit), got {gamma:,}", arg=arg
        )
    return gamma


def _check_cost(c: float) -> float:
    return finite_number("c (draft step cost / target step cost)", c, arg="c")


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(p(x), q(x)): the probability that a draft token drawn from q is accepted.

    Works along the last axis, so (vocab,) gives a scalar and (T, vocab) one value per row.
    """
    _check_pq(p, q)
    return torch.minimum(p, q).sum(dim=-1)


def _check_pq(p, q) -> None:
    if not isinstance(p, torch.Tensor) or not isinstance(q, torch.Tensor):
        raise BadType(
            f"p and q must be probability tensors, got {type(p).__name__} and {type(q).__name__}",
            arg="p" if not isinstance(p, torch.Tensor) else "q",
        )
    if p.shape != q.shape:
        raise BadValue(
            f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}", arg="q"
        )


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """TV(p, q) = sum_x |p(x) - q(x)| / 2; alpha = 1 - TV."""
    _check_pq(p, q)
    return (p - q).abs().sum(dim=-1) / 2


def expected_tokens_per_iteration(alpha: float, gamma: int) -> float:
    """(1 - alpha^(gamma+1)) / (1 - alpha) = 1 + alpha + ... + alpha^gamma; gamma + 1 at alpha = 1.

    Each of the gamma drafts is accepted with probability alpha (independently, the
    theory's simplification) until the first rejection; the iteration then adds one
    token of its own (the residual draw, or the bonus when all passed).
    """
    alpha, gamma = _check_alpha(alpha), _check_gamma(gamma)
    if alpha == 1.0:
        return float(gamma + 1)
    if alpha == 0.0:
        return 1.0
    # The closed form loses digits as alpha -> 1 (1 - alpha^(g+1) and 1 - alpha both -> 0);
    # expm1 keeps them: alpha^k - 1 = expm1(k log alpha), and log is accurate near 1.
    log_a = math.log(alpha)
    return math.expm1((gamma + 1) * log_a) / math.expm1(log_a)


def expected_speedup(alpha: float, gamma: int, c: float) -> float:
    """Expected wall-clock speedup over plain decoding: tokens per iteration / (gamma c + 1).

    An iteration costs gamma draft steps (c target steps each) plus one target pass,
    which the theory counts as one target step (scoring gamma + 1 positions is memory-
    bound like a single step). gamma = 0 is plain decoding: speedup 1.
    """
    c = _check_cost(c)
    return expected_tokens_per_iteration(alpha, gamma) / (gamma * c + 1.0)


def best_gamma(alpha: float, c: float, max_gamma: int = 64) -> int:
    """The gamma in 0..max_gamma with the largest expected speedup (0: speculation does not pay).

    The speedup rises then falls in gamma, except at alpha = 1 and c < 1, where every draft
    is always accepted and costs less than a target step (then max_gamma wins). Ties go to the
    smaller gamma. Every gamma is tried: ``max_gamma`` is at most ``MAX_GAMMA``.
    """
    _check_alpha(alpha), _check_cost(c), _check_gamma(max_gamma, "max_gamma")
    speedups = [expected_speedup(alpha, g, c) for g in range(max_gamma + 1)]
    return max(range(max_gamma + 1), key=lambda g: (speedups[g], -g))


def alpha_for_speedup(
    speedup: float, gamma: int, c: float, verify_cost: float = 1.0
) -> float | None:
    """The smallest alpha at which (tokens per iteration) / (gamma c + verify_cost) reaches
    ``speedup``.

    ``verify_cost`` is the verifying pass in target steps (the theory's 1; measure it on a
    real machine). None if even alpha = 1 falls short. Found by bisection: the expected
    tokens per iteration grow with alpha.
    """
    _check_gamma(gamma), _check_cost(c)
    speedup = finite_number("speedup", speedup, above=True)
    verify_cost = finite_number("verify_cost", verify_cost, above=True)
    need = speedup * (gamma * c + verify_cost)  # tokens per iteration needed
    if expected_tokens_per_iteration(1.0, gamma) < need:
        return None
    if expected_tokens_per_iteration(0.0, gamma) >= need:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_iteration(mid, gamma) < need else (lo, mid)
    return hi


# --- the decode loop -----------------------------------------------------------------------


@dataclass
class SpeculativeStats:
    gamma: int
    # target forward passes: one per iteration (the first also reads the prompt)
    target_calls: int = 0
    draft_calls: int = 0  # draft forward passes: gamma per iteration (fewer near the end)
    proposals: int = 0  # draft tokens proposed
    tested: int = 0  # draft tokens the target decided on (up to and including the first rejection)
    acceptances: int = 0  # draft tokens accepted
    produced: int = 0  # tokens emitted, EOS included (what max_new_tokens counts)
    # sum over tested positions of sum_x min(p, q), the exact acceptance probability
    alpha_sum: float = 0.0
    accepted_per_iteration: list[int] = field(default_factory=list)
    # tokens each iteration added (EOS cuts)
    emitted_per_iteration: list[int] = field(default_factory=list)
    target_positions: int = 0  # positions fed to the target (prompt + draft blocks)
    draft_positions: int = 0
    target_time: float = 0.0  # seconds in target forward passes (and their distributions)
    draft_time: float = 0.0  # seconds in draft forward passes (and their draws)
    # seconds from the first forward pass to the last token (as generate counts)
    total_time: float = 0.0
    stop_reason: str = ""  # "eos" or "max_new_tokens"

    @property
    def alpha(self) -> float:
        """Measured acceptance rate: accepted / tested draft tokens (the theory's alpha)."""
        return self.acceptances / self.tested if self.tested else float("nan")

    @property
    def alpha_exact(self) -> float:
        """Mean of sum_x min(p, q) over the tested positions: alpha without the coin flips'
        noise."""
        return self.alpha_sum / self.tested if self.tested else float("nan")

    @property
    def tokens_per_target_call(self) -> float:
        return self.produced / self.target_calls if self.target_calls else float("nan")

    @property
    def draft_time_per_call(self) -> float:
        return self.draft_time / self.draft_calls if self.draft_calls else float("nan")


@dataclass
class SpeculativeGeneration:
    prompt: list[int]
    tokens: list[int]  # the new tokens (EOS, when it ended the text, is not included)
    text: str
    stats: SpeculativeStats


# An iteration: (target, draft, seq, gamma, accept, probs, generator) -> the tokens it emits.
Iteration = Callable[..., list]


def speculative_iteration(
    target, draft, seq: list[int], gamma: int, accept, probs, generator
) -> list[int]:
    """One round of speculative decoding, ar_lab's: the draft proposes ``gamma`` tokens, the target
    verifies.

    ``target``, ``draft``: ``Side``s (a ``ProposerSide`` for a proposer function); ``seq``: the text
    so far; ``accept``, ``probs``: the loop's ``Accept`` and ``Distributions``. Each cache holds at
    most the text minus its last token when the round starts, so a pass feeds what its cache lacks
    (after a full accept the draft lacks its own last proposal too). The round returns the accepted
    drafts and one token of the target's (the residual draw or the bonus), after rolling both caches
    back to the new text minus its last token. Greedy without a penalty takes the argmax directly
    (no distributions built) unless the accept rule is one's own, which then sees one-hot p and q.
    """
    fast = getattr(probs, "argmax_only", False) and not getattr(accept, "checked", True)
    drafts, qs = _propose(draft, seq, gamma, probs, generator, fast)
    g = len(drafts)  # a proposer may find fewer than asked for, or none
    text = seq + drafts
    # (g + 1, V): one pass over the last token and drafts
    logits = target.feed(text[target.length :])[-(g + 1) :]
    if fast:
        best = probs.pick(logits)  # the target's greedy token at each position
        n = next((i for i in range(g) if drafts[i] != best[i]), g)
        emitted = drafts[:n] + [best[n]]
    else:
        if g and not qs:  # a proposer's drafts are certain: q one-hot
            qs = torch.nn.functional.one_hot(
                torch.tensor(drafts, device=logits.device), logits.shape[-1]
            ).float()
        n, dist = accept(probs(logits, text), qs, drafts)
        emitted = drafts[:n] + [draw(dist, generator)]
    keep = len(seq) + n  # the new text minus its last token: the rejected drafts' keys go
    target.truncate(keep)
    draft.truncate(min(draft.length, keep))
    return emitted


def _propose(
    draft, seq: list[int], gamma: int, probs, generator, fast: bool
) -> tuple[list[int], list]:
    """The draft's tokens (one pass each; its first pass feeds whatever its cache lacks) and the
    distributions q they were drawn from (none on the fast path; a proposer's: none, its drafts are
    certain)."""
    if isinstance(draft, ProposerSide):
        return (draft.propose(seq, gamma) if gamma else []), []
    drafts: list[int] = []
    qs: list[torch.Tensor] = []
    for _ in range(gamma):
        text = seq + drafts
        logits = draft.feed(text[draft.length :])[-1]  # (V,)
        if fast:
            drafts.append(probs.pipeline.one(logits))
        else:
            qs.append(probs(logits, text))
            drafts.append(draw(qs[-1], generator))
    return drafts, qs


class Speculation:
    """The state of one speculative generation: the two sides, the text so far, the counters.

    ``iteration`` runs one round (``speculative_iteration``, or an iteration of one's own) and
    counts what it can observe: each side's passes and positions, the tokens emitted, the drafts
    accepted (the tokens returned but the last), and the time before and after the target's first
    pass.
    """

    def __init__(
        self,
        target,
        draft,
        prompt: list[int],
        max_new_tokens: int,
        gamma: int,
        *,
        sampling,
        generator,
        clock,
        lean,
        accept: AcceptRule | None = None,
        iteration: Iteration | None = None,
    ):
        self.clock, self.device, self.gamma = clock, target.device, gamma
        self.seq = list(prompt)  # prompt + tokens emitted so far
        self.stats = SpeculativeStats(gamma=gamma)
        V = target.config.vocab_size
        self.step = iteration or speculative_iteration
        # Neither model ever needs the last emitted token's keys: at most P + N - 1 positions. An
        # iteration of one's own gets the whole window, so that one which forgets a rollback runs on
        # (and shows it).
        def cache(m):
            return KVCache.for_model(
                m, max_len=None if iteration else len(prompt) + max_new_tokens - 1
            )

        # Each call has its own decoders (their working memory and the verify pass's weight copies
        # are this call's, taken from the weights as they are now: this is not a generator).
        # each side holds the prompt but its last token (read with its first pass)
        held = prompt[:-1]
        self.target = Side(
            target, cache(target), pick_decoder(target, lean=lean), clock, "target", held
        )
        self.draft = (
            ProposerSide(draft, V)
            if is_proposer(draft)
            else Side(draft, cache(draft), pick_decoder(draft, lean=lean), clock, "draft", held)
        )
        self.accept = Accept(accept, V, generator)
        self.probs = Distributions(sampling, V)
        self.generator = generator

    def iteration(self, g: int, eos_id: int | None) -> None:
        """One round: the draft proposes g tokens, the target verifies them, the text grows by 1 to
        g + 1."""
        stats, target, draft, accept = self.stats, self.target, self.draft, self.accept
        before = (
            target.calls,
            target.positions,
            draft.calls,
            draft.positions,
            getattr(draft, "proposed", 0),
            accept.calls,
            accept.alpha_sum,
        )
        target.started = None
        t0 = self.clock()
        emitted = self.step(target, draft, list(self.seq), g, accept, self.probs, self.generator)
        emitted = checked_emitted(emitted, g, target.vocab_size)
        # a cache that does not match the text would make the next pass wrong
        for side in (target, draft):
            check_rolled_back(side, self.seq + emitted)
        synchronize(self.device)
        t1 = self.clock()
        split = t1 if target.started is None else target.started
        stats.draft_time += split - t0
        stats.target_time += t1 - split
        stats.target_calls += target.calls - before[0]
        stats.target_positions += target.positions - before[1]
        stats.draft_calls += draft.calls - before[2]
        stats.draft_positions += draft.positions - before[3]
        n = len(emitted) - 1  # the accepted drafts; the last token is the target's
        proposed = (
            accept.last_gamma
            if accept.calls > before[5]
            else getattr(draft, "proposed", 0) - before[4]
            if isinstance(draft, ProposerSide)
            else draft.calls - before[2]
        )
        # sum min(p, q) over the decided positions, from the distributions the rule saw; on greedy's
        # argmax path (no distributions: one-hot p and q) 1 where they agreed
        stats.alpha_sum += accept.alpha_sum - before[6] if accept.calls > before[5] else n
        stats.proposals += proposed
        stats.tested += min(proposed, n + 1)
        stats.acceptances += n
        stats.accepted_per_iteration.append(n)
        if eos_id is not None and eos_id in emitted:
            emitted = emitted[: emitted.index(eos_id) + 1]
        self.seq += emitted
        stats.produced += len(emitted)
        stats.emitted_per_iteration.append(len(emitted))


def _check_pair(
    target, draft, prompt, max_new_tokens: int, gamma: int, sampling, generator, clock
) -> list[int]:
    """The prompt's ids, after checking every argument of ``speculative_generate`` once."""
    ids = prompt_ids(prompt)
    _check_gamma(gamma)
    if not isinstance(sampling, SamplingParams):
        raise BadType(
            f"sampling must be a SamplingParams, got {type(sampling).__name__}", arg="sampling"
        )
    if (
        bad_generator := generator is not None and not isinstance(generator, torch.Generator)
    ) or not callable(clock):
        raise BadType(
            f"generator must be None or a torch.Generator, clock a function: got {generator!r}, "
            f"{clock!r}",
            arg="generator" if bad_generator else "clock",
        )
    loop_model(target, "target")
    if is_proposer(draft):  # a proposer function: only the target is a model
        check_prompt(target, ids, max_new_tokens)
        return ids
    loop_model(draft, "draft")
    for role, model in (("target", target), ("draft", draft)):  # the text within each one's window
        try:
            check_prompt(model, ids, max_new_tokens)
        except BadValue as e:  # a draft of another vocabulary: said as such, just below
            if model.config.vocab_size == target.config.vocab_size:
                raise type(e)(f"{role} model: {e}", arg=e.arg) from None
    if (vocab := draft.config.vocab_size) != target.config.vocab_size:
        raise BadValue(
            f"draft and target must share the vocabulary: {vocab} vs {target.config.vocab_size} "
            "tokens",
            arg="draft",
        )
    if draft.device != target.device:
        raise BadValue(
            f"draft is on {draft.device}, target on {target.device}: put both on one device",
            arg="draft",
        )
    return ids


def speculative_generate(
    target,
    draft,
    prompt: str | Sequence[int],
    max_new_tokens: int = 200,
    gamma: int = 4,
    *,
    sampling: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
    eos_id: int | None = EOS_ID,
    clock: Callable[[], float] = time.perf_counter,
    lean: bool = True,
    accept: AcceptRule | None = None,
    iteration: Iteration | None = None,
) -> SpeculativeGeneration:
    """Generate like ``ar_lab.generate(target, ...)`` with ``draft`` proposing ``gamma`` tokens at a
    time.

    The output has exactly the target's distribution under ``sampling`` (token for token the same
    text when greedy); only the speed and ``stats`` differ. Stops at ``eos_id`` (not included in
    ``tokens``) or after ``max_new_tokens`` tokens, as ``generate`` does. ``gamma = 0`` is plain
    decoding with the target (at most ``MAX_GAMMA``). Random draws come from ``generator``.
    ``clock`` times the stats (wall clock by default; see ``ar_lab.base.timing.steady_clock``).
    Forward passes of a ``GPT`` after the prompt run through ``ar_lab.engine.lean`` (one token: its
    decode step; the verify pass: its multi-token ``extend``), as ``generate``'s do; ``lean=False``
    uses ``model.forward``. ``accept``: an accept rule of one's own in place of ``accept_step``
    (chapter 07's learner passes theirs; greedy then runs on one-hot distributions through it, not
    the argmax shortcut). ``draft`` may also be a *proposer*, a function (tokens so far, k) -> at
    most k token ids, such as ``ar_lab.engine.lookup.PromptLookup()``: its tokens are drafts whose q
    is one-hot (the same exact rule). ``iteration``: one round of one's own in place of
    ``speculative_iteration`` (chapter 07's learner passes theirs), called as ``iteration(target,
    draft, seq, gamma, accept, probs, generator)`` with the two ``Side``s (each model's cache
    already holds the prompt but its last token), the text so far, the drafts to propose, the loop's
    ``Accept`` and ``Distributions`` and the generator; it returns the 1 to gamma + 1 tokens it
    emits and leaves each cache holding at most the new text minus its last token. This loop keeps
    the budget, EOS and the stats (``alpha_exact`` from the distributions ``accept`` saw).
    """
    ids = _check_pair(target, draft, prompt, max_new_tokens, gamma, sampling, generator, clock)
    if accept is not None and not callable(accept):
        raise BadType(
            "accept must be a function (p, q, drafts, u) -> (n, dist) or None: "
            f"{type(accept).__name__}",
            arg="accept",
        )
    if iteration is not None and not callable(iteration):
        raise BadType(
            "iteration must be a function (target, draft, seq, gamma, accept, probs, generator) "
            f"-> tokens, or None: got {type(iteration).__name__}",
            arg="iteration",
        )
    check_eos(target, eos_id)
    run = Speculation(
        target,
        draft,
        ids,
        max_new_tokens,
        gamma,
        sampling=sampling,
        generator=generator,
        clock=clock,
        lean=lean,
        accept=accept,
        iteration=iteration,
    )
    stats = run.stats
    with inference(*(m for m in (target, draft) if not is_proposer(m))):
        t_start = clock()  # as generate's clock: from the first forward pass on
        while stats.produced < max_new_tokens:
            # never past max_new_tokens
            run.iteration(min(gamma, max_new_tokens - stats.produced - 1), eos_id)
            if eos_id is not None and run.seq[-1] == eos_id:
                break
    tokens = run.seq[len(ids) :]
    if eos_id is not None and tokens and tokens[-1] == eos_id:
        tokens.pop()
        stats.stop_reason = "eos"
    else:
        stats.stop_reason = "max_new_tokens"
    stats.total_time = clock() - t_start
    text = decode([t for t in tokens if t < N_BYTES])
    return SpeculativeGeneration(ids, tokens, text, stats)


def token_sources(stats: SpeculativeStats) -> list[str]:
    """For each emitted token, who chose it: "draft" (an accepted proposal) or "target".

    Iteration k emitted ``accepted_per_iteration[k]`` drafts, then one target token
    (the residual draw or the bonus), unless EOS cut it short.
    """
    if not isinstance(stats, SpeculativeStats):
        raise BadType(
            f"stats must be a SpeculativeStats (speculative_generate(...).stats), got {stats!r}",
            arg="stats",
        )
    sources: list[str] = []
    for n, emitted in zip(stats.accepted_per_iteration, stats.emitted_per_iteration, strict=True):
        sources += (["draft"] * n + ["target"])[:emitted]
    return sources
