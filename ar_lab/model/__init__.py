"""The model layer: bytes and tokens, the corpus, the GPT, its KV cache, checkpoints and training.

Nothing here decodes: the loops that run a model for generation live in ``ar_lab.engine``.
"""
