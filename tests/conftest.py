import pytest
import torch
from hypothesis import settings

from ar_lab.model.gpt import GPT, GPTConfig

settings.register_profile("ar_lab", deadline=None, max_examples=30, derandomize=True)
settings.load_profile("ar_lab")


def pytest_collection_modifyitems(config, items):
    """Browser tests and notebook cells (nbval) are slow by nature: ``-m "not slow"`` leaves them out."""
    for item in items:
        if item.get_closest_marker("browser") or type(item).__name__ == "IPyNbCell":
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def tiny_model():
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=32)).eval()


class ScriptedModel(torch.nn.Module):
    """A stand-in model whose greedy output is a fixed script of token ids.

    At absolute position t (the token that follows t known tokens) it puts all
    its mass on script[t - prompt_len], so tests can force EOS, multi-byte
    characters or stop strings exactly. It keeps the KV-cache contract
    (updates ``cache.length``) so cached and uncached loops both work.
    """

    def __init__(self, script: list[int], prompt_len: int, block_size: int = 64) -> None:
        super().__init__()
        self.config = GPTConfig(block_size=block_size, n_layer=1, n_head=1, n_embd=4)
        self.script, self.prompt_len = script, prompt_len
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    @property
    def device(self):
        return self.dummy.device

    def forward(self, idx, cache=None):
        B, T = idx.shape
        start = 0 if cache is None else cache.length
        logits = torch.zeros(B, T, self.config.vocab_size)
        for t in range(T):
            k = start + t + 1 - self.prompt_len
            if 0 <= k < len(self.script):
                logits[:, t, self.script[k]] = 10.0
        if cache is not None:
            cache.length = start + T
        return logits
