import pytest

from rlflow import rewards


@pytest.mark.parametrize("resp,ans,expect", [
    ("so the total is 18.\n#### 18", "#### 18", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("The answer is \\boxed{42}.", "42", 1.0),
    ("\\boxed{\\frac{1}{2}} hmm \\boxed{3/6}", "0.5", 1.0),
    ("#### 17", "#### 18", 0.0),
    ("I think 7 then 9", "9", 1.0),  # falls back to the last number
    ("no number here", "3", 0.0),
    ("#### 2.50", "2.5", 1.0),
])
def test_math_verifier(resp, ans, expect):
    assert rewards.get("math")(resp, ans) == expect


def test_exact_and_registry():
    assert rewards.get("exact")(" 9 ", "9") == 1.0
    assert rewards.get("exact")("99", "9") == 0.0
    with pytest.raises(KeyError, match="unknown reward 'nope'"):
        rewards.get("nope")
    with pytest.raises(ValueError, match="already registered"):
        rewards.register("exact")(lambda r, a: 0.0)
