"""Counting what an expert-parallel layer moves and wastes, without running one.

Book: chapter 8, sections "What fixed capacity buys and what it costs" and "Load imbalance is idle
time". Pure functions: they take a routing (or its slot table) or the sizes of a layer and return
numbers.
"""
from __future__ import annotations

import math

import torch

from ..ops._checks import check_int
from ..routing import Routing


def send_counts(routing: Routing | torch.Tensor, world_size: int) -> torch.Tensor:
    """(token, expert) pairs that the tokens of ``routing`` send to each rank when the ``E`` experts
    are split contiguously over ``world_size`` ranks (rank ``r`` holds experts ``r*E/W ... (r+1)*E/W - 1``).

    ``routing`` is a sparse :class:`~minimoe.Routing` or its slot table ``position (..., T, E)``
    (``-1``: not dispatched). Returns a LongTensor ``(world_size,)`` summed over all groups; a dropped
    request sends nothing.
    """
    position = routing.position if isinstance(routing, Routing) else routing
    if not isinstance(position, torch.Tensor) or position.dim() < 2:
        raise ValueError("routing must be a sparse Routing or a position tensor of shape (..., T, E)")
    world_size = check_int(world_size, "world_size", low=1)
    E = position.shape[-1]
    if E % world_size:
        raise ValueError(f"n_experts={E} is not divisible by world_size={world_size}")
    per_expert = (position >= 0).reshape(-1, E).sum(0)
    return per_expert.view(world_size, E // world_size).sum(1)


def _binomial_pmf(n: int, p: float) -> torch.Tensor:
    m = torch.arange(n + 1, dtype=torch.float64)
    if p <= 0.0 or p >= 1.0:
        return (m == (n if p >= 1.0 else 0)).double()
    log_pmf = (math.lgamma(n + 1) - torch.lgamma(m + 1) - torch.lgamma(n - m + 1)
               + m * math.log(p) + (n - m) * math.log1p(-p))
    return log_pmf.exp()


def expected_overflow(tokens: int, experts: int, capacity: int, k: int = 1) -> tuple[float, float]:
    """Expected cost of a fixed capacity under a uniform random router, exactly.

    Model: each of the ``tokens`` tokens of a group asks for ``k`` distinct experts chosen uniformly
    at random, independently of the other tokens. Then the requests ``m`` for one expert follow
    Binomial(T, k/E), and by Lemma 1.3(d) the dropped requests are ``sum_e (m_e - C)_+``. Returns

    * the expected fraction of the ``k*T`` requests that are dropped, ``E * E[(m - C)_+] / (k T)``;
    * the expected fraction of the ``E*C`` slots that stay empty (padding), ``E[(C - m)_+] / C``.

    Book: chapter 8, Proposition 8.2.
    """
    tokens = check_int(tokens, "tokens", low=1)
    experts = check_int(experts, "experts", low=1)
    k = check_int(k, "k", low=1, high=experts)
    capacity = check_int(capacity, "capacity", low=1)
    pmf = _binomial_pmf(tokens, k / experts)
    m = torch.arange(tokens + 1, dtype=torch.float64)
    over = float((pmf * (m - capacity).clamp_min(0)).sum())
    under = float((pmf * (capacity - m).clamp_min(0)).sum())
    return experts * over / (k * tokens), under / capacity


def max_load_bound(tokens_per_rank: int, world_size: int) -> float:
    """An upper bound on the expected largest rank load, ``E[max_r L_r]``, when each of the
    ``W * N`` tokens of the ``W`` ranks sends one pair to a uniformly random rank (so ``L_r`` is
    Binomial(W N, 1/W) with mean ``N``):

        E[max_r L_r] <= min_{lam > 0} (log W + N (e^lam - 1)) / lam   (about N + sqrt(2 N log W)).

    Book: chapter 8, Proposition 8.4.
    """
    N = check_int(tokens_per_rank, "tokens_per_rank", low=1)
    W = check_int(world_size, "world_size", low=1)
    if W == 1:
        return float(N)
    # the objective is convex in lam; its minimiser solves lam e^lam - e^lam + 1 = log(W) / N, whose
    # left side increases from 0: bisection
    target, low, high = math.log(W) / N, 0.0, 1.0
    while high * math.exp(high) - math.expm1(high) < target:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if mid * math.exp(mid) - math.expm1(mid) < target else (low, mid)
    lam = (low + high) / 2
    return (math.log(W) + N * math.expm1(lam)) / lam


def idle_fraction(loads) -> float:
    """The share of device time spent waiting when every rank works in proportion to its load and all
    wait for the busiest: ``1 - mean(loads) / max(loads)`` (0 for equal loads; 0 when all are 0)."""
    loads = torch.as_tensor(loads, dtype=torch.float64).flatten()
    if loads.numel() == 0 or float(loads.max()) <= 0:
        return 0.0
    return float(1 - loads.mean() / loads.max())
