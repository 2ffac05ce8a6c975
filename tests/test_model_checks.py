"""The checkers of chapters 02-03's pieces name the mistake, and the place, where a learner's model
parts."""

import copy

import pytest
import torch
import torch.nn.functional as F

from ar_lab.course.checkers.checks import CheckFailed, check_matches
from ar_lab.course.checkers.model_checks import (
    Piece,
    attention_mistakes,
    block_mistakes,
    check_model,
    embedding_mistakes,
    gpt_mistakes,
    locate_difference,
    mlp_mistakes,
    record_calls,
    train_step_mistakes,
)
from ar_lab.model.data import corpus_tokens, train_val_split
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.model.train import TrainConfig, train
from tests.raising import mistaken


@pytest.fixture
def gpt():
    """A small GPT with weights as large as a trained model's (GPT-2's initialisation is too small
    for its mistakes to show: with tiny activations the exact and the tanh GELU agree to 1e-4)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                1 + 0.1 * torch.randn_like(p)
                if ".ln" in name and name.endswith("weight")
                else 0.3 * torch.randn_like(p)
            )
    return model


def x_for(gpt, T=6):
    return torch.randn(2, T, gpt.config.n_embd, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "mistakes, correct",
    [
        (
            lambda g, x, idx: embedding_mistakes(g.wte.weight, g.wpe.weight, idx),
            lambda g, x, idx: g.wte(idx) + g.wpe.weight[:6],
        ),
        (
            lambda g, x, idx: attention_mistakes(g.blocks[0].attn, x),
            lambda g, x, idx: g.blocks[0].attn(x, None, 0, 0),
        ),
        (lambda g, x, idx: mlp_mistakes(g.blocks[1].mlp, x), lambda g, x, idx: g.blocks[1].mlp(x)),
        (
            lambda g, x, idx: block_mistakes(g.blocks[1], x),
            lambda g, x, idx: g.blocks[1](x, None, 1, 0),
        ),
        (lambda g, x, idx: gpt_mistakes(g, idx), lambda g, x, idx: g(idx)),
    ],
    ids=["embedding", "attention", "mlp", "block", "gpt"],
)
def test_no_mistake_gives_the_right_answer(gpt, mistakes, correct):
    idx = torch.randint(0, 257, (2, 6), generator=torch.Generator().manual_seed(2))
    x = x_for(gpt)
    with torch.no_grad():
        right = correct(gpt, x, idx)
        found = mistakes(gpt, x, idx)
    assert len(found) >= 2
    for mistake, output in found.items():
        assert output.shape == right.shape, mistake
        assert not torch.allclose(output, right, atol=1e-4), (
            f"{mistake!r} is indistinguishable from the right answer"
        )
    check_matches("the right answer", right, right.clone(), mistakes=found)


def test_a_wrong_attention_and_a_missing_residual_are_named(gpt):
    attn, x = gpt.blocks[0].attn, x_for(gpt)
    B, T, C = x.shape
    with torch.no_grad():
        q, k, v = (t.view(B, T, 2, C // 2).transpose(1, 2) for t in attn.qkv(x).split(C, -1))
        unmasked = (q @ k.transpose(-2, -1) / (C // 2) ** 0.5).softmax(-1) @ v  # forgot the mask
        got = attn.proj(unmasked.transpose(1, 2).reshape(B, T, C))
        with mistaken("without the causal mask"):
            check_matches(
                "attention", got, attn(x, None, 0, 0), mistakes=attention_mistakes(attn, x)
            )
        block = gpt.blocks[1]
        h = x + block.attn(block.ln1(x), None, 1, 0)
        no_second_residual = block.mlp(block.ln2(h))
        with mistaken("without its second residual connection"):
            check_matches(
                "block", no_second_residual, block(x, None, 1, 0), mistakes=block_mistakes(block, x)
            )
        exact_gelu = block.mlp.proj(F.gelu(block.mlp.fc(x)))
        with mistaken("exact GELU"):
            check_matches("mlp", exact_gelu, block.mlp(x), mistakes=mlp_mistakes(block.mlp, x))


def test_piece_calls_a_course_module_with_its_extra_arguments(gpt):
    x = x_for(gpt)
    with torch.no_grad():
        assert torch.equal(Piece(gpt.blocks[1], None, 1, 0)(x), gpt.blocks[1](x, None, 1, 0))


def test_record_calls_sees_every_submodule_in_the_order_it_finished(gpt):
    idx = torch.tensor([[1, 2, 3]])
    calls = record_calls(gpt, lambda: gpt(idx))
    names = list(calls)
    assert names[0] == "wte" and names[-1] == "lm_head"
    assert (
        names.index("blocks.0.ln1")
        < names.index("blocks.0.attn.qkv")
        < names.index("blocks.0.attn")
        < names.index("blocks.0")
    )
    x_in, out = calls["blocks.1"]
    assert x_in.shape == out.shape == (1, 3, 16)
    assert not any(m._forward_hooks for m in gpt.modules())  # the hooks are gone


def test_check_model_passes_a_copy_and_locates_a_broken_submodule(gpt):
    idx = torch.tensor([[5, 6, 7, 8]])
    mine = copy.deepcopy(gpt)
    check_model("copy", mine, gpt, idx)
    with torch.no_grad():
        mine.blocks[1].mlp.fc.bias += 0.5
    assert locate_difference(mine, gpt, (idx,)) == (
        "The first difference is the output of `blocks.1.mlp.fc` (what goes into it agrees)."
    )
    with pytest.raises(
        CheckFailed, match=r"(?s)the first position that differs is 0.*`blocks.1.mlp.fc`"
    ):
        check_model("broken", mine, gpt, idx)


def test_locate_difference_blames_the_code_between_submodules():
    torch.manual_seed(0)
    ref = GPT(GPTConfig(block_size=8, n_layer=1, n_head=1, n_embd=8)).eval()

    class NoPositions(GPT):
        def forward(self, idx, cache=None):  # forgot wpe: the input of the first block differs
            x = self.wte(idx)
            for layer, block in enumerate(self.blocks):
                x = block(x, None, layer, 0)
            return self.lm_head(self.ln_f(x))

    mine = NoPositions(ref.config).eval()
    mine.load_state_dict(ref.state_dict())
    idx = torch.tensor([[1, 2, 3]])
    assert locate_difference(mine, ref, (idx,)).startswith(
        "The first difference is in what goes into `blocks.0.ln1`"
    )
    with mistaken("without position embeddings"):
        check_model("no positions", mine, ref, idx, mistakes=gpt_mistakes(ref, idx))


def test_train_step_mistakes_each_train_differently_and_leave_the_model_alone():
    torch.manual_seed(0)
    start = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16))
    before = copy.deepcopy(start.state_dict())
    tokens, val = train_val_split(corpus_tokens())
    tc = TrainConfig(
        steps=3,
        batch_size=2,
        block_size=16,
        lr=1e-2,
        warmup_steps=2,
        weight_decay=1.0,
        grad_clip=0.2,
        eval_every=100,
        eval_batches=1,
    )
    found = train_step_mistakes(start, tokens, val, tc)
    assert all(torch.equal(v, start.state_dict()[k]) for k, v in before.items())
    right = copy.deepcopy(start)
    train(right, tokens, val, tc, progress=False)
    for mistake, (model, losses) in found.items():
        moved = max(
            (p - q).abs().max().item()
            for p, q in zip(model.parameters(), right.parameters(), strict=True)
        )
        assert moved > 1e-3, f"{mistake!r} trains almost like the right step ({moved:.2g})"
        assert len(losses) == tc.steps
