"""Claims fail loudly, naming the sentence that stopped being true."""

import pytest

from ar_lab.claims import ClaimFailed, claim, magnitude


def test_a_true_claim_is_silent_and_a_false_one_names_itself():
    claim("top-p repeats less than greedy", 0.2 < 0.5)
    with pytest.raises(ClaimFailed, match="'top-p repeats less than greedy'.*0.7 vs 0.5"):
        claim("top-p repeats less than greedy", 0.7 < 0.5, "0.7 vs 0.5")


@pytest.mark.parametrize(
    "x, text", [(6.2e5, "6 × 10⁵"), (9.6e5, "1 × 10⁶"), (1.2e-3, "1 × 10⁻³"), (3, "3 × 10⁰"), (1e8, "1 × 10⁸")]
)
def test_magnitude(x, text):
    assert magnitude(x) == text


def test_magnitude_refuses_what_has_none():
    for bad in (0, -1.0, float("nan"), float("inf"), "1"):
        with pytest.raises(ValueError, match="finite positive"):
            magnitude(bad)
