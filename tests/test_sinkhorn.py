"""minimoe.ops.sinkhorn against the mathematics of chapter 2 and against POT.

Oracles: POT's log-domain solver in float64 (independent code), the closed form of the optimum,
strong duality, the LP (scipy.optimize.linprog) for eps -> 0, finite differences for the gradient.
"""
import math
import warnings

import numpy as np
import ot
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from minimoe.ops import linear_assignment, sinkhorn

METHODS = ["log", "sinkhorn", "auto"]


def marginal_errors(P, a=None, b=None):
    T, E = P.shape[-2:]
    a = torch.ones(T, dtype=P.dtype) if a is None else a
    b = torch.full((E,), T / E, dtype=P.dtype) if b is None else b
    return ((P.sum(-1) - a).abs() / a).max().item(), ((P.sum(-2) - b).abs() / b).max().item()


def entropy(P):
    return -(P * P.clamp_min(1e-300).log()).sum()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("eps", [0.1, 0.5, 1.0])
def test_marginals(method, eps):
    gen = torch.Generator().manual_seed(0)
    S = 2 * torch.randn(3, 40, 6, generator=gen, dtype=torch.float64)
    P = sinkhorn(S, eps, tol=1e-10, max_iter=5000, method=method)
    rows, cols = marginal_errors(P)
    assert rows <= 1e-9 and cols <= 1e-9
    assert (P > 0).all()
    P32 = sinkhorn(S.float(), eps, tol=1e-5, max_iter=2000, method=method)
    assert P32.dtype == torch.float32
    rows, cols = marginal_errors(P32)
    assert rows <= 2e-5 and cols <= 2e-5


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 30), E=st.integers(1, 8), eps=st.sampled_from([0.2, 1.0, 3.0]), seed=st.integers(0, 10**6),
       method=st.sampled_from(METHODS), batch=st.sampled_from([(), (2,), (2, 3)]))
def test_shapes_and_general_marginals(T, E, eps, seed, method, batch):
    gen = torch.Generator().manual_seed(seed)
    S = torch.randn(*batch, T, E, generator=gen, dtype=torch.float64)
    a = torch.rand(*batch, T, generator=gen, dtype=torch.float64) + 0.5
    b = torch.rand(*batch, E, generator=gen, dtype=torch.float64) + 0.5
    b = b * a.sum(-1, keepdim=True) / b.sum(-1, keepdim=True)
    out = sinkhorn(S, eps, row_sums=a, col_sums=b, tol=1e-9, max_iter=20000, method=method, return_potentials=True)
    assert out.plan.shape == S.shape and out.f.shape == (*batch, T) and out.g.shape == (*batch, E)
    assert torch.allclose(out.plan.sum(-1), a, rtol=1e-8) and torch.allclose(out.plan.sum(-2), b, rtol=1e-8)


def test_matches_pot():
    gen = torch.Generator().manual_seed(1)
    for trial in range(6):
        T, E = int(torch.randint(5, 60, (1,), generator=gen)), int(torch.randint(2, 9, (1,), generator=gen))
        S = torch.randn(T, E, generator=gen, dtype=torch.float64)
        eps = [0.25, 0.5, 1.0][trial % 3]  # where POT's float64 log-domain solver converges to 1e-13
        a, b = np.ones(T), np.full(E, T / E)
        # POT minimises <P, M> - eps H(P): M = -S is the same problem
        want = ot.sinkhorn(a, b, -S.numpy(), eps, method="sinkhorn_log", numItermax=200000, stopThr=1e-13)
        for method in METHODS:
            got = sinkhorn(S, eps, tol=1e-12, max_iter=100000, method=method)
            assert np.abs(got.numpy() - want).max() < 1e-8, (trial, method)


def test_closed_form_structure():
    """P = exp((S + f 1^T + 1 g^T) / eps): log P - S/eps has rank one in the additive sense."""
    gen = torch.Generator().manual_seed(2)
    S = torch.randn(30, 5, generator=gen, dtype=torch.float64)
    eps = 0.4
    out = sinkhorn(S, eps, tol=1e-12, max_iter=5000, return_potentials=True)
    assert torch.allclose(out.plan, ((S + out.f[:, None] + out.g[None, :]) / eps).exp(), rtol=1e-10)
    R = eps * out.plan.log() - S  # = f_t + g_e: all 2x2 "interaction" terms vanish
    interaction = R[:, None, :, None] + R[None, :, None, :] - R[:, None, None, :] - R[None, :, :, None]
    assert interaction.abs().max() < 1e-9


