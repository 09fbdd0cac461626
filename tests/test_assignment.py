"""minimoe.ops.linear_assignment (the exact solver of minimoe.ops.transport) against brute force, the
transportation LP and scipy's Jonker-Volgenant on hundreds of random, tied, slack and large instances,
and its dual certificate."""
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


@pytest.mark.parametrize("method", ["auto", "scipy"])
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


def test_balanced_when_capacity_is_t_over_e():
    S = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    S[:, 0] += 5  # everyone prefers expert 0
    z = linear_assignment(S, 8)
    assert torch.equal(counts(z, 8), torch.full((8,), 8))


def test_bad_arguments():
    with pytest.raises(ValueError, match="capacity is too small: the experts have 3 slots for 10 tokens"):
        linear_assignment(torch.randn(10, 3), 1)
    with pytest.raises(ValueError, match="capacity"):
        linear_assignment(torch.randn(10, 3), 0)
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        linear_assignment(torch.randn(10, 3), [5, 6, -1])
    with pytest.raises(TypeError, match="capacity must hold integers"):
        linear_assignment(torch.randn(10, 3), torch.tensor([4.0, 4.0, 4.0]))
    with pytest.raises(ValueError, match="broadcast"):
        linear_assignment(torch.randn(10, 3), [5, 5])
    with pytest.raises(ValueError, match="return_duals=True needs method='auto'"):
        linear_assignment(torch.randn(4, 2), 2, method="scipy", return_duals=True)
    with pytest.raises(ValueError, match="method"):
        linear_assignment(torch.randn(4, 2), 2, method="greedy")
    with pytest.raises(ValueError, match="inf"):
        linear_assignment(torch.tensor([[0.0, float("inf")]]), 1)


# ---------------------------------------------------------------- the exact solver against scipy

def scipy_total(S, capacity):
    from scipy.optimize import linear_sum_assignment

    columns = np.repeat(np.arange(S.shape[1]), capacity)
    rows, cols = linear_sum_assignment(S[:, columns], maximize=True)
    return S[rows, columns[cols]].sum()


