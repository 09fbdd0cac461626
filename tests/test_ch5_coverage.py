"""Chapter 5 results that the older test files leave open, each against an independent oracle.

* the separability assumption of Propositions 5.1, 5.2 and 5.8: a loss that couples tokens makes
  every estimator biased (exact enumeration of all k^n assignments and kept subsets; Monte Carlo
  with 20000 draws and 4.5 / 10 standard errors for GM-IW);
* Gumbel-matching against the Gibbs distribution beyond n = k = 2 (Monte Carlo, 200000 draws per
  instance, against the exact Gibbs law on the listed set of balanced assignments);
* Proposition 5.4 (one-dimensional quadrature against the closed form of the Gibbs probability and
  against 100000 Monte Carlo draws);
* Proposition 5.9 and its failure with slack (same-noise comparisons; the exact law for one token);
* Proposition 5.10 (the max-entropy distribution: a feasible sparse mixture from scipy's linprog,
  the null space of the marginal constraints from scipy, the permanent formula by enumeration);
* the leave-one-out baseline and the variance of skip-IW (exact enumeration);
* the paper's toy experiment, short: 3 seeds, 2000 steps, tau = 3.
"""
import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import integrate, optimize, stats
from scipy.linalg import null_space
from scipy.special import expit

from minimoe.ops import (
    balanced_assignments,
    estimator_coefficients,
    expected_loss_gradient,
    gumbel_matching_conditionals,
    gumbel_matching_sample,
    sample_estimator,
    sample_gumbel,
    sinkhorn_balance,
    skip_mask,
)
from minimoe.exercises.oracles import coupled_losses, coupled_true_gradient, fit_max_entropy, skip_outcomes

F64 = torch.float64


def gen(seed):
    return torch.Generator().manual_seed(seed)


# --- separability: a coupled loss breaks Propositions 5.1, 5.2 and 5.8 ------------------------------

def per_token_terms(theta, z, coef, losses, baseline=0.0):
    """(N, n, k): 1/n w_i (f_i - b_i) (onehot(z_i) - p_i), the per-draw gradient of the surrogate."""
    n, k = theta.shape
    p = torch.softmax(theta, -1)
    return (coef * (losses - baseline))[..., None] * (F.one_hot(z, k).double() - p) / n


def coupled_instance():
    g = gen(5)
    return (torch.randn(4, 2, generator=g, dtype=F64), torch.randn(4, 2, generator=g, dtype=F64),
            torch.randn(4, 2, generator=g, dtype=F64))


@pytest.mark.parametrize("tau", [1.0, 1.5])
def test_coupled_loss_biases_sample_and_skip_exactly(tau):
    """n = 4, k = 2, c = 2. Exact enumeration (16 assignments, every kept subset): with gamma = 0 the
    expectations of "sample" and skip-IW equal the true gradient to 1e-12; with gamma = 1 (token i's
    loss depends on token i+1's expert) both miss it by more than 0.02 (the true gradient's largest
    entry is about 0.14), and by the same amount: both estimate the gradient with the cross terms
    E[grad log p(z_{i+1}) f_i] left out."""
    theta, base, cross = coupled_instance()
    z, keep, probs, log_q = skip_outcomes(theta, 2, tau)
    assert abs(float(probs.sum()) - 1) < 1e-12
    errors = {}
    for gamma in (0.0, 1.0):
        truth = coupled_true_gradient(theta, base, cross, gamma)
        losses = coupled_losses(base, cross, gamma, z)
        for name in ("sample", "skip_iw"):
            coef = estimator_coefficients(name, theta.expand(len(z), 4, 2), z,
                                          proposal_log_probs=log_q.expand(len(z), 4, 2), keep=keep, capacity=2)
            mean = (probs[:, None, None] * per_token_terms(theta, z, coef, losses)).sum(0)
            errors[gamma, name] = mean - truth
    for name in ("sample", "skip_iw"):
        assert errors[0.0, name].abs().max() < 1e-12, name
        assert errors[1.0, name].abs().max() > 0.02, name
    assert torch.allclose(errors[1.0, "sample"], errors[1.0, "skip_iw"], atol=1e-12)
    # the missing cross terms, computed directly: E_p[grad_{theta_{i+1}} log p(z_{i+1}) f_i(z)] / n
    theta_, base_, cross_ = theta, base, cross
    x = theta_.clone().requires_grad_(True)
    Z = torch.tensor(list(itertools.product(range(2), repeat=4)))
    log_prob = torch.log_softmax(x, -1)[torch.arange(4), Z]
    weight = log_prob.sum(-1).exp().detach()
    losses = coupled_losses(base_, cross_, 1.0, Z)
    # own terms only: sum_i E[grad log p(z_i) f_i]
    own = (weight[:, None] * log_prob * losses).sum() / 4
    (own_grad,) = torch.autograd.grad(own, x)
    assert torch.allclose(errors[1.0, "sample"], own_grad - coupled_true_gradient(theta, base, cross, 1.0),
                          atol=1e-12)


