"""Gumbel-Matching (Kool et al., chapter 5): exact solvers, its law, and the conditionals.

Oracles: scipy.optimize.linear_sum_assignment on the column-replicated matrix; brute-force
enumeration of every assignment (the optimum, the law by an enumerated perturb-and-MAP sampler, the
forced optima of eq. (7) and the conditionals as a max over assignments); the exact k = 2 law by
numerical integration (scipy.integrate.quad); all simple paths for shortest paths; chi-square tests
with stated sample counts and p-value thresholds; Monte Carlo within 4.5 standard errors.
"""
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, stats
from scipy.optimize import linear_sum_assignment

import minimoe.ops.gumbel_matching as gm
from minimoe.ops import (
    balanced_assignments,
    count_balanced_assignments,
    floyd_warshall,
    gumbel_matching_conditionals,
    gumbel_matching_sample,
    linear_assignment,
    move_costs,
    sample_gumbel,
    sinkhorn_balance,
    solve_assignment,
)

P_MIN = 1e-3  # chi-square tests: fail below this p-value (fixed seeds: deterministic)


def total(scores, z):
    return scores.gather(-1, z[..., None])[..., 0].sum(-1)


def lsa_value(scores, capacity):
    """scipy's optimum of one (T, E) problem with at most ``capacity`` tokens per expert."""
    M = np.repeat(scores.numpy(), min(capacity, scores.shape[0]), axis=1)
    rows, cols = linear_sum_assignment(M, maximize=True)
    return float(M[rows, cols].sum())


def random_problem(seed, slack=False):
    gen = torch.Generator().manual_seed(seed)
    E = int(torch.randint(2, 7, (1,), generator=gen))
    c = int(torch.randint(1, 9, (1,), generator=gen))
    T = E * c - (int(torch.randint(0, c * E, (1,), generator=gen)) if slack else 0)
    scale = float(torch.rand(1, generator=gen)) * 5 + 0.05
    return torch.randn(3, max(T, 1), E, generator=gen, dtype=torch.float64) * scale, c


# --- solvers -------------------------------------------------------------------------------------

@pytest.mark.parametrize("slack", [False, True])
def test_solvers_match_scipy(slack):
    """P4: cycle cancelling, the assignment method and (k = 2) top-c reach scipy's optimum, 100 random
    batched problems (E in [2, 6], c in [1, 8]), with and without slack."""
    for seed in range(100):
        scores, c = random_problem(seed, slack)
        T, E = scores.shape[-2:]
        want = torch.tensor([lsa_value(s, c) for s in scores], dtype=torch.float64)
        methods = ["cycle", "assignment"] + (["top2"] if E == 2 else [])
        for method in methods:
            z = solve_assignment(scores, c, method=method)
            assert z.shape == (3, T) and z.dtype == torch.long
            assert ((z >= 0) & (z < E)).all()
            counts = torch.nn.functional.one_hot(z, E).sum(-2)
            assert (counts <= c).all()
            if not slack:
                assert (counts == c).all()
            assert torch.allclose(total(scores, z), want, atol=1e-9, rtol=0), (seed, method)


