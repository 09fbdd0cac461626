"""global_topc, the unified score and the selection LPs against the mathematics of chapter 6.

Oracles: scipy.optimize.linprog (HiGHS) on the LP relaxations, brute-force enumeration of all
subsets on tiny instances, the exact hypergeometric drop probability, Monte Carlo with a stated
sample count and tolerance.
"""
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minimoe.ops import (exchangeable_drop_probability, global_topc, selection_budget, selection_lp,
                         solve_selection_lp, topc_threshold, unified_score)


def topc_sum(S, c):
    return float(np.sort(S.ravel())[::-1][:c].sum())


def rng_scores(seed, T, E, positive=True):
    gen = torch.Generator().manual_seed(seed)
    S = torch.rand(T, E, generator=gen, dtype=torch.float64) if positive else torch.randn(
        T, E, generator=gen, dtype=torch.float64)
    return S


@given(T=st.integers(1, 7), E=st.integers(1, 6), data=st.data(), batch=st.sampled_from([(), (3,), (2, 2)]))
@settings(max_examples=60, deadline=None)
def test_budget_exact_and_threshold(T, E, data, batch):
    c = data.draw(st.integers(0, T * E))
    seed = data.draw(st.integers(0, 10_000))
    S = torch.randn(*batch, T, E, generator=torch.Generator().manual_seed(seed))
    mask = global_topc(S, c)
    assert mask.shape == S.shape and mask.dtype == torch.bool
    assert (mask.sum((-2, -1)) == c).all()
    if 0 < c < T * E:
        low = torch.where(mask, S, torch.inf).amin((-2, -1))
        high = torch.where(mask, -torch.inf, S).amax((-2, -1))
        assert (low >= high).all(), "every selected entry >= every unselected one"
        assert torch.equal(topc_threshold(S, c), low)


def test_ties_are_exact_and_deterministic():
    S = torch.tensor([[1.0, 2.0, 2.0], [2.0, 0.0, 2.0]])
    mask = global_topc(S, 3)
    assert mask.sum() == 3
    # four entries tie at 2: the first three in row-major order win
    assert mask.tolist() == [[False, True, True], [True, False, False]]
    assert torch.equal(global_topc(torch.zeros(2, 3), 4), torch.tensor([[True] * 3, [True, False, False]]))


@pytest.mark.parametrize("case", ["random", "ties at the threshold", "integers"])
@pytest.mark.parametrize("accelerator", [False, True])
def test_the_tie_shortcut_gives_the_same_selection(case, accelerator, monkeypatch):
    """On a CPU, when every entry tied with the threshold fits the budget, global_topc skips the
    running count of ties; the selection is the one that count gives (also with many ties)."""
    from minimoe.ops import _checks

    monkeypatch.setattr(_checks, "SIMULATE_ACCELERATOR", accelerator)
    gen = torch.Generator().manual_seed(0)
    batch, T, E, c = 3, 64, 16, 64
    S = torch.randn(batch, T, E, generator=gen)
    if case == "ties at the threshold":
        S = S.round(decimals=1)
    elif case == "integers":
        S = torch.randint(0, 5, (batch, T, E), generator=gen).float()
    flat = S.reshape(batch, -1)
    threshold = flat.topk(c, dim=-1).values[:, -1:]
    above, tied = flat > threshold, flat == threshold
    reference = above | (tied & (tied.cumsum(-1) <= c - above.sum(-1, keepdim=True)))
    assert torch.equal(global_topc(S, c), reference.view_as(S))


