"""A model on a GPU with what a notebook hands it: a seeded ``torch.Generator()`` (a CPU one) and
token ids.

The course's cells seed ``torch.Generator()``; on a learner's GPU the model's logits are on CUDA,
where torch refuses a CPU generator. Sampling and the speculative accept draw where the generator
lives, the same numbers as beside a CPU model. Ids on another device than the model are refused by
name at ``GPT.forward``. The CUDA tests run where a GPU is (they ran on an H200); the refusal also
on a CPU, with torch's error stood in.
"""

import pytest
import torch

from ar_lab.engine.accept import draw
from ar_lab.engine.generate import generate
from ar_lab.engine.sampling import SamplingParams, on_generator_device, sample
from ar_lab.engine.speculative import speculative_generate
from ar_lab.model.gpt import GPT, GPTConfig
from tests.raising import raises

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tiny(device="cpu") -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=32)).eval().to(device)


def test_ids_on_another_device_than_the_model_are_refused_by_name(monkeypatch):
    """The door costs nothing on the way in (no check before the embedding: a pass's PyTorch calls,
    which chapter 04 counts, stay the model's own); torch's refusal is said by name. On a CPU the
    refusal is torch's stand-in."""
    model = tiny()

    def torch_refuses(idx):  # what the embedding raises on a GPU for ids on the CPU
        raise RuntimeError("Expected all tensors to be on the same device")

    monkeypatch.setattr(model.wte, "forward", torch_refuses)
    with raises(ValueError, "idx"):  # ids elsewhere: said by name
        model(torch.zeros(1, 3, dtype=torch.long, device="meta"))
    # ids where the model is: torch's own error stands
    with pytest.raises(RuntimeError, match="same device"):
        model(torch.zeros(1, 3, dtype=torch.long))


def test_a_tensor_already_where_the_generator_draws_is_left_alone():
    t = torch.rand(5)
    assert on_generator_device(t, None) is t and on_generator_device(t, torch.Generator()) is t


@cuda
def test_a_cpu_generator_samples_cuda_logits_as_it_samples_cpu_ones():
    logits = torch.randn(4, 257, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, top_p=0.9)
    for seed in range(5):
        on_cpu = sample(logits, params, torch.Generator().manual_seed(seed))
        on_gpu = sample(logits.cuda(), params, torch.Generator().manual_seed(seed))
        assert on_gpu.device.type == "cuda" and on_gpu.cpu().tolist() == on_cpu.tolist()
    p = torch.softmax(logits[0], -1)
    assert draw(p.cuda(), torch.Generator().manual_seed(1)) == draw(
        p, torch.Generator().manual_seed(1)
    )


@cuda
def test_generate_and_speculative_decoding_on_a_gpu_take_a_cpu_generator():
    model, draft = tiny("cuda"), tiny("cuda")
    params = SamplingParams(temperature=1.0)
    runs = [
        generate(
            m,
            "The for",
            20,
            sampling=params,
            generator=torch.Generator().manual_seed(7),
            eos_id=None,
        )
        for m in (model, tiny("cpu"))
    ]
    assert len(runs[0].tokens) == 20 and runs[0].tokens == runs[1].tokens
    out = speculative_generate(model, draft, "The for", 20, gamma=3, sampling=params,
                               generator=torch.Generator().manual_seed(7), eos_id=None)
    assert len(out.tokens) == 20
    with raises(ValueError, "idx"):
        model(torch.zeros(1, 3, dtype=torch.long))
