import pytest
import torch

from ar_lab.generate import generate, stream, token_steps
from ar_lab.model import GPT, GPTConfig
from ar_lab.sampling import SamplingParams
from ar_lab.tokenizer import EOS_ID, encode
from tests.conftest import ScriptedModel


def test_headline_count_500500_vs_1000():
    """1,000 tokens from a 1-token prompt: 500,500 positions uncached, 1,000 cached."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=1024, n_layer=1, n_head=1, n_embd=8)).eval()
    uncached = generate(model, [0], 1000, use_cache=False, eos_id=None)
    cached = generate(model, [0], 1000, use_cache=True, eos_id=None)
    assert uncached.stats.positions_processed == 500_500
    assert cached.stats.positions_processed == 1_000
    assert uncached.stats.forward_calls == cached.stats.forward_calls == 1000
    assert uncached.tokens == cached.tokens


@pytest.mark.parametrize("P, N", [(1, 1), (1, 7), (5, 1), (9, 12), (30, 20)])
def test_positions_for_any_prompt_length(tiny_model, P, N):
    prompt = list(range(P))
    un = generate(tiny_model, prompt, N, use_cache=False, eos_id=None).stats
    ca = generate(tiny_model, prompt, N, use_cache=True, eos_id=None).stats
    # uncached: P + (P+1) + ... + (P+N-1); cached: P (prefill) + N - 1 single steps
    assert un.positions_processed == N * P + N * (N - 1) // 2
    assert ca.positions_processed == P + N - 1


def test_stops_at_eos_and_excludes_it():
    prompt = encode("ab")
    model = ScriptedModel(encode("xyz") + [EOS_ID] + encode("never"), len(prompt))
    for use_cache in (True, False):
        g = generate(model, prompt, 20, use_cache=use_cache)
        assert g.text == "xyz" and g.tokens == encode("xyz")
        assert g.stats.stop_reason == "eos" and g.stats.forward_calls == 4


def test_first_token_eos_gives_empty_text_and_real_stats():
    model = ScriptedModel([EOS_ID], 1)
    g = generate(model, "a", 5)
    assert g.text == "" and g.tokens == [] and g.stats.stop_reason == "eos" and g.stats.forward_calls == 1


def test_max_new_tokens_cap():
    model = ScriptedModel(encode("abcdefgh"), 1)
    g = generate(model, "a", 3)
    assert g.text == "abc" and g.stats.stop_reason == "max_new_tokens"


def test_stop_strings_cut_the_text_and_are_never_streamed():
    prompt = encode("Q")
    model = ScriptedModel(encode("hello\n\nworld"), len(prompt))
    events = list(stream(model, prompt, 20, stop_strings=["\n\n"]))
    assert "".join(e.text for e in events) == "hello"
    assert events[-1].stats.stop_reason == "stop_string"
    assert generate(model, prompt, 20, stop_strings=["lo\n"]).text == "hel"


def test_streaming_never_splits_a_character():
    text = "né €5 — ok"
    model = ScriptedModel(encode(text), 1)
    pieces = [e.text for e in stream(model, "a", len(encode(text)))]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # the first bytes of multi-byte characters produced no text yet


def test_timings_are_recorded(tiny_model):
    s = generate(tiny_model, "hello", 10, eos_id=None).stats
    assert s.prefill_time > 0 and len(s.decode_times) == 9 and all(t > 0 for t in s.decode_times)
    assert s.total_time == pytest.approx(s.prefill_time + sum(s.decode_times))


def test_seeded_sampling_is_reproducible(tiny_model):
    params = SamplingParams(temperature=1.0)
    a = generate(tiny_model, "x", 30, sampling=params, generator=torch.Generator().manual_seed(3), eos_id=None)
    b = generate(tiny_model, "x", 30, sampling=params, generator=torch.Generator().manual_seed(3), eos_id=None)
    c = generate(tiny_model, "x", 30, sampling=params, generator=torch.Generator().manual_seed(4), eos_id=None)
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_bad_input_is_rejected_clearly(tiny_model):
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(tiny_model, "", 5)
    with pytest.raises(ValueError, match="prompt has 65 tokens but the context window holds 64"):
        generate(tiny_model, "a" * 65, 1)
    with pytest.raises(ValueError, match="ask for at most 5 new tokens"):
        generate(tiny_model, "a" * 60, 6)
    assert len(generate(tiny_model, "a" * 60, 5, eos_id=None).tokens) == 5
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        generate(tiny_model, "a", 0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(tiny_model, [1, 999], 3)
    with pytest.raises(ValueError, match="stop_strings"):
        generate(tiny_model, "a", 3, stop_strings="\n")
    with pytest.raises(ValueError, match="top_p"):
        generate(tiny_model, "a", 3, sampling=SamplingParams(top_p=1.5))


def test_token_steps_restores_training_mode(tiny_model):
    tiny_model.train()
    list(token_steps(tiny_model, "ab", 3))
    assert tiny_model.training
