"""Argument checks shared by the ops: every bad input becomes a ValueError/TypeError that names
the argument and says what is allowed, instead of a NaN or an index error from deep inside."""
from __future__ import annotations

import math
import numbers

import torch


def check_scores(scores, name: str = "scores", min_dim: int = 2) -> torch.Tensor:
    """A floating tensor of rank >= ``min_dim`` with only finite entries."""
    score_range(scores, name, min_dim)
    return scores


def score_range(scores, name: str = "scores", min_dim: int = 2) -> tuple[float, float]:
    """:func:`check_scores`, returning the smallest and largest entry (0, 0 when empty)."""
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(scores).__name__}")
    if not scores.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {scores.dtype}")
    if scores.dim() < min_dim:
        raise ValueError(
            f"{name} must have shape (..., tokens, experts) with at least {min_dim} dims, "
            f"got shape {tuple(scores.shape)}"
        )
    if not scores.numel():
        return 0.0, 0.0
    # min and max propagate NaN and reach +-inf: one fused reduction instead of isfinite().all()
    low, high = torch.aminmax(scores.detach())
    low, high = float(low), float(high)
    if not (math.isfinite(low) and math.isfinite(high)):
        bad = "NaN" if torch.isnan(scores).any() else "inf"
        raise ValueError(f"{name} contains {bad} values; all entries must be finite")
    return low, high


def check_int(value, name: str, low: int | None = None, high: int | None = None) -> int:
    """An integer in [low, high] (either bound may be None)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value


def check_positive_float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value
