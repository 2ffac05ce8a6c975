"""The shared prompt checks, the inference rule, the timing helpers and the data folder."""

import time

import pytest
import torch

from ar_lab.base import timing
from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.engine.prompts import check_prompt, checked_prompt, prompt_batch, prompt_ids, stop_list
from ar_lab.model.data import data_dir
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.model.inference import check_inference_ready, inference
from ar_lab.model.tokenizer import encode
from tests.raising import raises


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=8))


def test_prompt_ids_accepts_text_lists_and_integer_tensors():
    assert prompt_ids("hé") == encode("hé")
    assert prompt_ids([1, 2]) == [1, 2] and prompt_ids((3,)) == [3]
    assert prompt_ids(torch.tensor([4, 5])) == [4, 5]


@pytest.mark.parametrize(
    "bad, kind",
    [
        ([1.7], BadType),  # a float token id
        ([True], BadType),  # a bool token id
        (torch.tensor([1.0]), BadType),  # not 1-D integer token ids
        (b"hi", BadType),  # neither text nor a list of token ids
        (iter([1]), BadType),  # neither text nor a list of token ids
        ("", BadValue),  # empty
        ([], BadValue),  # empty
    ],
)
def test_prompt_ids_rejects_what_would_silently_go_wrong(bad, kind):
    with raises(kind, "prompt"):
        prompt_ids(bad)


def test_the_window_and_vocabulary_checks_say_what_to_do(model):
    with raises(BadValue, 'prompt'):
        check_prompt(model, [300], 1)
    with raises(ContextFull, 'prompt'):
        check_prompt(model, [1] * 17, 1)
    with raises(ContextFull, 'max_new_tokens'):
        check_prompt(model, [1] * 10, 8)
    check_prompt(model, [1] * 10, 7)  # 10 + 7 - 1 = 16 positions: fits exactly
    with raises(BadValue, 'max_new_tokens'):
        checked_prompt(model, "a", 0)


def test_stop_list_takes_sequences_once_and_refuses_iterators():
    assert stop_list(None) == () and stop_list(["\n\n", "x"]) == ("\n\n", "x")
    for bad in ("\n", ["", "x"], [3], (s for s in ["x"])):
        with raises(BadValue, 'stop_strings'):
            stop_list(bad)


def test_prompt_batch_needs_equal_lengths(model):
    assert prompt_batch(model, ["ab", [1, 2]], 3).tolist() == [encode("ab"), [1, 2]]
    with raises(BadValue, 'prompts'):
        prompt_batch(model, ["a", "ab"], 3)
    with raises(BadValue, 'prompts'):
        prompt_batch(model, "ab", 3)


def test_inference_never_switches_the_model_and_restores_gradients(model):
    model.train()  # no dropout: training mode computes what eval mode computes
    model.blocks[0].attn.eval()  # a child deliberately in eval mode stays so
    flags = [m.training for m in model.modules()]
    with inference(model):
        assert [m.training for m in model.modules()] == flags
        assert torch.is_inference_mode_enabled()
    assert [m.training for m in model.modules()] == flags
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    class Boom(Exception):  # the caller's own error passes through unchanged
        pass

    with pytest.raises(Boom), inference(model):
        raise Boom
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_inference_refuses_a_model_whose_training_mode_is_random():
    model = GPT(GPTConfig(block_size=8, n_layer=1, n_head=1, n_embd=8, dropout=0.1)).train()
    with raises(BadValue, 'model'):
        check_inference_ready(model)
    with raises(BadValue, 'model'), inference(model):
        pass
    assert model.training  # refused, not switched
    check_inference_ready(model.eval())  # eval mode: dropout off, accepted
    bn = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).train()
    with raises(BadValue, 'model'):
        check_inference_ready(bn)
    with raises(BadType, 'model'):
        check_inference_ready("model")


def test_time_call_counts_calls_and_checks_its_options():
    calls = []
    times = timing.time_call(lambda: calls.append(time.sleep(0.001)), repeats=3, warmup=2)
    assert len(calls) == 5 and len(times) == 3 and all(t >= 0.001 for t in times)
    with raises(BadValue, 'repeats'):
        timing.time_call(lambda: None, repeats=0)


def test_machine_description_and_steady_clock():
    m = timing.machine("cpu")
    assert m["device"]["type"] == "cpu" and m["versions"]["torch"] == torch.__version__
    assert m["device"]["threads"] == torch.get_num_threads()
    assert timing.device_name("cpu") in timing.machine_line("cpu")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        # one thread: its CPU time is the work
        assert timing.steady_clock("cpu") is time.process_time
        torch.set_num_threads(2)
        assert timing.steady_clock("cpu") is time.perf_counter
        assert timing.steady_clock("cuda") is time.perf_counter
    finally:
        torch.set_num_threads(threads)


def test_data_dir_follows_ar_lab_data_at_call_time(monkeypatch, tmp_path):
    monkeypatch.delenv("AR_LAB_DATA", raising=False)
    assert (data_dir() / "course.safetensors").exists()
    monkeypatch.setenv("AR_LAB_DATA", str(tmp_path))
    assert data_dir() == tmp_path