def test_brute_force_optimum_and_large_problem():
    """The optimum equals the best of every enumerated assignment (n <= 8); and on one larger problem
    (T = 512, E = 8) cycle cancelling equals the linear-assignment solver."""
    for seed, (T, E, c) in enumerate([(6, 3, 2), (8, 2, 4), (8, 4, 2), (5, 3, 2), (7, 2, 5)]):
        S = torch.randn(T, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        Z = balanced_assignments(T, E, c)
        best = S.gather(1, Z.T).sum(0).max()
        for method in ["cycle", "assignment"] + (["top2"] if E == 2 else []):
            assert abs(float(total(S, solve_assignment(S, c, method=method)) - best)) < 1e-12
    S = torch.randn(2, 512, 8, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    assert torch.allclose(total(S, solve_assignment(S, 64, method="cycle")),
                          total(S, linear_assignment(S, 64)), atol=1e-9, rtol=0)


def test_certificate_and_one_cancelling_step():
    """P5: at the optimum Floyd-Warshall on the move costs has no negative diagonal; after swapping two
    tokens of different experts a negative cycle appears, and cancelling it strictly raises the
    objective and keeps the assignment balanced."""
    for seed in range(30):
        gen = torch.Generator().manual_seed(seed)
        T, E, c = 12, 3, 4
        S = torch.randn(T, E, generator=gen, dtype=torch.float64)
        z = solve_assignment(S, c)
        cost, token = move_costs(S, z, c)
        assert float(floyd_warshall(cost).diagonal().min()) >= -1e-12
        a = int(torch.nonzero(z == 0)[0])
        b = int(torch.nonzero(z == 1)[0])
        swapped = z.clone()
        swapped[a], swapped[b] = 1, 0
        cost, token = move_costs(S, swapped, c)
        assert float(floyd_warshall(cost).diagonal().min()) < 0
        found, on_cycle, pred = gm._negative_cycles(cost[None], torch.tensor([1e-12], dtype=torch.float64))
        assert bool(found[0])
        v = on_cycle[0].nonzero().flatten()
        u = pred[0, v]
        assert float(cost[u, v].sum()) < 0, "the extracted cycle is negative"
        better = swapped.clone()
        better[token[u, v]] = v
        assert torch.equal(torch.bincount(better, minlength=E), torch.full((E,), c))
        assert float(total(S, better)) > float(total(S, swapped))


def test_floyd_warshall_against_all_simple_paths():
    """d*[i, j] = min over all simple paths (enumerated) with arbitrary-sign edges and no negative
    cycle (the move costs at an optimum); the next-hop table rebuilds a path of that cost."""
    for seed in range(8):
        gen = torch.Generator().manual_seed(seed)
        S = torch.randn(10, 5, generator=gen, dtype=torch.float64)
        z = solve_assignment(S, 2)
        cost, _ = move_costs(S, z, 2)
        D, nxt = floyd_warshall(cost, return_next=True)
        E = 5
        for i, j in itertools.product(range(E), range(E)):
            best = 0.0 if i == j else math.inf
            others = [m for m in range(E) if m not in (i, j)]
            for r in range(len(others) + 1):
                for mid in itertools.permutations(others, r):
                    path = (i, *mid, j) if i != j else (i, *mid, i) if mid else (i,)
                    best = min(best, sum(float(cost[a, b]) for a, b in zip(path, path[1:])))
            assert abs(float(D[i, j]) - best) < 1e-12
            if i != j:
                node, walked, hops = i, 0.0, 0
                while node != j:
                    step = int(nxt[node, j])
                    walked += float(cost[node, step])
                    node, hops = step, hops + 1
                    assert hops <= E
                assert abs(walked - float(D[i, j])) < 1e-12


def test_free_slots_and_unconstrained_limit():
    """With capacity >= T every token takes its own argmax (independent sampling, P6); with some
    slack the free-slot rule of move_costs makes cycle cancelling exact (checked above) and an
    expert with a free slot offers cost-0 moves."""
    S = torch.randn(4, 7, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for method in ("cycle", "assignment"):
        assert torch.equal(solve_assignment(S, 7, method=method), S.argmax(-1))
    z = torch.tensor([0, 0, 1, 1, 2])
    cost, token = move_costs(S[0, :5], z, 2)
    assert (cost[2] <= 0).all() and (token[2] == -1).all()  # expert 2 has a free slot


# --- the law of Gumbel-Matching --------------------------------------------------------------------

def enumerated_gm(A, tau, c, gumbels):
    """Perturb-and-MAP by enumeration: the assignment with the largest total perturbed score."""
    T, E = A.shape
    Z = balanced_assignments(T, E, c)
    S = A / tau + gumbels  # (N, T, E)
    values = S.gather(2, Z.T[None].expand(S.shape[0], T, Z.shape[0])).sum(1)  # (N, #Z)
    return Z, values.argmax(-1)


def test_same_noise_same_assignment_as_enumeration():
    gen = torch.Generator().manual_seed(3)
    A = torch.randn(6, 3, generator=gen, dtype=torch.float64)
    G = sample_gumbel((500, 6, 3), generator=gen)
    Z, index = enumerated_gm(A, 0.7, 2, G)
    for method in ("cycle", "assignment"):
        assert torch.equal(gumbel_matching_sample(A.expand(500, 6, 3), 2, tau=0.7, gumbels=G, method=method), Z[index])


def test_law_matches_enumerated_sampler_chi_square():
    """(a) Two-sample chi-square: 20000 draws of gumbel_matching_sample (torch noise) against 20000 of
    the enumerated perturb-and-MAP sampler (numpy noise), n = 6, k = 3, c = 2 (90 assignments):
    p > 1e-3. The test has power: the Gibbs distribution (5), sampled exactly, is rejected."""
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(6, 3, generator=gen, dtype=torch.float64) * 1.5
    tau, N = 0.8, 20000
    z = gumbel_matching_sample(A.expand(N, 6, 3), 2, tau=tau, generator=gen)
    G = torch.from_numpy(np.random.default_rng(1).gumbel(size=(N, 6, 3)))
    Z, index = enumerated_gm(A, tau, 2, G)
    ours = (z[:, None, :] == Z[None]).all(-1).double().argmax(-1)
    counts = np.stack([np.bincount(ours.numpy(), minlength=len(Z)), np.bincount(index.numpy(), minlength=len(Z))])
    keep = counts.sum(0) > 0
    assert stats.chi2_contingency(counts[:, keep])[1] > P_MIN
    gibbs = torch.softmax(A.gather(1, Z.T).sum(0) / tau, 0)
    drawn = torch.multinomial(gibbs, N, replacement=True, generator=gen)
    counts = np.stack([counts[0], np.bincount(drawn.numpy(), minlength=len(Z))])
    assert stats.chi2_contingency(counts[:, counts.sum(0) > 0])[1] < 1e-6


def k2_law(ell, c):
    """Exact law of the k = 2 assignment: P(expert 1's set is S) for every c-subset S, where token i
    has Delta_i = ell_i + Logistic, and S must be the top c. By one integral over the threshold t:
    the density of max_{i not in S} Delta_i at t times prod_{i in S} P(Delta_i > t)."""
    n = len(ell)
    F = lambda t, i: 1 / (1 + math.exp(-(t - ell[i])))  # noqa: E731
    subsets = list(itertools.combinations(range(n), c))
    probs = []
    lo, hi = min(ell) - 40, max(ell) + 40
    for S in subsets:
        rest = [i for i in range(n) if i not in S]

        def integrand(t, S=S, rest=rest):
            density = sum(F(t, m) * (1 - F(t, m)) * math.prod(F(t, i) for i in rest if i != m) for m in rest)
            return density * math.prod(1 - F(t, i) for i in S)
        probs.append(integrate.quad(integrand, lo, hi, limit=200, epsabs=1e-13)[0])
    return subsets, np.array(probs)


@pytest.mark.parametrize("method", ["top2", "cycle", "assignment"])
def test_k2_law_by_quadrature_chi_square(method):
    """(b) k = 2, n = 6, c = 3: the frequencies of the 20 possible sets over 20000 draws against the
    exact law by quadrature, chi-square goodness of fit p > 1e-3. The quadrature sums to 1 (1e-8)."""
    gen = torch.Generator().manual_seed(4)
    A = torch.randn(6, 2, generator=gen, dtype=torch.float64)
    tau, N = 0.6, 20000
    ell = ((A[:, 1] - A[:, 0]) / tau).tolist()
    subsets, probs = k2_law(ell, 3)
    assert abs(probs.sum() - 1) < 1e-8
    z = gumbel_matching_sample(A.expand(N, 6, 2), 3, tau=tau, generator=gen, method=method)
    codes = {s: k for k, s in enumerate(subsets)}
    drawn = [codes[tuple(np.flatnonzero(row))] for row in z.numpy()]
    observed = np.bincount(drawn, minlength=len(subsets))
    assert stats.chisquare(observed, probs * N)[1] > P_MIN


def test_gumbel_max_and_uniform_marginals():
    """P1: without a capacity limit it is the Gumbel-max trick (k = 5, 40000 draws, every frequency
    within 4.5 binomial s.e. of softmax); P6: equal logits give uniform GM marginals (20000 draws)."""
    gen = torch.Generator().manual_seed(5)
    a = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5], dtype=torch.float64)
    N = 40_000
    z = gumbel_matching_sample(a.expand(N, 1, 5), 1, generator=gen)[:, 0]
    freq = torch.bincount(z, minlength=5).double() / N
    p = torch.softmax(a, 0)
    assert ((freq - p).abs() <= 4.5 * (p * (1 - p) / N).sqrt()).all()
    N = 20000
    z = gumbel_matching_sample(torch.zeros(N, 6, 3, dtype=torch.float64), 2, generator=gen)
    freq = torch.nn.functional.one_hot(z, 3).double().mean(0)
    assert ((freq - 1 / 3).abs() <= 4.5 * math.sqrt(2 / 9 / N)).all()


def test_low_temperature_is_the_base_assignment():
    """P6: at tau = 1e-3 with well-separated logits, GM equals the noise-free optimum for 20 noises."""
    gen = torch.Generator().manual_seed(6)
    A = torch.randn(12, 3, generator=gen, dtype=torch.float64) * 3
    want = linear_assignment(A, 4)
    for _ in range(20):
        assert torch.equal(gumbel_matching_sample(A, 4, tau=1e-3, generator=gen), want)


# --- the conditionals ------------------------------------------------------------------------------

CASES = [(6, 3, 2), (4, 2, 2), (8, 2, 4), (6, 2, 4), (5, 3, 2), (7, 4, 2), (4, 4, 1)]  # some with slack


@pytest.mark.parametrize("T,E,c", CASES)
def test_conditionals_against_enumeration(T, E, c):
    """q(z_i = j | G_-i) = softmax_j(max over assignments with z_i = j of sum_{i' != i} s_{i' z_i'} +
    a_ij / tau): the Gumbel-max trick over row i's noise, by brute force; 10 problems each, 1e-12."""
    gen = torch.Generator().manual_seed(T * 100 + E * 10 + c)
    Z = balanced_assignments(T, E, c)
    for _ in range(10):
        A = torch.randn(T, E, generator=gen, dtype=torch.float64) * 2
        tau = 0.7
        G = sample_gumbel((T, E), generator=gen)
        z = gumbel_matching_sample(A, c, tau=tau, gumbels=G)
        q = gumbel_matching_conditionals(A, G, z, tau=tau, capacity=c)
        S = A / tau + G
        values = S.gather(1, Z.T).sum(0)
        for i in range(T):
            others = values - S[i].gather(0, Z[:, i])
            best = torch.stack([others[Z[:, i] == j].max() if (Z[:, i] == j).any()
                                else torch.tensor(-math.inf, dtype=torch.float64) for j in range(E)])
            assert torch.allclose(q[i], torch.softmax(best + A[i] / tau, 0), atol=1e-12, rtol=0)
        assert torch.allclose(q.sum(-1), torch.ones(T, dtype=torch.float64), atol=1e-12)  # P11
        assert (q > 0).all()


@pytest.mark.parametrize("T,E,c", [(6, 3, 2), (8, 4, 2), (7, 3, 3)])
def test_forced_optimum_eq7(T, E, c):
    """P9: v*_{|z_i = j} = v* - s_{i z_i} + s_ij - d*_{j z_i}, against the best enumerated assignment
    with z_i = j, for every (i, j); 10 problems each, 1e-12."""
    gen = torch.Generator().manual_seed(T + E + c)
    Z = balanced_assignments(T, E, c)
    for _ in range(10):
        S = torch.randn(T, E, generator=gen, dtype=torch.float64) * 2
        z = solve_assignment(S, c)
        d = floyd_warshall(move_costs(S, z, c)[0])
        values = S.gather(1, Z.T).sum(0)
        v = float(values.max())
        for i, j in itertools.product(range(T), range(E)):
            forced = float(values[Z[:, i] == j].max())
            formula = v - float(S[i, z[i]]) + float(S[i, j]) - float(d[j, z[i]])
            assert abs(forced - formula) < 1e-12


def test_conditionals_ignore_own_noise():
    """P7: for 20 problems, 20 redraws of g_i (batched, so that z_i changes) leave row i of the
    conditionals unchanged to 1e-10."""
    gen = torch.Generator().manual_seed(7)
    changed = 0
    for _ in range(20):
        A = torch.randn(8, 4, generator=gen, dtype=torch.float64)
        G = sample_gumbel((8, 4), generator=gen).expand(20, 8, 4).clone()
        i = int(torch.randint(0, 8, (1,), generator=gen))
        G[:, i] = sample_gumbel((20, 4), generator=gen) * 3
        z = gumbel_matching_sample(A.expand(20, 8, 4), 2, gumbels=G)
        rows = gumbel_matching_conditionals(A.expand(20, 8, 4), G, z, capacity=2)[:, i]
        changed += len(z[:, i].unique()) > 1
        assert (rows - rows[0]).abs().max() < 1e-10
    assert changed >= 10


def test_conditional_frequencies_monte_carlo():
    """P8: fix G_-i (n = 6, k = 3, c = 2, tau = 0.7), redraw g_i 20000 times and re-solve (batched):
    the frequency of z_i = j is within 4.5 binomial s.e. of the conditional, 3 problems."""
    gen = torch.Generator().manual_seed(8)
    N = 20000
    for _ in range(3):
        A = torch.randn(6, 3, generator=gen, dtype=torch.float64)
        G = sample_gumbel((6, 3), generator=gen).expand(N, 6, 3).clone()
        i = int(torch.randint(0, 6, (1,), generator=gen))
        G[:, i] = sample_gumbel((N, 3), generator=gen)
        z = gumbel_matching_sample(A.expand(N, 6, 3), 2, tau=0.7, gumbels=G)
        q = gumbel_matching_conditionals(A, G[0], z[0], tau=0.7)[i]
        freq = torch.bincount(z[:, i], minlength=3).double() / N
        assert ((freq - q).abs() <= 4.5 * (q * (1 - q) / N).sqrt()).all()


def test_k2_closed_form_K3():
    """P10: for k = 2, q(z_i = 1 | G_-i) = sigmoid(l_i - T_i) with T_i the c-th largest Delta among
    the other tokens; equals the general formula to 1e-12."""
    gen = torch.Generator().manual_seed(9)
    for _ in range(20):
        A = torch.randn(10, 2, generator=gen, dtype=torch.float64)
        G = sample_gumbel((10, 2), generator=gen)
        tau, c = 0.5, 5
        z = gumbel_matching_sample(A, c, tau=tau, gumbels=G, method="top2")
        q = gumbel_matching_conditionals(A, G, z, tau=tau)[:, 1]
        S = A / tau + G
        delta = S[:, 1] - S[:, 0]
        ell = (A[:, 1] - A[:, 0]) / tau
        for i in range(10):
            others = torch.cat([delta[:i], delta[i + 1:]]).sort(descending=True).values
            assert abs(float(torch.sigmoid(ell[i] - others[c - 1]) - q[i])) < 1e-12


def test_invariance_to_row_and_column_shifts():
    """P20: GM(A / tau + alpha_i + beta_j, G) = GM(A / tau, G) and the conditionals agree (1e-8) when
    E * c = T; in particular Gumbel-Matching of the Sinkhorn-balanced log P~ changes nothing."""
    gen = torch.Generator().manual_seed(10)
    for _ in range(50):
        A = torch.randn(9, 3, generator=gen, dtype=torch.float64) * 2
        G = sample_gumbel((9, 3), generator=gen)
        shifted = A / 0.8 + torch.randn(9, 1, generator=gen, dtype=torch.float64) * 3 + torch.randn(
            1, 3, generator=gen, dtype=torch.float64) * 3
        balanced = sinkhorn_balance(A, tau=0.8, log=True)
        z = gumbel_matching_sample(A, 3, tau=0.8, gumbels=G)
        q = gumbel_matching_conditionals(A, G, z, tau=0.8)
        for other in (shifted, balanced):
            z2 = gumbel_matching_sample(other, 3, gumbels=G)
            assert torch.equal(z, z2)
            assert torch.allclose(gumbel_matching_conditionals(other, G, z2), q, atol=1e-8)


# --- enumeration, shapes, dtypes, errors -----------------------------------------------------------

def test_balanced_assignments():
    for T, E, c in [(6, 3, 2), (8, 2, 4), (4, 4, 1), (5, 3, 2), (0, 2, 1), (3, 1, 3)]:
        Z = balanced_assignments(T, E, c)
        brute = [z for z in itertools.product(range(E), repeat=T) if max((z.count(e) for e in range(E)),
                                                                             default=0) <= c]
        assert Z.tolist() == sorted(list(z) for z in brute)
        assert len(Z) == count_balanced_assignments(T, E, c)
    assert count_balanced_assignments(12, 3, 4) == math.factorial(12) // math.factorial(4) ** 3 == 34650
    with pytest.raises(ValueError, match="max_count"):
        balanced_assignments(16, 4, 4)


@given(batch=st.sampled_from([(), (2,), (2, 3)]), E=st.integers(1, 5), c=st.integers(1, 4),
       free=st.integers(0, 3), tau=st.floats(0.05, 5.0), seed=st.integers(0, 10_000),
       method=st.sampled_from(["auto", "cycle", "assignment"]))
@settings(max_examples=60, deadline=None)
def test_shapes_and_capacity_property(batch, E, c, free, tau, seed, method):
    T = max(E * c - free, 0)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*batch, T, E, generator=gen)  # float32 in, exact float64 solve inside
    z, G = gumbel_matching_sample(logits, c, tau=tau, generator=gen, method=method, return_gumbels=True)
    assert z.shape == (*batch, T) and z.dtype == torch.long and G.dtype == torch.float64
    if T:
        assert ((z >= 0) & (z < E)).all()
        assert (torch.nn.functional.one_hot(z, E).sum(-2) <= c).all()
        q = gumbel_matching_conditionals(logits, G, z, tau=tau, capacity=c)
        assert q.shape == logits.shape and q.dtype == logits.dtype
        assert torch.allclose(q.sum(-1), torch.ones(q.shape[:-1]), atol=1e-5)
        ref = solve_assignment(logits.double() / tau + G, c, method="assignment")
        S = logits.double() / tau + G
        assert torch.allclose(total(S, z), total(S, ref), atol=1e-9)