def test_coupled_loss_biases_gm_iw():
    """GM-IW on the same instance (tau = 1, 20000 draws): within 4.5 standard errors of the true
    gradient when uncoupled, more than 10 away when token i's loss depends on token i+1's expert."""
    theta, base, cross = coupled_instance()
    N = 20000
    zs = {}
    for gamma in (0.0, 1.0):
        drawn = sample_estimator(theta.expand(N, 4, 2), "gm_iw", 2, tau=1.0, generator=gen(1), method="top2")
        terms = per_token_terms(theta, drawn.assignment, drawn.coef, coupled_losses(base, cross, gamma, drawn.assignment))
        se = terms.std(0) / math.sqrt(N)
        zs[gamma] = float(((terms.mean(0) - coupled_true_gradient(theta, base, cross, gamma)) / se).abs().max())
    assert zs[0.0] < 4.5
    assert zs[1.0] > 10


# --- Gumbel-matching is not Gibbs (Proposition 5.4 and beyond n = k = 2) ----------------------------

def test_prop_5_4_two_by_two_quadrature_and_monte_carlo():
    """n = k = 2, c = 1: P(diagonal) = E sigma(ell + L), L standard logistic, by quadrature; it lies
    strictly between 1/2 and sigma(ell) (0.661 against 0.731 at ell = 1), and 100000 Monte Carlo
    draws of minimoe's sampler agree with it within 4.5 standard errors."""
    def gm_diagonal(ell):
        return integrate.quad(lambda t: expit(ell + t) * expit(t) * expit(-t), -60, 60, epsabs=1e-13)[0]

    assert abs(gm_diagonal(1.0) - 0.661) < 5e-4 and abs(expit(1.0) - 0.731) < 5e-4
    for ell in (-2.0, -0.5, 0.3, 1.0, 3.0):
        value = gm_diagonal(ell)
        assert min(0.5, expit(ell)) < value < max(0.5, expit(ell))
    N = 100_000
    for ell in (1.0, -2.0):
        a = torch.tensor([[ell, 0.0], [0.0, 0.0]], dtype=F64)     # a11 + a22 - a12 - a21 = ell
        draws = gumbel_matching_sample(a.expand(N, 2, 2), 1, generator=gen(int(10 * ell) + 50), method="top2")
        freq = float((draws[:, 0] == 0).double().mean())
        exact = gm_diagonal(ell)
        assert abs(freq - exact) < 4.5 * math.sqrt(exact * (1 - exact) / N)
        assert abs(freq - expit(ell)) > 10 * math.sqrt(exact * (1 - exact) / N)


GIBBS_CASES = [((3, 3, 1), 0), ((3, 3, 1), 1), ((4, 2, 2), 0), ((4, 2, 2), 1), ((4, 4, 1), 1), ((4, 4, 1), 2)]


@pytest.mark.parametrize("shape,seed", GIBBS_CASES)
def test_gumbel_matching_versus_gibbs_beyond_two_by_two(shape, seed):
    """Beyond n = k = 2 (a ~ N(0, 1), tau = 1; the instances of the chapter): 200000 Gumbel-matching
    draws, solved by brute force over the listed balanced assignments (cross-checked against
    minimoe's solver on the first 2000), against the exact Gibbs law on the same list. What the
    chapter claims: the laws differ (chi-square p < 1e-9); they are close but not very close
    (total variation between 0.04 and 0.2); Gumbel-matching is hotter (its entropy exceeds Gibbs's
    by more than 0.05 nats, about 20 times the Monte Carlo error of the entropy) and its marginals
    lie closer to 1/k."""
    n, k, c = shape
    N = 200_000
    Z = balanced_assignments(n, k, c)
    onehot = F.one_hot(Z, k).double()                                            # (M, n, k)
    a = torch.randn(n, k, generator=gen(seed), dtype=F64)
    gibbs = torch.softmax((onehot * a).sum((1, 2)), 0)
    scores = a + sample_gumbel((N, n, k), generator=gen(100 + seed))
    index = torch.einsum("bnk,mnk->bm", scores, onehot).argmax(-1)               # brute-force optimum
    assert torch.equal(Z[index[:2000]], gumbel_matching_sample(a.expand(2000, n, k), c, gumbels=scores[:2000] - a))
    counts = torch.bincount(index, minlength=len(Z)).double()
    freq = counts / N
    assert stats.chisquare(counts.numpy(), (gibbs * N).numpy()).pvalue < 1e-9
    tv = 0.5 * float((freq - gibbs).abs().sum())
    assert 0.04 < tv < 0.2, tv

    def entropy(q):
        return float(-(q * q.clamp_min(1e-300).log()).sum())

    assert entropy(freq) > entropy(gibbs) + 0.05
    gm_marginals = (freq[:, None, None] * onehot).sum(0)
    gibbs_marginals = (gibbs[:, None, None] * onehot).sum(0)
    assert (gm_marginals - 1 / k).abs().sum() < (gibbs_marginals - 1 / k).abs().sum()


