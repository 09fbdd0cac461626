"""minimoe.ops.linear_assignment against brute force and the transportation LP."""
import itertools

import numpy as np
import pytest
import torch
from scipy.optimize import linprog

from minimoe.ops import linear_assignment


def total(S, z):
    return S.gather(-1, z[..., None]).sum().item()


def counts(z, E):
    return torch.bincount(z, minlength=E)


def lp_value(S, capacity):
    """max <P, S>, rows sum to 1, columns at most capacity, P >= 0 (an integral LP)."""
    T, E = S.shape
    A_eq = np.zeros((T, T * E))
    for t in range(T):
        A_eq[t, t * E:(t + 1) * E] = 1
    A_ub = np.zeros((E, T * E))
    for e in range(E):
        A_ub[e, e::E] = 1
    res = linprog(-S.double().numpy().ravel(), A_ub=A_ub, b_ub=np.full(E, capacity), A_eq=A_eq, b_eq=np.ones(T),
                  bounds=(0, None), method="highs")
    assert res.status == 0
    return -res.fun


@pytest.mark.parametrize("method", ["scipy", "auction"])
def test_linear_assignment_brute_force(method):
    gen = torch.Generator().manual_seed(0)
    for _ in range(25):
        T = int(torch.randint(1, 7, (1,), generator=gen))
        E = int(torch.randint(1, 4, (1,), generator=gen))
        capacity = int(torch.randint(-(-T // E), T + 1, (1,), generator=gen))
        S = torch.randn(T, E, generator=gen, dtype=torch.float64)
        best = max(sum(S[t, e].item() for t, e in enumerate(z)) for z in itertools.product(range(E), repeat=T)
                   if max(np.bincount(z, minlength=E)) <= capacity)
        z = linear_assignment(S, capacity, method=method)
        assert z.dtype == torch.long and z.shape == (T,)
        assert counts(z, E).max() <= capacity
        assert abs(total(S, z) - best) < 1e-9


def test_linear_assignment_matches_linprog():
    gen = torch.Generator().manual_seed(1)
    for T, E, capacity in [(64, 8, 8), (50, 8, 7), (40, 5, 12), (30, 3, 10)]:
        S = torch.randn(2, T, E, generator=gen)
        z = linear_assignment(S, capacity)
        assert z.shape == (2, T)
        for b in range(2):
            assert counts(z[b], E).max() <= capacity
            assert abs(total(S[b].double(), z[b]) - lp_value(S[b], capacity)) < 1e-4


def test_auction_gap_within_bound():
    """Auction: total score within 1e-6 x (score range) of the exact optimum, batched."""
    gen = torch.Generator().manual_seed(2)
    S = torch.randn(3, 96, 8, generator=gen, dtype=torch.float64)
    exact = linear_assignment(S, 12, method="scipy")
    auction = linear_assignment(S, 12, method="auction")
    for b in range(3):
        assert counts(auction[b], 8).max() <= 12
        spread = (S[b].max() - S[b].min()).item()
        assert 0 <= total(S[b], exact[b]) - total(S[b], auction[b]) <= 1e-6 * spread + 1e-12


def test_balanced_when_capacity_is_t_over_e():
    S = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    S[:, 0] += 5  # everyone prefers expert 0
    z = linear_assignment(S, 8)
    assert torch.equal(counts(z, 8), torch.full((8,), 8))


def test_bad_arguments():
    with pytest.raises(ValueError, match="capacity=1 is too small"):
        linear_assignment(torch.randn(10, 3), 1)
    with pytest.raises(ValueError, match="capacity"):
        linear_assignment(torch.randn(10, 3), 0)
    with pytest.raises(ValueError, match="method"):
        linear_assignment(torch.randn(4, 2), 2, method="greedy")
    with pytest.raises(ValueError, match="inf"):
        linear_assignment(torch.tensor([[0.0, float("inf")]]), 1)
