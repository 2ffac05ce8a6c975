"""Chapter 08's named mistakes: the row mask, the admission policies and the continuous schedule."""

import pytest
import torch

from ar_lab.course.checks import CheckFailed
from ar_lab.course.mistakes import check_exact


def _fails_naming(fragment: str, check, *args, **kwargs) -> str:
    with pytest.raises(CheckFailed) as e:
        check(*args, **kwargs)
    assert fragment in str(e.value), str(e.value)
    return str(e.value)


def test_chapter_08_mistakes_are_named():
    """The row mask, the two admission policies and the continuous schedule: each classic slip, written out by
    hand, is named; the right answer passes."""
    from ar_lab.course.mistakes import admission_mistakes, continuous_finish_mistakes, row_mask_mistakes
    from ar_lab.engine.scheduling import continuous_admit, static_admit
    from ar_lab.engine.serving import simulate
    from ar_lab.model.cache import BatchKVCache

    lengths, T = [2, 5, 3], 2
    cache = BatchKVCache(n_layer=1, max_batch=3, n_kv_heads=1, max_len=max(lengths) + T, head_dim=1)
    for n in lengths:
        cache.add(n)
    right = cache.begin(T)[1].tolist()
    keys, pos = torch.arange(max(lengths) + T), torch.tensor(lengths)[:, None] + torch.arange(T)  # pos: (rows, T)
    wrong = {
        "does not see itself": keys < pos[:, :, None],
        "longest row's length": (keys <= (max(lengths) + torch.arange(T))[:, None]).expand(3, T, -1),
        "no causal part": (keys < (torch.tensor(lengths) + T)[:, None, None]).expand(3, T, -1),
    }
    for fragment, answer in wrong.items():
        _fails_naming(fragment, check_exact, "mask", answer[:, None].tolist(), right, row_mask_mistakes(lengths, T))
    check_exact("mask", right, right, row_mask_mistakes(lengths, T))

    _fails_naming("that is continuous batching", check_exact, "static", 2, static_admit(5, 2, 4),
                  admission_mistakes("static", 5, 2, 4))
    _fails_naming("not capped by the queue", check_exact, "continuous", 4, continuous_admit(1, 0, 4),
                  admission_mistakes("continuous", 1, 0, 4))
    _fails_naming("one request per step", check_exact, "continuous", 1, continuous_admit(3, 0, 4),
                  admission_mistakes("continuous", 3, 0, 4))
    want = continuous_admit(3, 1, 4)
    check_exact("continuous", want, want, admission_mistakes("continuous", 3, 1, 4))

    need = [1, 10, 10, 0, 3]
    right = simulate(need, 2, "continuous")
    mistakes = continuous_finish_mistakes(need, 2)
    _fails_naming("static batching", check_exact, "finish", simulate(need, 2, "static"), right, mistakes)
    early = [f - 1 if n else f for f, n in zip(right, need, strict=True)]
    _fails_naming("one step early", check_exact, "finish", early, right, mistakes)
    check_exact("finish", right, right, mistakes)
    for seed in range(50):  # the stepped schedule behind the mistakes is simulate's, static and continuous
        g = torch.Generator().manual_seed(seed)
        need = torch.randint(0, 9, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        b = int(torch.randint(1, 5, (1,), generator=g))
        named = continuous_finish_mistakes(need, b)
        static = named["static batching's schedule (a new batch only when the whole batch is done)"]
        assert static == simulate(need, b, "static")
