"""Checkers for the GPT's pieces (chapters 02, 03 and 03b): where a learner's model parts from the
course's.

A learner writes each piece of the GPT (embeddings, attention, MLP, block, the whole model) with
the course model's parameter names, so the course's weights load into it and its outputs can be
compared with ``ar_lab.model.gpt``'s; then its parameter count, its loss, a training step and a
greedy loop. When they differ, these helpers say why:

- ``*_mistakes``: what the course's own piece computes with a common mistake (no causal mask, the
  exact GELU, a missing residual connection, the tied output layer counted twice, the loss summed
  instead of averaged, the gradients never reset, ...); ``checks.check_matches(mistakes=...)`` and
  ``mistakes.check_exact`` / ``mistakes.name_mistake`` name the one a learner's output equals.
- ``Piece``: the course's own part inside the learner's module, so a test of the block checks only
  what the block adds (its LayerNorms and residual connections).
- ``locate_difference`` / ``check_model``: hooks on every submodule of both models find the first
  one (``blocks.1.mlp``, say) whose input or output differs.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ar_lab.course.checkers.checks import CheckFailed, check_matches
from ar_lab.course.checkers.mistakes import generation_mistakes
from ar_lab.model.data import get_batch
from ar_lab.model.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig
from ar_lab.model.train import TrainConfig, lr_at, make_optimizer, train, train_step


class Piece(torch.nn.Module):
    """A module of ``ar_lab.model.gpt`` called as ``piece(x)``, its extra arguments fixed (the
    block's ``cache, layer, start``): a test puts the course's own part inside the learner's
    module."""

    def __init__(self, module: torch.nn.Module, *args: Any) -> None:
        super().__init__()
        self.module, self.args = module, args

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x, *self.args)


# --- common mistakes, computed with the course's own pieces ------------------------------


@torch.no_grad()
def embedding_mistakes(
    wte: torch.Tensor, wpe: torch.Tensor, idx: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Token ids idx (B, T) embedded with tables wte (V, C) and wpe (block_size, C), wrongly."""
    T = idx.shape[1]
    tokens = wte[idx]  # (B, T, C)
    out = {
        "the token embeddings alone (no position embedding)": tokens,
        "the position embeddings alone (no token embedding)": wpe[:T].expand_as(tokens),
    }
    if T < wpe.shape[0]:
        out["positions counted from 1 instead of 0"] = tokens + wpe[1 : T + 1]
    return out


@torch.no_grad()
def attention_mistakes(attn: CausalSelfAttention, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The course's multi-head attention (with n_kv_heads == n_head) on x (B, T, C), wrongly."""
    B, T, C = x.shape
    H, D = attn.n_head, C // attn.n_head
    q, k, v = attn.qkv(x).split(C, dim=-1)  # each (B, T, C)

    def heads(t: torch.Tensor) -> torch.Tensor:  # (B, T, (h d)) -> (B, H, T, D)
        return t.view(B, T, H, D).transpose(1, 2)

    def merged(y: torch.Tensor) -> torch.Tensor:  # (B, H, T, D) -> (B, T, (h d))
        return y.transpose(1, 2).reshape(B, T, C)

    # (B, T, (d h)) -> (B, H, T, D): the wrong split
    def interleaved(t: torch.Tensor) -> torch.Tensor:
        return t.view(B, T, D, H).permute(0, 3, 1, 2)

    sdpa = F.scaled_dot_product_attention
    q, k, v = heads(q), heads(k), heads(v)
    wrong = sdpa(*(interleaved(t) for t in attn.qkv(x).split(C, dim=-1)), is_causal=True)
    return {
        "attention without the causal mask (every position also reads the future)": attn.proj(
            merged(sdpa(q, k, v))
        ),
        "attention without the 1/√d scaling of the scores": attn.proj(
            merged(sdpa(q, k, v, is_causal=True, scale=1.0))
        ),
        "scores divided by √C (the model width) instead of √d (the head size)": attn.proj(
            merged(sdpa(q, k, v, is_causal=True, scale=1 / math.sqrt(C)))
        ),
        "attention without the output projection (proj)": merged(sdpa(q, k, v, is_causal=True)),
        "heads cut from interleaved channels ('(d h)' instead of '(h d)')": attn.proj(
            wrong.permute(0, 2, 3, 1).reshape(B, T, C)
        ),
    }


@torch.no_grad()
def mlp_mistakes(mlp: MLP, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The course's MLP on x (..., C), wrongly."""
    h = mlp.fc(x)  # (..., 4C)
    return {
        "the exact GELU (the course model uses the tanh approximation, "
        "approximate='tanh')": mlp.proj(F.gelu(h)),
        "ReLU instead of GELU": mlp.proj(F.relu(h)),
        "no activation between the two layers": mlp.proj(h),
    }


@torch.no_grad()
def block_mistakes(block: Block, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The course's block (its own attention and MLP) on x (B, T, C), wired wrongly."""

    def attn(h: torch.Tensor) -> torch.Tensor:
        return block.attn(h, None, 0, 0)

    a = attn(block.ln1(x))  # the attention branch
    h = x + a  # after the first residual connection
    post = block.ln1(x + attn(x))
    return {
        "a block without its first residual connection (x = attn(ln1(x)) instead of x = x + "
        "attn(ln1(x)))": a + block.mlp(block.ln2(a)),
        "a block without its second residual connection (mlp(ln2(x)) returned without "
        "adding x)": block.mlp(block.ln2(h)),
        "a block without either residual connection": block.mlp(block.ln2(a)),
        "a post-norm block (LayerNorm after each residual add, as in the original "
        "Transformer)": block.ln2(post + block.mlp(post)),
        "a block whose MLP branch reads the block's input x instead of x after attention": h
        + block.mlp(block.ln2(x)),
        "one LayerNorm (ln1) in front of both branches": h + block.mlp(block.ln1(h)),
    }


@torch.no_grad()
def gpt_mistakes(gpt: GPT, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """The course's GPT (its own blocks) on token ids idx (B, T), assembled wrongly."""
    T = idx.shape[1]

    def run(x: torch.Tensor, final_norm: bool = True) -> torch.Tensor:
        for layer, block in enumerate(gpt.blocks):
            x = block(x, None, layer, 0)
        return gpt.lm_head(gpt.ln_f(x) if final_norm else x)

    tokens, positions = gpt.wte(idx), gpt.wpe.weight
    out = {
        "a GPT without position embeddings": run(tokens),
        "a GPT without the final LayerNorm (ln_f)": run(tokens + positions[:T], final_norm=False),
    }
    if T < positions.shape[0]:
        out["a GPT whose positions count from 1 instead of 0"] = run(tokens + positions[1 : T + 1])
    return out


def param_count_mistakes(cfg: GPTConfig, right: int) -> dict[str, int]:
    """The parameter count of ``GPT(cfg)`` (with ``n_kv_heads == n_head``; ``right`` is the true
    count), counted wrongly."""
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    biases = L * (3 * C + C + 4 * C + C)  # qkv, attention proj, MLP fc, MLP proj
    norms = (2 * L + 1) * 2 * C  # two per block and the final one, a weight and a bias each
    block = 12 * C * C + 13 * C  # attention 4C^2 + 4C, MLP 8C^2 + 5C, LayerNorms 4C
    return {
        "counting the tied output layer again (V x C more)": right + V * C,
        "leaving out the biases": right - biases,
        "leaving out the LayerNorms": right - norms,
        "counting one vector per LayerNorm (each has a weight and a bias)": right - norms // 2,
        "leaving out the final LayerNorm (ln_f)": right - 2 * C,
        "leaving out the position embedding (block_size x C)": right - cfg.block_size * C,
        "counting one block instead of n_layer": right - (L - 1) * block,
    }


@torch.no_grad()
def cross_entropy_mistakes(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """The mean next-token cross-entropy of ``logits`` (..., V) against ``targets`` (...), computed
    wrongly."""
    flat, y = logits.reshape(-1, logits.shape[-1]).double(), targets.reshape(-1)  # (N, V), (N,)
    rows = torch.arange(len(y))
    log_p = flat.log_softmax(dim=-1)[rows, y]  # log p(target) at each position, (N,)
    # normalised over the N positions: the wrong dimension
    across_positions = flat.log_softmax(dim=0)[rows, y]
    out = {
        "the sum over positions instead of the mean": -log_p.sum(),
        "the mean log-probability without the minus sign": log_p.mean(),
        "the probability of the target instead of its log": -flat.softmax(dim=-1)[rows, y].mean(),
        "the target's raw logit, without the log-softmax": -flat[rows, y].mean(),
        "the log-softmax over the positions (dim 0) instead of the vocabulary": (
            -across_positions.mean()
        ),
    }
    if logits.ndim == 3:
        out["the loss of the first sequence only"] = -log_p.view(targets.shape)[0].mean()
    return {k: v.float() for k, v in out.items()}


class Trained(NamedTuple):
    model: GPT  # after training
    losses: list[float]  # the training loss of every step


def _trainer_steps(
    model: GPT, train_tokens: torch.Tensor, tc: TrainConfig, optimizer: torch.optim.Optimizer
) -> list:
    """``ar_lab.model.train.train``'s steps (its seeds, batches, schedule and ``train_step``) with
    ``optimizer``."""
    torch.manual_seed(tc.seed)
    g = torch.Generator().manual_seed(tc.seed)
    model.train()
    losses = []
    for step in range(tc.steps):
        x, y = get_batch(train_tokens, tc.batch_size, tc.block_size, g)
        losses.append(train_step(model, optimizer, x, y, lr_at(step, tc), tc.grad_clip))
    model.eval()
    return losses


def _never_reset(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    # the mistake: gradients add up across steps
    optimizer.zero_grad = lambda set_to_none=True: None
    return optimizer


def train_step_mistakes(
    model: GPT, train_tokens: torch.Tensor, val_tokens: torch.Tensor, tc: TrainConfig
) -> dict[str, Trained]:
    """Copies of ``model`` (left untouched) trained by ``ar_lab.model.train``'s trainer as a common
    mistake would, with their loss curves."""
    changed = {
        "training without gradient clipping": replace(tc, grad_clip=None),
        "a constant learning rate (lr_at's warm-up and decay not applied)": replace(
            tc, warmup_steps=1, min_lr_ratio=1.0
        ),
        "training without weight decay": replace(tc, weight_decay=0.0),
    }
    optimizers = {  # the trainer's steps with a wrongly built or wrongly used optimizer
        "gradients never reset (no optimizer.zero_grad() before backward)": lambda m: _never_reset(
            make_optimizer(m, tc)
        ),
        "weight decay on every parameter (biases and LayerNorms too)": lambda m: torch.optim.AdamW(
            m.parameters(), lr=tc.lr, betas=(0.9, 0.99), weight_decay=tc.weight_decay
        ),
    }
    out = {}
    for mistake, config in changed.items():
        trained = copy.deepcopy(model)
        out[mistake] = Trained(
            trained, train(trained, train_tokens, val_tokens, config, progress=False).train_loss
        )
    for mistake, optimizer in optimizers.items():
        trained = copy.deepcopy(model)
        out[mistake] = Trained(
            trained, _trainer_steps(trained, train_tokens, tc, optimizer(trained))
        )
    return out


@torch.no_grad()
def greedy_mistakes(
    model: torch.nn.Module, prompt: list[int], expected: list[int]
) -> dict[str, list[int]]:
    """What a greedy loop over ``model`` that should return ``expected`` (the new tokens after
    ``prompt``) returns with a classic slip."""
    # position 0's logits never change as ids grow
    first = int(model(torch.tensor([prompt]))[0, 0].argmax())
    return {
        **generation_mistakes(prompt, expected, None),
        "the argmax of the first position's logits at every step (instead of the last "
        "position's)": [first] * len(expected),
    }


# --- where two models part ---------------------------------------------------------------


def record_calls(model: torch.nn.Module, run: Callable[[], Any]) -> dict[str, tuple]:
    """Run ``run()`` with a hook on every named submodule of ``model``: {name: (first tensor input,
    output)} of each one's first call, in the order the calls finished."""
    calls: dict[str, tuple] = {}

    def hook(name: str) -> Callable:
        def record(module, args, output):
            if name not in calls:
                calls[name] = (
                    args[0] if args and isinstance(args[0], torch.Tensor) else None,
                    output,
                )

        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules() if name]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return calls


def _same(a: Any, b: Any, atol: float, rtol: float) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
        return False
    return torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol)


def locate_difference(
    mine: torch.nn.Module,
    reference: torch.nn.Module,
    inputs: tuple,
    *,
    atol: float = 1e-4,
    rtol: float = 1e-4,
) -> str:
    """Where two models with the same submodule names first compute different values on ``inputs``,
    in the order the reference's submodules finish (``blocks.0.ln1``, ``blocks.0.attn.qkv``,
    ...)."""
    got = record_calls(mine, lambda: mine(*inputs))
    want = record_calls(reference, lambda: reference(*inputs))
    for name, (x_ref, y_ref) in want.items():
        if name not in got:
            continue
        x, y = got[name]
        if x is not None and x_ref is not None and not _same(x, x_ref, atol, rtol):
            return (
                f"The first difference is in what goes into `{name}`: your code before that call "
                "computes it."
            )
        if not _same(y, y_ref, atol, rtol):
            return f"The first difference is the output of `{name}` (what goes into it agrees)."
    return ""


def check_model(
    what: str,
    mine: torch.nn.Module,
    reference: torch.nn.Module,
    idx: torch.Tensor,
    *,
    atol: float = 1e-4,
    rtol: float = 1e-4,
    mistakes: dict[str, torch.Tensor] | None = None,
    hint: str = "",
) -> None:
    """The learner's model gives the reference's logits for ``idx`` (B, T); if not, also name the
    first submodule (the two share the course model's names) where the two computations part."""
    with torch.no_grad():
        expected, got = reference(idx), mine(idx)
    try:
        check_matches(
            what, got, expected, atol=atol, rtol=rtol, dim=1, mistakes=mistakes, hint=hint
        )
    except CheckFailed as failure:
        where = locate_difference(mine, reference, (idx,), atol=atol, rtol=rtol)
        raise CheckFailed(
            f"{failure}\n{where}" if where else str(failure), failure.mistake
        ) from None
