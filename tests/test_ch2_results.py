"""The propositions of chapter 2 that test_sinkhorn.py does not check one by one, each against an
independent oracle: the definitions evaluated directly (KL divergences, entropies, the dual function
written out), autograd of a formula written independently of minimoe, brute force over all balanced
assignments, and scipy. Everything is float64 on tiny problems; each test takes well under a second."""
import itertools
import math

import numpy as np
import pytest
import torch
from scipy.optimize import linprog, minimize

from minimoe.ops import linear_assignment, sinkhorn
from minimoe.ops.sinkhorn import col_update, _log_iterations, _newton, row_update

F64 = torch.float64


def xlogx(P):
    return torch.special.xlogy(P, P)


def entropy(P):
    return -xlogx(P).sum()


def gen_kl(P, Q):
    """Generalised KL(P || Q) = sum P log(P / Q) - P + Q, with 0 log 0 = 0."""
    return (xlogx(P) - torch.special.xlogy(P, Q) - P + Q).sum()


def objective(P, S, eps):
    """F(P) = <P, S> + eps H(P), eq. (eq-ch2-problem)."""
    return (P * S).sum() + eps * entropy(P)


def marginals(gen, T, E):
    """Random positive marginals a, b with equal totals m."""
    a = torch.rand(T, generator=gen, dtype=F64) + 0.5
    b = torch.rand(E, generator=gen, dtype=F64) + 0.5
    return a, b * a.sum() / b.sum()


def feasible_plans(gen, T, E, a, b, n=5):
    """Plans in U(a, b) built independently of the problem at hand: the independent coupling, and the
    Sinkhorn plans of unrelated random scores at several eps (all with the marginals a, b)."""
    plans = [a[:, None] * b[None, :] / a.sum()]
    for i in range(n):
        other = 3 * torch.randn(T, E, generator=gen, dtype=F64)
        plans.append(sinkhorn(other, [0.1, 0.5, 2.0][i % 3], row_sums=a, col_sums=b, tol=1e-14, max_iter=100_000))
    return plans


def test_prop_2_1b_kl_identity_and_projection():
    """Proposition 2.1(b): eps KL(P || K) = -F(P) + eps (sum K - m) on U(a, b), K = exp(S / eps); so the
    solution is the KL projection of K: KL(P* || K) <= KL(Q || K) for every feasible Q."""
    gen = torch.Generator().manual_seed(100)
    for T, E, eps in [(7, 3, 0.5), (12, 4, 1.3), (5, 5, 0.2)]:
        S = torch.randn(T, E, generator=gen, dtype=F64)
        a, b = marginals(gen, T, E)
        K, m = (S / eps).exp(), a.sum()
        star = sinkhorn(S, eps, row_sums=a, col_sums=b, tol=1e-14, max_iter=100_000)
        kl_star = gen_kl(star, K).item()
        for Q in [star] + feasible_plans(gen, T, E, a, b):
            lhs = eps * gen_kl(Q, K)
            rhs = -objective(Q, S, eps) + eps * (K.sum() - m)
            assert abs(lhs.item() - rhs.item()) <= 1e-10 * (1 + abs(lhs.item()))
            assert gen_kl(Q, K).item() >= kl_star - 1e-10
        # and the identity fails off U(a, b) (a matrix with total 2m): it uses the constraints
        Q = 2 * star
        assert abs((eps * gen_kl(Q, K) + objective(Q, S, eps) - eps * (K.sum() - m)).item()) > 1e-3


