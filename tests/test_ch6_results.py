"""Chapter 6 results that the paper states wrongly or leaves unchecked: Lemma A.2 with negative
scores, Proposition 6.4 for expert choice, Lemma 3.5's token-choice part and its margin (Proposition
6.6), and Lemma 3.7's rank claim (Proposition 6.8).

Oracles: scipy.optimize.linprog (HiGHS) through ``solve_selection_lp``, brute-force enumeration of
the noise corners, numpy's SVD, and torch.autograd's Jacobian.
"""
import itertools

import numpy as np
import pytest
import torch

from minimoe.ops import global_topc, solve_selection_lp, topc_threshold, unified_score


def erank(A, tol=1e-12):
    """Effective rank: exp of the entropy of the normalised singular values."""
    s = np.linalg.svd(np.asarray(A, dtype=float), compute_uv=False)
    s = s[s > tol]
    p = s / s.sum()
    return float(np.exp(-(p * np.log(p)).sum()))


# --- Proposition 6.2(d): USMoE's Lemma A.2 -----------------------------------------------------

def test_lemma_a2_expert_choice_beats_global_with_negative_scores():
    """With E not dividing c, expert choice selects fewer pairs; on negative scores it then beats the
    exact-budget global top-c, so Lemma A.2 needs non-negative scores (or E | c)."""
    S = np.array([[-1.0, -1.0], [-1.0, -1.0], [-10.0, -10.0]])
    c = 3  # k = 1 per token, C = floor(3 / 2) = 1 per expert: expert choice keeps 2 pairs
    ec = solve_selection_lp(S, per_expert=c // 2)
    glob = solve_selection_lp(S, budget=c, budget_equality=True)
    assert ec.objective == pytest.approx(-2.0) and glob.objective == pytest.approx(-3.0)
    assert ec.objective > glob.objective
    # with non-negative scores (the same matrix shifted) the lemma holds
    ec = solve_selection_lp(S + 10, per_expert=c // 2)
    glob = solve_selection_lp(S + 10, budget=c, budget_equality=True)
    assert ec.objective <= glob.objective + 1e-12


# --- Proposition 6.4, column version -------------------------------------------------------------

def test_equality_criterion_for_expert_choice():
    """With E | c and C = c / E: OPT_EC = OPT_U iff every column's C-th value >= every column's (C+1)-th."""
    T, E, C = 6, 3, 2
    strict = 0
    for seed in range(200):
        S = np.random.default_rng(seed).random((T, E))
        cols = np.sort(S, 0)[::-1]
        ec = solve_selection_lp(S, per_expert=C).objective
        assert ec == pytest.approx(cols[:C].sum(), abs=1e-9)
        gap = np.sort(S.ravel())[::-1][: E * C].sum() - ec
        predicted = cols[C - 1].min() < cols[C].max()
        assert (gap > 1e-9) == predicted
        strict += predicted
    assert 0 < strict < 200


# --- Proposition 6.6: USMoE's Lemma 3.5 --------------------------------------------------------

def test_token_choice_misroute_needs_margin_below_two_delta():
    """(a) Top-1 token choice misroutes a noisy token only if Delta_min < 2 delta (necessary), and the
    worst admissible noise does misroute it then; but Delta_min < 2 delta does not make every noise
    draw misroute it (zero noise is admissible)."""
    gen = np.random.default_rng(0)
    delta = 0.1
    for _ in range(300):
        row = gen.random(4)
        best = int(row.argmax())
        margin = np.min(np.delete(row[best] - row, best))
        # every corner of the noise box [-delta, delta]^4: the extreme points of the misroute condition
        misroutable = any(int(np.argmax(row + delta * np.array(signs))) != best
                          for signs in itertools.product((-1, 1), repeat=4))
        assert misroutable == (margin < 2 * delta)
        if margin < 2 * delta:
            assert int(np.argmax(row)) == best, "zero noise: not misrouted, although Delta_min < 2 delta"


def test_lemma_35_margin_delta_is_not_enough():
    """(c) With delta < gamma <= 2 delta the paper's conclusion fails: the global top-c selects a wrong
    pair of a noisy token and drops the other token (the chapter's counterexample), for every gamma in
    the interval of the two-token family."""
    clean = torch.tensor([[1.0, 0.7], [0.8, 0.0]], dtype=torch.float64)
    c, delta = 2, 0.06
    best = clean.argmax(-1)
    assert best.tolist() == [0, 0]
    gamma = topc_threshold(clean, c) - torch.stack([clean[0, 1], clean[1, 1]]).max()
    assert delta < gamma <= 2 * delta  # gamma = 0.1
    noise = torch.tensor([[0.0, delta], [-delta, 0.0]], dtype=torch.float64)
    assert noise.abs().max() <= delta
    mask = global_topc(clean + noise, c)
    assert mask.tolist() == [[True, True], [False, False]], "wrong pair (0, 1) in, token 1 dropped"
    assert torch.equal(global_topc(clean, c), torch.tensor([[True, False], [True, False]]))
    # top-1 token choice on the same noisy scores routes both tokens correctly
    assert torch.equal((clean + noise).argmax(-1), best)
    # the family S* = [[1, tau - g], [tau, 0]]: the wrong pair enters for every g in (delta, 2 delta)
    tau = 0.8
    for g in np.linspace(delta, 2 * delta, 13)[1:-1]:
        S = torch.tensor([[1.0, tau - g], [tau, 0.0]], dtype=torch.float64) + noise
        assert global_topc(S, c)[0, 1]
    # and at g > 2 delta it does not (part (c) of the proposition)
    S = torch.tensor([[1.0, tau - 2.2 * delta], [tau, 0.0]], dtype=torch.float64) + noise
    assert not global_topc(S, c)[0, 1]


# --- Proposition 6.8: USMoE's Lemma 3.7 --------------------------------------------------------

def test_lemma_37_counterexample_ranks():
    """(b) Non-collinear coefficient vectors, yet the mixed gating Jacobian has a lower (effective)
    rank than the token-choice one: ranks 2, 1, 1 and effective ranks 1.80, 1.00, 1.00."""
    basis = np.eye(2)  # router embeddings e_1, e_2
    c = [np.array([1.0, 0.0]), np.array([1.0, 1.0])]
    d = [np.array([-1.0, 1.0]), np.array([-1.0, 1.0])]
    for cj, dj in zip(c, d):
        assert abs(cj[0] * dj[1] - cj[1] * dj[0]) > 0.5, "c_j and d_j are not collinear"
    J_t = sum(np.outer(cj, ej) for cj, ej in zip(c, basis))
    J_e = sum(np.outer(dj, ej) for dj, ej in zip(d, basis))
    J_u = 0.5 * J_t + 0.5 * J_e  # alpha = 0.5, the paper's default
    assert [np.linalg.matrix_rank(J) for J in (J_t, J_e, J_u)] == [2, 1, 1]
    ranks = [erank(J) for J in (J_t, J_e, J_u)]
    assert ranks == pytest.approx([1.8035, 1.0, 1.0], abs=1e-3)
    assert ranks[2] < max(ranks[0], ranks[1]), "eq. (28) fails"
    # for every other alpha the mix has full rank: det = (1 - 2 alpha)(1 - alpha)
    for alpha in (0.0, 0.3, 0.7, 0.9):
        J = (1 - alpha) * J_t + alpha * J_e
        assert np.linalg.det(J) == pytest.approx((1 - 2 * alpha) * (1 - alpha))
        assert np.linalg.matrix_rank(J) == 2


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_gating_jacobian_rank_is_at_most_the_selected_experts(alpha):
    """(a) The gating part sum_{i in K} E_i grad S_{U,i}^T of USMoE's Jacobian, computed by autograd,
    has rank <= |K| and lies in the span of the router embeddings, for every alpha."""
    gen = torch.Generator().manual_seed(1)
    d, E, out = 12, 6, 10
    W = torch.randn(E, d, generator=gen, dtype=torch.float64)  # row j: router embedding e_j
    x = torch.randn(d, generator=gen, dtype=torch.float64)
    experts_out = torch.randn(E, out, generator=gen, dtype=torch.float64)  # E_i(x), held fixed
    for n_selected in (1, 2, 3):
        selected = (W @ x).topk(n_selected).indices  # the token's selected set (a row prefix)

        def gate_part(z):
            U = unified_score((W @ z)[None], alpha)[0]
            return (U[selected, None] * experts_out[selected]).sum(0)

        J = torch.autograd.functional.jacobian(gate_part, x)  # (out, d)
        assert torch.linalg.matrix_rank(J, rtol=1e-9).item() <= n_selected
        # every row of J lies in the row space of W (the span of the e_j)
        projector = torch.linalg.pinv(W) @ W
        assert torch.allclose(J @ projector, J, atol=1e-10)
    if alpha == 1.0:  # the sigmoid term alone: grad S_{e,i} = (2/E) sigma'(r_i) e_i
        r = W @ x
        i = int(r.argmax())
        grad = torch.autograd.functional.jacobian(lambda z: unified_score((W @ z)[None], 1.0)[0, i], x)
        s = torch.sigmoid(r[i])
        assert torch.allclose(grad, (2 / E) * s * (1 - s) * W[i])
