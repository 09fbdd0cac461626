"""The estimators of Kool et al. (chapter 5): skip, Gumbel-Matching, Sinkhorn balancing, the surrogate.

Oracles: the exact gradient of a separable loss, p (f - <p, f>) / T (and autograd of the expected
loss); exact enumeration over every assignment and every kept subset (skip, n <= 6); Monte Carlo
with 20000 draws and a 4.5 standard-error bound on every coordinate (unbiased estimators), or a
6 / 10 standard-error *lower* bound (the biased ones); POT's Sinkhorn; chi-square for the uniform
subsampling (p > 1e-3); autograd against hand-written gradients of the surrogate (K1).
"""
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from minimoe.ops import (
    ESTIMATORS,
    estimator_coefficients,
    expected_loss_gradient,
    reinforce_surrogate,
    sample_estimator,
    sinkhorn,
    sinkhorn_balance,
    skip_mask,
    skip_sample,
)

N = 20000


def problem(seed, T=6, E=3):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(T, E, generator=gen, dtype=torch.float64),
            torch.randn(T, E, generator=gen, dtype=torch.float64))


def estimator_terms(logits, f, assignment, coef, baseline=0.0):
    """Per draw, the gradient estimate w.r.t. logits: 1/T sum_t w_t (f_t - b) (onehot(z_t) - p_t)."""
    T, E = logits.shape
    p = torch.softmax(logits, -1)
    fz = f.expand(*assignment.shape, E).gather(-1, assignment[..., None])[..., 0]
    onehot = torch.nn.functional.one_hot(assignment, E).double()
    return (coef * (fz - baseline))[..., None] * (onehot - p) / T


def z_score(logits, f, estimator, capacity, tau, seed, baseline=0.0, **options):
    """max over coordinates of |MC mean - exact gradient| / standard error, N draws."""
    T, E = logits.shape
    drawn = sample_estimator(logits.expand(N, T, E), estimator, capacity, tau=tau,
                             generator=torch.Generator().manual_seed(seed), **options)
    terms = estimator_terms(logits, f, drawn.assignment, drawn.coef, baseline)
    se = terms.std(0) / math.sqrt(N)
    assert (se > 0).all(), "every coordinate must vary, or the z-score means nothing"
    return float(((terms.mean(0) - expected_loss_gradient(logits, f)) / se).abs().max())


def test_exact_gradient_oracle():
    logits, f = problem(0)
    x = logits.clone().requires_grad_(True)
    (torch.softmax(x, -1) * f).sum(-1).mean().backward()
    assert torch.allclose(expected_loss_gradient(logits, f), x.grad, atol=1e-15)


# --- skip: exact enumeration ------------------------------------------------------------------------

def enumerate_skip(logits, f, capacity, tau, estimator, baseline=0.0, sinkhorn_proposal=False):
    """E over z ~ prod q and over the uniform kept subsets of the estimator, exactly."""
    T, E = logits.shape
    log_q = (sinkhorn_balance(logits, tau=tau, log=True) if sinkhorn_proposal
             else torch.log_softmax(logits / tau, -1))
    zs, keeps, weights = [], [], []
    for z in itertools.product(range(E), repeat=T):
        prob_z = math.exp(sum(float(log_q[t, z[t]]) for t in range(T)))
        groups = [[t for t in range(T) if z[t] == e] for e in range(E)]
        choices = [itertools.combinations(g, min(len(g), capacity)) for g in groups]
        subsets = list(itertools.product(*choices))
        for kept in subsets:
            keep = torch.zeros(T, dtype=torch.bool)
            keep[[t for part in kept for t in part]] = True
            zs.append(z)
            keeps.append(keep)
            weights.append(prob_z / len(subsets))
    z = torch.tensor(zs)
    keep = torch.stack(keeps)
    coef = estimator_coefficients(estimator, logits.expand(len(z), T, E), z,
                                  proposal_log_probs=log_q.expand(len(z), T, E), keep=keep, capacity=capacity)
    terms = estimator_terms(logits, f, z, coef, baseline)
    return (torch.tensor(weights, dtype=torch.float64)[:, None, None] * terms).sum(0), sum(weights)