def test_prop_2_1c_softmax_maximises_without_column_constraint():
    """Proposition 2.1(c): over row-stochastic P the maximiser of F is the row softmax, with value
    eps * sum_t LSE(S_t / eps). Oracle: 2000 random row-stochastic matrices (Dirichlet rows) and
    small perturbations of the softmax all score lower."""
    gen = torch.Generator().manual_seed(101)
    T, E, eps = 6, 4, 0.7
    S = torch.randn(T, E, generator=gen, dtype=F64)
    soft = torch.softmax(S / eps, -1)
    best = objective(soft, S, eps).item()
    assert abs(best - eps * torch.logsumexp(S / eps, -1).sum().item()) < 1e-12
    dirichlet = torch.distributions.Dirichlet(torch.ones(E, dtype=F64))
    torch.manual_seed(101)
    rows = dirichlet.sample((2000, T))
    values = (rows * S).sum((-1, -2)) - eps * xlogx(rows).sum((-1, -2))
    assert values.max().item() < best
    for _ in range(50):
        D = 1e-3 * torch.randn(T, E, generator=gen, dtype=F64)
        D -= D.mean(-1, keepdim=True)  # stays row-stochastic
        assert objective(soft + D, S, eps).item() < best


def test_prop_2_2_unique_positive_solution_from_any_start():
    """Proposition 2.2: one solution, strictly positive. Sinkhorn from six random starting potentials
    and with three solvers reaches the same plan, and every entry is positive (float64, |S|/eps <= 20)."""
    gen = torch.Generator().manual_seed(102)
    T, E, eps = 20, 5, 0.3
    S = 2 * torch.randn(T, E, generator=gen, dtype=F64)
    ref = sinkhorn(S, eps, tol=1e-12, max_iter=100_000, method="log")
    assert (ref > 0).all()
    for i in range(6):
        init = 5 * torch.randn(E, generator=gen, dtype=F64)
        P = sinkhorn(S, eps, tol=1e-12, max_iter=100_000, init=init, method=["log", "sinkhorn", "auto"][i % 3])
        assert (P - ref).abs().max() < 1e-9


