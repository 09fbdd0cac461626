"""Chapter 10's propositions that engineer A's tests/test_loss_free.py does not already check: the dual
function (Prop. 10.1) against scipy's linprog, the Sinkhorn limit (Prop. 10.4), the sign update's
band (Prop. 10.5: monotonicity, margin lemma, two experts) and what the Switch loss does to the
gradient (Prop. 10.8). Oracles: HiGHS via scipy.optimize.linprog, brute force over bias grids."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from minimoe.losses import switch_balance_loss
from minimoe.ops import bias_update, expert_loads, max_violation, sinkhorn, solve_selection_lp
from minimoe.routers import build

pytest.importorskip("scipy")


def select(scores, bias, k):
    """top-k of each row of scores + bias (the loss-free selection)."""
    key = scores + bias
    return torch.zeros_like(key, dtype=torch.bool).scatter_(-1, key.topk(k, dim=-1).indices, True)


def dual(scores, bias, k):
    """D(b) = sum_t top_k(S_t + b) - (kT/E) sum_e b_e (eq. eq-ch10-dual), float64."""
    S, b = scores.double(), bias.double()
    T, E = S.shape
    return float((S + b).topk(k, dim=-1).values.sum() - k * T / E * b.sum())


@pytest.mark.parametrize("T, E, k", [(8, 4, 1), (12, 4, 2), (12, 6, 3), (20, 5, 2)])
def test_dual_function_bounds_and_equals_the_lp(T, E, k):
    """Prop. 10.1. Tolerance 1e-7 (HiGHS's optimality tolerance). (b) weak duality: D(b) >= linprog's
    optimum for 50 random biases; strong duality: D(-nu) with nu linprog's column duals equals the
    optimum; (a) D is blind to a constant shift; (d) L(b) - kT/E is a subgradient: checked against 50
    random other biases."""
    gen = torch.Generator().manual_seed(T * E + k)
    S = torch.randn(T, E, generator=gen, dtype=torch.float64)
    lp = solve_selection_lp(S, per_token=k, per_expert=k * T // E)
    nu = torch.as_tensor(lp.expert_duals)
    assert dual(S, -nu, k) == pytest.approx(lp.objective, abs=1e-7)
    assert dual(S, -nu + 2.5, k) == pytest.approx(lp.objective, abs=1e-7)
    for _ in range(50):
        b = torch.randn(E, generator=gen, dtype=torch.float64)
        assert dual(S, b, k) >= lp.objective - 1e-7
        g = expert_loads(select(S, b, k)).double() - k * T / E
        other = torch.randn(E, generator=gen, dtype=torch.float64)
        assert dual(S, other, k) >= dual(S, b, k) + float(g @ (other - b)) - 1e-9


def test_bias_update_is_a_subgradient_step():
    """Prop. 10.2(a, b): the proportional step equals -(rate / mean load) * (L - mean load), the sign
    step -rate * sign(L - mean load); the proportional step keeps sum(b) (dropless). Tolerance 1e-6:
    minimoe.ops.bias_update works in float32 whatever the bias's dtype."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        b = torch.randn(6, generator=gen, dtype=torch.float64)
        loads = torch.randint(0, 30, (6,), generator=gen).double()
        mean = loads.mean()
        g = loads - mean
        assert torch.allclose(bias_update(b, loads, 0.3, "proportional"), b - 0.3 / mean * g, atol=1e-6)
        assert torch.allclose(bias_update(b, loads, 0.3, "sign"), b - 0.3 * torch.sign(g), atol=1e-6)
        assert float(bias_update(b, loads, 0.3, "proportional").sum()) == pytest.approx(float(b.sum()), abs=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sinkhorn_potential_dual_gap(seed):
    """Prop. 10.4 (k = 1). Oracle: linprog's optimum. 0 <= D(g_eps) - OPT <= eps T log E for eps from 1 to
    0.003, and the gap at the smallest eps is below 1% of the bound's value at eps = 1."""
    gen = torch.Generator().manual_seed(seed)
    T, E = 64, 4
    S = torch.randn(T, E, generator=gen, dtype=torch.float64) + torch.linspace(-1, 1, E, dtype=torch.float64)
    opt = solve_selection_lp(S, per_token=1, per_expert=T // E).objective
    gaps = []
    for eps in (1.0, 0.1, 0.01, 0.003):
        g = sinkhorn(S, eps, col_sums=torch.full((E,), T / E, dtype=torch.float64), return_potentials=True).g
        gaps.append(dual(S, g, 1) - opt)
        assert -1e-7 <= gaps[-1] <= eps * T * math.log(E) + 1e-7
    assert gaps[-1] < 0.01 * T * math.log(E)


def test_monotone_loads_and_margin_lemma():
    """Prop. 10.5(a, b, c), brute force over 300 random biases. (a) raising b_e never lowers L_e nor
    raises another load; (b) |L_e(b) - kT/E| <= N(w) with w the spread of b - b*; (c) the expert with
    the largest b_e - b*_e has load >= kT/E. b* is an exactly balanced bias (reached by the
    proportional update with a decreasing rate)."""
    gen = torch.Generator().manual_seed(4)
    T, E, k = 120, 5, 2
    S = torch.randn(T, E, generator=gen, dtype=torch.float64) + torch.linspace(-1, 1, E, dtype=torch.float64)
    L_bar = k * T // E
    b_star = torch.zeros(E, dtype=torch.float64)
    for n in range(5000):
        loads = expert_loads(select(S, b_star, k))
        if bool((loads == L_bar).all()):
            break
        b_star = bias_update(b_star, loads, 0.5 / math.sqrt(1 + n / 50), "proportional")
    assert bool((expert_loads(select(S, b_star, k)) == L_bar).all())
    top = (S + b_star).topk(k + 1, dim=-1).values
    margin = top[:, k - 1] - top[:, k]
    for _ in range(300):
        b = b_star + 0.2 * torch.randn(E, generator=gen, dtype=torch.float64)
        loads = expert_loads(select(S, b, k))
        d = b - b_star
        w = float(d.max() - d.min())
        assert float((loads - L_bar).abs().max()) <= int((margin <= w).sum())
        assert float(max_violation(loads)) <= int((margin <= w).sum()) / L_bar + 1e-12
        assert float(loads[int(d.argmax())]) >= L_bar and float(loads[int(d.argmin())]) <= L_bar
        e = int(torch.randint(0, E, (1,), generator=gen))
        raised = b.clone()
        raised[e] += float(torch.rand((), generator=gen, dtype=torch.float64))
        after = expert_loads(select(S, raised, k))
        assert after[e] >= loads[e]
        others = torch.arange(E) != e
        assert bool((after[others] <= loads[others]).all())


@pytest.mark.parametrize("rate", [0.005, 0.02, 0.1])
def test_two_expert_band(rate):
    """Prop. 10.5(d): E = 2, k = 1. The balanced interval I of u = b_1 - b_2 is found by brute force on
    the sorted score differences; after ceil(dist(u_0, I) / (2 rate)) steps u stays within 2 rate of I
    (tolerance 1e-9) for 300 more steps."""
    gen = torch.Generator().manual_seed(int(rate * 1000))
    T = 100
    S = torch.randn(T, 2, generator=gen, dtype=torch.float64) + torch.tensor([0.0, 0.7], dtype=torch.float64)
    # token t goes to expert 1 iff S_t1 + u > S_t2, i.e. u > diff_t; L_1 = T/2 iff u in [diff_(50), diff_(51))
    diff = torch.sort(S[:, 1] - S[:, 0]).values
    low, high = float(diff[T // 2 - 1]), float(diff[T // 2])
    b = torch.zeros(2, dtype=torch.float64)
    burn_in = math.ceil(max(low - 0.0, 0.0 - high, 0.0) / (2 * rate)) + 1
    for step in range(burn_in + 300):
        b = bias_update(b, expert_loads(select(S, b, 1)), rate, "sign")
        u = float(b[0] - b[1])
        if step >= burn_in:
            assert low - 2 * rate - 1e-9 <= u <= high + 2 * rate + 1e-9


def test_switch_loss_gradient_and_loss_free_none():
    """Prop. 10.8(a, b). The Switch loss's gradient with respect to p_te is E f_e / T (autograd against the
    formula, exact to 1e-12); the loss-free router's aux_loss is 0, its bias has no gradient, and
    the gradient of the combine weights with respect to the logits does not depend on the bias when
    the selection does not change."""
    gen = torch.Generator().manual_seed(0)
    T, E = 10, 4
    probs = torch.softmax(torch.randn(T, E, generator=gen, dtype=torch.float64), -1).requires_grad_()
    mask = select(probs.detach(), torch.zeros(E, dtype=torch.float64), 2)
    switch_balance_loss(probs, mask).backward()
    f = mask.double().sum(0) / mask.sum()
    assert torch.allclose(probs.grad, (E * f / T).expand(T, E), atol=1e-12)

    router = build("loss_free", 4, E, k=2)
    logits = torch.randn(1, T, E, generator=gen)
    grads = []
    for shift in (0.0, 1e-4):  # a bias too small to change any selection
        router.expert_bias.fill_(shift)
        x = logits.clone().requires_grad_()
        routing = router.route(x)
        assert float(routing.aux_loss) == 0.0 and not router.expert_bias.requires_grad
        (routing.combine * torch.arange(1.0, E + 1)).sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


def margins(scores, bias, k):
    """Each token's margin at b: k-th minus (k+1)-th largest entry of S_t + b (Prop. 10.5)."""
    top = (scores + bias).topk(k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k]


@pytest.mark.parametrize("rate", [0.01, 0.05])
@pytest.mark.parametrize("E, k", [(8, 2), (6, 1)])
def test_sign_update_band_for_any_number_of_experts(E, k, rate):
    """Prop. 10.5(e). Every sign step obeys the descent inequality
    D(b') <= D(b) - rate * (|L(b) - kT/E|_1 - 2k N_b(2 rate)), N_b(w) = #{t: margin_t(b) <= w};
    hence, with OPT the balanced LP optimum (linprog), the running mean of |L - kT/E|_1 is at most
    the running mean of 2k N_b(2 rate) plus (D(b_0) - OPT) / (rate * n), at every n. 400 steps on
    skewed random scores, float64; the inequalities are exact up to 1e-9."""
    gen = torch.Generator().manual_seed(E * 10 + k)
    T = 240
    S = torch.randn(T, E, generator=gen, dtype=torch.float64) + torch.linspace(1.5, -1.5, E, dtype=torch.float64)
    opt = solve_selection_lp(S, per_token=k, per_expert=k * T // E).objective
    mean_load = k * T / E
    b = torch.zeros(E, dtype=torch.float64)
    d0, gaps, near, imbalance = dual(S, b, k), 0.0, 0.0, 0.0
    for n in range(1, 401):
        loads = select(S, b, k).sum(0).double()
        l1 = float((loads - mean_load).abs().sum())
        n_near = int((margins(S, b, k) <= 2 * rate).sum())
        b_next = bias_update(b, loads, rate, "sign")
        assert dual(S, b_next, k) <= dual(S, b, k) - rate * (l1 - 2 * k * n_near) + 1e-9
        imbalance, near = imbalance + l1, near + 2 * k * n_near
        assert imbalance / n <= near / n + (d0 - opt) / (rate * n) + 1e-9
        b = b_next
    # the band is real: after the transient the mean imbalance is a small share of the tokens
    assert imbalance / 400 < 0.25 * k * T