# --- Proposition 5.9, and its failure with slack ----------------------------------------------------

def test_prop_5_9_holds_without_slack_and_fails_with_slack():
    """Same noise, 500 problems. Without slack (n = k c = 6, k = 3) row and column shifts leave every
    assignment and every conditional unchanged (1e-10). With one free slot (n = 5, c = 2) row shifts
    still change nothing, but a column shift moves tokens in some draws, and for a single token with
    two experts of capacity 1 the law is exactly softmax(a + kappa) (Proposition 5.3), which 20000
    draws of minimoe's sampler confirm within 4.5 standard errors."""
    B, k, c = 500, 3, 2
    for n, slack in ((6, False), (5, True)):
        a = 2 * torch.randn(B, n, k, generator=gen(80 + n), dtype=F64)
        G = sample_gumbel((B, n, k), generator=gen(81 + n))
        rho = 3 * torch.randn(B, n, 1, generator=gen(82 + n), dtype=F64)
        kappa = 3 * torch.randn(B, 1, k, generator=gen(83 + n), dtype=F64)
        z = gumbel_matching_sample(a, c, gumbels=G)
        q = gumbel_matching_conditionals(a, G, z, capacity=c)
        z_row = gumbel_matching_sample(a + rho, c, gumbels=G)
        assert torch.equal(z_row, z)
        assert (gumbel_matching_conditionals(a + rho, G, z_row, capacity=c) - q).abs().max() < 1e-10
        z_col = gumbel_matching_sample(a + kappa, c, gumbels=G)
        changed = (z_col != z).any(-1).double().mean()
        if slack:
            assert changed > 0.1
        else:
            assert changed == 0
            assert (gumbel_matching_conditionals(a + kappa, G, z_col, capacity=c) - q).abs().max() < 1e-10
    N = 20000
    a, kappa = torch.tensor([[0.3, -0.2]], dtype=F64), torch.tensor([[0.0, 1.5]], dtype=F64)
    for shift in (torch.zeros_like(kappa), kappa):
        exact = float(torch.softmax(a + shift, -1)[0, 1])
        draws = gumbel_matching_sample((a + shift).expand(N, 1, 2), 1, generator=gen(90))
        assert abs(float(draws.double().mean()) - exact) < 4.5 * math.sqrt(exact * (1 - exact) / N)
    assert float(torch.softmax(a + kappa, -1)[0, 1] - torch.softmax(a, -1)[0, 1]) > 0.3


# --- Proposition 5.10: maximum entropy with given marginals is Gibbs, and positive ------------------

