"""The six estimators of chapter 5 for two experts, in closed form and batched over runs: the fast
code of the piecewise-linear toy (notebook 07, Kool et al. §3), in one copy that the notebook runs and
``tests/test_piecewise_toy.py`` checks against the general operations of `minimoe.ops`.

With two experts every estimator has a closed form (chapter 5, "The toy experiment"), and every run of
a grid (estimator, temperature, seed, variant) can be one row of a single tensor program:

* only the difference of the two Gumbels matters: ``L = g_2 - g_1`` is a standard logistic variable,
  and with ``l_i = log p(2|x_i) - log p(1|x_i)`` the perturbed score difference is ``l_i / tau + L_i``;
* independent sampling (Gumbel-max) picks expert 2 where that difference is positive;
* Gumbel-matching gives expert 2 the ``c`` tokens with the largest difference, and its conditional
  (Proposition 5.7) is ``sigmoid(l_i / tau - T_i)`` with ``T_i`` the ``c``-th largest difference among
  the *other* tokens;
* Sinkhorn balancing is one offset per run (`sinkhorn_offset`);
* skipping keeps the first ``c`` of the over-full expert's tokens in a random order.

Here ``n`` is the number of tokens and ``c = n / 2`` the capacity (Kool et al.'s letters, as in the
notebook). Everything is float64 by default: the importance weights reach 1e3 and more.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

__all__ = ["ESTIMATORS", "SAMPLE", "SKIP_IW", "SKIP", "GM_IW", "GM_SH", "GM", "VARIANTS", "run_tensors",
           "sinkhorn_offset", "draw_noise", "route_k2", "reinforce_surrogate_k2", "balance_loss_k2"]

ESTIMATORS = ("Sample", "Sample Skip IW", "Sample Skip", "GM IW", "GM SH", "GM")
SAMPLE, SKIP_IW, SKIP, GM_IW, GM_SH, GM = range(len(ESTIMATORS))
VARIANTS = {  # Kool et al. App. E: what changes relative to the paper's main runs ("plain")
    "plain": dict(sinkhorn=False, weighted=True, balance=0.01),
    "Sinkhorn before": dict(sinkhorn=True, weighted=True, balance=0.01),
    "no IW": dict(sinkhorn=False, weighted=False, balance=0.01),
    "no LB": dict(sinkhorn=False, weighted=True, balance=0.0),
    "LB 0.03": dict(sinkhorn=False, weighted=True, balance=0.03),
    "LB 0.1": dict(sinkhorn=False, weighted=True, balance=0.1),
}


def run_tensors(runs, device="cpu", dtype=torch.float64):
    """Per-run settings as tensors of shape (R,), plus the masks the estimators need.

    ``runs`` is a list of dicts with keys family ("REINFORCE" or "gating"), variant (a key of
    `VARIANTS`), estimator (one of `ESTIMATORS`), tau and seed."""
    est = torch.tensor([ESTIMATORS.index(r["estimator"]) for r in runs], device=device)
    variant = [VARIANTS[r["variant"]] for r in runs]
    t = SimpleNamespace(
        tau=torch.tensor([float(r["tau"]) for r in runs], dtype=dtype, device=device),
        seed=torch.tensor([r["seed"] for r in runs], device=device),
        gating=torch.tensor([r["family"] == "gating" for r in runs], device=device),
        sinkhorn=torch.tensor([v["sinkhorn"] for v in variant], device=device),
        weighted=torch.tensor([v["weighted"] for v in variant], device=device),
        # the Switch balance loss is a gating ingredient: REINFORCE runs have none
        balance=torch.tensor([v["balance"] * (r["family"] == "gating") for r, v in zip(runs, variant)],
                             dtype=dtype, device=device),
        gm=est >= GM_IW, gm_iw=est == GM_IW, gm_sh=est == GM_SH, skip_iw=est == SKIP_IW)
    # estimators that average over the survivors: Sample Skip, and Sample Skip IW without weights
    t.skip_mean = (est == SKIP) | (t.skip_iw & ~t.weighted)
    t.needs_offset = (t.gm_sh | t.sinkhorn).nonzero().squeeze(1)  # runs that need the Sinkhorn offset
    return t


def sinkhorn_offset(log_odds, beta, tol=1e-12, max_iter=200):
    """beta (R,) with sum_i sigmoid(log_odds_i + beta) = n / 2: Sinkhorn for two experts.

    Newton from the given beta (a warm start), safeguarded by a bisection bracket that starts where
    every sigmoid is saturated. Rows that have converged, or are not finite, are left alone."""
    half = log_odds.shape[-1] / 2
    low, high = -log_odds.amax(-1) - 40.0, -log_odds.amin(-1) + 40.0
    beta = torch.minimum(torch.maximum(beta, low), high)
    for _ in range(max_iter):
        s = torch.sigmoid(log_odds + beta[:, None])
        excess = s.sum(-1) - half
        done = (excess.abs() < tol) | ~torch.isfinite(excess)
        if bool(done.all()):
            return beta
        low = torch.where(excess < 0, beta, low)
        high = torch.where(excess > 0, beta, high)
        newton = beta - excess / (s * (1 - s)).sum(-1)
        inside = (newton > low) & (newton < high)  # saturated sigmoids give a flat slope: bisect
        beta = torch.where(done, beta, torch.where(inside, newton, 0.5 * (low + high)))
    raise RuntimeError("the Sinkhorn offset did not converge")


def draw_noise(n_seeds, n, generator, seed_index, dtype=torch.float64):
    """One step's randomness, drawn per seed and shared by every run with that seed: the logistic
    noise L = g_2 - g_1 and a uniformly random token order (with its inverse) for skipping.

    ``seed_index`` (R,) gives each run's seed; the results have shape (R, n)."""
    info = torch.finfo(dtype)
    u = torch.rand(n_seeds, n, generator=generator, dtype=dtype, device=generator.device).clamp_(info.tiny, 1 - info.eps)
    order = torch.argsort(torch.rand(n_seeds, n, generator=generator, dtype=dtype, device=generator.device), dim=-1)
    inverse = torch.argsort(order, dim=-1)
    return SimpleNamespace(logistic=(torch.log(u) - torch.log1p(-u))[seed_index],
                           order=order[seed_index], inverse=inverse[seed_index])


