"""Which expert wins under Gaussian noise: the exact top-1 probability and the paper's product.

Book: chapter 3, section "Noise and the probability of being chosen" (Proposition 3.3, SSR's Prop. 4.3
corrected). With ``s~_j = s_j + std * z_j`` and ``z`` i.i.d. standard normal, expert ``i`` wins with
probability

    P_i = integral phi(z) prod_{j != i} Phi((s_i - s_j) / std + z) dz          (condition on z_i),

while SSR multiplies the pairwise probabilities ``Phi((s_i - s_j) / (sqrt(2) std))`` as if the events
``{s~_i > s~_j}`` were independent. They all involve ``z_i``, are positively correlated (Harris'
inequality), and the product is only a lower bound: for E equal scores it is ``2^-(E-1)``, not ``1/E``.
"""
from __future__ import annotations

import functools
import math

import torch

from ._checks import check_positive_float, check_scores


@functools.cache
def _grid() -> torch.Tensor:
    """The quadrature nodes, read only. Built on first use, not at import: importing minimoe runs no
    kernel (the benchmarks fork cases from a process that has imported it)."""
    return torch.linspace(-10.0, 10.0, 4001, dtype=torch.float64)  # the normal mass outside is 1.5e-23


def gaussian_top1_probability(scores: torch.Tensor, noise_std: float) -> torch.Tensor:
    """Exact ``P(argmax_j (scores_j + noise_std * z_j) = i)`` for each ``i``, shape ``(..., E)``.

    One-dimensional quadrature (trapezoid on [-10, 10], 4001 nodes, float64) of the integral above,
    with the product of normal CDFs summed in the log domain (``log_ndtr``) so that no factor underflows.
    """
    check_scores(scores, "scores", min_dim=1)
    std = check_positive_float(noise_std, "noise_std")
    s = scores.detach().double()
    z = _grid().to(s.device)
    gaps = (s[..., :, None] - s[..., None, :]) / std  # (..., i, j)
    log_cdf = torch.special.log_ndtr(gaps[..., None] + z)  # (..., i, j, z)
    eye = torch.eye(s.shape[-1], dtype=torch.bool, device=s.device)[..., None]
    log_prod = log_cdf.masked_fill(eye, 0.0).sum(-2)  # (..., i, z): the product over j != i
    log_density = -0.5 * z**2 - 0.5 * math.log(2 * math.pi)
    integrand = (log_prod + log_density).exp()
    return torch.trapezoid(integrand, z, dim=-1).to(scores.dtype)


def gaussian_top1_product_bound(scores: torch.Tensor, noise_std: float) -> torch.Tensor:
    """SSR's formula ``prod_{j != i} Phi((s_i - s_j) / (sqrt(2) noise_std))``, shape ``(..., E)``.

    A lower bound on :func:`gaussian_top1_probability`, equal to it only for two experts.
    """
    check_scores(scores, "scores", min_dim=1)
    std = check_positive_float(noise_std, "noise_std")
    s = scores.detach().double()
    gaps = (s[..., :, None] - s[..., None, :]) / (math.sqrt(2) * std)
    eye = torch.eye(s.shape[-1], dtype=torch.bool, device=s.device)
    return torch.special.log_ndtr(gaps).masked_fill(eye, 0.0).sum(-1).exp().to(scores.dtype)
