"""Our GPT as a Hugging Face ``GPT2LMHeadModel``: the industry implementation as a peer.

With ``n_kv_heads == n_head`` our model is GPT-2's architecture, so its weights map
one to one onto ``transformers``' GPT-2 (built from a config: nothing is downloaded).
Tests use this to prove the from-scratch model computes the same logits, and the
decode benchmark uses it as the reference peer. ``transformers`` is optional
(the ``dev`` extra).
"""

from __future__ import annotations

import torch

from ar_lab.base.errors import BadValue
from ar_lab.model.gpt import GPT
from ar_lab.model.tokenizer import EOS_ID


def have_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def to_hf_gpt2(model: GPT):
    """A ``transformers.GPT2LMHeadModel`` with the same weights as ``model``."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise ImportError(
            "the reference peer needs transformers: `pip install transformers` (it is in the dev extra)"
        ) from None
    cfg = model.config
    if cfg.kv_heads != cfg.n_head:
        raise BadValue(
            f"GPT-2 has no grouped-query attention: n_kv_heads={cfg.kv_heads} != n_head={cfg.n_head}; "
            "only a model of the MHA configuration converts",
            arg="model",
        )
    hf_config = GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.block_size,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        activation_function="gelu_new",  # the tanh approximation, as in our MLP
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=True,
    )
    hf = GPT2LMHeadModel(hf_config)
    # HF's Conv1D stores weights as (in, out): the transpose of nn.Linear's (out, in).
    ours = model.state_dict()
    mapping = {"transformer.wte.weight": ours["wte.weight"], "transformer.wpe.weight": ours["wpe.weight"]}
    for i in range(cfg.n_layer):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        for hf_name, our_name, transpose in [
            ("ln_1", "ln1", False),
            ("attn.c_attn", "attn.qkv", True),
            ("attn.c_proj", "attn.proj", True),
            ("ln_2", "ln2", False),
            ("mlp.c_fc", "mlp.fc", True),
            ("mlp.c_proj", "mlp.proj", True),
        ]:
            w = ours[b + our_name + ".weight"]
            mapping[h + hf_name + ".weight"] = w.t() if transpose else w
            mapping[h + hf_name + ".bias"] = ours[b + our_name + ".bias"]
    mapping["transformer.ln_f.weight"] = ours["ln_f.weight"]
    mapping["transformer.ln_f.bias"] = ours["ln_f.bias"]
    with torch.no_grad():
        hf_state = hf.state_dict()
        for name, tensor in mapping.items():
            hf_state[name].copy_(tensor)
    hf.tie_weights()
    return hf.to(model.device).eval()
