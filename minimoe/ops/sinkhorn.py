"""The max-score entropic optimal-transport plan (Sinkhorn), batched, stable, with an exact gradient.

Book: chapter 2 (Routing as optimal transport), sections "Sinkhorn is block-coordinate descent on the
dual", "The log domain", "The semi-dual and Newton's method" and "Differentiating the plan". The plan solves

    max_P  <P, S> + eps * H(P)   subject to   P 1 = a (row sums),   P^T 1 = b (column sums),

with ``H(P) = -sum P log P``. Its closed form is ``P = exp((S + f 1^T + 1 g^T) / eps)`` for a row
potential ``f`` (one number per token) and a column potential ``g`` (one per expert); every solver
below only looks for ``f`` and ``g``. Internally the potentials are kept divided by ``eps``
(``alpha = f / eps``, ``beta = g / eps``) and the scores as the log-kernel ``L = S / eps``.

Three solvers, chosen by ``method``:

* ``"log"``: Sinkhorn's iterations in the log domain, ``alpha = log a - LSE_j(L + beta)`` then
  ``beta = log b - LSE_i(L + alpha)``. Never overflows; two exponentials per entry per iteration.
* ``"sinkhorn"``: the same iterations on scalings ``u, v`` in the exp domain against the kernel
  ``K = exp(L + alpha + beta)``, i.e. two matrix-vector products per iteration and no exponential.
  Every few iterations the scalings are absorbed into the potentials (``alpha += log u``) so that
  ``K`` is the current plan and cannot overflow; a block that would overflow or underflow anyway is
  redone in the log domain. (Schmitzer 2019's "absorption" stabilisation.)
* ``"auto"`` (default): ``"sinkhorn"``, and when that is slow (small ``eps``), Newton's method on the
  semi-dual in ``beta``. It has only E unknowns, and its Hessian ``diag(P^T 1) - P^T diag(1/a) P``
  costs one (E, T) x (T, E) product, so a Newton step costs about as much as 30--50 Sinkhorn
  iterations and converges quadratically.
"""
from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

from ._checks import check_int, check_positive_float, check_scores

METHODS = ("auto", "sinkhorn", "log")
GRADS = ("none", "implicit", "unroll")


class SinkhornResult(NamedTuple):
    """What :func:`sinkhorn` returns with ``return_potentials=True``.

    ``plan = exp((scores + f[..., :, None] + g[..., None, :]) / eps)``; ``iterations`` counts
    Sinkhorn iterations plus Newton steps; ``error`` is the largest relative marginal error of
    ``plan`` over both marginals and the whole batch.
    """

    plan: torch.Tensor
    f: torch.Tensor
    g: torch.Tensor
    iterations: int
    error: float


