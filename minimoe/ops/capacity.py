"""Expert buffer capacity: how many slots each expert has per routing group.

Book: chapter 1, section "Why capacity exists". Liu et al. (2024) use C = round(c * k * T / E)
in their experiments and ceil in their Section 1.2; V-MoE rounds up to a multiple of 4.
"""
from __future__ import annotations

import math

from ._checks import check_int, check_positive_float


def compute_capacity(
    tokens: int,
    experts: int,
    capacity_factor: float,
    *,
    k: int = 1,
    rounding: str = "round",
    multiple_of: int = 1,
    min_capacity: int = 0,
) -> int:
    """Slots per expert, ``C = rounding(capacity_factor * k * tokens / experts)``.

    ``rounding="round"`` rounds half up (``floor(x + 0.5)``, not Python's banker's rounding), as in
    the experiments of Liu et al.; ``"ceil"`` as in their Section 1.2 and in GShard/V-MoE. The result
    is then raised to ``min_capacity``, rounded up to a multiple of ``multiple_of``, and capped at
    ``tokens`` (an expert never has use for more slots than there are tokens in the group).

    Raises ``ValueError`` when the result is below 1: such a layer could process no token at all.
    """
    tokens = check_int(tokens, "tokens", low=1)
    experts = check_int(experts, "experts", low=1)
    capacity_factor = check_positive_float(capacity_factor, "capacity_factor")
    k = check_int(k, "k", low=1)
    multiple_of = check_int(multiple_of, "multiple_of", low=1)
    min_capacity = check_int(min_capacity, "min_capacity", low=0)
    if rounding not in ("round", "ceil"):
        raise ValueError(f"rounding must be 'round' or 'ceil', got {rounding!r}")

    exact = capacity_factor * k * tokens / experts
    # A tiny slack so that 2.0000000000000004 does not ceil to 3.
    capacity = math.ceil(exact - 1e-9) if rounding == "ceil" else math.floor(exact + 0.5)
    capacity = max(capacity, min_capacity)
    capacity = -(-capacity // multiple_of) * multiple_of
    capacity = min(capacity, tokens)
    if capacity < 1:
        raise ValueError(
            f"capacity_factor={capacity_factor} with k={k}, tokens={tokens} and experts={experts} "
            f"gives {exact:.3g} slots per expert, which rounds ({rounding}) to {capacity}; "
            f"raise capacity_factor or pass min_capacity>=1"
        )
    return capacity