@pytest.mark.parametrize("seed", range(20))
def test_lp_optimum_is_topc_and_integral(seed):
    gen = np.random.default_rng(seed)
    T, E = int(gen.integers(2, 7)), int(gen.integers(2, 6))
    S = rng_scores(seed, T, E).numpy()
    c = int(gen.integers(1, T * E))
    sol = solve_selection_lp(S, budget=c)
    assert sol.objective == pytest.approx(topc_sum(S, c), abs=1e-9)
    assert np.abs(sol.x - np.round(sol.x)).max() < 1e-7, "a vertex of the budget polytope is integral"
    mask = global_topc(torch.from_numpy(S), c).numpy()
    assert float((S * mask).sum()) == pytest.approx(sol.objective, abs=1e-9)
    # the dual certificate of chapter 6: lambda = c-th largest, mu = (S - lambda)_+
    lam = float(np.sort(S.ravel())[::-1][c - 1])
    mu = np.maximum(S - lam, 0)
    assert c * lam + mu.sum() == pytest.approx(sol.objective, abs=1e-12)
    assert (lam + mu >= S - 1e-15).all() and lam >= 0
    # HiGHS's own dual of the budget is a valid threshold: between the c+1-th and c-th largest
    ordered = np.sort(S.ravel())[::-1]
    assert ordered[c] - 1e-9 <= sol.budget_dual <= ordered[c - 1] + 1e-9


@pytest.mark.parametrize("seed", range(10))
def test_brute_force_exact_budget(seed):
    S = rng_scores(100 + seed, 3, 4, positive=False).numpy()
    for c in range(0, 13):
        best = max(sum(S.ravel()[list(idx)]) for idx in itertools.combinations(range(12), c)) if c else 0.0
        mask = global_topc(torch.from_numpy(S), c).numpy()
        assert float((S * mask).sum()) == pytest.approx(best, abs=1e-12)


def test_at_most_c_with_negative_scores_skips_them():
    """Prop. 3.3 needs the top-c scores >= 0 under the budget 'sum X <= c': otherwise the optimum takes
    only the positive ones, and the top-c set is strictly worse (chapter 6 counterexample)."""
    S = np.array([[0.5, -0.2], [-0.1, -0.3]])
    sol = solve_selection_lp(S, budget=2)
    assert sol.objective == pytest.approx(0.5)
    assert topc_sum(S, 2) == pytest.approx(0.4) and topc_sum(S, 2) < sol.objective
    exact = solve_selection_lp(S, budget=2, budget_equality=True)
    assert exact.objective == pytest.approx(0.4), "with an exact budget, top-c is optimal"


@pytest.mark.parametrize("seed", range(15))
def test_token_and_expert_choice_lps(seed):
    T, E, k = 6, 4, 2
    S = rng_scores(200 + seed, T, E).numpy()
    tc = solve_selection_lp(S, per_token=k)
    assert tc.objective == pytest.approx(np.sort(S, 1)[:, ::-1][:, :k].sum(), abs=1e-9)
    e = T * k // E
    ec = solve_selection_lp(S, per_expert=e)
    assert ec.objective == pytest.approx(np.sort(S, 0)[::-1][:e].sum(), abs=1e-9)
    unified = topc_sum(S, T * k)
    assert tc.objective <= unified + 1e-12 and ec.objective <= unified + 1e-12
    for sol in (tc, ec):
        assert np.abs(sol.x - np.round(sol.x)).max() < 1e-7
    # token choice's duals are one threshold per token: selected entries above it, others below
    x = np.round(tc.x).astype(bool)
    for t in range(T):
        assert S[t, x[t]].min() >= tc.token_duals[t] - 1e-9 >= S[t, ~x[t]].max() - 2e-9
    # expert choice's duals are one threshold per expert
    x = np.round(ec.x).astype(bool)
    for j in range(E):
        assert S[x[:, j], j].min() >= ec.expert_duals[j] - 1e-9 >= S[~x[:, j], j].max() - 2e-9


def test_equality_criterion_over_seeds():
    """OPT_U > OPT_TC exactly when some row's (k+1)-th value beats another row's k-th (chapter 6)."""
    T, E, k = 5, 4, 2
    strict = 0
    for seed in range(300):
        S = rng_scores(1000 + seed, T, E).numpy()
        rows = np.sort(S, 1)[:, ::-1]
        gap = topc_sum(S, T * k) - rows[:, :k].sum()
        predicted = rows[:, k - 1].min() < rows[:, k].max()
        assert (gap > 1e-12) == predicted
        strict += predicted
    assert 0 < strict < 300