def random_instance(gen, kind):
    """One of six kinds: continuous, tied (scores in {-2..2}), slack capacities (a vector), scores of
    +-1e4, a popular expert that everyone prefers, and ties plus per-expert offsets like 1/3 (whose
    differences round: the kind that once sent float64 round a cycle of cost -1e-16)."""
    T = int(torch.randint(1, 80, (1,), generator=gen))
    E = int(torch.randint(1, 9, (1,), generator=gen))
    if kind == "tied":
        S = torch.randint(-2, 3, (T, E), generator=gen).double()
    elif kind == "offsets":
        S = torch.randint(0, 2, (T, E), generator=gen).double() + torch.linspace(0, 1, E, dtype=torch.float64)
    elif kind == "large":
        S = torch.randn(T, E, generator=gen, dtype=torch.float64) * 1e4
    else:
        S = torch.randn(T, E, generator=gen, dtype=torch.float64)
    if kind == "popular":
        S[:, 0] += 3
    if kind == "slack":
        capacity = torch.randint(0, T + 1, (E,), generator=gen)
        short = T - int(capacity.sum())
        if short > 0:
            capacity[int(torch.randint(0, E, (1,), generator=gen))] += short
    else:
        capacity = torch.full((E,), -(-T // E) + int(torch.randint(0, 2, (1,), generator=gen)))
    return S, capacity


def check_certificate(S, capacity, result, atol):
    """u_t + p_e >= S_te everywhere, = on the assignment, p >= 0, p = 0 where an expert is not full."""
    z, p, u = result
    E = S.shape[-1]
    assert (p >= 0).all()
    slack = u[..., :, None] + p[..., None, :] - S.double()
    assert slack.min() >= -atol, float(slack.min())
    assert slack.gather(-1, z[..., None]).abs().max() <= atol
    loads = torch.nn.functional.one_hot(z, E).sum(-2)
    assert (loads <= capacity).all()
    assert (p[loads < capacity] <= atol).all(), "a price on an expert with a free slot"


@pytest.mark.parametrize("kind", ["continuous", "tied", "slack", "large", "popular", "offsets"])
def test_exact_against_scipy_on_random_instances(kind):
    """240 instances in all (40 of each kind), solved one at a time: the same total as scipy's
    Jonker-Volgenant to 1e-9 relative, every capacity respected, and the dual certificate holds."""
    gen = torch.Generator().manual_seed(hash(kind) % 2**31)
    for _ in range(40):
        S, capacity = random_instance(gen, kind)
        result = linear_assignment(S, capacity, return_duals=True)
        z = result.assignment
        best = scipy_total(S.numpy(), capacity.numpy())
        assert abs(total(S, z) - best) <= 1e-9 * (1 + abs(best)), (kind, S.shape)
        check_certificate(S, capacity, result, atol=1e-9 * (1 + S.abs().max().item()))


def test_batched_problems_are_solved_independently():
    gen = torch.Generator().manual_seed(5)
    S = torch.randn(3, 4, 48, 6, generator=gen)  # float32 input, solved in float64
    S[0, 0, :, 2] += 4
    capacity = torch.tensor([8, 8, 8, 8, 10, 6])
    result = linear_assignment(S, capacity, return_duals=True)
    assert result.assignment.shape == (3, 4, 48) and result.prices.shape == (3, 4, 6)
    for i in range(3):
        for j in range(4):
            alone = linear_assignment(S[i, j], capacity)
            assert torch.equal(alone, result.assignment[i, j])
            best = scipy_total(S[i, j].double().numpy(), capacity.numpy())
            assert abs(total(S[i, j].double(), result.assignment[i, j]) - best) < 1e-9 * (1 + abs(best))
    check_certificate(S, capacity, result, atol=1e-9)


def test_ties_are_broken_deterministically():
    S = torch.zeros(40, 4)  # every assignment is optimal
    first = linear_assignment(S, 10)
    assert torch.equal(first, linear_assignment(S.clone(), 10))
    assert torch.equal(torch.bincount(first, minlength=4), torch.full((4,), 10))


def test_a_large_problem_is_exact_and_balanced():
    """T = 4096 tokens, E = 64 experts, capacity 64, a popular expert: the certificate proves the
    optimum without an oracle."""
    gen = torch.Generator().manual_seed(6)
    S = torch.randn(4096, 64, generator=gen, dtype=torch.float64)
    S[:, :4] += 1.0
    result = linear_assignment(S, 64, return_duals=True)
    check_certificate(S, torch.full((64,), 64), result, atol=1e-9)
    assert torch.equal(torch.bincount(result.assignment, minlength=64), torch.full((64,), 64))


def test_balanced_and_slack_groups_in_one_batch():
    """The price cuts of the first phase are for balanced groups only (sum_e C_e = T); a batch that mixes
    both kinds gets each right."""
    gen = torch.Generator().manual_seed(8)
    S = torch.randn(4, 60, 6, generator=gen, dtype=torch.float64)
    S[:, :, 0] += 2
    capacity = torch.tensor([[10] * 6, [12] * 6, [10] * 6, [20, 0, 10, 10, 10, 10]])  # sums 60, 72, 60, 60
    result = linear_assignment(S, capacity, return_duals=True)
    for b in range(4):
        best = scipy_total(S[b].numpy(), capacity[b].numpy())
        assert abs(total(S[b], result.assignment[b]) - best) <= 1e-9 * (1 + abs(best))
    check_certificate(S, capacity, result, atol=1e-9)


def test_a_large_tied_problem():
    """T = 4096, E = 64, scores in {0, 1, 2, 3}: thousands of tokens tie for their best expert (the first
    phase must spread them, not send them all to the first); against scipy."""
    gen = torch.Generator().manual_seed(9)
    S = torch.randint(0, 4, (4096, 64), generator=gen).double()
    result = linear_assignment(S, 64, return_duals=True)
    assert total(S, result.assignment) == scipy_total(S.numpy(), np.full(64, 64))
    check_certificate(S, torch.full((64,), 64), result, atol=1e-9)


def test_column_potentials_approach_the_prices():
    """Chapter 2, Proposition 2.10: q = -g_eps violates CS1 against the optimal assignment by at most
    eps T log E in total, that violation is exactly the dual gap, and the solver's prices lie in the
    polytope p_e - p_a >= -d_ae of the shortest move paths (as do Sinkhorn's once eps is small)."""
    import math

    from minimoe.ops import floyd_warshall, move_costs, sinkhorn

    gen = torch.Generator().manual_seed(10)
    T, E, C = 48, 6, 8
    S = torch.randn(T, E, generator=gen, dtype=torch.float64)
    exact = linear_assignment(S, C, return_duals=True)
    z, best = exact.assignment, total(S, exact.assignment)

    def violation(q):
        net = S - q
        return (net.max(1).values - net.gather(1, z[:, None])[:, 0]).sum().item()

    g, violations = None, []
    for eps in [3.0, 1.0, 0.3, 0.1, 0.03, 0.01, 0.003]:
        g = sinkhorn(S, eps, tol=1e-11, max_iter=50_000, init=g, return_potentials=True).g
        q = -g
        violations.append(violation(q))
        assert violations[-1] <= eps * T * math.log(E) + 1e-9
        dual = ((S - q).max(1).values.sum() + C * q.sum()).item()
        assert abs(violations[-1] - (dual - best)) <= 1e-8
    assert violations[-1] <= 1e-9 < violations[0], "the violation vanishes as eps -> 0"
    d = floyd_warshall(move_costs(S, z)[0])
    for prices in (exact.prices, -g):
        assert violation(prices) <= 1e-9
        diff = prices[None, :] - prices[:, None]  # diff[a, e] = p_e - p_a
        assert (diff >= -d - 1e-9).all() and (diff <= d.T + 1e-9).all()


def _dual(S, C, q):
    """Phi(q) = sum_t max_e (S_te - q_e) + sum_e C_e q_e (chapter 2, proof of Proposition 2.10)."""
    return ((S - q).max(1).values.sum() + (C * q).sum()).item()


def test_the_dual_grows_at_the_rate_of_proposition_2_10c():
    """Prop. 2.10(c): along a non-constant direction v, Phi(q + s v) - Phi(q) >= s sum_e C_e (v_e - min v)
    - T R, and that rate is the exact slope for large s. The book once claimed the rate
    T max v - sum_e C_e v_e, which the instance S = 0, T = 4, C = (1, 3), v = e_1 refutes (s, not 3 s)."""
    S, C, v = torch.zeros(4, 2, dtype=torch.float64), torch.tensor([1.0, 3.0], dtype=torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64)
    zero = torch.zeros(2, dtype=torch.float64)
    assert _dual(S, C, 5 * v) - _dual(S, C, zero) == pytest.approx(5.0)
    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        T, E = 12, 4
        S = torch.randn(T, E, generator=gen, dtype=torch.float64)
        C = torch.tensor([2.0, 3.0, 3.0, 4.0], dtype=torch.float64)
        q, v = torch.randn(E, generator=gen, dtype=torch.float64), torch.randn(E, generator=gen, dtype=torch.float64)
        rate = (C * (v - v.min())).sum().item()
        net = S - q
        R = (net.max(1).values - net.min(1).values).max().item()
        for s in (0.1, 1.0, 10.0):
            assert _dual(S, C, q + s * v) - _dual(S, C, q) >= s * rate - T * R - 1e-9
        slope = (_dual(S, C, q + 2000 * v) - _dual(S, C, q + 1000 * v)) / 1000
        assert slope == pytest.approx(rate, rel=1e-9)


def test_the_optimal_prices_are_a_polytope_not_the_box_of_their_intervals():
    """Prop. 2.10(b): p is optimal (V(p) = 0) iff p_b - p_a >= -d_ab for every pair. The box that the
    intervals p_e - p_0 in [-d_0e, d_e0] span is larger: some of its points are not optimal prices."""
    from minimoe.ops import floyd_warshall, move_costs
    gen = torch.Generator().manual_seed(0)
    found_box_point_outside = False
    for _ in range(20):
        T, E, C = 6, 3, 2
        S = torch.randn(T, E, generator=gen, dtype=torch.float64)
        z = linear_assignment(S, C)
        d = floyd_warshall(move_costs(S, z)[0])

        def violation(p):
            net = S - p
            return (net.max(1).values - net.gather(1, z[:, None])[:, 0]).sum().item()

        low, high = -d[0, :], d[:, 0]
        for _ in range(100):
            p = low + (high - low) * torch.rand(E, generator=gen, dtype=torch.float64)   # in the box
            in_polytope = bool((p[None, :] - p[:, None] >= -d - 1e-12).all())
            assert (violation(p) <= 1e-12) == in_polytope
            found_box_point_outside |= not in_polytope
    assert found_box_point_outside


def test_a_push_round_may_keep_more_than_the_capacity():
    """Chapter 2, "Solving the assignment exactly": after a push, an expert keeps at least C_e tokens,
    not exactly C_e (the instance in the text), and the solver still returns the optimum."""
    S = torch.tensor([[10.0, 0, -10], [1, 0.5, -10], [0, 10, 0], [0, 5, 0]], dtype=torch.float64)
    capacity = torch.tensor([1, 1, 2])
    prices = torch.tensor([0.5, 5.0, 0.0], dtype=torch.float64)     # both overfull experts raised at once
    favourite = (S - prices).argmax(1)
    assert (favourite == 0).sum() == 2 > capacity[0], "the second token stays with the first expert"
    z = linear_assignment(S, capacity)
    assert (torch.bincount(z, minlength=3) <= capacity).all()
    assert total(S, z) == pytest.approx(scipy_total(S, capacity))