def test_strong_duality_and_envelope():
    gen = torch.Generator().manual_seed(3)
    S = torch.randn(25, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    eps = 0.3
    out = sinkhorn(S, eps, tol=1e-13, max_iter=10000, return_potentials=True, grad="implicit")
    P = out.plan
    primal = (P * S).sum() + eps * entropy(P)
    dual = -out.f.sum() - (25 / 4) * out.g.sum()
    assert abs(primal.item() - dual.item()) < 1e-9
    # envelope (Danskin): d/dS of the optimal value is the plan; the value is the dual formula,
    # differentiated through the implicit gradient of the plan
    value = (P * S).sum() + eps * entropy(P)
    (grad,) = torch.autograd.grad(value, S)
    assert torch.allclose(grad, P.detach(), atol=1e-8)


def test_shift_invariance():
    gen = torch.Generator().manual_seed(4)
    S = torch.randn(2, 20, 6, generator=gen, dtype=torch.float64)
    P = sinkhorn(S, 0.5, tol=1e-12, max_iter=5000)
    shifted = S + 10 * torch.randn(2, 20, 1, generator=gen, dtype=torch.float64) \
        + 10 * torch.randn(2, 1, 6, generator=gen, dtype=torch.float64)
    assert torch.allclose(sinkhorn(shifted, 0.5, tol=1e-12, max_iter=5000), P, atol=1e-10)


def test_scale_equivalence():
    gen = torch.Generator().manual_seed(5)
    S = torch.randn(20, 6, generator=gen, dtype=torch.float64)
    for eps in [0.2, 2.0]:
        assert torch.allclose(sinkhorn(S, eps, tol=1e-13, max_iter=5000), sinkhorn(S / eps, 1.0, tol=1e-13, max_iter=5000),
                              atol=1e-12)


def test_eps_to_infinity_is_uniform():
    S = torch.randn(16, 4, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    assert (sinkhorn(S, 1e4) - 1 / 4).abs().max() <= 1e-3


def transport_lp(S):
    """LP* = max <P, S> over the transportation polytope (rows 1, columns T/E), by linprog."""
    T, E = S.shape
    A_eq = np.zeros((T + E, T * E))
    for t in range(T):
        A_eq[t, t * E:(t + 1) * E] = 1
    for e in range(E):
        A_eq[T + e, e::E] = 1
    b_eq = np.concatenate([np.ones(T), np.full(E, T / E)])
    res = linprog(-S.numpy().ravel(), A_eq=A_eq, b_eq=b_eq, bounds=(0, None), method="highs")
    assert res.status == 0
    return -res.fun


def test_eps_to_zero_matches_assignment_lp():
    gen = torch.Generator().manual_seed(7)
    T, E = 64, 8
    for _ in range(3):
        S = torch.randn(T, E, generator=gen, dtype=torch.float64)
        lp = transport_lp(S)
        # the LP has an integral optimum: the balanced assignment (total unimodularity)
        z = linear_assignment(S, T // E)
        assert abs(S.gather(1, z[:, None]).sum().item() - lp) < 1e-8
        for eps in [0.3, 0.1, 0.03]:
            P = sinkhorn(S, eps, tol=1e-10, max_iter=20000)
            gap = lp - (P * S).sum().item()
            assert -1e-8 <= gap <= eps * entropy(P).item() + 1e-8 <= eps * T * math.log(E) + 1e-8
        # near the limit the plan's top-1 is (almost) the balanced assignment itself
        top1 = sinkhorn(S, 0.005, tol=1e-9, max_iter=20000).argmax(-1)
        assert (torch.bincount(top1, minlength=E) - T // E).abs().max() <= 1
        assert (top1 == z).float().mean() >= 0.95


def test_single_token_is_uniform():
    S = torch.tensor([[5.0, -3.0, 0.0, 100.0]], dtype=torch.float64)
    assert torch.allclose(sinkhorn(S, 0.1), torch.full((1, 4), 0.25, dtype=torch.float64), atol=1e-12)
    # float32: S / eps = 1000 leaves ~1e-4 relative precision in the exponents, hence the tolerance
    assert torch.allclose(sinkhorn(S.float(), 0.1), torch.full((1, 4), 0.25), atol=1e-3)


@pytest.mark.parametrize("method", METHODS)
def test_one_row_update_is_softmax(method):
    """Propositions 2.1(c) and 2.5(d), on Sinkhorn itself. One iteration (``max_iter=1``, ``tol=0``) is a
    row update from g = 0 followed by a column update, and ends on the columns. The row potential it
    returns is that of the row update, so exp((S + f) / eps) is the plan after the first half-step: it
    must be the row softmax. The plan returned is the softmax with each column rescaled to T / E, and
    with ``last_update="rows"`` that matrix with its rows renormalised."""
    gen = torch.Generator().manual_seed(8)
    S = torch.randn(10, 5, generator=gen, dtype=torch.float64)
    eps = 0.7
    soft = torch.softmax(S / eps, -1)
    one = sinkhorn(S, eps, max_iter=1, tol=0, method=method, return_potentials=True)
    assert one.iterations == 1
    assert torch.allclose(((S + one.f[:, None]) / eps).exp(), soft, atol=1e-13)
    columns = soft * (2.0 / soft.sum(0))  # the column update of the softmax: columns sum to T/E = 2
    assert torch.allclose(one.plan, columns, atol=1e-13)
    assert not torch.allclose(one.plan, soft, atol=1e-3)  # the column update did something
    rows = sinkhorn(S, eps, max_iter=1, tol=0, method=method, last_update="rows")
    assert torch.allclose(rows, columns / columns.sum(1, keepdim=True), atol=1e-13)
    # when the column sums asked for are the softmax's own, the softmax is the solution (a fixed point)
    P = sinkhorn(S, eps, col_sums=soft.sum(0), tol=1e-13, max_iter=1000, method=method)
    assert torch.allclose(P, soft, atol=1e-12)
    # and when the softmax is already balanced (circulant scores), Sinkhorn returns the softmax itself
    c = torch.randn(4, generator=gen, dtype=torch.float64)
    circ = torch.stack([c.roll(i) for i in range(4)] * 3)
    assert torch.allclose(sinkhorn(circ, eps, tol=1e-13, method=method), torch.softmax(circ / eps, -1), atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("last_update", ["rows", "columns"])
@pytest.mark.parametrize("solve", ["fixed", "converge"])
def test_the_reported_error_is_the_plans_own(dtype, last_update, solve):
    """The solver reads the plan's marginal error from its scalings (``u * (K v)``, ``v * (K^T u)``)
    instead of summing the returned plan: the two must agree to rounding, and the side the iterations
    end on must be exact (rows for ``last_update="rows"``, columns otherwise). A few iterations leave
    a visible error (0.01-0.1 here), so an error read from the wrong side, or from the iterate before
    the last, would be off by far more than rounding."""
    gen = torch.Generator().manual_seed(11)
    S = (3 * torch.randn(3, 96, 8, generator=gen, dtype=torch.float64)).to(dtype)
    kw = dict(max_iter=4, tol=0.0, method="sinkhorn") if solve == "fixed" else dict(tol=1e-3)
    out = sinkhorn(S, 1.0, last_update=last_update, return_potentials=True, **kw)
    P = out.plan.double()
    rows, cols = P.sum(-1), P.sum(-2)
    row_error, col_error = float((rows - 1).abs().max()), float((cols / 12 - 1).abs().max())
    rounding = 2e-6 if dtype == torch.float32 else 1e-12
    exact, off = (row_error, col_error) if last_update == "rows" else (col_error, row_error)
    assert exact <= rounding
    assert abs(out.error - max(row_error, col_error)) <= rounding
    if solve == "fixed":
        assert out.error > 1e-3  # four iterations do not balance these scores: the check has teeth
    else:
        assert out.error <= 1e-3 / (1 - 1e-3) + rounding  # a row-ended plan: columns within tol / (1 - tol)
    # the returned potentials give the returned plan: exp((S + f + g) / eps)
    again = ((S.double() + out.f.double()[..., None] + out.g.double()[..., None, :])).exp()
    assert torch.allclose(again, P, rtol=1e-4 if dtype == torch.float32 else 1e-10, atol=0)


@pytest.mark.parametrize("method", METHODS)
def test_finite_at_extreme_scores_float32(method):
    gen = torch.Generator().manual_seed(9)
    for scale, eps in [(1e4, 1.0), (10.0, 0.05), (3.0, 0.01)]:
        S = scale * torch.randn(4, 64, 8, generator=gen)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # convergence is not the point here
            P = sinkhorn(S, eps, max_iter=200, method=method)
        assert torch.isfinite(P).all() and (P >= 0).all()
        assert torch.allclose(P.sum(-2), torch.full((4, 8), 8.0), rtol=1e-3)  # columns exact after their update


def test_naive_exp_domain_overflows_in_float32():
    """The reason for the log domain: K = exp(S / eps) is inf once S / eps > 88.7."""
    S = 3 * torch.randn(64, 8, generator=torch.Generator().manual_seed(10))
    K = torch.exp(S / 0.05)
    v = torch.ones(8)
    u = 1 / (K @ v)
    v = 8.0 / (K.T @ u)
    assert not torch.isfinite(u * (K @ v)).all()
    assert torch.isfinite(sinkhorn(S, 0.05, max_iter=50, tol=0)).all()


def test_implicit_gradient_gradcheck():
    gen = torch.Generator().manual_seed(11)
    for T, E, eps in [(5, 3, 1.0), (6, 2, 0.5), (4, 4, 0.3)]:
        S = torch.randn(T, E, generator=gen, dtype=torch.float64, requires_grad=True)
        a = torch.rand(T, generator=gen, dtype=torch.float64) + 0.5
        b = torch.rand(E, generator=gen, dtype=torch.float64) + 0.5
        b = b * a.sum() / b.sum()
        fn = lambda s: sinkhorn(s, eps, row_sums=a, col_sums=b, tol=1e-14, max_iter=100000, grad="implicit")  # noqa: E731
        assert torch.autograd.gradcheck(fn, (S,), eps=1e-6, atol=1e-6, rtol=1e-5)
    S = torch.randn(2, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True)  # batched
    assert torch.autograd.gradcheck(lambda s: sinkhorn(s, 0.5, tol=1e-14, max_iter=100000, grad="implicit"), (S,),
                                    eps=1e-6, atol=1e-6, rtol=1e-5)


def test_implicit_gradient_matches_unrolled():
    """Unrolling many iterations converges to the gradient of the solution."""
    gen = torch.Generator().manual_seed(12)
    S = torch.randn(12, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(12, 4, generator=gen, dtype=torch.float64)
    g_imp, = torch.autograd.grad((sinkhorn(S, 0.5, tol=1e-14, max_iter=10000, grad="implicit") * weights).sum(), S)
    g_unr, = torch.autograd.grad((sinkhorn(S, 0.5, tol=0, max_iter=400, grad="unroll") * weights).sum(), S)
    assert torch.allclose(g_imp, g_unr, atol=1e-9)
    assert sinkhorn(S, 0.5).requires_grad is False  # grad="none": a constant


def dual_value(S, eps, alpha, beta):
    """D(f, g) = eps * sum exp((S + f + g)/eps) - <a, f> - <b, g> + const, in eps-scaled potentials."""
    T, E = S.shape
    return (eps * (S / eps + alpha[:, None] + beta[None, :]).exp().sum()
            - eps * alpha.sum() - eps * (T / E) * beta.sum()).item()


def test_log_domain_dual_decreases():
    """Each half-step of Sinkhorn exactly minimises the (convex) dual over one block: monotone."""
    from minimoe.ops.sinkhorn import col_update, row_update
    gen = torch.Generator().manual_seed(13)
    T, E, eps = 20, 5, 0.2
    S = torch.randn(T, E, generator=gen, dtype=torch.float64)
    L = (S / eps)[None]
    log_a, log_b = torch.zeros(1, T, dtype=S.dtype), torch.full((1, E), math.log(T / E), dtype=S.dtype)
    alpha, beta = torch.zeros(1, T, dtype=S.dtype), torch.zeros(1, E, dtype=S.dtype)
    values = [dual_value(S, eps, alpha[0], beta[0])]
    for _ in range(30):
        alpha = row_update(L, beta, log_a)
        values.append(dual_value(S, eps, alpha[0], beta[0]))
        beta = col_update(L, alpha, log_b)
        values.append(dual_value(S, eps, alpha[0], beta[0]))
    assert all(later <= earlier + 1e-12 for earlier, later in zip(values, values[1:]))
    # and it decreases to the primal optimum
    P = sinkhorn(S, eps, tol=1e-13, max_iter=10000)
    primal = ((P * S).sum() + eps * entropy(P)).item()
    assert values[-1] >= primal - 1e-9


def test_warm_start():
    gen = torch.Generator().manual_seed(14)
    S = torch.randn(200, 8, generator=gen, dtype=torch.float64)
    cold = sinkhorn(S, 0.1, tol=1e-9, max_iter=10000, method="sinkhorn", return_potentials=True)
    warm = sinkhorn(S + 1e-3 * torch.randn(200, 8, generator=gen, dtype=torch.float64), 0.1, tol=1e-9,
                    max_iter=10000, method="sinkhorn", init=cold.g, return_potentials=True)
    assert warm.iterations < cold.iterations
    again = sinkhorn(S, 0.1, tol=1e-9, max_iter=10000, init=cold.g, return_potentials=True)
    assert torch.allclose(again.plan, cold.plan, atol=1e-8)


def test_methods_agree():
    gen = torch.Generator().manual_seed(15)
    S = torch.randn(3, 300, 16, generator=gen, dtype=torch.float64) * 2
    for eps in [1.0, 0.1, 0.02]:
        plans = [sinkhorn(S, eps, tol=1e-10, max_iter=50000, method=m) for m in METHODS]
        for P in plans[1:]:
            assert (P - plans[0]).abs().max() < 1e-7


def test_does_not_converge_warns():
    S = torch.randn(50, 5, generator=torch.Generator().manual_seed(16))
    with pytest.warns(RuntimeWarning, match="did not reach tol"):
        sinkhorn(S, 0.01, max_iter=3, method="sinkhorn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sinkhorn(S, 0.01, max_iter=3, tol=0)  # tol=0: a fixed number of iterations, no warning


@pytest.mark.parametrize("bad, match", [
    (dict(eps=0.0), "eps"), (dict(eps=-1.0), "eps"), (dict(max_iter=0), "max_iter"), (dict(tol=-1.0), "tol"),
    (dict(method="exp"), "method"), (dict(grad="yes"), "grad"), (dict(row_sums=-torch.ones(4)), "row_sums"),
    (dict(col_sums=torch.ones(3)), "same total"), (dict(col_sums=torch.ones(2)), "col_sums"),
    (dict(init=torch.zeros(5)), "init"),
])
def test_bad_arguments(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        sinkhorn(torch.randn(4, 3), **bad)


def test_bad_scores():
    with pytest.raises(ValueError, match="NaN"):
        sinkhorn(torch.tensor([[0.0, float("nan")]]))
    with pytest.raises(ValueError, match="shape"):
        sinkhorn(torch.randn(5))
    with pytest.raises(TypeError, match="floating"):
        sinkhorn(torch.ones(3, 2, dtype=torch.long))


def test_auto_converges_far_below_the_score_scale():
    """|S| / eps in the thousands: a cold start has one-hot rows (Newton's Hessian is 0, Sinkhorn
    crawls); method="auto" warm-starts from larger eps and still meets the tolerance."""
    gen = torch.Generator().manual_seed(17)
    for dtype, tol in [(torch.float32, 1e-4), (torch.float64, 1e-9)]:
        S = (1e4 * torch.randn(64, 8, generator=gen)).to(dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "did not reach tol" warning
            out = sinkhorn(S, 1.0, tol=tol, max_iter=5000, return_potentials=True)
        assert out.error <= 1.5 * tol
        assert torch.equal(out.plan.argmax(-1), linear_assignment(S, 8))


def _relaxed_sinkhorn_rate(L, a, b, omega, max_iter=5000):
    """Measured asymptotic contraction per iteration of log-domain Sinkhorn over-relaxed by omega
    (eq-ch2-overrelax), from the marginal error between 1e-6 and 1e-10."""
    f, g, errors = torch.zeros_like(a), torch.zeros_like(b), []
    for _ in range(max_iter):
        f = (1 - omega) * f + omega * (a.log() - torch.logsumexp(L + g, 1))
        g = (1 - omega) * g + omega * (b.log() - torch.logsumexp(L + f[:, None], 0))
        Q = (L + f[:, None] + g).exp()
        errors.append(max(((Q.sum(1) - a).abs() / a).max().item(), ((Q.sum(0) - b).abs() / b).max().item()))
        if errors[-1] < 1e-10:
            break
    start = next(i for i, e in enumerate(errors) if e < 1e-6)
    return (errors[-1] / errors[start]) ** (1 / (len(errors) - 1 - start))


def test_overrelaxation_rate_matches_young():
    """Chapter 2, "Over-relaxation": with mu the second singular value of diag(a)^-1/2 P diag(b)^-1/2,
    plain Sinkhorn contracts by mu^2 per iteration, and over-relaxation by omega by Young's SOR rate:
    (omega mu / 2 + sqrt((omega mu / 2)^2 - (omega - 1)))^2 up to omega* = 2 / (1 + sqrt(1 - mu^2)),
    omega - 1 beyond."""
    gen = torch.Generator().manual_seed(21)
    T, E, eps = 80, 6, 0.1
    S = 2 * torch.randn(T, E, generator=gen, dtype=torch.float64)
    a, b = torch.ones(T, dtype=torch.float64), torch.full((E,), T / E, dtype=torch.float64)
    P = sinkhorn(S, eps, tol=1e-14, max_iter=100000)
    mu = torch.linalg.svdvals(P / a.sqrt()[:, None] / b.sqrt())[1].item()
    best = 2 / (1 + math.sqrt(1 - mu**2))
    for omega in [1.0, 1.2, 1.4, best, 1.8]:
        if omega < best:
            x = omega * mu / 2 + math.sqrt((omega * mu / 2) ** 2 - (omega - 1))
            predicted = x * x
        else:
            predicted = omega - 1
        # at omega* the iteration matrix has a Jordan block, so the measured rate converges slowly
        assert _relaxed_sinkhorn_rate(S / eps, a, b, omega) == pytest.approx(predicted, abs=5e-3), omega
    assert _relaxed_sinkhorn_rate(S / eps, a, b, best) < 0.7 * mu**2


def test_auto_overrelaxes():
    """method="auto" over-relaxes where plain Sinkhorn is slow: same plan, far fewer iterations."""
    gen = torch.Generator().manual_seed(22)
    S = torch.randn(2000, 32, generator=gen)
    plain = sinkhorn(S, 0.03, method="sinkhorn", max_iter=5000, return_potentials=True)
    auto = sinkhorn(S, 0.03, method="auto", max_iter=5000, return_potentials=True)
    assert auto.error <= 1e-4 and plain.error <= 1e-4
    assert auto.iterations < plain.iterations / 2
    assert marginal_errors(auto.plan)[0] <= 1.2e-4 and marginal_errors(auto.plan)[1] <= 1.2e-4
    exact = sinkhorn(S.double(), 0.03, tol=1e-10, max_iter=20000)
    assert (auto.plan.double() - exact).abs().max() < 1e-2
    assert (plain.plan.double() - exact).abs().max() < 1e-2


# The implicit gradient at large |S| / eps, where the plan has exact zeros (underflow) and its support
# graph (tokens to experts) falls apart into connected components: the Schur complement of the
# implicit system is then singular beyond the gauge, the system stays consistent, and every solution
# gives the same gradient.

def _block_scores(batch, scale, gen):
    """(batch, 8, 4) scores whose plan, at |S| / eps >> 1, has three components: tokens 0-3 share
    experts 0 and 1 (a fractional block), tokens 4-5 go to expert 2 and tokens 6-7 to expert 3. Every
    block is balanced (capacity T / E = 2 per expert), so no mass crosses; the scores off the blocks
    are ``scale`` to ``2 * scale`` lower."""
    base = torch.randn(batch, 8, 4, generator=gen, dtype=torch.float64)
    off = torch.ones(8, 4, dtype=torch.float64)
    off[:4, :2] = 0
    off[4:6, 2] = 0
    off[6:, 3] = 0
    return base - scale * off * (1 + torch.rand(batch, 8, 4, generator=gen, dtype=torch.float64)), off.bool()


def _finite_difference_vjp(S, eps, G, h=1e-4):
    """<G, dP / dS_ij> for every entry, by central differences of the converged float64 plan."""
    out = torch.zeros_like(S)
    for idx in np.ndindex(*S.shape):
        up, down = S.clone(), S.clone()
        up[idx] += h
        down[idx] -= h
        plans = [sinkhorn(s, eps, tol=1e-13, max_iter=100000) for s in (up, down)]
        out[idx] = ((plans[0] - plans[1]) * G).sum() / (2 * h)
    return out


@pytest.mark.parametrize("scale", [1e2, 1e3, 1e4])
def test_implicit_gradient_large_scale_matches_finite_differences(scale):
    """|S| / eps up to 2 * scale: the implicit gradient equals central differences of the solution
    (float64, h = 1e-4: truncation and the solver's 1e-13 give about 1e-8), in float64 and in float32
    (float32 plans, tol 1e-6). Off the blocks the plan is exactly 0 (float32: already at 1e2)."""
    gen = torch.Generator().manual_seed(23)
    S64, off = _block_scores(2, scale, gen)
    G = torch.randn(S64.shape, generator=gen, dtype=torch.float64)
    for dtype, tol, atol in [(torch.float64, 1e-13, 1e-8), (torch.float32, 1e-6, 1e-5)]:
        S = S64.to(dtype)
        want = _finite_difference_vjp(S.double(), 1.0, G)
        assert want.abs().max() > 0.1  # the fractional block moves
        S.requires_grad_()
        P = sinkhorn(S, 1.0, tol=tol, max_iter=10000, grad="implicit")
        if dtype == torch.float32 or scale >= 1e3:
            assert (P[:, off] == 0).all()
        (got,) = torch.autograd.grad(P, S, G.to(dtype))
        assert torch.isfinite(got).all()
        assert (got.double() - want).abs().max() <= atol, dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1e2, 1e3, 1e4])
def test_implicit_gradient_large_scale_identities(dtype, scale):
    """Random (3, 64, 8) scores times ``scale`` (most entries of the plan exactly 0; in float32 this
    raised LinAlgError before). Two identities of the exact gradient ``J^T G``, for any ``G``:
    * ``sinkhorn(S + c 1^T + 1 d^T) = sinkhorn(S)``, so ``J^T G`` has zero row and column sums;
    * ``P 1 = a`` and ``P^T 1 = b`` whatever ``S``, so ``<u 1^T + 1 v^T, dP> = 0``: ``J^T G = 0`` for
      ``G = u 1^T + 1 v^T``, whatever ``G`` is where ``P = 0`` (``P`` stays 0 there to first order).
    Tolerances: rounding of the float64 solve (1e-9) or of the float32 result (1e-6), relative to G."""
    gen = torch.Generator().manual_seed(24)
    S = (scale * torch.randn(3, 64, 8, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # convergence is not the point here
        P = sinkhorn(S, 1.0, grad="implicit")
    assert (P == 0).float().mean() > (0.5 if scale >= 1e3 or dtype == torch.float32 else -1)
    rtol = 1e-9 if dtype == torch.float64 else 1e-6
    G = torch.randn(S.shape, generator=gen, dtype=dtype)
    (grad,) = torch.autograd.grad(P, S, G, retain_graph=True)
    assert torch.isfinite(grad).all()
    assert (grad[P == 0] == 0).all()
    assert grad.sum(-1).abs().max() <= rtol * G.abs().max()
    assert grad.sum(-2).abs().max() <= rtol * G.abs().max()
    u = torch.randn(3, 64, 1, generator=gen, dtype=dtype)
    v = torch.randn(3, 1, 8, generator=gen, dtype=dtype)
    G = u + v + torch.where(P == 0, 1e3 * torch.randn(S.shape, generator=gen, dtype=dtype), 0.0)
    (grad,) = torch.autograd.grad(P, S, G)
    assert grad.abs().max() <= rtol * (u.abs().max() + v.abs().max())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_implicit_gradient_disconnected_support(dtype):
    """A plan with three components on purpose (see _block_scores): the Schur complement
    ``diag(P^T 1) - P^T diag(1 / P 1) P`` has three null vectors (the components' indicators), so the
    gauge ``c 1 1^T`` alone leaves it singular. The gradient is still the solution's: it equals the
    unrolled gradient of 300 log-domain iterations (autograd, converged here), and is exactly 0 on the
    two single-expert components (their plan is 1 whatever S does)."""
    gen = torch.Generator().manual_seed(25)
    S64, off = _block_scores(2, 1e3, gen)
    S = S64.to(dtype).requires_grad_()
    P = sinkhorn(S, 1.0, tol=1e-12 if dtype == torch.float64 else 1e-6, max_iter=10000, grad="implicit")
    assert (P[:, off] == 0).all()
    P64 = P.detach().double()
    schur = torch.diag_embed(P64.sum(-2)) - P64.mT @ (P64 / P64.sum(-1, keepdim=True))
    values = torch.linalg.eigvalsh(schur)
    assert (values[:, :3].abs() <= 1e-12).all() and (values[:, 3:] >= 1e-3).all()
    gauged = schur + P64.sum(-2).mean(-1)[:, None, None] / 4
    assert (torch.linalg.matrix_rank(gauged) == 2).all()
    G = torch.randn(S.shape, generator=gen, dtype=torch.float64)
    (got,) = torch.autograd.grad(P, S, G.to(dtype))
    S_unroll = S64.to(dtype).double().requires_grad_()
    (want,) = torch.autograd.grad(sinkhorn(S_unroll, 1.0, tol=0, max_iter=300, grad="unroll"), S_unroll, G)
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max() <= (1e-10 if dtype == torch.float64 else 1e-5)
    assert (got[:, 4:] == 0).all() and (got[:, :, 2:] == 0).all()
    assert got.abs().max() > 0.05


def test_implicit_gradient_gradcheck_moderate_scale():
    """|S| / eps of 20 to 60: links between the blocks of e^-20 to e^-60 (some below the
    pseudo-inverse's cut-off, 1e-12 of the column sums), and random scores at |S| / eps about 30."""
    gen = torch.Generator().manual_seed(26)
    S, _ = _block_scores(1, 20.0, gen)
    fn = lambda s: sinkhorn(s, 1.0, tol=1e-14, max_iter=100000, grad="implicit")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (S.requires_grad_(),), eps=1e-6, atol=1e-6, rtol=1e-5)
    S = 10 * torch.randn(2, 6, 3, generator=gen, dtype=torch.float64)
    assert torch.autograd.gradcheck(fn, (S.requires_grad_(),), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_the_plain_iterations_on_buffers_are_the_textbook_loop():
    """The scaling solver runs its plain iterations in buffers made once: the numbers of
    ``v = b / K^T u``, ``u = a / K v`` written out (to the rounding of another summation order), for
    several groups at once, and the ``u`` it starts from is left as it was."""
    from minimoe.ops.sinkhorn import _plain_iterations

    gen = torch.Generator().manual_seed(2)
    B, T, E = 3, 24, 5
    K = torch.rand(B, T, E, generator=gen) + 0.1
    a, b = torch.ones(B, T), torch.full((B, E), T / E)
    u0 = torch.rand(B, T, generator=gen) + 0.5
    u = u0.clone()
    for _ in range(7):
        v = b / torch.einsum("bt,bte->be", u, K)
        u = a / torch.einsum("bte,be->bt", K, v)
    start = u0.clone()
    got = _plain_iterations(K, u0, a, b, 7)
    torch.testing.assert_close(got, u, rtol=1e-6, atol=0)
    assert torch.equal(u0, start)