def test_prop_2_3b_pythagoras_and_value():
    """Proposition 2.3(b): F(Q) = F(P*) - eps KL(Q || P*) for every Q in U(a, b), and
    F(P*) = -<a, f> - <b, g>. The feasible Q include hard balanced assignments (entries 0 and 1)."""
    gen = torch.Generator().manual_seed(103)
    for T, E, eps, default in [(8, 4, 0.6, True), (9, 3, 0.3, False), (6, 6, 1.5, False)]:
        S = torch.randn(T, E, generator=gen, dtype=F64)
        if default:
            a, b = torch.ones(T, dtype=F64), torch.full((E,), T / E, dtype=F64)
        else:
            a, b = marginals(gen, T, E)
        out = sinkhorn(S, eps, row_sums=a, col_sums=b, tol=1e-14, max_iter=100_000, return_potentials=True)
        P = out.plan
        value = objective(P, S, eps).item()
        assert abs(value - (-(a @ out.f) - b @ out.g).item()) < 1e-10
        Qs = feasible_plans(gen, T, E, a, b)
        if default:  # 0/1 plans: the balanced assignments of random scores
            Qs += [torch.nn.functional.one_hot(linear_assignment(torch.randn(T, E, generator=gen, dtype=F64), T // E),
                                               E).to(F64) for _ in range(3)]
        for Q in Qs:
            assert abs(objective(Q, S, eps).item() - (value - eps * gen_kl(Q, P).item())) < 1e-10
            assert objective(Q, S, eps).item() <= value + 1e-12


def test_prop_2_3c_potentials_unique_up_to_gauge():
    """Proposition 2.3(c): potentials from different solvers and starts differ by (c 1, -c 1) only."""
    gen = torch.Generator().manual_seed(104)
    S = torch.randn(15, 4, generator=gen, dtype=F64)
    ref = sinkhorn(S, 0.4, tol=1e-14, max_iter=100_000, method="log", return_potentials=True)
    for method in ["sinkhorn", "auto"]:
        init = 10 * torch.randn(4, generator=gen, dtype=F64)
        out = sinkhorn(S, 0.4, tol=1e-14, max_iter=100_000, method=method, init=init, return_potentials=True)
        c_f, c_g = out.f - ref.f, out.g - ref.g
        assert (c_f.max() - c_f.min()) < 1e-9 and (c_g.max() - c_g.min()) < 1e-9
        assert abs(c_f.mean() + c_g.mean()) < 1e-9
        assert abs(c_f.mean()) > 1e-3  # a genuinely different representative (init moved the gauge)


def dual_function(S, eps, f, g, a, b):
    """Psi(f, g) of eq. (eq-ch2-dual), written out."""
    return eps * ((S + f[:, None] + g[None, :]) / eps).exp().sum() - a @ f - b @ g - eps * a.sum()


def test_prop_2_4_weak_duality_and_dual_gradient():
    """Proposition 2.4(a), (b): Psi(f, g) >= F(P) for feasible P and any (f, g); the autograd gradient of
    Psi is the marginal residual of P(f, g)."""
    gen = torch.Generator().manual_seed(105)
    T, E, eps = 10, 4, 0.5
    S = torch.randn(T, E, generator=gen, dtype=F64)
    a, b = marginals(gen, T, E)
    out = sinkhorn(S, eps, row_sums=a, col_sums=b, tol=1e-14, max_iter=100_000, return_potentials=True)
    best = objective(out.plan, S, eps).item()
    assert abs(dual_function(S, eps, out.f, out.g, a, b).item() - best) < 1e-10  # (c): equality at the optimum
    feasible = feasible_plans(gen, T, E, a, b)
    for _ in range(50):
        f = (out.f + torch.randn(T, generator=gen, dtype=F64)).requires_grad_()
        g = (out.g + torch.randn(E, generator=gen, dtype=F64)).requires_grad_()
        psi = dual_function(S, eps, f, g, a, b)
        assert psi.item() >= best - 1e-12
        assert all(psi.item() >= objective(Q, S, eps).item() - 1e-12 for Q in feasible)
        df, dg = torch.autograd.grad(psi, (f, g))
        P = ((S + f[:, None] + g[None, :]) / eps).exp().detach()
        assert torch.allclose(df, P.sum(1) - a, atol=1e-10) and torch.allclose(dg, P.sum(0) - b, atol=1e-10)


def test_prop_2_5_fixed_point_and_convergence():
    """Proposition 2.5(e), (f): the potentials of the solution are a fixed point of one iteration, and
    from random starts the iterates' plans converge to P* (their distance to it tends to 0)."""
    gen = torch.Generator().manual_seed(106)
    T, E, eps = 12, 4, 0.3
    S = torch.randn(T, E, generator=gen, dtype=F64)
    L = (S / eps)[None]
    log_a, log_b = torch.zeros(1, T, dtype=F64), torch.full((1, E), math.log(T / E), dtype=F64)
    out = sinkhorn(S, eps, tol=1e-14, max_iter=100_000, return_potentials=True)
    alpha = row_update(L, (out.g / eps)[None], log_a)
    beta = col_update(L, alpha, log_b)
    assert (alpha[0] - out.f / eps).abs().max() < 1e-10 and (beta[0] - out.g / eps).abs().max() < 1e-10
    for _ in range(3):
        beta = 20 * torch.randn(1, E, generator=gen, dtype=F64)  # a far-off start
        distances = []
        for _ in range(200):
            alpha = row_update(L, beta, log_a)
            distances.append((L + alpha[..., None] + beta[:, None, :]).exp()[0].sub(out.plan).abs().max().item())
            beta = col_update(L, alpha, log_b)
        assert distances[-1] < 1e-10 < distances[0]


def semidual(S, eps, g, a, b):
    """The semi-dual of eq. (eq-ch2-semidual), written out."""
    return eps * (a * torch.logsumexp((S + g) / eps, -1)).sum() - b @ g - eps * (a * a.log()).sum()


def test_prop_2_6_semidual_gradient_and_hessian():
    """Proposition 2.6: autograd gradient and Hessian of the semi-dual written as in eq. (eq-ch2-semidual)
    equal the formulas of eq. (eq-ch2-hessian); the Hessian is PSD with null space span(1); the
    semi-dual is min_f Psi(f, g); it is minimised at the column potential of the solution, where it
    equals the optimal value."""
    gen = torch.Generator().manual_seed(107)
    for T, E, eps in [(9, 4, 0.5), (14, 3, 0.2)]:
        S = torch.randn(T, E, generator=gen, dtype=F64)
        a, b = marginals(gen, T, E)
        for _ in range(3):
            g = torch.randn(E, generator=gen, dtype=F64)
            P = a[:, None] * torch.softmax((S + g) / eps, -1)
            grad = torch.autograd.functional.jacobian(lambda x: semidual(S, eps, x, a, b), g)
            hess = torch.autograd.functional.hessian(lambda x: semidual(S, eps, x, a, b), g)
            assert torch.allclose(grad, P.sum(0) - b, atol=1e-12)
            formula = (torch.diag(P.sum(0)) - P.T @ (P / a[:, None])) / eps
            assert torch.allclose(hess, formula, atol=1e-10)
            values, vectors = torch.linalg.eigh(formula)
            assert abs(values[0]) < 1e-10 and values[1] > 1e-6
            assert torch.allclose(vectors[:, 0].abs(), torch.full((E,), E ** -0.5, dtype=F64), atol=1e-8)
            # min over f of Psi(f, g) is attained at the row update and equals the semi-dual
            f_row = eps * (a.log() - torch.logsumexp((S + g) / eps, -1))
            psi_g = semidual(S, eps, g, a, b).item()
            assert abs(dual_function(S, eps, f_row, g, a, b).item() - psi_g) < 1e-10
            for _ in range(10):
                f = f_row + 0.5 * torch.randn(T, generator=gen, dtype=F64)
                assert dual_function(S, eps, f, g, a, b).item() > psi_g
        out = sinkhorn(S, eps, row_sums=a, col_sums=b, tol=1e-14, max_iter=100_000, return_potentials=True)
        at_star = semidual(S, eps, out.g, a, b).item()
        assert abs(at_star - objective(out.plan, S, eps).item()) < 1e-10
        for _ in range(20):
            assert semidual(S, eps, out.g + 0.3 * torch.randn(E, generator=gen, dtype=F64), a, b).item() > at_star - 1e-12


def test_newton_on_the_semidual_converges_quadratically():
    """Cited theorem (ch2-thm-newton), measured on minimoe's Newton solver: from a start near the
    solution (10 Sinkhorn iterations), the relative column error e_k after k Newton steps satisfies
    e_{k+1} <= C e_k^2 with C = 10 until rounding, while Sinkhorn's own steps only shrink it linearly."""
    gen = torch.Generator().manual_seed(108)
    T, E, eps = 200, 8, 0.1
    S = torch.randn(T, E, generator=gen, dtype=F64)
    L = (S / eps)[None]
    a, b = torch.ones(1, T, dtype=F64), torch.full((1, E), T / E, dtype=F64)
    _, beta0, _, _ = _log_iterations(L, a.log(), b.log(), torch.zeros(1, E, dtype=F64), 10, 0.0)

    def column_error(alpha, beta):
        P = (L + alpha[:, :, None] + beta[:, None, :]).exp()
        return ((P.sum(-2) - b).abs() / b).max().item()

    errors = [column_error(row_update(L, beta0, a.log()), beta0)]
    for k in range(1, 5):
        alpha, beta, _, _ = _newton(L, a.log(), b.log(), a, b, beta0, k, 0.0)
        errors.append(column_error(alpha, beta))
    assert errors[0] > 1e-3  # a real distance to cover
    for before, after in zip(errors, errors[1:]):
        if before > 1e-7:
            assert after <= 10 * before**2, errors
    assert errors[4] < 1e-13


def test_prop_2_8_bounds_and_first_order_term():
    """Proposition 2.8: ||P_eps - Q||_1 <= min(m osc(S) / eps, m sqrt(2 osc(S) / eps)) for general
    marginals; H(Q) - H(P) = KL(P || Q) >= 0 on U(a, b); the 1/eps bound is the tighter one for large
    eps and is of the right order: eps (P_eps - Q) tends to the first-order term
    (S_tj - row mean - column mean + mean) / E (default marginals), checked at eps = 1e3."""
    gen = torch.Generator().manual_seed(109)
    for T, E in [(8, 4), (20, 5)]:
        S = 3 * torch.randn(T, E, generator=gen, dtype=F64)
        a, b = marginals(gen, T, E)
        m, osc = a.sum().item(), (S.max() - S.min()).item()
        Q = a[:, None] * b[None, :] / m
        for P in feasible_plans(gen, T, E, a, b):
            assert abs((entropy(Q) - entropy(P) - gen_kl(P, Q)).item()) < 1e-10
            assert entropy(P) <= entropy(Q) + 1e-12
        linear_was_tighter = False
        for eps in np.logspace(-1, 4, 11):
            P = sinkhorn(S, float(eps), row_sums=a, col_sums=b, tol=1e-13, max_iter=100_000)
            distance = (P - Q).abs().sum().item()
            linear, root = m * osc / eps, m * math.sqrt(2 * osc / eps)
            assert distance <= min(linear, root) * (1 + 1e-9)
            linear_was_tighter |= linear < root
        assert linear_was_tighter
    S = torch.randn(16, 4, generator=gen, dtype=F64)
    first_order = (S - S.mean(1, keepdim=True) - S.mean(0, keepdim=True) + S.mean()) / 4
    eps = 1e3
    P = sinkhorn(S, eps, tol=1e-14, max_iter=1000)
    assert (eps * (P - 0.25) - first_order).abs().max() < 1e-2 * first_order.abs().max()


def balanced_assignments(T, E):
    """Every assignment of T tokens to E experts with exactly T / E tokens each (the vertices of U)."""
    C = T // E
    return [z for z in itertools.product(range(E), repeat=T) if all(z.count(e) == C for e in range(E))]


def test_top1_is_exactly_balanced_below_eps0():
    """Corollary to Proposition 2.9 (ch2-cor-top1-balanced): with delta the gap between the best and
    second-best balanced assignments (brute force over all of them), for eps < delta / (2 T log E),
    P_eps[t, z_t] >= 1 - eps H(P_eps) / delta > 1/2, and the top-1 of the plan is z, with loads T / E."""
    gen = torch.Generator().manual_seed(110)
    for T, E in [(6, 3), (6, 2), (8, 2)]:
        vertices = torch.tensor(balanced_assignments(T, E))
        for _ in range(2):
            S = torch.randn(T, E, generator=gen, dtype=F64)
            scores = S.gather(1, vertices.T).sum(0)
            order = scores.argsort(descending=True)
            z, delta = vertices[order[0]], (scores[order[0]] - scores[order[1]]).item()
            assert torch.equal(z, linear_assignment(S, T // E))
            eps0 = delta / (2 * T * math.log(E))
            for eps in [0.99 * eps0, 0.5 * eps0, 0.1 * eps0]:
                P = sinkhorn(S, eps, tol=1e-12, max_iter=100_000)
                on_z = P.gather(1, z[:, None])[:, 0]
                assert (on_z >= 1 - eps * entropy(P).item() / delta - 1e-10).all()
                assert (on_z > 0.5).all()
                assert torch.equal(P.argmax(1), z)
                assert (torch.bincount(P.argmax(1), minlength=E) == T // E).all()


def test_eps_to_zero_selects_the_largest_entropy_lp_solution():
    """Cited theorem (ch2-thm-max-entropy): with ties the LP has a face of optimal solutions, and P_eps
    tends to the one of largest entropy. Oracle, without minimoe: linprog gives LP* and, entry by entry,
    the largest value P_ij takes on the optimal face, hence the face's support; the face is the set of
    plans in U supported there, and its largest-entropy point is the matrix scaling of the 0/1 support
    pattern to the marginals (the closed form of Proposition 2.3 with S = 0 on the support), done by a
    plain numpy loop. Integer scores in {0, 1, 2}: every suboptimal vertex scores >= 1 less, so at
    eps = 0.02 the mass off the face is of order exp(-1 / 0.02)."""
    rng = np.random.default_rng(111)
    T, E = 6, 3
    A_eq = np.vstack([np.kron(np.eye(T), np.ones((1, E))), np.kron(np.ones((1, T)), np.eye(E))])
    b_eq = np.concatenate([np.ones(T), np.full(E, T / E)])
    found = 0
    while found < 3:
        S = rng.integers(0, 3, size=(T, E)).astype(float)
        lp = linprog(-S.ravel(), A_eq=A_eq, b_eq=b_eq, bounds=(0, None), method="highs")
        face_A, face_b = np.vstack([A_eq, S.ravel()[None]]), np.concatenate([b_eq, [-lp.fun]])
        largest = np.array([-linprog(-np.eye(T * E)[k], A_eq=face_A, b_eq=face_b, bounds=(0, None),
                                     method="highs").fun for k in range(T * E)])
        support = (largest > 1e-9).reshape(T, E)
        if support.sum() == T:
            continue  # a unique (integral) optimum: not the case this theorem is about
        found += 1
        K, u, v = support.astype(float), np.ones(T), np.ones(E)
        for _ in range(20_000):
            u = 1 / (K @ v)
            v = (T / E) / (K.T @ u)
        maxent = u[:, None] * K * v[None, :]
        assert np.abs(maxent.sum(1) - 1).max() < 1e-12 and (S * maxent).sum() == pytest.approx(-lp.fun, abs=1e-9)
        P = sinkhorn(torch.tensor(S), 0.02, tol=1e-13, max_iter=100_000).numpy()
        assert np.abs(P - maxent).max() < 1e-6
        # and it is not just any optimal solution: the vertex linprog returns is far from it
        assert np.abs(lp.x.reshape(T, E) - maxent).max() > 0.1


def test_sinkhorn_rate_within_birkhoff_bound():
    """Cited theorem (ch2-thm-rate): the measured contraction per iteration of the marginal error stays
    below kappa^2 = tanh^2(Delta / 4), Delta the largest log cross-ratio of the kernel."""
    gen = torch.Generator().manual_seed(112)
    for T, E, eps, scale in [(30, 4, 1.0, 1.0), (20, 3, 0.5, 0.5), (40, 5, 2.0, 2.0)]:
        S = scale * torch.randn(T, E, generator=gen, dtype=F64)
        D = S[:, :, None] - S[:, None, :]
        kappa2 = math.tanh((D.amax(0) - D.amin(0)).max().item() / eps / 4) ** 2
        L = (S / eps)[None]
        log_a, log_b = torch.zeros(1, T, dtype=F64), torch.full((1, E), math.log(T / E), dtype=F64)
        beta, errors = torch.zeros(1, E, dtype=F64), []
        for _ in range(2000):
            alpha = row_update(L, beta, log_a)
            beta = col_update(L, alpha, log_b)
            errors.append((alpha - row_update(L, beta, log_a)).expm1().abs().max().item())
            if errors[-1] < 1e-12:
                break
        assert errors[-1] < 1e-12
        start = next(i for i, e in enumerate(errors) if e < 1e-4)
        rate = (errors[-1] / errors[start]) ** (1 / (len(errors) - 1 - start))
        assert rate <= kappa2
