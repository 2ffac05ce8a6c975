"""Our GPT as a Hugging Face model: the industry implementation as a peer.

With the default configuration our model is GPT-2's architecture, so its weights map one to one
onto ``transformers``' ``GPT2LMHeadModel``; the Llama-shaped configuration (``GPTConfig.modern``)
maps onto ``LlamaForCausalLM``, and with a sliding window onto ``MistralForCausalLM`` (built from a
config: nothing is downloaded). ``to_hf`` picks the peer. Tests use this to prove the from-scratch
model computes the same logits, and the decode benchmark uses it as the reference peer.
``transformers`` is optional (the ``dev`` extra).
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


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "the reference peer needs transformers: `pip install transformers` (it is in the dev "
            "extra)"
        ) from None
    return transformers


def to_hf(model: GPT):
    """``model`` as the ``transformers`` model of its architecture, with the same weights: GPT-2's
    (``to_hf_gpt2``), Llama's, or Mistral's for a sliding window (``to_hf_llama``)."""
    cfg = model.config
    return to_hf_gpt2(model) if cfg.is_gpt2 else to_hf_llama(model)


def to_hf_llama(model: GPT):
    """A ``transformers.LlamaForCausalLM`` (``MistralForCausalLM`` with a window) with ``model``'s
    weights.

    The fused projections split: qkv into q_proj, k_proj, v_proj (n_head, n_kv_heads and n_kv_heads
    heads); the SwiGLU fc into gate_proj and up_proj. Both use RoPE's rotate-half pairing, so no row
    is permuted."""
    cfg = model.config
    llama = (cfg.norm, cfg.positions, cfg.mlp) == ("rmsnorm", "rope", "swiglu")
    if not llama or cfg.sinks or cfg.n_experts or (cfg.window is not None and cfg.bias):
        raise BadValue(
            "only a Llama-shaped model converts to transformers' Llama or Mistral "
            "(norm='rmsnorm', positions='rope', mlp='swiglu'; a window without sinks and "
            f"without biases): got norm={cfg.norm!r}, positions={cfg.positions!r}, mlp="
            f"{cfg.mlp!r}, sinks={cfg.sinks}, n_experts={cfg.n_experts}",
            arg="model",
        )
    tf = _transformers()
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.n_embd,
        intermediate_size=cfg.hidden,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.block_size,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        tie_word_embeddings=True,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        attention_dropout=0.0,
    )
    if cfg.window is None:
        hf = tf.LlamaForCausalLM(
            tf.LlamaConfig(**common, attention_bias=cfg.bias, mlp_bias=cfg.bias)
        )
    else:
        hf = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=cfg.window))
    ours = model.state_dict()
    H, Hk, F = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.hidden
    mapping = {
        "model.embed_tokens.weight": ours["wte.weight"],
        "model.norm.weight": ours["ln_f.weight"],
    }
    for i in range(cfg.n_layer):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias") if cfg.bias else ("weight",):
            qkv, fc = ours[f"{b}attn.qkv.{kind}"], ours[f"{b}mlp.fc.{kind}"]
            mapping |= {
                f"{h}self_attn.q_proj.{kind}": qkv[:H],
                f"{h}self_attn.k_proj.{kind}": qkv[H : H + Hk],
                f"{h}self_attn.v_proj.{kind}": qkv[H + Hk :],
                f"{h}self_attn.o_proj.{kind}": ours[f"{b}attn.proj.{kind}"],
                f"{h}mlp.gate_proj.{kind}": fc[:F],
                f"{h}mlp.up_proj.{kind}": fc[F:],
                f"{h}mlp.down_proj.{kind}": ours[f"{b}mlp.proj.{kind}"],
            }
        mapping[f"{h}input_layernorm.weight"] = ours[f"{b}ln1.weight"]
        mapping[f"{h}post_attention_layernorm.weight"] = ours[f"{b}ln2.weight"]
    return _load(hf, mapping, model.device)


def _load(hf, mapping: dict, device):
    with torch.no_grad():
        hf_state = hf.state_dict()
        missing = set(hf_state) - set(mapping) - {"lm_head.weight"}
        if missing:
            raise RuntimeError(
                f"no weights of ours for {sorted(missing)[:3]} of the transformers model"
            )
        for name, tensor in mapping.items():
            hf_state[name].copy_(tensor)
    hf.tie_weights()
    return hf.to(device).eval()


def to_hf_gpt2(model: GPT):
    """A ``transformers.GPT2LMHeadModel`` with the same weights as ``model``."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise ImportError(
            "the reference peer needs transformers: `pip install transformers` (it is in the dev "
            "extra)"
        ) from None
    cfg = model.config
    if cfg.kv_heads != cfg.n_head:
        raise BadValue(
            f"GPT-2 has no grouped-query attention: n_kv_heads={cfg.kv_heads} != n_head="
            f"{cfg.n_head}; only a model of the MHA configuration converts",
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
    mapping = {
        "transformer.wte.weight": ours["wte.weight"],
        "transformer.wpe.weight": ours["wpe.weight"],
    }
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
