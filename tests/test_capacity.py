import math

import pytest

from minimoe.ops import compute_capacity


@pytest.mark.parametrize(
    "tokens, experts, factor, kwargs, expected",
    [
        (196, 32, 1.0, {}, 6),  # 6.125 rounds to 6 (Liu et al. B/16 with c=1)
        (49, 32, 1.0, {}, 2),  # 1.53 -> 2
        (49, 32, 2.0, {}, 3),  # 3.06 -> 3
        (196, 32, 1.0, {"rounding": "ceil"}, 7),
        (8192, 64, 1.0, {"k": 2}, 256),
        (10, 4, 1.0, {}, 3),  # 2.5 rounds half *up*, not to even
        (18, 4, 1.0, {}, 5),  # 4.5 -> 5 (Python's round would give 4)
        (100, 8, 1.05, {"rounding": "ceil", "multiple_of": 4}, 16),  # V-MoE style: ceil(13.125)=14 -> 16
        (4, 8, 1.0, {"min_capacity": 1}, 1),  # 0.5 rounds to 1 anyway
        (2, 8, 1.0, {"min_capacity": 1}, 1),  # 0.25 -> 0, raised to the minimum
        (16, 2, 4.0, {}, 16),  # 32 slots asked, capped at the 16 tokens
        (64, 8, 2.0, {"rounding": "ceil"}, 16),  # exact: no spurious ceil from float error
    ],
)
def test_known_values(tokens, experts, factor, kwargs, expected):
    assert compute_capacity(tokens, experts, factor, **kwargs) == expected


def test_round_matches_half_up_formula_everywhere():
    for tokens in range(1, 300, 7):
        for experts in (1, 2, 3, 8, 32):
            for factor in (0.5, 1.0, 1.25, 2.0):
                exact = factor * tokens / experts
                want = min(math.floor(exact + 0.5), tokens)
                if want < 1:
                    with pytest.raises(ValueError, match="capacity_factor"):
                        compute_capacity(tokens, experts, factor)
                else:
                    assert compute_capacity(tokens, experts, factor) == want
                    ceil = compute_capacity(tokens, experts, factor, rounding="ceil")
                    assert ceil == min(math.ceil(exact - 1e-9), tokens) and ceil >= want


def test_too_small_raises_with_the_numbers():
    with pytest.raises(ValueError, match=r"capacity_factor=1.0.*tokens=10.*experts=64"):
        compute_capacity(10, 64, 1.0)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((16, 4, 0.0), {}, "capacity_factor must be a finite number > 0"),
        ((16, 4, -1.0), {}, "capacity_factor"),
        ((16, 4, float("nan")), {}, "capacity_factor"),
        ((0, 4, 1.0), {}, "tokens must be >= 1"),
        ((16, 0, 1.0), {}, "experts must be >= 1"),
        ((16, 4, 1.0), {"rounding": "floor"}, "rounding must be"),
        ((16, 4, 1.0), {"multiple_of": 0}, "multiple_of"),
        ((16, 4, 1.0), {"k": 0}, "k must be >= 1"),
        ((16.5, 4, 1.0), {}, "tokens must be an int"),
    ],
)
def test_bad_arguments(args, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        compute_capacity(*args, **kwargs)
