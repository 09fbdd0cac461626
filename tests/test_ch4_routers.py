"""Chapter 4 (six routers of Liu et al.): Liu et al.'s eq. (7), the rankings of Proposition 4.1(b)-(c), and the
sign convention of the quadratic-OT prices, each against an independent oracle."""
import numpy as np
import torch
from scipy.optimize import minimize

from minimoe.ops import sinkhorn, sparse_simplex_projection, sparsity_constrained_plan, sparsity_constrained_semi_dual


def entropic_objective(P, S):
    return (P * S).sum() - (P * P.clamp_min(1e-300).log()).sum()


def test_liu_eq7_softmax_solves_the_row_constrained_entropic_problem():
    """Liu et al. eq. (7): softmax(S) maximises <P, S> - <P, log P> over positive row-stochastic P. Oracles: an
    SLSQP solve of the same problem and 2,000 random row-stochastic matrices."""
    gen = torch.Generator().manual_seed(0)
    S = 2 * torch.randn(5, 3, generator=gen, dtype=torch.float64)
    soft = torch.softmax(S, -1)
    best = entropic_objective(soft, S).item()
    assert abs(best - torch.logsumexp(S, -1).sum().item()) < 1e-12  # the value: sum of log-partition functions
    s = S.numpy().ravel()
    res = minimize(lambda p: -(p @ s - p @ np.log(p)), np.full(15, 1 / 3), jac=lambda p: -(s - np.log(p) - 1),
                   bounds=[(1e-12, 1)] * 15, method="SLSQP", options=dict(ftol=1e-14, maxiter=500),
                   constraints=[{"type": "eq", "fun": lambda p: p.reshape(5, 3).sum(1) - 1}])
    assert res.success
    assert np.abs(res.x.reshape(5, 3) - soft.numpy()).max() < 1e-5
    others = torch.distributions.Dirichlet(torch.ones(3, dtype=torch.float64)).sample((2000, 5))
    values = (others * S).sum((-2, -1)) - (others * others.log()).sum((-2, -1))
    assert (values <= best + 1e-12).all()


def test_prop_4_1_rankings_go_through_the_expert_potential():
    """Prop. 4.1(b)-(c): the converged plan ranks column r by S_tr - LSE_j(S_tj + g_j) and row t by S_t + g;
    the softmax is the case g = 0. Checked on the plan entries, not only on their order."""
    gen = torch.Generator().manual_seed(1)
    S = torch.randn(40, 5, generator=gen, dtype=torch.float64)
    S[:, 0] += 2.0  # a popular expert, so that g matters
    out = sinkhorn(S, 1.0, tol=1e-13, max_iter=20000, return_potentials=True)
    column_key = S - torch.logsumexp(S + out.g, -1, keepdim=True)  # + g_r, common to the column
    assert torch.allclose(out.plan, torch.exp(column_key + out.g), atol=1e-12)
    assert torch.equal(out.plan.argsort(0), column_key.argsort(0))
    assert torch.equal(out.plan.argsort(1), (S + out.g).argsort(1))
    soft = torch.softmax(S, -1)
    assert torch.equal(soft.argsort(0), (S - torch.logsumexp(S, -1, keepdim=True)).argsort(0))
    assert not torch.equal(out.plan.argsort(0), soft.argsort(0)), "with a popular expert, g changes the columns"


def test_quadratic_ot_prices_are_subtracted_and_the_gradient_sign_is_flipped():
    """Prop. 4.3 with C >= T: Pi = [U - alpha - mu]_+ / gamma, where alpha is the solver's price, and the semi-dual
    gradient is 1 - Pi 1 (finite differences): a token with too much mass gets a higher price."""
    gen = torch.Generator().manual_seed(2)
    U = torch.softmax(2 * torch.randn(8, 4, generator=gen, dtype=torch.float64), -1)
    gamma = 0.5
    info = sparsity_constrained_plan(U, 8, gamma=gamma, method="annealed", max_iter=400, return_info=True)
    support = info.plan > 0
    mu = torch.where(support, U - gamma * info.plan - info.alpha[:, None], torch.nan).nanmean(0)
    assert torch.allclose(info.plan, (U - info.alpha[:, None] - mu).clamp_min(0) / gamma, atol=1e-6)
    alpha = (0.1 * torch.randn(8, generator=gen, dtype=torch.float64)).requires_grad_(True)
    sparsity_constrained_semi_dual(U, alpha, 8, gamma=gamma).backward()
    grad = alpha.grad
    beta = 8 / 4
    columns = [beta * sparse_simplex_projection((U[:, r] - alpha.detach()) / (gamma * beta), 8) for r in range(4)]
    plan = torch.stack(columns, -1)  # Pi(alpha), column by column (eq. ch4-column)
    assert torch.allclose(grad, 1 - plan.sum(-1), atol=1e-9), "grad h = 1 - Pi 1: the opposite sign of grad_f Psi"
    h = 1e-6
    with torch.no_grad():
        for t in range(8):
            step = torch.zeros(8, dtype=torch.float64)
            step[t] = h
            fd = (sparsity_constrained_semi_dual(U, alpha + step, 8, gamma=gamma)
                  - sparsity_constrained_semi_dual(U, alpha - step, 8, gamma=gamma)) / (2 * h)
            assert abs(fd.item() - grad[t].item()) < 1e-6
    heavy = int(plan.sum(-1).argmax())
    assert grad[heavy] < 0, "raising the price of the most served token lowers h"


def test_ot_routers_pass_no_gradient_through_the_plan():
    """Eq. (ch4-combine): the logits reach the combine weights of the three OT routers only through the softmax
    at the dispatched pairs; oracle: autograd through D * softmax(logits) with D held fixed."""
    from minimoe.routers import build

    gen = torch.Generator().manual_seed(3)
    logits = 2 * torch.randn(2, 32, 4, generator=gen, dtype=torch.float64)
    logits[..., 0] += 2.0
    weights = torch.randn(2, 32, 4, generator=gen, dtype=torch.float64)
    for name in ("sinkhorn_token_choice", "sinkhorn_expert_choice", "sparsity_constrained_ec"):
        leaf = logits.clone().requires_grad_(True)
        routing = build(name, 8, 4, capacity_factor=1.0).eval().route(leaf)
        (grad_router,) = torch.autograd.grad((routing.combine * weights).sum(), leaf)
        mask = routing.mask.detach().double()
        (grad_softmax,) = torch.autograd.grad((mask * torch.softmax(leaf, -1) * weights).sum(), leaf)
        assert torch.allclose(grad_router, grad_softmax, atol=1e-12), name
        assert grad_router.abs().sum() > 0


def test_adam_leaves_tokens_without_mass_when_the_utility_is_nearly_flat():
    """Chapter 4's numbers ("On the CPU scale"): logits of standard deviation 0.1, T = 1024, E = 8,
    C = T/E, 20 groups. The authors' 20 Adam steps at a fixed learning rate leave 17 % of the tokens
    without mass (an all-zero row: the router drops them); the annealed solver under 1 %."""
    gen = torch.Generator().manual_seed(0)
    utility = torch.softmax(0.1 * torch.randn(20, 1024, 8, generator=gen), -1)
    no_mass = {method: (sparsity_constrained_plan(utility, 128, method=method).sum(-1) == 0).double().mean().item()
               for method in ("adam", "annealed")}
    assert round(100 * no_mass["adam"]) == 17, no_mass
    assert no_mass["annealed"] < 0.01, no_mass