def test_prop_5_10_max_entropy_is_gibbs_and_positive():
    """(n, k, c) = (6, 3, 2), 90 balanced assignments, P~ = Sinkhorn of random logits. Oracles from
    scipy: linprog finds a feasible mixture with these marginals (a sparse one, as Birkhoff's
    algorithm would) and one with marginals (P~ - eps/k) / (1 - eps), which mixed with the uniform
    distribution gives a *positive* feasible mixture (the argument for positivity); null_space gives
    every feasible direction. The Gibbs mixture fitted by Newton has the marginals P~ (1e-10), is
    positive, has zero entropy gradient along every feasible direction (1e-8: the KKT condition of a
    strictly concave problem, so it is the maximiser), beats both linprog mixtures and 200 random
    feasible perturbations, and its marginals satisfy the permanent formula (1e-10)."""
    n, k, c = 6, 3, 2
    Z = balanced_assignments(n, k, c)
    onehot = F.one_hot(Z, k).double()
    M = len(Z)
    A = np.vstack([onehot.reshape(M, -1).numpy().T, np.ones((1, M))])            # marginals and total mass
    P = sinkhorn_balance(torch.randn(n, k, generator=gen(3), dtype=F64), tol=1e-14)
    b = np.concatenate([P.reshape(-1).numpy(), [1.0]])

    def entropy(alpha):
        alpha = np.asarray(alpha, dtype=np.float64)
        return float(-(alpha[alpha > 0] * np.log(alpha[alpha > 0])).sum())

    sparse = optimize.linprog(np.random.default_rng(0).random(M), A_eq=A, b_eq=b, bounds=(0, None), method="highs")
    assert sparse.status == 0 and (sparse.x > 1e-12).sum() < M / 2               # a sparse feasible mixture
    eps = 0.5 * float(P.min()) * k
    shrunk = optimize.linprog(np.zeros(M), A_eq=A, b_eq=np.concatenate([(P.reshape(-1).numpy() - eps / k) / (1 - eps),
                                                                         [1.0]]),
                              bounds=(0, None), method="highs")
    assert shrunk.status == 0
    positive = (1 - eps) * shrunk.x + eps / M                                    # uniform on Z has marginals 1/k
    assert positive.min() > 0 and np.abs(A @ positive - b).max() < 1e-9

    lam, alpha, _ = fit_max_entropy(P, onehot)
    alpha_np = alpha.numpy()
    assert np.abs(A @ alpha_np - b).max() < 1e-10 and alpha_np.min() > 0
    directions = null_space(A)
    assert directions.shape[1] == M - np.linalg.matrix_rank(A)
    assert np.abs(directions.T @ (-np.log(alpha_np) - 1)).max() < 1e-8          # projected gradient = 0
    best = entropy(alpha_np)
    assert best > entropy(sparse.x) + 0.1 and best > entropy(positive)
    rng = np.random.default_rng(1)
    for _ in range(200):
        v = directions @ rng.standard_normal(directions.shape[1])
        v *= 0.5 * alpha_np.min() / np.abs(v).max()
        assert entropy(alpha_np + v) < best
    # the marginal formula u_ij Perm(U_-ij) / Perm(U), by enumeration of the minors
    u = lam.exp()
    perm = float(torch.prod(u[torch.arange(n), Z], -1).sum())
    for i, j in itertools.product(range(n), range(k)):
        others = [t for t in range(n) if t != i]
        rooms = [c - (e == j) for e in range(k)]
        minor = sum(math.prod(float(u[t, e]) for t, e in zip(others, zz))
                    for zz in itertools.product(range(k), repeat=n - 1)
                    if all(zz.count(e) == rooms[e] for e in range(k)))
        assert abs(float(u[i, j]) * minor / perm - float(P[i, j])) < 1e-10


# --- the skip estimator: leave-one-out baseline, variance, and the biased "skip" ---------------------

def test_leave_one_out_baseline_needs_the_skipped_losses():
    """n = 4, k = 2, c = 2, tau = 1.7, exact enumeration. Skip-IW with b_i = the mean loss of the
    other tokens, skipped ones included, is exactly unbiased (1e-12); with b_i = the mean loss of the
    other *kept* tokens it is biased (error > 1e-3)."""
    g = gen(21)
    theta, f = torch.randn(4, 2, generator=g, dtype=F64), torch.randn(4, 2, generator=g, dtype=F64)
    z, keep, probs, log_q = skip_outcomes(theta, 2, 1.7)
    coef = estimator_coefficients("skip_iw", theta.expand(len(z), 4, 2), z,
                                  proposal_log_probs=log_q.expand(len(z), 4, 2), keep=keep, capacity=2)
    losses = f[torch.arange(4), z]
    everyone = (losses.sum(-1, keepdim=True) - losses) / 3
    kept = keep.double()
    others_kept = ((losses * kept).sum(-1, keepdim=True) - losses * kept) / (kept.sum(-1, keepdim=True) - kept).clamp_min(1)
    truth = expected_loss_gradient(theta, f)
    full = (probs[:, None, None] * per_token_terms(theta, z, coef, losses, everyone)).sum(0)
    partial = (probs[:, None, None] * per_token_terms(theta, z, coef, losses, others_kept)).sum(0)
    assert (full - truth).abs().max() < 1e-12
    assert (partial - truth).abs().max() > 1e-3


