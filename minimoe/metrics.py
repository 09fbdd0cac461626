"""Balance and usage metrics of a routing decision. Book: chapter 1, "Measuring balance".

All take tensors of shape (..., T, E) and reduce over tokens; leading (group) dims are averaged
where a single number is returned.
"""
from __future__ import annotations

import torch

from .ops._checks import check_finite, check_tensor, reads_are_free

_MASK_SHAPE = "(..., tokens, experts)"


def _mask(mask, name: str = "mask") -> torch.Tensor:
    """A bool routing mask of rank >= 2: a float one (combine weights, probabilities) would count
    weights as tokens without a word."""
    check_tensor(mask, name, floating=False, min_dim=2, shape_hint=_MASK_SHAPE)
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor {_MASK_SHAPE} (token t goes to expert e), got dtype "
                        f"{mask.dtype}; for a routing, pass routing.mask, or weights > 0")
    return mask


def tokens_per_expert(mask: torch.Tensor) -> torch.Tensor:
    """Number of tokens each expert processes, ``(..., E)``."""
    return _mask(mask).sum(-2)


def load_imbalance(mask: torch.Tensor) -> torch.Tensor:
    """Max load over mean load (1 is perfect balance; E means one expert takes everything)."""
    load = tokens_per_expert(mask).float()
    return (load.amax(-1) / load.mean(-1).clamp_min(1e-12)).mean()


def coefficient_of_variation(mask: torch.Tensor) -> torch.Tensor:
    """Standard deviation over mean of the per-expert load (0 is perfect balance)."""
    load = tokens_per_expert(mask).float()
    return (load.std(-1, unbiased=False) / load.mean(-1).clamp_min(1e-12)).mean()


def drop_rate(mask: torch.Tensor) -> torch.Tensor:
    """Fraction of tokens that no expert processes (their output is the residual alone)."""
    mask = _mask(mask)
    dropped = (~mask.any(-1)).float()
    return dropped.mean() if dropped.numel() else dropped.new_zeros(())  # no token, none dropped


def routing_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the entropy (nats) of the router distribution over experts."""
    check_tensor(probs, "probs", min_dim=1, shape_hint="(..., experts)")
    check_finite(probs, "probs")
    if probs.numel() and reads_are_free(probs) and bool((probs.detach() < 0).any()):
        raise ValueError("probs must be probabilities (entries >= 0), got a negative entry")
    probs = probs.float() if probs.dtype in (torch.float16, torch.bfloat16) else probs  # in float16 a clamp at 1e-30 is 0, and 0 * log 0 is NaN
    if probs.numel() == 0:
        return probs.new_zeros(())
    return -torch.special.xlogy(probs, probs).sum(-1).mean()


def experts_per_token(mask: torch.Tensor) -> torch.Tensor:
    """Histogram: entry j is the fraction of tokens processed by exactly j experts, j = 0..E."""
    mask = _mask(mask)
    E = mask.shape[-1]
    counts = mask.sum(-1).flatten()
    return torch.bincount(counts, minlength=E + 1).float() / max(counts.numel(), 1)


def routing_stats(mask: torch.Tensor, probs: torch.Tensor | None = None) -> dict:
    """The dictionary every sparse router puts in ``Routing.stats`` (detached scalars)."""
    mask = _mask(mask)
    if mask.numel() == 0:  # no tokens: nothing dropped, nothing imbalanced
        zero = torch.zeros(())
        stats = dict.fromkeys(("drop_rate", "load_imbalance", "load_cv", "mean_experts_per_token"), zero)
        if probs is not None:
            stats["routing_entropy"] = zero
        return stats
    with torch.no_grad():
        stats = {
            "drop_rate": drop_rate(mask),
            "load_imbalance": load_imbalance(mask),
            "load_cv": coefficient_of_variation(mask),
            "mean_experts_per_token": mask.sum(-1).float().mean() if mask.numel() else torch.zeros(()),
        }
        if probs is not None:
            stats["routing_entropy"] = routing_entropy(probs)
    return stats
