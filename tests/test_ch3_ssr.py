"""Chapter 3 (Selective Sinkhorn Routing): the paper's Algorithm 1 as printed, its stopping rule, the SSR-S
bounds, Proposition 3.2 and the gradient on Sinkhorn steps, each against an independent oracle."""
import math

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from minimoe import MoELayer
from minimoe.ops import gaussian_top1_probability, linear_assignment, sinkhorn


def algorithm1(cost, r, s, xi, kernel_sign, iters):
    """SSR's Algorithm 1 transcribed literally (v-update, then u-update), kernel exp(kernel_sign * C / xi)."""
    K = torch.exp(kernel_sign * cost / xi)
    u = torch.ones_like(r)
    for _ in range(iters):
        v = s / (K.T @ u)
        u = r / (K @ v)
    return u[:, None] * K * v[None, :]


def scipy_assignment(scores, capacity):
    """Balanced assignment maximising the total score: each expert repeated `capacity` times (Hungarian)."""
    T, E = scores.shape
    rows, cols = linear_sum_assignment(np.repeat(scores.numpy(), capacity, axis=1), maximize=True)
    out = np.empty(T, dtype=np.int64)
    out[rows] = cols // capacity
    return torch.from_numpy(out)


def test_paper_kernel_sign_gives_the_worst_plan():
    """Algorithm 1 with the printed kernel exp(-C/xi) computes the plan of -C: below the uniform plan's score,
    and within xi * H of the balanced assignment of SMALLEST total score (oracle: scipy's Hungarian method)."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(3):
        S = torch.randn(8, 4, generator=gen, dtype=torch.float64)
        r, s = torch.ones(8, dtype=torch.float64), torch.full((4,), 2.0, dtype=torch.float64)
        printed = algorithm1(S, r, s, 0.5, -1.0, 2000)
        assert torch.allclose(printed, sinkhorn(-S, 0.5, tol=1e-12, max_iter=20000), atol=1e-9)
        ours = algorithm1(S, r, s, 0.5, +1.0, 2000)
        uniform = S.sum().item() / 4
        assert (printed * S).sum().item() < uniform < (ours * S).sum().item()
        worst = scipy_assignment(-S, 2)
        best = scipy_assignment(S, 2)
        worst_score, best_score = S[torch.arange(8), worst].sum().item(), S[torch.arange(8), best].sum().item()
        for xi in (0.5, 0.2):  # Prop. 2.9(a) for -S and for S: within xi * H(P) of the worst / best assignment
            cold = algorithm1(S, r, s, xi, -1.0, 3000)
            warm = algorithm1(S, r, s, xi, +1.0, 3000)
            for plan, target, sign in ((cold, worst_score, -1.0), (warm, best_score, 1.0)):
                entropy = -(plan * plan.clamp_min(1e-300).log()).sum().item()
                gap = sign * (target - (plan * S).sum().item())
                assert -1e-6 <= gap <= xi * entropy + 1e-6
        assert S[torch.arange(8), worst].sum() < S[torch.arange(8), best].sum()


def test_stopping_rule_never_fires_with_ssr_marginals_in_float32():
    """At the paper's size (T = 24,576, E = 16) the absolute test ||Pi^T 1 - s|| < 1e-4 stays above 1e-4 for all
    100 iterations when the columns sum to T/E = 1536, and passes almost at once with probability vectors."""
    T, E = 24_576, 16
    S = torch.randn(T, E, generator=torch.Generator().manual_seed(1))  # float32
    K = torch.exp(S / 0.5)

    def run(r, s):
        u = torch.ones_like(r)
        for it in range(1, 101):
            v = s / (K.T @ u)
            u = r / (K @ v)
            col = (v * (K.T @ u) - s).abs().max().item()
            row = (u * (K @ v) - r).abs().max().item()
            if col < 1e-4 and row < 1e-4:
                return it
        return None

    assert run(torch.ones(T), torch.full((E,), T / E)) is None
    fired = run(torch.full((T,), 1 / T), torch.full((E,), 1 / E))
    assert fired is not None and fired < 100
    assert np.spacing(np.float32(1536)) == 2.0 ** -13 > 1e-4


def test_ssr_s_bounds():
    """The paper's two SSR-S bounds and Prop. 3.3(c) hold, in the order appendix < main text < (c) < the
    integral bound, which is the exact worst case (checked by Monte Carlo) and below every softmax row."""
    E, gamma = 8, 1.0
    Phi = lambda v: float(torch.special.ndtr(torch.tensor(v, dtype=torch.float64)))
    appendix = Phi(-math.sqrt(2) / gamma) ** E
    main_text = Phi(-1 / (math.sqrt(2) * gamma)) ** E
    prop_c = Phi(-1 / (math.sqrt(2) * gamma)) ** (E - 1)
    worst = torch.tensor([0.0] + [1.0] * (E - 1), dtype=torch.float64)
    integral = gaussian_top1_probability(worst, gamma)[0].item()
    assert appendix < main_text < prop_c < integral
    assert prop_c == pytest.approx(4.55e-5, rel=0.01) and integral == pytest.approx(0.0219, abs=5e-4)
    n = 200_000
    gen = torch.Generator().manual_seed(2)
    wins = (worst + gamma * torch.randn(n, E, generator=gen, dtype=torch.float64)).argmax(-1)
    freq = (wins == 0).double().mean().item()
    assert abs(freq - integral) <= 4 * math.sqrt(integral * (1 - integral) / n)
    rows = torch.softmax(3 * torch.randn(25, E, generator=gen, dtype=torch.float64), -1)
    rows[0] = torch.softmax(torch.tensor([-30.0] + [0.0] * (E - 1), dtype=torch.float64), -1)  # near the worst case
    exact = torch.stack([gaussian_top1_probability(row, gamma) for row in rows])
    assert (exact > integral).all()
    for g in (0.3, 1.0, 3.0):  # (c) for other noise levels, against the exact probability
        smallest = torch.stack([gaussian_top1_probability(row, g) for row in rows[:8]]).min().item()
        assert smallest > Phi(-1 / (math.sqrt(2) * g)) ** (E - 1)


def test_prop_3_2_balance_single_token_and_two_by_two():
    gen = torch.Generator().manual_seed(3)
    for scale in (0.1, 1.0, 10.0):  # (a) exact batch balance for any cost
        c = scale * torch.randn(2, 10, 5, generator=gen, dtype=torch.float64)
        plan = sinkhorn(c, 0.5, tol=1e-12, max_iter=50_000)
        assert torch.allclose(plan.mean(-2), torch.full((2, 5), 0.2, dtype=torch.float64), atol=1e-9)
    c1 = 5 * torch.randn(1, 6, generator=gen, dtype=torch.float64)  # (b) one token: uniform row
    assert torch.allclose(sinkhorn(c1, 0.3), torch.full((1, 6), 1 / 6, dtype=torch.float64))
    for eps in (0.25, 0.5, 2.0):  # (c) closed form against a brute-force scan over q
        for a in (-1.0, 0.0, 0.9, 1.1, 3.0):
            c = torch.tensor([[1.0, 0.0], [a, 0.0]], dtype=torch.float64)
            q = torch.linspace(1e-6, 1 - 1e-6, 200_001, dtype=torch.float64)
            objective = q * (1 + 0) + (1 - q) * (0 + a) - 2 * eps * (q * q.log() + (1 - q) * (1 - q).log())
            q_star = q[objective.argmax()].item()
            row = sinkhorn(c, eps, tol=1e-13, max_iter=10_000)[0]
            assert row[0].item() == pytest.approx(1 / (1 + math.exp(-(1 - a) / (2 * eps))), abs=1e-9)
            assert row[0].item() == pytest.approx(q_star, abs=1e-5)
            assert int(row.argmax()) == (0 if a < 1 else 1)


def test_top1_counts_are_exact_below_some_eps():
    """For E | T and a unique assignment optimum, top-1 of the plan is the balanced assignment (exact counts)
    for small eps (Prop. 2.9(c)), not for eps = 1 in general."""
    gen = torch.Generator().manual_seed(4)
    unbalanced_at_one = 0
    for _ in range(5):
        S = torch.randn(24, 4, generator=gen, dtype=torch.float64)
        hard = scipy_assignment(S, 6)
        assert torch.equal(linear_assignment(S, 6), hard)
        top1 = sinkhorn(S, 0.02, tol=1e-12, max_iter=100_000).argmax(-1)
        assert torch.equal(top1, hard)
        assert (torch.bincount(top1, minlength=4) == 6).all()
        loose = torch.bincount(sinkhorn(S, 1.0, tol=1e-12, max_iter=10_000).argmax(-1), minlength=4)
        unbalanced_at_one += int((loose != 6).any())
    assert unbalanced_at_one > 0


def test_sinkhorn_step_gate_gradient_against_finite_differences():
    """'W_g is decoupled': with the default detached plan autograd gives the gate no gradient on a Sinkhorn step,
    although the loss depends on W_g (finite difference); with detach_plan=False the gradient is exact."""
    x = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    d = torch.randn(4, 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    found = {}
    for p, detach in ((0.0, True), (1.0, True), (1.0, False)):
        torch.manual_seed(7)
        layer = MoELayer(8, 16, 4, router="ssr", router_options=dict(k=2, p=p, detach_plan=detach, tol=1e-13,
                                                                      max_iter=5000)).double()
        W = layer.router.gate.weight
        layer(x).square().sum().backward()
        auto = 0.0 if W.grad is None else (W.grad * d).sum().item()
        h = 1e-6
        with torch.no_grad():
            W += h * d
            plus = layer(x).square().sum().item()
            W -= 2 * h * d
            minus = layer(x).square().sum().item()
        found[(p, detach)] = (auto, (plus - minus) / (2 * h))
        assert layer.experts.w_in.grad.abs().sum() > 0
    auto, fd = found[(0.0, True)]
    assert auto == pytest.approx(fd, rel=1e-5, abs=1e-7)
    auto, fd = found[(1.0, True)]
    assert auto == 0.0 and abs(fd) > 1e-3
    auto, fd = found[(1.0, False)]
    assert auto == pytest.approx(fd, rel=1e-5, abs=1e-7)
    assert fd == pytest.approx(found[(1.0, True)][1], rel=1e-9)  # same layer, same loss