@pytest.mark.parametrize("T,E,c", [(4, 2, 2), (6, 3, 2), (6, 2, 3), (5, 2, 1)])
@pytest.mark.parametrize("baseline", [0.0, 0.7])
def test_skip_iw_is_exactly_unbiased(T, E, c, baseline):
    """P12/P15: enumerate all k^n assignments (weights prod q, tau = 1.7) and all kept subsets: the
    skip-IW expectation equals the exact gradient to 1e-12; "skip" (survivors averaged) misses it by
    more than 1e-3; with a Sinkhorn proposal skip-IW stays exact (to Sinkhorn's tolerance)."""
    logits, f = problem(T * 10 + E + c, T, E)
    truth = expected_loss_gradient(logits, f)
    mean, mass = enumerate_skip(logits, f, c, 1.7, "skip_iw", baseline)
    assert abs(mass - 1) < 1e-12
    assert (mean - truth).abs().max() < 1e-12
    biased, _ = enumerate_skip(logits, f, c, 1.7, "skip", baseline)
    assert (biased - truth).abs().max() > 1e-3
    balanced, _ = enumerate_skip(logits, f, c, 1.7, "skip_iw", baseline, sinkhorn_proposal=True)
    assert (balanced - truth).abs().max() < 1e-9  # P~'s rows sum to 1 within Sinkhorn's tol (1e-10)


def test_skip_mask_is_uniform_and_respects_capacity():
    """P3 and the keep probability: 7 tokens on expert 0 and 2 on expert 1, capacity 3. Each kept set
    of expert 0 (35 of them) appears with frequency 1/35 (chi-square over 20000 draws, p > 1e-3), so
    a token survives with probability min(n, c) / n = 3/7; expert 1 keeps both."""
    z = torch.tensor([0, 1, 0, 0, 0, 1, 0, 0, 0]).expand(N, 9).contiguous()
    keep, counts = skip_mask(z, 3, 3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(counts[0], torch.tensor([7, 2, 0]))
    assert (keep[:, [1, 5]]).all() and (keep[:, z[0] == 0].sum(-1) == 3).all()
    tokens = (z[0] == 0).nonzero().flatten().tolist()
    subsets = {s: i for i, s in enumerate(itertools.combinations(tokens, 3))}
    codes = [subsets[tuple(t for t in tokens if keep[i, t])] for i in range(N)]
    observed = np.bincount(codes, minlength=35)
    assert stats.chisquare(observed)[1] > 1e-3
    freq = keep[:, tokens].double().mean(0)
    assert ((freq - 3 / 7).abs() <= 4.5 * math.sqrt(3 / 7 * 4 / 7 / N)).all()


@given(T=st.integers(0, 30), E=st.integers(1, 6), c=st.integers(1, 8), seed=st.integers(0, 10_000),
       batch=st.sampled_from([(), (3,)]))
@settings(max_examples=60, deadline=None)
def test_skip_properties(T, E, c, seed, batch):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*batch, T, E, generator=gen, dtype=torch.float64)
    drawn = skip_sample(logits, c, tau=1.3, generator=gen)
    counts = torch.nn.functional.one_hot(drawn.assignment, E).sum(-2) if T else torch.zeros(*batch, E, dtype=torch.long)
    assert torch.equal(drawn.expert_counts, counts)
    kept = (torch.nn.functional.one_hot(drawn.assignment, E) * drawn.keep[..., None]).sum(-2) if T else counts
    assert torch.equal(kept, counts.clamp(max=c))
    coef = estimator_coefficients("skip_iw", logits, drawn.assignment, proposal_log_probs=drawn.proposal_log_probs,
                                  keep=drawn.keep, capacity=c)
    assert coef.shape == drawn.keep.shape and (coef[~drawn.keep] == 0).all() and (coef[drawn.keep] > 0).all()


# --- Monte Carlo: the unbiased estimators and the biased ones ---------------------------------------

@pytest.mark.parametrize("tau", [0.5, 1.0, 2.0])
def test_unbiased_estimators_monte_carlo(tau):
    """P13/P14: sample, skip-IW and GM-IW (n = 6, k = 3, c = 2), 20000 draws each: every coordinate
    within 4.5 standard errors of the exact gradient. The instance (logits ~ N(0, 1), seed 0) keeps
    the weights light-tailed enough at tau = 0.5 for the standard error to mean something; sharper
    logits need far more draws (a rare token with a weight of 1e4 is then never seen)."""
    logits, f = problem(0)
    for seed, estimator in enumerate(("sample", "skip_iw", "gm_iw")):
        assert z_score(logits, f, estimator, 2, tau, seed) < 4.5, estimator