def test_skip_iw_is_sample_plus_skipping_noise():
    """Exact enumeration (n = 4, k = 2, c = 1 and n = 6, k = 3, c = 2; tau = 1.7). Given z, the
    mean of skip-IW over the kept subsets is the "sample" estimator of the same z (1e-12), so (law
    of total variance) trace Var(skip-IW) = trace Var(sample) + E trace Var(skip-IW | z), both
    sides computed exactly (1e-12), and the second term is positive: skip-IW is never less noisy
    than independent sampling without capacity."""
    for n, k, c in ((4, 2, 1), (6, 3, 2)):
        g = gen(30 + n)
        theta, f = torch.randn(n, k, generator=g, dtype=F64), torch.randn(n, k, generator=g, dtype=F64)
        z, keep, probs, log_q = skip_outcomes(theta, c, 1.7)
        args = dict(proposal_log_probs=log_q.expand(len(z), n, k), keep=keep, capacity=c)
        losses = f[torch.arange(n), z]
        skip = per_token_terms(theta, z, estimator_coefficients("skip_iw", theta.expand(len(z), n, k), z, **args),
                               losses).reshape(len(z), -1)
        sample = per_token_terms(theta, z, estimator_coefficients("sample", theta.expand(len(z), n, k), z, **args),
                                 losses).reshape(len(z), -1)
        codes = (z * (k ** torch.arange(n))).sum(-1)
        _, group = torch.unique(codes, return_inverse=True)
        mass = torch.zeros(int(group.max()) + 1, dtype=F64).index_add_(0, group, probs)
        conditional = torch.zeros(len(mass), skip.shape[1], dtype=F64).index_add_(0, group, probs[:, None] * skip)
        conditional = conditional / mass[:, None]
        assert (conditional[group] - sample).abs().max() < 1e-12
        mean = (probs[:, None] * skip).sum(0)
        var_skip = float((probs[:, None] * (skip - mean) ** 2).sum())
        var_sample = float((probs[:, None] * (sample - mean) ** 2).sum())
        extra = float((probs[:, None] * (skip - conditional[group]) ** 2).sum())
        assert abs(var_skip - var_sample - extra) < 1e-12 and extra > 0.01 * var_sample


def test_survivor_averaging_reweights_towards_under_subscribed_experts():
    """What the chapter shows about "Sample Skip": on every draw its coefficient is skip-IW's times
    (n / #kept) * min(n_j, c) / n_j, so among the kept tokens those of over-subscribed experts get
    relatively less weight (checked on 1000 random draws, n = 12, k = 3, c = 4, to 1e-12)."""
    n, k, c, B = 12, 3, 4, 1000
    logits = torch.randn(B, n, k, generator=gen(40), dtype=F64)
    z = torch.distributions.Categorical(logits=logits).sample()
    keep, counts = skip_mask(z, k, c, generator=gen(41))
    log_q = torch.log_softmax(logits, -1)
    args = dict(proposal_log_probs=log_q, keep=keep, capacity=c)
    iw = estimator_coefficients("skip_iw", logits, z, **args)
    avg = estimator_coefficients("skip", logits, z, **args)
    n_z = counts.gather(-1, z).double()
    factor = n / keep.sum(-1, keepdim=True).double() * n_z.clamp(max=c) / n_z
    assert torch.allclose(avg[keep], (iw * factor)[keep], atol=1e-12)
    assert (avg[~keep] == 0).all()
    ratio = torch.where(keep, avg / iw.where(keep, 1.0), math.nan)
    over, under = keep & (n_z > c), keep & (n_z <= c)
    both = over.any(-1) & under.any(-1)
    assert both.sum() > 100
    worst_over = ratio.where(over, -math.inf).amax(-1)
    best_under = ratio.where(under, math.inf).amin(-1)
    assert (worst_over[both] < best_under[both]).all()


# --- the paper's toy experiment, short -----------------------------------------------------------------