def sinkhorn(
    scores: torch.Tensor,
    eps: float = 1.0,
    *,
    row_sums: torch.Tensor | float | None = None,
    col_sums: torch.Tensor | float | None = None,
    max_iter: int = 1000,
    tol: float = 1e-4,
    init: torch.Tensor | None = None,
    method: str = "auto",
    grad: str = "none",
    return_potentials: bool = False,
):
    """Entropic OT plan maximising ``<P, scores> + eps * H(P)`` with the given marginals (chapter 2).

    Args:
        scores: ``(..., T, E)`` floating tensor; every leading dimension is an independent problem.
            float32 and float64 are solved in their own precision; half precisions in float32.
        eps: entropic regularisation (SSR's xi), > 0. The plan depends on ``scores / eps`` only.
        row_sums: ``a``, broadcastable to ``(..., T)``, > 0; default 1 (each token sends one unit).
        col_sums: ``b``, broadcastable to ``(..., E)``, > 0; default ``a.sum() / E`` (balanced experts).
            ``a`` and ``b`` must have the same total.
        max_iter: cap on iterations (Sinkhorn iterations plus Newton steps).
        tol: stop when the relative marginal error ``max(|P 1 - a| / a, |P^T 1 - b| / b)`` is at most
            ``tol``; ``tol=0`` runs exactly ``max_iter`` iterations (as routers with a fixed count do).
        init: a column potential ``g`` ``(..., E)`` from an earlier call (warm start).
        method: ``"auto"``, ``"sinkhorn"`` or ``"log"`` (see the module docstring); all give the same
            plan up to ``tol``.
        grad: which gradient the plan carries with respect to ``scores``:
            ``"none"`` (default): none (the plan is a constant, as in routers that only select with it);
            ``"implicit"``: the exact gradient of the *solution* of the problem, by implicit
            differentiation of its optimality conditions (an E x E linear solve per problem; chapter 2,
            "Differentiating the plan"); no gradient flows to ``row_sums`` / ``col_sums``;
            ``"unroll"``: autograd through the log-domain iterations actually run (memory grows with
            the number of iterations; the gradient of the truncated algorithm, not of the solution).
        return_potentials: return a :class:`SinkhornResult` instead of the plan alone.

    Returns:
        The plan ``(..., T, E)`` in the dtype of ``scores``, or a :class:`SinkhornResult`. If ``tol``
        is not met within ``max_iter`` a ``RuntimeWarning`` says so and the last iterate is returned.
    """
    check_scores(scores)
    eps = check_positive_float(eps, "eps")
    max_iter = check_int(max_iter, "max_iter", low=1)
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (tol >= 0 and math.isfinite(tol)):
        raise ValueError(f"tol must be a finite number >= 0, got {tol!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if grad not in GRADS:
        raise ValueError(f"grad must be one of {GRADS}, got {grad!r}")

    *batch, T, E = scores.shape
    out_dtype = scores.dtype
    dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
    S = scores.reshape(-1, T, E).to(dtype)
    B = S.shape[0]
    a = _marginal(row_sums, "row_sums", (*batch, T), B, T, S, default=1.0)
    b = _marginal(col_sums, "col_sums", (*batch, E), B, E, S, default=None, total=a.sum(-1))
    if B * T * E == 0:
        plan = torch.zeros(scores.shape, dtype=out_dtype, device=scores.device)
        if return_potentials:
            zeros = scores.new_zeros
            return SinkhornResult(plan, zeros((*batch, T)), zeros((*batch, E)), 0, 0.0)
        return plan
    beta0 = torch.zeros(B, E, dtype=dtype, device=S.device)
    if init is not None:
        check_scores(init, "init", min_dim=1)
        try:
            beta0 = init.detach().to(dtype).broadcast_to((*batch, E)).reshape(B, E) / eps
        except RuntimeError:
            raise ValueError(f"init must be a column potential of shape {(*batch, E)}, "
                             f"got shape {tuple(init.shape)}") from None

    log_a, log_b = a.log(), b.log()
    plan = None
    if grad == "unroll":
        L = S / eps
        alpha, beta, iterations, converged = _log_iterations(L, log_a, log_b, beta0, max_iter, tol)
    else:
        with torch.no_grad():
            L = S / eps
            if method == "log":
                alpha, beta, iterations, converged = _log_iterations(L, log_a, log_b, beta0, max_iter, tol)
            elif method == "sinkhorn" or tol == 0:
                alpha, beta, iterations, converged, plan = _scaling_iterations(
                    L, log_a, log_b, beta0, max_iter, tol, newton=False)
            else:
                alpha, beta, iterations, converged, plan = _eps_scaling(L, log_a, log_b, beta0, max_iter, tol)
    if plan is None:
        plan = (L + alpha[:, :, None] + beta[:, None, :]).exp()
    with torch.no_grad():
        error = _marginal_error(plan, a, b)
    if tol > 0 and not converged:
        warnings.warn(f"sinkhorn did not reach tol={tol:g} in max_iter={max_iter} iterations "
                      f"(relative marginal error {error:.3g}); raise max_iter or eps", RuntimeWarning,
                      stacklevel=2)
    if grad == "implicit" and scores.requires_grad:
        plan = _ImplicitPlan.apply(S, plan.detach(), eps)
    plan = plan.reshape(scores.shape).to(out_dtype)
    if not return_potentials:
        return plan
    f = (eps * alpha).reshape(*batch, T).to(out_dtype)
    g = (eps * beta).reshape(*batch, E).to(out_dtype)
    return SinkhornResult(plan, f, g, iterations, error)


def _marginal(value, name, shape, B, n, S, default, total=None):
    """A positive marginal of shape (B, n) in the working dtype; checks the totals match."""
    if value is None:
        if default is not None:
            return S.new_full((B, n), default)
        return (total / n)[:, None].expand(B, n).clone()
    value = torch.as_tensor(value, dtype=S.dtype, device=S.device)
    try:
        value = value.broadcast_to(shape).reshape(B, n)
    except RuntimeError:
        raise ValueError(f"{name} must broadcast to shape {shape}, got shape {tuple(value.shape)}") from None
    if not torch.isfinite(value).all() or not (value > 0).all():
        raise ValueError(f"{name} must be finite and > 0 everywhere")
    if total is not None:
        gap = (value.sum(-1) - total).abs()
        if (gap > 1e-5 * total).any():
            raise ValueError("row_sums and col_sums must have the same total (every unit a token sends "
                             f"must arrive at an expert); totals differ by up to {gap.max().item():.3g}")
    return value


def _marginal_error(plan, a, b) -> float:
    row = ((plan.sum(-1) - a).abs() / a).max()
    col = ((plan.sum(-2) - b).abs() / b).max()
    return float(torch.maximum(row, col))


def _row_update(L, beta, log_a):
    return log_a - torch.logsumexp(L + beta[:, None, :], dim=-1)


def _col_update(L, alpha, log_b):
    return log_b - torch.logsumexp(L + alpha[:, :, None], dim=-2)


CHECK_EVERY = 10
NEWTON_COST = 100  # Sinkhorn iterations one Newton step costs (about 10 ms vs 0.1 ms at T=8192, E=64, CPU)


def _log_iterations(L, log_a, log_b, beta, max_iter, tol):
    """Sinkhorn in the log domain. Each iteration: rows exact, then columns exact (ends on columns).

    After the column update the columns are exact, so only the rows can be off; their relative error
    is ``|exp(alpha - alpha_next) - 1|``, where ``alpha_next`` is the next row update (reused).
    Returns ``(alpha, beta, iterations, converged)``."""
    alpha = _row_update(L, beta, log_a)
    for it in range(1, max_iter + 1):
        beta = _col_update(L, alpha, log_b)
        alpha_next = _row_update(L, beta, log_a)
        if tol > 0 and (it % CHECK_EVERY == 0 or it == max_iter):
            if torch.expm1(alpha - alpha_next).abs().max() <= tol:
                return alpha, beta, it, True
        if it < max_iter:
            alpha = alpha_next
    return alpha, beta, max_iter, False


EPS_SCALING_START = 30.0  # largest score range within a row, in units of eps, solved directly
EPS_SCALING_FACTOR = 4.0


def _eps_scaling(L, log_a, log_b, beta, max_iter, tol):
    """``method="auto"``: when ``scores / eps`` spans more than EPS_SCALING_START within a row, first
    solve the problem at larger eps (divide ``L`` by ``m > 1``), loosely, and warm-start each smaller
    eps from the last column potential (``g = eps * m * beta`` is what carries over). At large
    ``|S| / eps`` the rows of a cold start are one-hot in floating point: Newton's Hessian vanishes
    and Sinkhorn crawls, while from a warm start both converge in a few steps."""
    spread = float((L.amax(-1) - L.amin(-1)).max())
    multipliers = []
    m = spread / EPS_SCALING_START
    while m > 1:
        multipliers.append(m)
        m /= EPS_SCALING_FACTOR
    used = 0
    previous = 1.0
    for m in multipliers:
        beta = beta * previous / m
        _, beta, its, _, _ = _scaling_iterations(L / m, log_a, log_b, beta, max(1, max_iter - used),
                                                 max(tol, 1e-3), newton=True)
        used += its
        previous = m
    beta = beta * previous
    alpha, beta, its, converged, plan = _scaling_iterations(L, log_a, log_b, beta, max(1, max_iter - used), tol,
                                                            newton=True)
    return alpha, beta, used + its, converged, plan


def _kernel(log_kernel):
    """exp, with entries below the smallest normal float set to 0: subnormal numbers make every
    later product 10-100x slower on CPUs, and entries that small carry no mass at any tolerance."""
    K = log_kernel.exp()
    return K.masked_fill_(K < torch.finfo(K.dtype).tiny, 0.0)


def _scaling_iterations(L, log_a, log_b, beta, max_iter, tol, newton):
    """Sinkhorn on exp-domain scalings with absorption; with ``newton=True``, Newton when slow.

    The kernel is ``K = exp(L + alpha + beta)`` and the plan ``diag(u) K diag(v)``. Returns
    ``(alpha, beta, iterations, converged, plan)``; ``plan`` is None when it must be recomputed."""
    a, b = log_a.exp(), log_b.exp()
    # Absorb when a scaling leaves [e^-limit, e^limit]: far inside the float range, so a block of
    # CHECK_EVERY iterations cannot overflow before it is seen.
    limit = 30.0 if L.dtype == torch.float32 else 200.0
    shifted = L + beta[:, None, :]
    alpha = -shifted.amax(-1)  # each row of K has its largest entry equal to 1: no overflow
    K = _kernel(shifted + alpha[:, :, None])
    u = torch.ones_like(alpha)
    v = torch.ones_like(beta)
    it = 0
    # tol=0 asks for exactly max_iter Sinkhorn iterations, so no Newton then
    use_newton = newton and tol > 0
    previous_error = None

    def absorb():
        nonlocal alpha, beta, K, u, v
        alpha, beta = alpha + u.log(), beta + v.log()
        K = _kernel(L + alpha[:, :, None] + beta[:, None, :])
        u, v = torch.ones_like(u), torch.ones_like(v)

    while it < max_iter:
        u_good, v_good = u, v
        steps = min(CHECK_EVERY, max_iter - it)
        for _ in range(steps):
            u = a / torch.bmm(K, v[:, :, None])[:, :, 0]
            v = b / torch.bmm(u[:, None, :], K)[:, 0, :]
        it += steps
        lu, lv = u.log(), v.log()
        underflow = not bool(torch.isfinite(lu).all() & torch.isfinite(lv).all())
        if underflow:
            # K underflowed somewhere: redo this block in the log domain from the last good scalings
            alpha, beta = alpha + u_good.log(), beta + v_good.log()
            alpha, beta, _, _ = _log_iterations(L, log_a, log_b, beta, steps, 0.0)
            u, v = torch.ones_like(u), torch.ones_like(v)
            K = _kernel(L + alpha[:, :, None] + beta[:, None, :])
            row_sums = K.sum(-1)
        else:
            row_sums = u * torch.bmm(K, v[:, :, None])[:, :, 0]
        # the columns are exact after the v update; only the rows can be off
        error = float(((row_sums - a).abs() / a).max()) if tol > 0 else float("inf")
        if error <= tol:
            plan = K * u[:, :, None] * v[:, None, :]
            return alpha + u.log(), beta + v.log(), it, True, plan
        if not underflow and max(lu.abs().max(), lv.abs().max()) > limit:
            absorb()
        # Sinkhorn converges linearly: extrapolate the error's decay over the last block. A Newton
        # step costs about as much as NEWTON_COST iterations and a few of them finish the job.
        slow = False
        if use_newton and previous_error is not None and it < max_iter:
            rate = error / previous_error
            remaining = math.inf if rate >= 1 else CHECK_EVERY * math.log(tol / error) / math.log(rate)
            slow = remaining > 3 * NEWTON_COST
        previous_error = error
        if slow:
            absorb()
            result = _newton(L, log_a, log_b, a, b, beta, max_iter - it, tol)
            if result is not None:
                alpha, beta, steps, converged = result
                return alpha, beta, it + steps, converged, None
            use_newton = False  # a Newton step failed: go on with Sinkhorn from before it
    return alpha + u.log(), beta + v.log(), it, False, K * u[:, :, None] * v[:, None, :]


def _solve_gauged(P, rows, cols, rhs):
    """Solve ``(diag(cols) - P^T diag(1/rows) P) y = rhs`` in float64, for ``rows = P 1``, ``cols = P^T 1``.

    This E x E matrix is the semi-dual Hessian (Newton) and the Schur complement of the implicit
    gradient. It is singular along ``1`` only (the gauge ``g + c 1``) and ``rhs`` is orthogonal to
    ``1``, so adding ``c 1 1^T`` for any ``c > 0`` gives the solution with ``sum(y) = 0``."""
    P = P.double()
    rows, cols = rows.double(), cols.double()
    matrix = torch.diag_embed(cols) - torch.bmm(P.transpose(1, 2), P / rows[:, :, None])
    gauge = cols.mean(-1)[:, None, None] / cols.shape[-1]
    return torch.linalg.solve(matrix + gauge, rhs.double()[:, :, None])[:, :, 0]


def _newton(L, log_a, log_b, a, b, beta, max_steps, tol):
    """Damped Newton on the semi-dual ``J(beta) = sum_i a_i LSE_j(L_ij + beta_j) - <b, beta>``.

    ``grad J = P^T 1 - b`` with rows ``P_i = a_i softmax(L_i + beta)`` (so rows are always exact), and
    ``hess J = diag(P^T 1) - P^T diag(1/a) P``. ``J`` is unchanged by ``beta + c 1``, so the Hessian
    is singular along ``1`` (see :func:`_solve_gauged`).
    Returns None when a step fails (e.g. a Hessian singular beyond the gauge in float32)."""
    lse = torch.logsumexp(L + beta[:, None, :], dim=-1)
    for step in range(1, max_steps + 1):
        P = a[:, :, None] * (L + beta[:, None, :] - lse[:, :, None]).exp()
        col = P.sum(-2)
        gradient = col - b
        if tol > 0 and bool(((gradient.abs() / b).max() <= tol)):
            return log_a - lse, beta, step - 1, True
        try:
            direction = -_solve_gauged(P, a, col, gradient)
        except RuntimeError:
            return None
        slope = (gradient.double() * direction).sum(-1)
        if not torch.isfinite(direction).all() or (slope > 0).any():
            return None
        direction = direction.to(L.dtype)
        J0 = (a * lse).double().sum(-1) - (b * beta).double().sum(-1)
        slack = 8 * torch.finfo(L.dtype).eps * ((a * lse).abs().double().sum(-1) + (b * beta).abs().double().sum(-1))
        t = torch.ones_like(slope)
        for _ in range(30):  # backtracking (Armijo), per problem of the batch
            trial = beta + t.to(L.dtype)[:, None] * direction
            lse_trial = torch.logsumexp(L + trial[:, None, :], dim=-1)
            J = (a * lse_trial).double().sum(-1) - (b * trial).double().sum(-1)
            ok = J <= J0 + 1e-4 * t * slope + slack
            if ok.all():
                break
            t = torch.where(ok, t, t / 2)
        else:
            return None
        beta, lse = trial, lse_trial
    return log_a - lse, beta, max_steps, False


class _ImplicitPlan(torch.autograd.Function):
    """Gradient of the converged plan with respect to the scores (chapter 2, "Differentiating the plan").

    With ``P = exp((S + f 1^T + 1 g^T)/eps)`` and the marginals held fixed, a change ``dS`` moves the
    potentials so that ``dP 1 = 0`` and ``dP^T 1 = 0``. For an upstream gradient ``G`` and ``Q = G * P``
    the vector-Jacobian product is ``(Q - P * (x 1^T + 1 y^T)) / eps`` where ``(x, y)`` solves

        [diag(P 1)   P        ] [x]   [Q 1  ]
        [P^T         diag(P^T 1)] [y] = [Q^T 1],

    done through its E x E Schur complement ``(diag(P^T 1) - P^T diag(1/P 1) P) y = Q^T 1 - P^T (Q 1 / P 1)``,
    which is singular along ``1`` only (the gauge), like the Newton system above.
    """

    @staticmethod
    def forward(ctx, scores, plan, eps):
        ctx.save_for_backward(plan)
        ctx.eps = eps
        return plan.clone()

    @staticmethod
    def backward(ctx, grad_plan):
        (P,) = ctx.saved_tensors
        P64 = P.double()
        Q = grad_plan.double() * P64
        rows, cols = P64.sum(-1), P64.sum(-2)
        Q_rows, Q_cols = Q.sum(-1), Q.sum(-2)
        rhs = Q_cols - torch.bmm(P64.transpose(1, 2), (Q_rows / rows)[:, :, None])[:, :, 0]
        y = _solve_gauged(P64, rows, cols, rhs)
        x = (Q_rows - torch.bmm(P64, y[:, :, None])[:, :, 0]) / rows
        grad_scores = (Q - P64 * (x[:, :, None] + y[:, None, :])) / ctx.eps
        return grad_scores.to(grad_plan.dtype), None, None