def test_baseline_and_solver_do_not_change_the_mean():
    """P15: with a constant baseline b = 0.7 skip-IW and GM-IW stay within 4.5 standard errors; GM-IW
    through the assignment solver too (tau = 1, 20000 draws each)."""
    logits, f = problem(0)
    assert z_score(logits, f, "skip_iw", 2, 1.0, 11, baseline=0.7) < 4.5
    assert z_score(logits, f, "gm_iw", 2, 1.0, 12, baseline=0.7) < 4.5
    assert z_score(logits, f, "gm_iw", 2, 1.0, 13, method="assignment") < 4.5


def test_biased_estimators_monte_carlo():
    """Negative controls on the same instance at tau = 0.5 (fixed seeds): "skip" and GM-SH are more
    than 6 standard errors off on some coordinate, "gm" more than 10 (it ignores the balancing).
    GM-SH's weights are formed from one Sinkhorn balancing of the (shared) logits."""
    logits, f = problem(0)
    assert z_score(logits, f, "skip", 2, 0.5, 5) > 6
    assert z_score(logits, f, "gm", 2, 0.5, 7) > 10
    drawn = sample_estimator(logits.expand(N, 6, 3), "gm", 2, tau=0.5, generator=torch.Generator().manual_seed(6))
    balanced = sinkhorn_balance(logits, tau=0.5, log=True).expand(N, 6, 3)
    coef = estimator_coefficients("gm_sh", logits.expand(N, 6, 3), drawn.assignment, proposal_log_probs=balanced)
    terms = estimator_terms(logits, f, drawn.assignment, coef)
    z = (terms.mean(0) - expected_loss_gradient(logits, f)) / (terms.std(0) / math.sqrt(N))
    assert float(z.abs().max()) > 6


def test_gm_iw_unbiased_with_slack():
    """GM-IW stays unbiased with slack (n = 5, k = 3, c = 2: one free slot), through the free-slot
    move costs: 20000 draws, 4.5 standard errors."""
    logits, f = problem(11, T=5)
    assert z_score(logits, f, "gm_iw", 2, 1.0, 8) < 4.5


def test_sinkhorn_proposal_turns_gm_into_gm_sh_and_leaves_gm_iw():
    """With E * c = T, Gumbel-Matching of log P~ gives the same draws; GM-IW's weights are unchanged
    (1e-8) and "gm" becomes GM-SH."""
    logits, _ = problem(1)
    draws = {}
    for estimator in ("gm_iw", "gm_sh", "gm"):
        for balanced in (False, True):
            draws[estimator, balanced] = sample_estimator(logits.expand(50, 6, 3), estimator, 2, tau=0.8,
                                                          sinkhorn_proposal=balanced,
                                                          generator=torch.Generator().manual_seed(0))
    plain, balanced = draws["gm_iw", False], draws["gm_iw", True]
    assert torch.equal(plain.assignment, balanced.assignment)
    assert torch.allclose(plain.coef, balanced.coef, rtol=1e-8)
    assert torch.allclose(draws["gm", True].coef, draws["gm_sh", False].coef, rtol=1e-8)


# --- coefficients, surrogate, Sinkhorn ---------------------------------------------------------------

def test_coefficients_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6], [0.7, 0.2, 0.1]],
                                    dtype=torch.float64))
    z = torch.tensor([0, 0, 0, 1])
    keep = torch.tensor([True, False, True, True])
    log_q = torch.log(torch.full((4, 3), 1 / 3, dtype=torch.float64))
    p_z = torch.tensor([0.5, 0.1, 0.2, 0.2], dtype=torch.float64)
    ratio = p_z * 3
    got = lambda name, **kw: estimator_coefficients(name, logits, z, proposal_log_probs=log_q, keep=keep,  # noqa: E731
                                                    capacity=2, **kw)
    assert torch.allclose(got("sample"), ratio)
    assert torch.allclose(got("skip_iw"), ratio * keep * torch.tensor([1.5, 1.5, 1.5, 1.0], dtype=torch.float64))
    assert torch.allclose(got("skip"), ratio * keep * 4 / 3)
    assert torch.allclose(got("skip_no_iw"), keep.double() * 4 / 3)
    assert torch.equal(got("gm_no_iw"), torch.ones(4, dtype=torch.float64))