def train_toy(estimators, tau, seeds, steps, lr=0.1):
    """The piecewise-linear toy of Kool et al. section 3 (100 points, two linear experts, a logistic
    router, capacity 50, REINFORCE with the surrogate (K1), an EMA baseline, Adam 0.1), every
    (estimator, seed) run at once. The coefficients are the closed forms for two experts, checked
    against minimoe.ops.estimator_coefficients on the first step; Gumbel-matching for two experts is
    the top-c of s_i2 - s_i1. Returns the final MSE with argmax
    routing (the paper's success metric) per run."""
    g = gen(0)
    x = torch.rand(100, generator=g, dtype=F64) * 2 - 1
    y = torch.where(x < 0.5, 0.8 * x - 0.2, -2 * x + 2) + 0.1 * torch.randn(100, generator=g, dtype=F64)
    n, c = 100, 50
    names = [e for e in estimators for _ in range(seeds)]
    seed = torch.tensor([s for _ in estimators for s in range(seeds)])
    gm = torch.tensor([e.startswith("gm") for e in names])[:, None]
    skip = torch.tensor([e == "skip_iw" for e in names])[:, None]
    assert set(estimators) <= {"sample", "skip_iw", "gm"}
    init = torch.rand(seeds, 6, generator=gen(2021), dtype=F64) * 2 - 1
    theta = init[seed].clone().requires_grad_()
    optimizer = torch.optim.Adam([theta], lr=lr)
    noise = gen(7)
    baseline = None
    groups = {e: [i for i, m in enumerate(names) if m == e] for e in estimators}
    for step in range(steps):
        u = torch.rand(seeds, n, generator=noise, dtype=F64).clamp(1e-12, 1 - 1e-12)[seed]
        order = torch.rand(seeds, n, generator=noise, dtype=F64)[seed]
        logit = theta[:, 0:1] * x + theta[:, 1:2]                                   # log p(2|x) - log p(1|x)
        with torch.no_grad():
            logits = torch.stack([torch.zeros_like(logit), logit], -1)              # (R, n, 2)
            delta = logit / tau + torch.log(u) - torch.log1p(-u)                   # s_i2 - s_i1
            independent = delta > 0
            matching = delta > torch.kthvalue(delta, n - c, dim=-1, keepdim=True).values
            z = torch.where(gm, matching, independent).long()
            # uniform skipping: rank the tokens by (expert, random order); keep the first c of each expert
            n2 = independent.sum(-1, keepdim=True)
            rank = torch.argsort(torch.argsort(independent.double() * 2 + order, -1), -1)
            keep = (rank - torch.where(independent, n - n2, 0)) < c
            # the coefficients in closed form for two experts: p / q_tau, times n_z / min(n_z, c) and the
            # keep mask for skip-IW; on the first step they must equal minimoe's
            sign = torch.where(z.bool(), 1.0, -1.0).to(F64)
            ratio = torch.exp(F.logsigmoid(sign * logit) - F.logsigmoid(sign * logit / tau))
            n_z = torch.where(independent, n2, n - n2).to(F64)
            coef = torch.where(skip, keep * n_z / n_z.clamp(max=c) * ratio, ratio)
            if step == 0:
                for e, rows in groups.items():
                    reference = estimator_coefficients(e, logits[rows], z[rows], keep=keep[rows], capacity=c,
                                                       proposal_log_probs=torch.log_softmax(logits[rows] / tau, -1))
                    assert torch.allclose(coef[rows], reference, rtol=1e-12, atol=0)
        e1, e2 = theta[:, 2:3] * x + theta[:, 3:4], theta[:, 4:5] * x + theta[:, 5:6]
        f = (y - torch.where(z.bool(), e2, e1)) ** 2
        log_p = F.logsigmoid(torch.where(z.bool(), logit, -logit))
        batch = f.detach().mean(-1)
        baseline = batch if baseline is None else baseline
        surrogate = (coef * (f + (f.detach() - baseline[:, None]) * log_p)).mean(-1)
        baseline = 0.99 * baseline + 0.01 * batch
        optimizer.zero_grad()
        surrogate.sum().backward()
        optimizer.step()
    with torch.no_grad():
        logit = theta[:, 0:1] * x + theta[:, 1:2]
        out = torch.where(logit > 0, theta[:, 4:5] * x + theta[:, 5:6], theta[:, 2:3] * x + theta[:, 3:4])
        mse = ((y - out) ** 2).mean(-1)
    return {e: mse[rows] for e, rows in groups.items()}


def test_toy_experiment_short():
    """A short run of the paper's toy (tau = 3, 3 seeds, 2000 of the paper's 10000 steps; about a
    second): Sample Skip IW solves the task (MSE < 0.02, noise floor 0.01) in at least 2 of 3 seeds,
    while the uncorrected Gumbel-matching estimator "GM" solves it in none and stays at the
    one-expert fit (MSE > 0.04; the best single line has MSE 0.05)."""
    torch.set_num_threads(1)
    mse = train_toy(("skip_iw", "gm"), 3.0, 3, 2000)
    assert int((mse["skip_iw"] < 0.02).sum()) >= 2, mse
    assert (mse["gm"] > 0.04).all(), mse
