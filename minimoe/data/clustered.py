"""A synthetic task where the right expert of every input is known, so specialisation is measurable.

Inputs are drawn around ``n_clusters`` centres; cluster c has its own random nonlinear map
``y = tanh(x A_c) B_c``. A model that sends each cluster to its own expert can fit every map
exactly, a dense model of the same width must share capacity between them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ClusteredTask:
    x: torch.Tensor  # (n, d_in) inputs
    y: torch.Tensor  # (n, d_out) regression targets
    cluster: torch.Tensor  # (n,) the true "expert" of each input


def make_clustered_task(
    n_samples: int = 4096,
    d_in: int = 16,
    d_out: int = 8,
    n_clusters: int = 8,
    *,
    spread: float = 0.3,
    seed: int = 0,
) -> ClusteredTask:
    """Sample the clustered regression task (deterministic given ``seed``)."""
    if n_clusters < 1 or n_samples < 1:
        raise ValueError("n_samples and n_clusters must be >= 1")
    gen = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(n_clusters, d_in, generator=gen), dim=-1) * 2.0
    maps_in = torch.randn(n_clusters, d_in, 2 * d_in, generator=gen) / d_in**0.5
    maps_out = torch.randn(n_clusters, 2 * d_in, d_out, generator=gen) / (2 * d_in) ** 0.5
    cluster = torch.randint(0, n_clusters, (n_samples,), generator=gen)
    x = centres[cluster] + spread * torch.randn(n_samples, d_in, generator=gen)
    hidden = torch.tanh(torch.einsum("nd,ndh->nh", x, maps_in[cluster]))
    y = torch.einsum("nh,nho->no", hidden, maps_out[cluster])
    return ClusteredTask(x=x, y=y, cluster=cluster)
