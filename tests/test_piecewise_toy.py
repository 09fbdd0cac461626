"""The closed-form, batched two-expert estimators of the piecewise-linear toy
(`minimoe.exercises.piecewise_toy`, run by notebook 07) against the general operations of `minimoe.ops`:
the Gumbel-matching sample (both exact solvers), its conditional (the Floyd-Warshall formula), the
Sinkhorn offset, the kept tokens of skipping, every estimator's coefficients, the surrogate's gradient
and the Switch balance loss, in float64."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from minimoe.exercises.piecewise_toy import (ESTIMATORS, GM, GM_IW, GM_SH, SAMPLE, SKIP, SKIP_IW, balance_loss_k2,
                                             draw_noise, reinforce_surrogate_k2, route_k2, run_tensors,
                                             sinkhorn_offset)
from minimoe.losses import switch_balance_loss
from minimoe.ops import (estimator_coefficients, gumbel_matching_conditionals, gumbel_matching_sample,
                         reinforce_surrogate, sample_gumbel, sinkhorn_balance, skip_mask)

N, CAPACITY = 100, 50
TAUS = (0.01, 0.1, 0.3, 1.0, 3.0, 10.0)
PACKAGE_NAMES = {SAMPLE: "sample", SKIP_IW: "skip_iw", SKIP: "skip", GM_IW: "gm_iw", GM_SH: "gm_sh", GM: "gm"}


def toy_x():
    """The toy's inputs: 100 points uniform on (-1, 1)."""
    return torch.rand(N, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2 - 1


@pytest.mark.parametrize("sinkhorn_before", [False, True], ids=["plain", "sinkhorn-before"])
def test_route_k2_is_the_chapters_estimators(sinkhorn_before):
    """Every estimator at six temperatures, on a confident router with an imbalanced split (where the
    importance weights are large), against the package given the same Gumbel noise and uniforms."""
    gen = torch.Generator().manual_seed(0)
    logit = (4.0 * toy_x() - 2.0).expand(len(TAUS), -1).contiguous()
    logits2 = torch.stack([F.logsigmoid(-logit), F.logsigmoid(logit)], -1)        # log p, (R, n, 2)
    gumbels = sample_gumbel((len(TAUS), N, 2), generator=gen)
    order_seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    uniforms = torch.rand(len(TAUS), N, generator=torch.Generator().manual_seed(order_seed), dtype=torch.float64)
    order = torch.argsort(uniforms, dim=-1)
    noise = SimpleNamespace(logistic=gumbels[..., 1] - gumbels[..., 0], order=order, inverse=torch.argsort(order, -1))
    variant = "Sinkhorn before" if sinkhorn_before else "plain"
    checked = set()
    for e, name in PACKAGE_NAMES.items():
        runs = run_tensors([dict(family="REINFORCE", variant=variant, estimator=ESTIMATORS[e], tau=t, seed=0)
                            for t in TAUS])
        z, coef, keep, beta = route_k2(logit, runs, noise, torch.zeros(runs.needs_offset.numel(), dtype=torch.float64))
        for r, tau in enumerate(TAUS):
            log_balanced = sinkhorn_balance(logits2[r], tau=tau, log=True, tol=1e-13)
            if sinkhorn_before:  # the package samples Gumbel-matching from log P~ at temperature 1
                sample_logits, sample_tau, tempered_log = log_balanced, 1.0, log_balanced
            else:
                sample_logits, sample_tau, tempered_log = logits2[r], tau, torch.log_softmax(logits2[r] / tau, -1)
            pkg_keep = None
            if e in (GM_IW, GM_SH, GM):
                for method in ("assignment", "cycle"):
                    z_pkg = gumbel_matching_sample(sample_logits, CAPACITY, tau=sample_tau, gumbels=gumbels[r],
                                                   method=method)
                    assert torch.equal(z_pkg, z[r].long()), (name, tau, method)
                assert int(z[r].sum()) == CAPACITY
                cond = gumbel_matching_conditionals(sample_logits, gumbels[r], z_pkg, tau=sample_tau,
                                                    capacity=CAPACITY, log=True)
                proposal = {GM_IW: cond, GM_SH: log_balanced, GM: tempered_log}[e]
                if e == GM_IW:  # the closed-form conditional (K3) against the general formula
                    delta = (sample_logits[:, 1] - sample_logits[:, 0]) / sample_tau + noise.logistic[r]
                    top = torch.sort(delta, descending=True).values
                    threshold = torch.where(z[r], top[CAPACITY], top[CAPACITY - 1])
                    mine = torch.sigmoid((sample_logits[:, 1] - sample_logits[:, 0]) / sample_tau - threshold)
                    torch.testing.assert_close(mine, cond[:, 1].exp(), rtol=0, atol=1e-10)
            else:
                z_pkg = (tempered_log + gumbels[r]).argmax(-1)   # the package's Gumbel-max draw
                assert torch.equal(z_pkg, z[r].long()), (name, tau)
                proposal = tempered_log
                if r == 0:  # skip_mask draws one (B, T) block of uniforms: row 0 sees the same numbers
                    pkg_keep, _ = skip_mask(z_pkg, 2, CAPACITY, generator=torch.Generator().manual_seed(order_seed))
                    assert torch.equal(pkg_keep, keep[r]), (name, tau)
                pkg_keep = keep[r]
            if sinkhorn_before or e == GM_SH:
                position = int((runs.needs_offset == r).nonzero()[0, 0])  # beta holds one offset per such run
                torch.testing.assert_close(torch.sigmoid(logit[r] / tau + beta[position]), log_balanced[:, 1].exp(),
                                           rtol=0, atol=1e-10)
            pkg_coef = estimator_coefficients(name, logits2[r], z_pkg, proposal_log_probs=proposal,
                                              keep=pkg_keep if e in (SKIP_IW, SKIP) else None, capacity=CAPACITY)
            assert ((pkg_coef - coef[r]).abs() / (1 + pkg_coef.abs())).max() < 1e-10, (name, tau)
            checked.add(name)
    assert checked == set(PACKAGE_NAMES.values())


def test_sinkhorn_offset_balances_even_when_the_sigmoids_saturate():
    """sum_i sigmoid(l_i + beta) = n / 2 from a cold and from a far-off start, at temperatures down to
    1e-3 (log-odds in the thousands), where plain Newton would step off a flat slope."""
    logit = 4.0 * toy_x() - 2.0
    log_odds = torch.stack([logit / tau for tau in (1e-3, 1e-2, 1.0, 10.0)])
    for start in (torch.zeros(4, dtype=torch.float64), torch.full((4,), 1e4, dtype=torch.float64)):
        beta = sinkhorn_offset(log_odds, start)
        sums = torch.sigmoid(log_odds + beta[:, None]).sum(-1)
        torch.testing.assert_close(sums, torch.full((4,), N / 2, dtype=torch.float64), rtol=0, atol=1e-9)


def test_draw_noise_is_logistic_and_shared_by_seed():
    """L = g_2 - g_1 is standard logistic (mean 0, variance pi^2 / 3), the order is a permutation with
    its inverse, and runs of one seed see the same numbers."""
    gen = torch.Generator().manual_seed(0)
    noise = draw_noise(2, 20_000, gen, torch.tensor([0, 1, 0]))
    assert torch.equal(noise.logistic[0], noise.logistic[2]) and not torch.equal(noise.logistic[0], noise.logistic[1])
    L = noise.logistic[:2].flatten()
    assert abs(float(L.mean())) < 0.05 and abs(float(L.var()) - torch.pi**2 / 3) < 0.1
    assert torch.equal(noise.order.gather(1, noise.inverse), torch.arange(20_000).expand(3, -1))


def test_surrogate_and_balance_loss_are_the_packages():
    """The training loop's REINFORCE surrogate (K1) has reinforce_surrogate's gradient, and its two-expert
    balance loss is switch_balance_loss with F from the unperturbed argmax."""
    x = toy_x()
    y = torch.where(x < 0.5, 0.8 * x - 0.2, -2 * x + 2)
    theta = torch.tensor([4.0, -2.0, 0.3, -0.1, -1.5, 1.2], dtype=torch.float64, requires_grad=True)
    logit = theta[0] * x + theta[1]
    runs = run_tensors([dict(family="REINFORCE", variant="plain", estimator="GM IW", tau=1.0, seed=0)])
    noise = draw_noise(1, N, torch.Generator().manual_seed(1), torch.zeros(1, dtype=torch.long))
    z, coef, _, _ = route_k2(logit.detach()[None], runs, noise, torch.zeros(0, dtype=torch.float64))
    pred = torch.where(z[0], theta[4] * x + theta[5], theta[2] * x + theta[3])
    log_p = F.logsigmoid(torch.where(z[0], logit, -logit))
    f = (y - pred) ** 2
    ours = reinforce_surrogate_k2(coef, f[None], log_p[None], torch.tensor([0.05], dtype=torch.float64))[0]
    theirs = reinforce_surrogate(log_p, f, coef[0], baseline=0.05)
    g_ours, g_theirs = (torch.autograd.grad(s, theta, retain_graph=True)[0] for s in (ours, theirs))
    torch.testing.assert_close(g_ours, g_theirs, rtol=0, atol=1e-12)
    p2 = torch.sigmoid(logit)
    theirs_lb = switch_balance_loss(torch.stack([1 - p2, p2], -1), torch.stack([logit <= 0, logit > 0], -1))
    torch.testing.assert_close(balance_loss_k2(logit[None])[0], theirs_lb, rtol=0, atol=1e-12)
