"""The max-score entropic optimal-transport plan (Sinkhorn), batched, stable, with an exact gradient.

Book: chapter 2 (Routing as optimal transport), sections "Sinkhorn is block-coordinate descent on the
dual", "The log domain", "Over-relaxation", "The semi-dual and Newton's method" and "Differentiating
the plan". The plan solves

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
* ``"auto"`` (default): ``"sinkhorn"`` over-relaxed, ``u <- u^(1-w) (a / Kv)^w`` with the factor
  ``w = 2 / (1 + sqrt(1 - r))`` of successive over-relaxation for the measured rate ``r`` (back to
  ``w = 1`` if the error ever grows); when even that is slow (small ``eps``), Newton's method on the
  semi-dual in ``beta``. It has only E unknowns, and its Hessian ``diag(P^T 1) - P^T diag(1/a) P``
  costs one (E, T) x (T, E) product, so a Newton step costs about as much as NEWTON_COST Sinkhorn
  iterations and converges quadratically. When ``scores / eps`` spans more than EPS_SCALING_START
  within a row, it first solves at larger ``eps`` and warm-starts (eps-scaling).
"""
from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

from ._checks import check_bool, check_int, check_positive_float, check_scores, score_range

METHODS = ("auto", "sinkhorn", "log")
GRADS = ("none", "implicit", "unroll")
LAST_UPDATES = ("columns", "rows")


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
    last_update: str = "columns",
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
        last_update: ``"columns"`` (default): the plan as the solver leaves it, which for plain
            Sinkhorn iterations means after a column update (every expert's column sum exact, the
            rows off by what is left of the error); ``"rows"``: one more row update at the end, so
            every token's row sums exactly to ``row_sums`` and the columns carry the error, as OTT's
            Sinkhorn (and so V-MoE's routers) end. At convergence the two agree up to ``tol``.
        return_potentials: return a :class:`SinkhornResult` instead of the plan alone.

    Returns:
        The plan ``(..., T, E)`` in the dtype of ``scores``, or a :class:`SinkhornResult`. If ``tol``
        is not met within ``max_iter`` a ``RuntimeWarning`` says so and the last iterate is returned.

    Under ``torch.compile`` (the compiled form): ``max_iter`` log-domain iterations, always, since a
    stopping test or a choice of method by the scores' range would read the host; ``tol`` is not
    tested (the plan is at least as close to the marginals as the eager one), no warning is given,
    and the result's ``error`` is a 0-dim tensor. The finiteness of ``scores`` is asserted on the device.
    """
    compiling = torch.compiler.is_compiling()
    if compiling:
        check_scores(scores)
        low = high = 0.0
    else:
        low, high = score_range(scores)
    eps = check_positive_float(eps, "eps")
    max_iter = check_int(max_iter, "max_iter", low=1)
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (tol >= 0 and math.isfinite(tol)):
        raise ValueError(f"tol must be a finite number >= 0, got {tol!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if grad not in GRADS:
        raise ValueError(f"grad must be one of {GRADS}, got {grad!r}")
    return_potentials = check_bool(return_potentials, "return_potentials")
    if last_update not in LAST_UPDATES:
        raise ValueError(f"last_update must be one of {LAST_UPDATES}, got {last_update!r}")

    *batch, T, E = scores.shape
    if E == 0 and T > 0 and math.prod(batch) > 0:
        raise ValueError(f"scores has shape {tuple(scores.shape)}: {T} tokens and no expert, so no plan can give "
                         "each token's row its mass (rows must sum to row_sums); give at least one expert")
    out_dtype = scores.dtype
    dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
    B = math.prod(batch)  # not reshape(-1, ...): that cannot infer -1 for an empty tensor
    S = scores.reshape(B, T, E).to(dtype)
    a = _marginal(row_sums, "row_sums", (*batch, T), B, T, S, default=1.0, checked=compiling)
    b = _marginal(col_sums, "col_sums", (*batch, E), B, E, S, default=None, total=a.sum(-1), checked=compiling)
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
    plan, error = None, None
    spread = (high - low) / eps  # bounds the range of scores / eps within any row
    if not compiling and not (max(abs(low), abs(high)) / eps < torch.finfo(dtype).max and math.isfinite(spread)):
        # L = scores / eps would overflow the working dtype: no plan can be computed from it
        raise ValueError(f"scores / eps overflows {dtype} (scores in [{low:.3g}, {high:.3g}], eps={eps:.3g}): "
                         "raise eps or scale the scores down")
    if grad == "unroll" or compiling:
        L = (S if grad == "unroll" else S.detach()) / eps
        with torch.set_grad_enabled(grad == "unroll" and torch.is_grad_enabled()):
            alpha, beta, iterations, converged = _log_iterations(L, log_a, log_b, beta0, max_iter,
                                                                 0.0 if compiling else tol)
    else:
        with torch.no_grad():
            L = S if eps == 1.0 else S / eps
            if method == "log":
                alpha, beta, iterations, converged = _log_iterations(L, log_a, log_b, beta0, max_iter, tol)
            elif method == "sinkhorn" or tol == 0:
                alpha, beta, iterations, converged, plan, error = _scaling_iterations(
                    L, log_a, log_b, beta0, max_iter, tol, accelerate=False, spread=spread, cold=init is None,
                    last_update=last_update)
            else:
                alpha, beta, iterations, converged, plan, error = _eps_scaling(
                    L, log_a, log_b, beta0, max_iter, tol, spread, cold=init is None, last_update=last_update)
    rows_done = plan is not None and last_update == "rows"  # the scaling solver ended on the row update
    if plan is None:
        plan = (L + alpha[:, :, None] + beta[:, None, :]).exp()
    if last_update == "rows" and not rows_done:
        # one more row update: diag(a / P 1) P, i.e. alpha += log(a / P 1) (rows with no mass stay)
        rows = plan.sum(-1)
        scale = torch.where(rows > 0, a / rows, torch.ones_like(rows))
        plan = plan * scale[:, :, None]
        alpha = alpha + scale.log()
        error = None
    if error is None:
        with torch.no_grad():
            error = _marginal_error(plan, a, b, as_tensor=compiling)
    if tol > 0 and not converged and not compiling:
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


def _marginal(value, name, shape, B, n, S, default, total=None, checked=False):
    """A positive marginal of shape (B, n) in the working dtype; checks the totals match (unless
    ``checked``: under compilation, where the checks would read the host)."""
    if value is None:
        if default is not None:
            return S.new_full((B, n), default)
        return (total / n)[:, None].expand(B, n).clone()
    value = torch.as_tensor(value, dtype=S.dtype, device=S.device)
    try:
        value = value.broadcast_to(shape).reshape(B, n)
    except RuntimeError:
        raise ValueError(f"{name} must broadcast to shape {shape}, got shape {tuple(value.shape)}") from None
    if checked:
        return value
    if not torch.isfinite(value).all() or not (value > 0).all():
        raise ValueError(f"{name} must be finite and > 0 everywhere")
    if total is not None:
        gap = (value.sum(-1) - total).abs()
        if (gap > 1e-5 * total).any():
            raise ValueError("row_sums and col_sums must have the same total (every unit a token sends "
                             f"must arrive at an expert); totals differ by up to {gap.max().item():.3g}")
    return value


def _marginal_error(plan, a, b, as_tensor=False):
    row = ((plan.sum(-1) - a).abs() / a).max()
    col = ((plan.sum(-2) - b).abs() / b).max()
    error = torch.maximum(row, col)
    return error if as_tensor else float(error)


def row_update(L, beta, log_a):
    """One Sinkhorn row step in the log domain (chapter 2, "Sinkhorn's algorithm"): the row potentials
    ``alpha = log a - logsumexp_e(L + beta)`` for the kernel ``L = scores / eps`` ``(B, T, E)``."""
    return log_a - torch.logsumexp(L + beta[:, None, :], dim=-1)


def col_update(L, alpha, log_b):
    """One Sinkhorn column step: ``beta = log b - logsumexp_t(L + alpha)``."""
    return log_b - torch.logsumexp(L + alpha[:, :, None], dim=-2)


CHECK_EVERY = 10
NEWTON_COST = 100  # Sinkhorn iterations one Newton step costs (about 10 ms vs 0.1 ms at T=8192, E=64, CPU)


def _log_iterations(L, log_a, log_b, beta, max_iter, tol):
    """Sinkhorn in the log domain. Each iteration: rows exact, then columns exact (ends on columns).

    After the column update the columns are exact, so only the rows can be off; their relative error
    is ``|exp(alpha - alpha_next) - 1|``, where ``alpha_next`` is the next row update (reused).
    Returns ``(alpha, beta, iterations, converged)``."""
    alpha = row_update(L, beta, log_a)
    for it in range(1, max_iter + 1):
        beta = col_update(L, alpha, log_b)
        alpha_next = row_update(L, beta, log_a)
        if tol > 0 and (it % CHECK_EVERY == 0 or it == max_iter):
            if torch.expm1(alpha - alpha_next).abs().max() <= tol:
                return alpha, beta, it, True
        if it < max_iter:
            alpha = alpha_next
    return alpha, beta, max_iter, False


EPS_SCALING_START = 100.0  # largest score range within a row, in units of eps, solved directly
EPS_SCALING_FACTOR = 4.0


def _eps_scaling(L, log_a, log_b, beta, max_iter, tol, spread, cold, last_update="columns"):
    """``method="auto"``: when ``scores / eps`` spans more than EPS_SCALING_START within a row, first
    solve the problem at larger eps (divide ``L`` by ``m > 1``), loosely, and warm-start each smaller
    eps from the last column potential (``g = eps * m * beta`` is what carries over). At large
    ``|S| / eps`` the rows of a cold start are one-hot in floating point: Newton's Hessian vanishes
    and Sinkhorn crawls, while from a warm start both converge in a few steps.
    ``spread`` is an upper bound on the range of ``L`` within a row (the range over all entries)."""
    if spread > EPS_SCALING_START:  # the bound was loose: measure it row by row (in float64: no overflow)
        spread = float((L.amax(-1).double() - L.amin(-1).double()).max())
    # (finite: sinkhorn checked the range) one stage per factor EPS_SCALING_FACTOR of the range: at most
    # about 510 stages in float64

    multipliers = []
    m = spread / EPS_SCALING_START
    while m > 1:
        multipliers.append(m)
        m /= EPS_SCALING_FACTOR
    used = 0
    previous = 1.0
    for m in multipliers:
        beta = beta * previous / m
        _, beta, its, _, _, _ = _scaling_iterations(L / m, log_a, log_b, beta, max(1, max_iter - used),
                                                    max(tol, 1e-3), accelerate=True, spread=spread / m, cold=cold)
        cold = False
        used += its
        previous = m
    beta = beta * previous
    alpha, beta, its, converged, plan, error = _scaling_iterations(
        L, log_a, log_b, beta, max(1, max_iter - used), tol, accelerate=True, spread=spread, cold=cold,
        last_update=last_update)
    return alpha, beta, used + its, converged, plan, error


# exp(x) is subnormal (or 0) below this: subnormal numbers make every later product 10-100x slower
# on CPUs, and entries that small carry no mass at any tolerance, so kernels set them to 0.
SUBNORMAL_BELOW = {torch.float32: math.log(torch.finfo(torch.float32).tiny),
                   torch.float64: math.log(torch.finfo(torch.float64).tiny)}


def _kernel(log_kernel, lowest=-math.inf):
    """``exp(log_kernel)`` in place, with subnormal entries set to 0; ``lowest`` is a lower bound on
    ``log_kernel`` that lets us skip that pass when nothing can be subnormal."""
    K = log_kernel.exp_()
    if lowest < SUBNORMAL_BELOW[K.dtype] + 1:
        K.masked_fill_(K < torch.finfo(K.dtype).tiny, 0.0)
    return K


MAX_RELAXATION = 1.8


def _scaling_iterations(L, log_a, log_b, beta, max_iter, tol, accelerate, spread=math.inf, cold=False,
                        last_update="columns"):
    """Sinkhorn on exp-domain scalings with absorption; with ``accelerate=True``, over-relaxed, and
    Newton when even that is slow.

    The kernel is ``K = exp(L + alpha + beta)`` and the plan ``diag(u) K diag(v)``. ``spread`` bounds
    the range of ``L`` within a row; ``cold`` says ``beta`` is 0. With ``last_update="rows"`` the
    returned plan ends on a row update (its rows exact). Returns
    ``(alpha, beta, iterations, converged, plan, error)``; ``plan`` and ``error`` are None when they
    must be recomputed.

    The plan's marginals are read from the scalings, not from a pass over the plan: after the column
    update ``v = b / (K^T u)`` its column sums are ``b``, and its row sums are ``u * (K v)``, where
    ``K v`` is the next row update's own product. Ending on the row update instead, the plan is
    ``diag(u') K diag(v)`` with ``u' = a / (K v)``, its rows are ``a`` and its columns
    ``v * (K^T u')``: one more matrix-vector product, against the three passes over the T x E plan
    that summing its rows, rescaling them and summing them again would cost. Both agree with sums
    over the plan itself up to float rounding (tests/test_sinkhorn.py)."""
    a, b = log_a.exp(), log_b.exp()
    # Absorb when a scaling leaves [e^-limit, e^limit]: far inside the float range, so the
    # iterations between two checks cannot overflow before it is seen.
    limit = 30.0 if L.dtype == torch.float32 else 200.0
    # each row of K has its largest entry equal to 1, so K cannot overflow
    if cold:  # beta = 0: L + alpha in one pass (L + 0 + alpha is the same number)
        alpha = -L.amax(-1)
        K = L + alpha[:, :, None]
    else:
        K = L + beta[:, None, :]
        alpha = -K.amax(-1)
        K.add_(alpha[:, :, None])
    K = _kernel(K, lowest=-(spread + float(beta.amax() - beta.amin())))
    v = torch.ones_like(beta)
    u = a / torch.bmm(K, v[:, :, None])[:, :, 0]
    it = 0
    # tol=0 asks for exactly max_iter Sinkhorn iterations, so no Newton and no over-relaxation then
    use_newton = accelerate and tol > 0
    relax = 1.0  # over-relaxation factor (chapter 2, "Over-relaxation"); set once the rate is known
    may_relax = accelerate  # cleared for good by the safeguard
    good_u, good_v, good_it = u, v, 0  # scalings at the last check, where nothing had underflowed
    previous_error, previous_it = None, 0
    next_check = min(2 if tol > 0 else CHECK_EVERY, max_iter)

    def absorb(u, v):
        nonlocal alpha, beta, K
        alpha, beta = alpha + u.log(), beta + v.log()
        K = _kernel(L + alpha[:, :, None] + beta[:, None, :])

    while True:
        # One iteration: the column update, then the row update. The iteration before a check
        # updates the columns exactly, so that only the rows can be off there; the row sums of
        # diag(u) K diag(v) are u * (K v) = a * u / u_exact, so their error comes free with the
        # next row update.
        if relax == 1.0 and next_check - it > 1:  # the plain iterations up to the check, in one go
            u = _plain_iterations(K, u, a, b, next_check - it - 1)
            it = next_check - 1
        it += 1
        v_exact = b / torch.bmm(u[:, None, :], K)[:, 0, :]
        v = v_exact if relax == 1.0 or it == next_check else v * (v_exact / v).pow_(relax)
        u_exact = a / torch.bmm(K, v[:, :, None])[:, :, 0]
        if it < next_check:
            u = u_exact if relax == 1.0 else u * (u_exact / u).pow_(relax)
            continue
        ratio = u / u_exact
        stats = torch.stack([*torch.aminmax(ratio), *torch.aminmax(u_exact), *torch.aminmax(v)]).tolist()
        ratio_low, ratio_high, u_low, u_high, v_low, v_high = stats
        underflow = not (ratio_low > 0 and ratio_high < math.inf and v_low > 0 and v_high < math.inf)
        if underflow:
            # K underflowed somewhere: redo the iterations since the last check in the log domain
            alpha, beta = alpha + good_u.log(), beta + good_v.log()
            alpha, beta, _, _ = _log_iterations(L, log_a, log_b, beta, it - good_it, 0.0)
            K = _kernel(L + alpha[:, :, None] + beta[:, None, :])
            u, v = torch.ones_like(u), torch.ones_like(v)
            good_u, good_v, good_it = u, v, it
            relax = 1.0
            next_check = min(it + 1, max_iter)
            if it >= max_iter:  # the plan from the potentials (and the row update, if asked) by the caller
                return alpha, beta, it, False, None, None
            continue
        # the row sums of diag(u) K diag(v) over a are u / u_exact = ratio; its columns are exact
        error = max(ratio_high - 1, 1 - ratio_low)
        if (tol > 0 and error <= tol) or it >= max_iter:  # tol = 0: exactly max_iter iterations
            converged = tol > 0 and error <= tol
            if last_update == "rows":  # end on the row update: rows exact, the columns carry the error
                u = u_exact
                columns = v * torch.bmm(u[:, None, :], K)[:, 0, :]
                error = float(((columns - b).abs() / b).max())
            plan = K.mul_(u[:, :, None]).mul_(v[:, None, :])
            return alpha + u.log(), beta + v.log(), it, converged, plan, error
        u = u_exact if relax == 1.0 else u * (u_exact / u).pow_(relax)
        good_u, good_v, good_it = u, v, it
        if max(-math.log(min(u_low, v_low)), math.log(max(u_high, v_high))) > limit:
            absorb(u, v)
            u, v = torch.ones_like(u), torch.ones_like(v)
            good_u, good_v = u, v
        # Sinkhorn converges linearly: extrapolate the error's decay per iteration, check again when
        # it should be met, and switch to Newton (which costs NEWTON_COST iterations a step and needs
        # a few steps) when that is far away.
        gap = CHECK_EVERY
        if tol > 0 and previous_error is not None:
            rate = (error / previous_error) ** (1 / (it - previous_it)) if previous_error > 0 else 0.0
            if may_relax and relax == 1.0 and rate < 1:
                # successive over-relaxation's best factor for a Gauss-Seidel rate ``rate``
                relax = min(MAX_RELAXATION, 2 / (1 + math.sqrt(1 - rate)))
            elif relax > 1.0 and rate >= 1:
                relax, may_relax = 1.0, False  # the safeguard: plain Sinkhorn always converges
            remaining = math.inf if rate >= 1 else (math.log(tol / error) / math.log(rate) if rate > 0 else 1)
            gap = CHECK_EVERY if remaining >= CHECK_EVERY else max(1, math.ceil(remaining))
            if use_newton and remaining > 3 * NEWTON_COST:
                absorb(u, v)
                result = _newton(L, log_a, log_b, a, b, beta, max_iter - it, tol)
                if result is not None:
                    # the plan is recomputed from the potentials, and in float32 that rounding can
                    # move its marginals by more than Newton's error at large |scores| / eps: the
                    # caller measures the error on the plan itself
                    alpha, beta, steps, converged = result
                    return alpha, beta, it + steps, converged, None, None
                use_newton = False  # a Newton step failed: go on with Sinkhorn from before it
                u, v = torch.ones_like(u), torch.ones_like(v)
                good_u, good_v = u, v
        elif tol > 0:
            gap = 2
        previous_error, previous_it = error, it
        next_check = min(it + gap, max_iter)


def _plain_iterations(K, u, a, b, n):
    """``n`` plain Sinkhorn iterations on the scalings, ``v = b / (K^T u)`` then ``u = a / (K v)``, from
    ``u (B, T)``; returns the last ``u``. The same arithmetic as the loop of :func:`_scaling_iterations`,
    written into buffers made once: four operations an iteration instead of eight, which is most of the
    cost when the groups are small (32 tokens, 8 experts: each operation is a few microseconds of
    dispatch for a few hundred numbers)."""
    B, T, E = K.shape
    u = u.clone()  # written in place
    v = u.new_empty(B, E)
    column_sums, row_sums = u.new_empty(B, 1, E), u.new_empty(B, T, 1)
    u_row, v_row, v_column, b_row, row_sums_flat = u.view(B, 1, T), v.view(B, 1, E), v.view(B, E, 1), \
        b.view(B, 1, E), row_sums.view(B, T)
    for _ in range(n):
        torch.bmm(u_row, K, out=column_sums)
        torch.div(b_row, column_sums, out=v_row)
        torch.bmm(K, v_column, out=row_sums)
        torch.div(a, row_sums_flat, out=u)
    return u


def _solve_gauged(P, rows, cols, rhs, singular=False, rtol=1e-12):
    """Solve ``(diag(cols) - P^T diag(1/rows) P) y = rhs`` in float64, for ``rows = P 1``, ``cols = P^T 1``.

    This E x E matrix is the semi-dual Hessian (Newton) and the Schur complement of the implicit
    gradient: the Laplacian of the experts weighted by ``W = P^T diag(1/rows) P`` (its rows sum to
    ``cols``), so symmetric PSD with one null vector per connected component of the support of ``P``
    (bipartite, tokens to experts). A plan with no zero entries is connected: singular along ``1``
    only (the gauge ``g + c 1``), and ``rhs`` is orthogonal to ``1``, so adding ``c 1 1^T`` for any
    ``c > 0`` gives the solution with ``sum(y) = 0``.

    With ``singular=True`` (the implicit gradient) any support is allowed: at large ``|S| / eps``
    entries underflow to 0 and cut it into components, and ``linalg.solve`` fails (or rounds away
    links far weaker than the gauge). ``rhs`` must then be orthogonal to every component's indicator,
    and ``y`` is the pseudo-inverse's solution, by ``eigh``, with eigenvalues below ``rtol`` times the
    largest column sum taken as 0 (links that weak count as cut): far above eigh's rounding, a link
    that weak moves the gradient by about as little, and ``y`` stays small enough that ``x_i + y_j``
    does not cancel (``rhs`` is orthogonal to the near-null vectors only up to its rounding, about
    1e-16 of ``Q``). Empty rows and columns are allowed."""
    P = P.double()
    rows, cols = rows.double(), cols.double()
    if not singular:
        matrix = torch.diag_embed(cols) - torch.bmm(P.transpose(1, 2), P / rows[:, :, None])
        gauge = cols.mean(-1)[:, None, None] / cols.shape[-1]
        return torch.linalg.solve(matrix + gauge, rhs.double()[:, :, None])[:, :, 0]
    rows = torch.where(rows > 0, rows, 1.0)  # an empty row has P = 0: any positive value will do
    # the Laplacian from its off-diagonal weights alone (cols = the weights' row sums): diag(cols)
    # minus W would cancel to rounding of cols (about 1e-16 T / E) where the links are weak
    weights = torch.bmm(P.transpose(1, 2), P / rows[:, :, None])
    weights = weights * (1 - torch.eye(weights.shape[-1], dtype=weights.dtype, device=weights.device))
    matrix = torch.diag_embed(weights.sum(-1)) - weights
    values, vectors = torch.linalg.eigh(matrix)  # ascending; 0 up to rounding on the null space
    keep = values > rtol * cols.amax(-1, keepdim=True)
    inverse = torch.where(keep, 1 / torch.where(keep, values, 1.0), 0.0)
    coefficients = torch.bmm(vectors.transpose(1, 2), rhs.double()[:, :, None])[:, :, 0] * inverse
    return torch.bmm(vectors, coefficients[:, :, None])[:, :, 0]


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
    which is singular along ``1`` (the gauge), like the Newton system above, and along one more vector
    per extra connected component of the support of ``P``: at large ``|S| / eps`` many entries underflow
    to 0 and cut it (``x = 1`` on a component's rows, ``y = -1`` on its columns, is a null vector of the
    full system). The system stays consistent (``Q`` has the support of ``P``, so the right side is
    orthogonal to every null vector) and ``x_i + y_j`` is the same for every solution wherever
    ``P_ij > 0``, so any solution gives the exact gradient: :func:`_solve_gauged` finds one by
    pseudo-inverse. Empty rows and columns get a zero gradient.
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
        rows = torch.where(rows > 0, rows, 1.0)  # an empty row: Q_rows = 0 there, so x = 0
        Q_rows, Q_cols = Q.sum(-1), Q.sum(-2)
        rhs = Q_cols - torch.bmm(P64.transpose(1, 2), (Q_rows / rows)[:, :, None])[:, :, 0]
        y = _solve_gauged(P64, rows, cols, rhs, singular=True)
        x = (Q_rows - torch.bmm(P64, y[:, :, None])[:, :, 0]) / rows
        grad_scores = (Q - P64 * (x[:, :, None] + y[:, None, :])) / ctx.eps
        return grad_scores.to(grad_plan.dtype), None, None