def test_sorted_dominance():
    S = rng_scores(7, 8, 5).numpy()
    c = 16  # k = 2 per token for T = 8; the expert-choice capacity is 16 / 5 -> 3 per expert (15 pairs)
    unified = np.sort(S.ravel())[::-1][:c]
    tc = np.sort(np.sort(S, 1)[:, ::-1][:, :2].ravel())[::-1]
    ec = np.sort(np.sort(S, 0)[::-1][:3].ravel())[::-1]
    assert (tc <= unified + 1e-15).all(), "r-th best of any c entries <= r-th best overall"
    assert (ec <= unified[:15] + 1e-15).all()


def test_reductions():
    S = rng_scores(8, 1, 6)
    assert torch.equal(global_topc(S, 2), S >= S.topk(2).values[..., -1:]), "one token: token choice"
    S = rng_scores(9, 7, 1)
    assert torch.equal(global_topc(S, 3)[:, 0], S[:, 0] >= S[:, 0].topk(3).values[-1]), "one expert: expert choice"
    assert global_topc(S, 7).all(), "c = TE: dense"


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
def test_sigmoid_unified_score_keeps_row_order(alpha):
    gen = torch.Generator().manual_seed(10)
    logits = 2 * torch.randn(4, 16, 8, generator=gen, dtype=torch.float64)
    U = unified_score(logits, alpha)
    mask = global_topc(U, 24)
    k_i = mask.sum(-1)
    order = logits.argsort(-1, descending=True)
    for g, t in itertools.product(range(4), range(16)):
        chosen = set(order[g, t, :k_i[g, t]].tolist())
        assert set(mask[g, t].nonzero().flatten().tolist()) == chosen, "row-prefix: top-k_i of its own row"


def test_column_softmax_can_reorder_a_row():
    logits = torch.tensor([[2.0, 1.0], [5.0, -3.0]], dtype=torch.float64)
    U = unified_score(logits, 1.0, ec_score="column_softmax")
    assert logits[0, 0] > logits[0, 1] and U[0, 0] < U[0, 1]


def test_alpha_one_sigmoid_is_topc_of_logits_but_row_softmax_is_not():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    assert torch.equal(global_topc(unified_score(logits, 1.0), 8), global_topc(logits, 8))
    logits = torch.tensor([[3.0, 2.9], [0.0, -5.0]], dtype=torch.float64)
    assert not torch.equal(global_topc(unified_score(logits, 0.0), 2), global_topc(logits, 2))


def test_unified_score_values():
    logits = torch.randn(3, 5, 4, dtype=torch.float64)
    alpha = 0.25
    expected = 0.75 * torch.softmax(logits, -1) + 0.25 * 0.5 * torch.sigmoid(logits)
    assert torch.allclose(unified_score(logits, alpha), expected)
    col = unified_score(logits, 1.0, ec_score="column_softmax")
    assert torch.allclose(col.sum(-2), torch.ones(3, 4, dtype=torch.float64))


def test_exchangeable_drop_probability_monte_carlo():
    """i.i.d. scores: the top-n set is a uniform n-subset, so a token is dropped with probability
    C(LN - N, n) / C(LN, n). Monte Carlo: 500 groups x 64 tokens; the tolerance 0.01 is > 4 standard
    errors of the mean (sd of one group's drop rate is about 0.04 here)."""
    L, N, k = 64, 16, 2
    n = selection_budget(k, L, N)
    exact = exchangeable_drop_probability(L, N, n)
    assert exact == pytest.approx(math.comb(L * N - N, n) / math.comb(L * N, n), rel=1e-12)
    assert exact <= (1 - k / N) ** N <= math.exp(-k)
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(500, L, N, generator=gen)
    mask = global_topc(unified_score(logits, 1.0), n)
    measured = (mask.sum(-1) == 0).double().mean().item()
    assert measured == pytest.approx(exact, abs=0.01)


