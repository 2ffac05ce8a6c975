"""Chapter 04's checks (ar_lab.course.checkers.kv_checks): a copy of the cache is named without
addresses, and each classic slip of the bytes-per-token exercise is named; a right answer never
is."""


import pytest
import torch

from ar_lab.course.checkers.checks import CheckFailed
from ar_lab.course.checkers.kv_checks import check_view, kv_bytes_mistakes
from ar_lab.course.checkers.mistakes import check_exact
from tests.raising import fails_naming


def test_a_copy_of_the_cache_is_named_without_addresses():
    buf = torch.zeros(2, 3, 10, 4)
    check_view("keys", buf[:, :, :5], buf)
    for copy in (buf[:, :, :5].clone(), torch.cat([buf[:, :, :4], buf[:, :, 4:5]], dim=2)):
        message = fails_naming(
            "a copy, not a view of the cache's buffer", check_view, "keys", copy, buf
        )
        assert str(buf.data_ptr()) not in message and str(copy.data_ptr()) not in message
    with pytest.raises(CheckFailed):  # not a tensor at all
        check_view("keys", [1, 2], buf)


def test_kv_bytes_mistakes_are_named():
    for bpv in (2, 4):
        shape = (80, 64, 8, 128, 512, 64, bpv)  # Llama 2 70B's heads, DeepSeek's latent sizes
        right = {
            "MHA": 80 * 2 * 64 * 128,
            "GQA": 80 * 2 * 8 * 128,
            "MQA": 80 * 2 * 128,
            "MLA": 80 * 576,
        }
        for scheme, want in right.items():
            mistakes = kv_bytes_mistakes(scheme, *shape)
            # a right answer is never named for a mistake
            check_exact("b", want * bpv, want * bpv, mistakes)
            for mistake, value in mistakes.items():
                fails_naming(mistake, check_exact, "b", value, want * bpv, mistakes)
    shape = (80, 64, 8, 128, 512, 64, 2)
    right = {"MHA": 80 * 2 * 64 * 128 * 2, "GQA": 80 * 2 * 8 * 128 * 2, "MLA": 80 * 576 * 2}
    mla, gqa = kv_bytes_mistakes("MLA", *shape), kv_bytes_mistakes("GQA", *shape)
    fails_naming("a factor 2 for K and V", check_exact, "b", 2 * right["MLA"], right["MLA"], mla)
    fails_naming("n_head KV heads", check_exact, "b", right["MHA"], right["GQA"], gqa)
