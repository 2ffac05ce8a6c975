"""ar_lab: autoregressive generation, built from scratch and measured.

The package is four layers, each a folder, imports pointing one way: ``course`` (the notebooks'
apparatus) -> ``perf`` (measuring and predicting speed) -> ``engine`` (every decoding loop, through
one decoder interface) -> ``model`` (tokens, the GPT, its cache, training), all on a small ``base``
(argument checks, timing). This module is the public API: the names most notebooks start from.
"""

from ar_lab.engine.generate import Generation, GenerationStats, generate, stream
from ar_lab.engine.sampling import GREEDY, SamplingParams
from ar_lab.model.cache import KVCache, kv_cache_bytes
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.model.tokenizer import EOS_ID, VOCAB_SIZE, decode, encode

__version__ = "0.1.0"

__all__ = [
    "EOS_ID",
    "GPT",
    "GREEDY",
    "GPTConfig",
    "Generation",
    "GenerationStats",
    "KVCache",
    "SamplingParams",
    "VOCAB_SIZE",
    "decode",
    "encode",
    "generate",
    "kv_cache_bytes",
    "load_pretrained",
    "stream",
]


def load_pretrained(name: str = "course", device=None):
    """Load a checkpoint shipped in data/ ("course" or "draft"); see ar_lab.model.train."""
    from ar_lab.model.train import load_pretrained as _load

    return _load(name, device)
