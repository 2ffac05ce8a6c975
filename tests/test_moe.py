"""Mixture-of-experts blocks (``GPTConfig(n_experts=...)``, ``ar_lab.model.moe``): the router's
top-k and renormalised weights, dispatch equal to each token through its own experts, only chosen
experts computed, cached = uncached decoding (alone and served in a batch), the expected count of
distinct experts against sampling, and bad input refused with the argument named."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ar_lab
from ar_lab.base.errors import BadType, BadValue
from ar_lab.engine.calibrated import calibrated_model
from ar_lab.engine.quant import QuantizedLinear, quantize_model
from ar_lab.engine.serving import Request, serve
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.model.moe import dispatch, expected_experts, route, routing, with_pieces
from ar_lab.model.widen import widen
from tests.raising import raises


def moe_model(seed=0, **over) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(block_size=64, n_layer=2, n_head=4, n_embd=32, n_experts=8, experts_per_token=2)
    model = GPT(GPTConfig(**{**cfg, **over})).eval()
    with torch.no_grad():  # a router that spreads tokens (a trained one balances its experts)
        for b in model.blocks:
            b.mlp.router.weight.normal_(0, 1.0)
    return model


@given(n=st.integers(1, 12), e=st.integers(1, 9), data=st.data())
def test_route_picks_the_top_k_and_renormalises_their_softmax(n, e, data):
    k = data.draw(st.integers(1, e))
    logits = torch.randn(n, e, generator=torch.Generator().manual_seed(n * 31 + e))
    experts, weights = route(logits, k)
    assert experts.shape == weights.shape == (n, k)
    for row in range(n):
        chosen = experts[row].tolist()
        assert len(set(chosen)) == k
        assert sorted(logits[row].tolist(), reverse=True)[:k] == logits[row, chosen].tolist()
        full = torch.softmax(logits[row], -1)[chosen]  # softmax over all, renormalised over k
        torch.testing.assert_close(weights[row], full / full.sum())
    torch.testing.assert_close(weights.sum(-1), torch.ones(n))


def test_dispatch_equals_each_token_through_its_own_experts():
    moe = moe_model().blocks[0].mlp
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = moe(x)
        h = x.reshape(-1, 32)
        experts, weights = route(moe.router(h), moe.k)
        want = torch.stack([sum(w * moe.experts[e](h[i : i + 1])[0]
                                for e, w in zip(experts[i].tolist(), weights[i], strict=True))
                            for i in range(h.shape[0])]).view(3, 5, 32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class _Fixed(torch.nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, h):
        return self.logits.expand(h.shape[0], -1)


def test_an_expert_no_token_chose_is_neither_computed_nor_read():
    moe = moe_model().blocks[0].mlp
    moe.router = _Fixed(torch.tensor([[5.0, 4.0] + [0.0] * 6]))  # every token: experts 0 and 1

    def untouchable(h):
        raise AssertionError("an expert no token chose was run")

    for e in range(2, 8):
        moe.experts[e].forward = untouchable
    with torch.no_grad():
        out = moe(torch.randn(4, 32))
    assert out.shape == (4, 32) and torch.isfinite(out).all()


@given(prompt=st.lists(st.integers(0, 255), min_size=1, max_size=12),
       n_new=st.integers(1, 20), seed=st.integers(0, 3))
def test_cached_decoding_of_a_mixture_gives_the_uncached_tokens(prompt, n_new, seed):
    model = moe_model(seed)
    cached = ar_lab.generate(model, prompt, n_new, eos_id=None)
    uncached = ar_lab.generate(model, prompt, n_new, eos_id=None, use_cache=False)
    assert cached.tokens == uncached.tokens


def test_a_served_batch_of_a_mixture_gives_each_request_its_own_tokens():
    """Rows share a router call and their experts' products: each still gets its tokens alone."""
    model = moe_model(1)
    g = torch.Generator().manual_seed(2)
    requests = [Request(torch.randint(0, 256, (n,), generator=g).tolist(), new)
                for n, new in [(3, 9), (17, 4), (8, 12), (30, 6), (1, 10)]]
    for kv in ("contiguous", "paged"):
        got = serve(model, requests, max_batch=3, kv=kv, eos_id=None, chunk=8)
        for r, res in zip(requests, got.results, strict=True):
            assert res.tokens == ar_lab.generate(model, r.prompt, r.max_new_tokens,
                                                 eos_id=None).tokens


