"""Comparing two greedy texts of the same model computed by different kernels."""

import torch

from ar_lab.model.tokenizer import encode


def assert_same_greedy(model, prompt, expected, got, near: float = 1e-4):
    """Tokens equal; if they ever differ, it must be a genuine near-tie of the model's top two
    logits there (within ``near``: float rounding differs with the kernel, the batch a row shares,
    the rows a pass covers), and the comparison stops at that token, after which the texts may
    part."""
    ids = encode(prompt) if isinstance(prompt, str) else list(prompt)
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        if a != b:
            with torch.no_grad():
                logits = model(torch.tensor([ids + list(expected[:i])]))[0, -1].float()
            gap = float(logits[[a, b]].max() - logits[[a, b]].min())
            top = float(logits.max())
            assert gap < near and top - float(logits[[a, b]].max()) < near, (
                f"token {i} differs ({a} vs {b}) without a near-tie: logits "
                f"{float(logits[a]):.5f} vs {float(logits[b]):.5f} (top {top:.5f})"
            )
            return