def test_order_statistics_are_lipschitz():
    """Lemma 3.5, repaired: |tau_c(S + N) - tau_c(S)| <= ||N||_inf (the paper's tau*_c <= tau_c is false)."""
    gen = torch.Generator().manual_seed(13)
    for _ in range(200):
        S = torch.randn(6, 4, generator=gen, dtype=torch.float64)
        noise = 0.3 * (2 * torch.rand(6, 4, generator=gen, dtype=torch.float64) - 1)
        for c in (1, 6, 12):
            gap = (topc_threshold(S + noise, c) - topc_threshold(S, c)).abs()
            assert gap <= noise.abs().max() + 1e-12
    # the paper's step: noise that only lowers entries lowers the threshold
    S = torch.tensor([[1.0, 0.0], [0.5, 0.2]], dtype=torch.float64)
    assert topc_threshold(S - 0.1, 2) < topc_threshold(S, 2)


def test_noisy_token_lemma_corrected():
    """Lemma 3.5 with the 2 delta margin: wrong pairs of noisy tokens are never selected when
    gamma > 2 delta; and every USMoE misroute (a nonempty set without the clean best expert) is
    also a top-1 token-choice misroute."""
    gen = torch.Generator().manual_seed(14)
    T, E, delta = 8, 4, 0.1
    clean = torch.full((T, E), 0.0, dtype=torch.float64)
    clean[:, 0] = 1.0  # clean best expert 0 for everyone
    clean[:4] += 0.5  # four confident clean tokens; the noisy ones are 4..7
    noisy_rows = torch.arange(4, T)
    tau_clean = topc_threshold(clean, T)
    gamma = tau_clean - clean[noisy_rows][:, 1:].max()
    assert gamma > 2 * delta
    for _ in range(200):
        S = clean.clone()
        S[noisy_rows] += delta * (2 * torch.rand(4, E, generator=gen, dtype=torch.float64) - 1)
        mask = global_topc(S, T)
        assert not mask[noisy_rows][:, 1:].any()
    violations = 0
    for _ in range(1000):
        clean = torch.rand(T, E, generator=gen, dtype=torch.float64)
        S = clean.clone()
        S[noisy_rows] += 0.3 * torch.randn(4, E, generator=gen, dtype=torch.float64)
        best = clean.argmax(-1)
        mask = global_topc(S, T)
        us_mis = mask.any(-1) & ~mask.gather(1, best[:, None])[:, 0]
        tc_mis = S.argmax(-1) != best
        violations += int((us_mis & ~tc_mis).sum())
    assert violations == 0


def test_selection_lp_shapes_and_errors():
    lp = selection_lp(np.ones((3, 2)), budget=2, per_token=1, per_expert=1)
    assert lp.A_ub.shape == (1, 6) and lp.A_eq.shape == (3 + 2, 6)
    with pytest.raises(ValueError, match="at least one"):
        selection_lp(np.ones((2, 2)))
    with pytest.raises(ValueError, match="budget"):
        selection_lp(np.ones((2, 2)), budget=5)
    with pytest.raises(ValueError, match="one \\(T, E\\) matrix"):
        selection_lp(np.ones((2, 2, 2)), budget=1)
    with pytest.raises(ValueError, match="infeasible"):
        solve_selection_lp(np.ones((3, 2)), per_token=1, per_expert=1)  # 3 tokens cannot fill 2 x 1 evenly


@pytest.mark.parametrize("call, match", [
    (lambda: global_topc(torch.randn(3, 4), 13), "c must be <= 12"),
    (lambda: global_topc(torch.randn(3, 4), -1), "c must be >= 0"),
    (lambda: global_topc(torch.tensor([[float("nan"), 1.0]]), 1), "NaN"),
    (lambda: global_topc(torch.randn(4), 1), "shape"),
    (lambda: unified_score(torch.randn(3, 4), 1.5), "alpha"),
    (lambda: unified_score(torch.randn(3, 4), ec_score="softmax"), "ec_score"),
    (lambda: selection_budget(0.0, 4, 8), "k"),
    (lambda: selection_budget(9, 4, 8), "k"),
    (lambda: exchangeable_drop_probability(4, 2, 9), "selected"),
])
def test_bad_arguments(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