def test_a_models_router_and_dispatch_can_be_ones_own():
    """with_pieces puts other functions in every mixture layer: the model then runs through them
    (here, ones that count their calls and give the package's results)."""
    model, calls = moe_model(), []
    want = ar_lab.generate(model, [4, 5, 6], 6, eos_id=None).tokens

    def my_route(logits, k):
        calls.append("route")
        return route(logits, k)

    def my_dispatch(*args):
        calls.append("dispatch")
        return dispatch(*args)

    assert with_pieces(model, route=my_route, dispatch=my_dispatch) is model
    assert ar_lab.generate(model, [4, 5, 6], 6, eos_id=None).tokens == want
    assert calls.count("route") == calls.count("dispatch") > 0
    with raises(BadValue, "route"):
        with_pieces(model, route="topk")
    with raises(BadValue, "model"):
        with_pieces(GPT(GPTConfig(n_layer=1, block_size=16)), route=route)


def test_routing_records_each_layers_choices_and_the_count_follows_the_formula():
    model = moe_model(0, n_experts=16, experts_per_token=2)
    tokens = torch.randint(0, 256, (256, 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), routing(model) as seen:
        model(tokens)
    assert len(seen) == 2 and all(s.shape == (256, 2) for s in seen)
    # one token touches k experts; many touch them all
    assert expected_experts(1, 16, 2) == pytest.approx(2)
    assert expected_experts(10_000, 16, 2) == pytest.approx(16)
    # uniform random routing: the formula is its mean (2,000 simulated batches of 8 tokens)
    g = torch.Generator().manual_seed(0)
    counts = [len(torch.cat([torch.randperm(16, generator=g)[:2] for _ in range(8)]).unique())
              for _ in range(2000)]
    assert sum(counts) / len(counts) == pytest.approx(expected_experts(8, 16, 2), abs=0.1)


def test_quantizing_a_mixture_rounds_every_expert_and_keeps_the_router():
    model = moe_model()
    q = quantize_model(model, weights="int8")
    moe = q.blocks[0].mlp
    assert all(isinstance(e.fc, QuantizedLinear) and isinstance(e.proj, QuantizedLinear)
               for e in moe.experts)
    assert type(moe.router) is torch.nn.Linear
    assert len(ar_lab.generate(q, [1, 2, 3], 8, eos_id=None).tokens) == 8


def test_bad_mixtures_and_router_outputs_are_refused():
    for bad, arg in [({"n_experts": 4, "experts_per_token": 5}, "experts_per_token"),
                     ({"n_experts": 4, "experts_per_token": 0}, "experts_per_token"),
                     ({"n_experts": -1}, "n_experts"), ({"n_experts": 2.0}, "n_experts")]:
        with raises(BadValue, arg):
            GPTConfig(**bad)
    with raises(BadValue, "router"):
        route(torch.tensor([[0.0, float("nan"), 1.0]]), 2)
    with raises(BadValue, "k"):
        route(torch.zeros(2, 3), 4)
    with raises(BadValue, "k"):
        expected_experts(4, 8, 9)
    with raises(BadValue, "batch"):
        expected_experts(0, 8, 2)
    model = moe_model()
    with torch.no_grad():
        model.blocks[1].mlp.router.weight.fill_(float("nan"))
    with raises(BadValue, "router"):
        ar_lab.generate(model, [1, 2], 3)
    with raises(BadValue, "model"), routing(GPT(GPTConfig(n_layer=1, block_size=16))):
        pass
    with raises(BadValue, "model"):
        calibrated_model(moe_model(), "gptq")
    with raises(BadType, "model"):
        widen(moe_model(), 2)