def route_k2(logit, runs, noise, beta):
    """Every run's sample and coefficients at once (no gradient).

    logit (R, n): the router's log-odds l_i = log p(2|x_i) - log p(1|x_i). Returns z (R, n), True
    for expert 2; coef (R, n), the run's w_i; keep (R, n); and the Sinkhorn offsets (warm start)."""
    n = logit.shape[-1]
    c = n // 2
    tempered = logit / runs.tau[:, None]                 # log-odds of q_tau
    balanced = tempered.clone()                          # log-odds of P~ (only where a run needs it)
    if runs.needs_offset.numel():
        beta = sinkhorn_offset(tempered[runs.needs_offset], beta)
        balanced[runs.needs_offset] += beta[:, None]
    proposal = torch.where(runs.sinkhorn[:, None], balanced, tempered)
    delta = proposal + noise.logistic                    # s_i2 - s_i1
    # independent sampling (Gumbel-max) and Gumbel-matching (expert 2 takes the c largest delta)
    z_independent = delta > 0
    below = torch.kthvalue(delta, n - c, dim=-1, keepdim=True).values                  # (c+1)-th largest
    above = torch.where(delta > below, delta, math.inf).amin(-1, keepdim=True)         # c-th largest
    z_matching = delta > below
    z = torch.where(runs.gm[:, None], z_matching, z_independent)
    sign = torch.where(z, 1.0, -1.0).to(logit.dtype)
    # the GM conditional (K3): the c-th largest delta among the *other* tokens
    threshold = torch.where(z_matching, below, above)
    log_p = F.logsigmoid(sign * logit)
    log_q = F.logsigmoid(sign * torch.where(runs.gm_iw[:, None], proposal - threshold,
                                            torch.where(runs.gm_sh[:, None], balanced, proposal)))
    ratio = torch.where(runs.weighted[:, None], torch.exp(log_p - log_q), 1.0)
    # skipping: the over-full expert keeps the first c of its tokens in a random order
    n2 = z_independent.sum(-1, keepdim=True)
    in_full = z_independent == (n2 > c)
    shuffled = in_full.gather(1, noise.order)
    keep = (~shuffled | (shuffled.cumsum(-1) <= c)).gather(1, noise.inverse)
    n_z = torch.where(z_independent, n2, n - n2).to(logit.dtype)
    survivors = keep.sum(-1, keepdim=True).to(logit.dtype)
    coef = torch.where(runs.skip_iw[:, None] & runs.weighted[:, None], keep * (n_z / n_z.clamp(max=c)) * ratio,
                       torch.where(runs.skip_mean[:, None], keep * (n / survivors) * ratio, ratio))
    return z, coef, keep, beta


def reinforce_surrogate_k2(coef, f, log_p, baseline):
    """Each run's surrogate (K1), shape (R,): mean_i w_i [f_i + (f_i - b) log p(z_i|x_i)], with the
    coefficients and the baseline (R,) held constant; f (R, n) the per-token losses."""
    return (coef * (f + (f.detach() - baseline[:, None]) * log_p)).mean(-1)


def balance_loss_k2(logit):
    """The Switch balance loss k * sum_j F_j P_j for two experts, per run, shape (R,): F_j counts the
    router's unperturbed argmax (a balanced sample would make it a constant), P_j is the mean router
    probability; logit (R, n) the router's log-odds."""
    share2 = (logit.detach() > 0).to(logit.dtype).mean(-1)
    prob2 = torch.sigmoid(logit).mean(-1)
    return 2 * (share2 * prob2 + (1 - share2) * (1 - prob2))