def test_bad_arguments():
    A = torch.randn(6, 3)
    with pytest.raises(ValueError, match="capacity=1 is too small"):
        gumbel_matching_sample(A, 1)
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        gumbel_matching_sample(A, 0)
    with pytest.raises(TypeError, match="capacity must be an int"):
        gumbel_matching_sample(A, 2.0)
    with pytest.raises(ValueError, match="tau must be a finite number > 0"):
        gumbel_matching_sample(A, 2, tau=0.0)
    with pytest.raises(ValueError, match="method must be one of"):
        gumbel_matching_sample(A, 2, method="hungarian")
    with pytest.raises(ValueError, match="needs exactly 2 experts"):
        gumbel_matching_sample(A, 2, method="top2")
    with pytest.raises(ValueError, match="logits contains NaN"):
        gumbel_matching_sample(torch.full((6, 3), math.nan), 2)
    with pytest.raises(ValueError, match="gumbels must have the shape"):
        gumbel_matching_sample(A, 2, gumbels=torch.zeros(6, 2))
    G = sample_gumbel((6, 3))
    z = gumbel_matching_sample(A, 2, gumbels=G)
    worse = z.clone()
    a, b = int(torch.nonzero(z == 0)[0]), int(torch.nonzero(z == 1)[0])
    worse[a], worse[b] = 1, 0
    with pytest.raises(ValueError, match="assignment is not optimal"):
        gumbel_matching_conditionals(A, G, worse)
    with pytest.raises(ValueError, match="more than capacity"):
        gumbel_matching_conditionals(A, G, torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="assignment values must be in"):
        gumbel_matching_conditionals(A, G, torch.full((6,), 3))
    with pytest.raises(ValueError, match="not a multiple"):
        gumbel_matching_conditionals(torch.randn(5, 3), sample_gumbel((5, 3)), torch.tensor([0, 0, 1, 1, 2]))
    with pytest.raises(ValueError, match="must be square"):
        floyd_warshall(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="capacity=1 is too small"):
        balanced_assignments(5, 2, 1)