def test_surrogate_gradients():
    """P16: the gradient of (K1) with fixed z and w is 1/T sum_t w_t (f_t - b) grad log p(z_t) for the
    router and 1/T sum_t w_t grad f_t for what the loss depends on (1e-12)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    theta = torch.randn(2, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    z = torch.randint(0, 4, (2, 5), generator=gen)
    w = torch.rand(2, 5, generator=gen, dtype=torch.float64) * 2
    f = theta ** 2
    log_p = torch.log_softmax(logits, -1).gather(-1, z[..., None])[..., 0]
    surrogate = reinforce_surrogate(log_p, f, w, baseline=0.3)
    g_logits, g_theta = torch.autograd.grad(surrogate, (logits, theta))
    with torch.no_grad():
        p = torch.softmax(logits, -1)
        onehot = torch.nn.functional.one_hot(z, 4).double()
        want = (w * (f - 0.3))[..., None] * (onehot - p) / 10
    assert torch.allclose(g_logits, want, atol=1e-12)
    assert torch.allclose(g_theta, w * 2 * theta / 10, atol=1e-12)
    assert abs(float(surrogate.detach()) - float((w * (f + (f - 0.3) * log_p)).mean().detach())) < 1e-12


def test_sinkhorn_balance():
    """P17/P18 and the claim that P~ is the entropic plan of log q at eps = 1: rows 1, columns T/E,
    equal to POT's ot.sinkhorn with cost -log q and reg 1 (1e-8) and to minimoe.ops.sinkhorn; log P~ -
    log q is a row effect plus a column effect (residual < 1e-8); balancing a balanced matrix is the
    identity; and P~ ignores a row/column rescaling of q."""
    import ot

    for T, E in [(4, 2), (12, 3), (100, 4)]:
        gen = torch.Generator().manual_seed(T)
        logits = torch.randn(T, E, generator=gen, dtype=torch.float64) * 2
        tau = 0.7
        P = sinkhorn_balance(logits, tau=tau)
        assert torch.allclose(P.sum(-1), torch.ones(T, dtype=torch.float64), atol=1e-10)
        assert torch.allclose(P.sum(-2), torch.full((E,), T / E, dtype=torch.float64), atol=1e-8)
        log_q = torch.log_softmax(logits / tau, -1)
        pot = ot.sinkhorn(np.ones(T), np.full(E, T / E), -log_q.numpy(), 1.0, numItermax=10000, stopThr=1e-13)
        assert np.abs(P.numpy() - pot).max() < 1e-8
        assert torch.allclose(P, sinkhorn(log_q, 1.0, tol=1e-12), atol=1e-9)
        diff = (P.log() - log_q).numpy()
        design = np.concatenate([np.kron(np.eye(T), np.ones((E, 1))), np.kron(np.ones((T, 1)), np.eye(E))], 1)
        fit = np.linalg.lstsq(design, diff.reshape(-1), rcond=None)[0]
        assert np.abs(design @ fit - diff.reshape(-1)).max() < 1e-8
        assert torch.allclose(sinkhorn_balance(P.log()), P, atol=1e-8)
        rescaled = logits / tau + torch.randn(T, 1, generator=gen, dtype=torch.float64) + torch.randn(
            1, E, generator=gen, dtype=torch.float64)
        assert torch.allclose(sinkhorn_balance(rescaled), P, atol=1e-8)
    # the log stays finite where the probabilities underflow
    assert torch.isfinite(sinkhorn_balance(torch.randn(8, 2, dtype=torch.float64) * 50, tau=0.01, log=True)).all()


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_estimator_shapes_and_dtypes(estimator):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 6, 3, generator=gen)
    drawn = sample_estimator(logits, estimator, 2, tau=0.9, generator=gen)
    assert drawn.assignment.shape == drawn.keep.shape == drawn.coef.shape == (2, 3, 6)
    assert drawn.coef.dtype == torch.float32 and drawn.proposal_log_probs.shape == logits.shape
    assert torch.isfinite(drawn.coef).all() and (drawn.coef >= 0).all()
    if estimator.startswith("gm"):
        assert (torch.nn.functional.one_hot(drawn.assignment, 3).sum(-2) == 2).all()


def test_bad_arguments():
    logits = torch.randn(6, 3)
    z = torch.zeros(6, dtype=torch.long)
    with pytest.raises(ValueError, match="estimator must be one of"):
        sample_estimator(logits, "reinforce", 2)
    with pytest.raises(ValueError, match="estimator must be one of"):
        estimator_coefficients("iw", logits, z)
    with pytest.raises(ValueError, match="needs proposal_log_probs"):
        estimator_coefficients("gm_iw", logits, z)
    with pytest.raises(ValueError, match="needs keep"):
        estimator_coefficients("skip_iw", logits, z, proposal_log_probs=logits)
    with pytest.raises(ValueError, match="assignment must be a LongTensor of shape"):
        estimator_coefficients("sample", logits, torch.zeros(5, dtype=torch.long), proposal_log_probs=logits)
    with pytest.raises(ValueError, match="pass capacity"):
        sample_estimator(logits, "gm_iw")
    with pytest.raises(ValueError, match="capacity=1 is too small"):
        sample_estimator(logits, "gm_iw", 1)
    with pytest.raises(ValueError, match="tau must be"):
        sample_estimator(logits, "skip_iw", 2, tau=-1.0)
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        skip_mask(z, 3, 0)
    with pytest.raises(ValueError, match=r"assignment values must be in \[0, 3\)"):
        skip_mask(torch.full((6,), 3), 3, 2)
    with pytest.raises(ValueError, match="same shape"):
        reinforce_surrogate(torch.zeros(3), torch.zeros(4), torch.zeros(3))
    with pytest.raises(ValueError, match="loss_table must have the shape"):
        expected_loss_gradient(logits, torch.zeros(6, 2))


def test_sample_categorical_has_the_law_and_skips_zero_mass():
    """Inverse-CDF draws (200,000 rows, fixed seed): chi-square against q, and a category of
    probability 0 (log q = -inf) is never drawn."""
    from minimoe.ops import sample_categorical

    q = torch.tensor([0.1, 0.0, 0.25, 0.6, 0.05], dtype=torch.float64)
    N = 200_000
    draws = sample_categorical(q.log().expand(N, 5), torch.Generator().manual_seed(0))
    observed = torch.bincount(draws, minlength=5)
    assert observed[1] == 0
    nonzero = q > 0
    assert stats.chisquare(observed[nonzero].numpy(), (q[nonzero] * N).numpy())[1] > 1e-3
    assert draws.shape == (N,) and draws.dtype == torch.long


def test_coefficients_reuse_a_given_log_softmax_bit_for_bit():
    """sample_estimator hands the skip proposal at tau = 1 (log_softmax of the logits) to
    estimator_coefficients as its log p: the coefficients are those computed from scratch, to the bit;
    a log_probs of the wrong dtype or shape is refused."""
    from minimoe.ops.balanced_estimators import estimator_coefficients, skip_sample

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 50, 6, generator=gen, dtype=torch.float64) * 3
    drawn = skip_sample(logits, 8, generator=gen)
    log_probs = torch.log_softmax(logits, -1)
    assert torch.equal(drawn.proposal_log_probs, log_probs)  # the proposal is log p itself at tau = 1
    for estimator in ("skip_iw", "skip_no_iw", "sample"):
        kwargs = dict(proposal_log_probs=drawn.proposal_log_probs, keep=drawn.keep, capacity=8)
        fresh = estimator_coefficients(estimator, logits, drawn.assignment, **kwargs)
        reused = estimator_coefficients(estimator, logits, drawn.assignment, log_probs=log_probs, **kwargs)
        assert torch.equal(fresh, reused)
    with pytest.raises(ValueError, match="log_probs must be log_softmax"):
        estimator_coefficients("skip_iw", logits, drawn.assignment, proposal_log_probs=log_probs, keep=drawn.keep,
                               log_probs=log_probs.float())
