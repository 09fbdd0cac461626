"""Sparsity-constrained optimal transport: the plan behind the sparsity-constrained Expert Choice router.

Book: chapter 4 (Six routers, one formulation), sections "The sparsity-constrained problem", "The
semi-dual" and "The solver". Liu et al. (2024, Routers in Vision MoE, eq. 9), after Liu, Puigcerver
& Blondel (2023), allocate with

    max_P  <P, U> - (gamma / 2) ||P||_F^2   subject to   P >= 0,   P 1 = 1 (rows),
                                                         P^T 1 = (T/E) 1 (columns),
                                                         ||P[:, r]||_0 <= C for every expert r,

for a utility ``U (T, E)`` (the router's softmax; the paper fixes ``gamma = 1``). The l0 cap makes the
problem non-convex, so the row constraint is dualised with one price ``alpha_t`` per token. The
*semi-dual*

    h(alpha) = sum_t alpha_t + sum_r max_{pi in B} <pi, U[:, r] - alpha> - (gamma / 2) ||pi||^2,
    B = {pi >= 0, sum pi = T/E, ||pi||_0 <= C},

is convex, and ``h(alpha)`` is at least the optimum of (9) for every ``alpha`` (weak duality). The inner
maximum is a Euclidean projection onto the sparse simplex, ``pi_r = beta * Proj((U[:, r] - alpha) /
(gamma * beta))`` with ``beta = T/E`` (:func:`sparse_simplex_projection`), and ``grad h = 1 - P 1``.
Reading the plan off any ``alpha`` gives columns that are *exact* (mass ``T/E``, at most ``C``
nonzeros); the rows are exact only where the gradient vanishes, which the non-smooth ``h`` need not
allow. Two solvers minimise ``h`` from ``alpha = 0``, both Adam on ``grad h``:

* ``"adam"``: learning rate 1e-2, 20 steps, the last iterate: the authors' released code (V-MoE).
  Cheap and rough: on softmax utilities (``gamma = 1``) the rows are typically 10-40% off after 20
  steps. Its steps ignore the scale of ``U``, so it fails away from it: rows off by 1.5-1.8 on
  average for ``U = 1e3 * randn`` or ``1e4 * randn``, by about 1 for ``1e-3 * randn`` or a nearly
  uniform softmax when ``C < T``; no learning rate rescues 20 constant steps at ``1e3 * randn``.
* ``"annealed"``: learning rate ``lr * scale / (1 + step / 10)`` with ``lr = 3e-2`` and ``scale =
  s + min(s, gamma)`` for the spread ``s = max(U) - min(U)`` (the prices move on the scale of ``s``;
  ``gamma`` if ``s = 0``), 100 steps, and the iterate whose plan has the smallest mean row error.
  ``h`` is convex but not smooth: its gradient jumps whenever a column's C-th and (C+1)-th entries
  swap, and the minimiser typically sits on such a kink. A constant step then circles the minimiser
  for ever, and Newton or quasi-Newton steps stall on the kinks (we tried a damped semismooth Newton
  method and POT's L-BFGS-B: neither reached smaller row errors, at several times the cost); a step
  size that decays like 1/t (with a divergent sum) is what subgradient theory asks for. Keeping the
  best iterate is a primal-recovery rule: every iterate gives exact columns, so we return the one
  whose rows are closest to 1. Its ``h`` still bounds (9).
  *Continuation* once ``s > 30 gamma``: as ``U / gamma`` grows the plan tends to the sparse linear
  OT plan, and the decaying step needs some ``s / gamma`` steps to shrink to the resolution the
  prices need (100 steps leave rows 0.35 off at ``1e3 * randn (64, 8)``, 1.6 at ``1e4``). The
  solver then runs its steps at ``gamma_j = gamma * 10^j`` for ``j = J, ..., 0`` (``J`` the smallest
  with ``30 gamma_J >= s``), each stage from the best prices of the one before with ``scale = 10
  gamma_j``, as epsilon-scaling does for auctions: 100 steps a stage, 400-500 at ``1e3-1e4 * randn``,
  and the rows come within 0.02 on average.

Never silent: :func:`sparsity_constrained_plan` warns (``RuntimeWarning``: row error, spread, remedy)
when the mean ``|P 1 - 1|`` of its plan exceeds 1, a whole token's mass: the solver has failed.
"adam" on the router's softmax stays below (0.07-0.34 measured at the initialisation of an
``nn.Linear`` gate, T/E = 196/32 the worst; 0.04-0.28 for logits of std 1-10; 0.46-0.75 in training
on the toy vision task, 16 tokens and C = 2) unless the softmax is nearly uniform (logits of std 0.1
or less); the failures above are 1.1-1.8. The router reports the error of every call in
``routing.stats["plan_row_error"]``.

Limits: with ``capacity >= T`` the l0 cap is void and (9) is plain quadratically regularised OT
(Blondel, Seguy & Rolet 2018): ``h`` is smooth and the rows are exact at its minimum. With
``capacity = T/E`` (E divides T) a column can only hold its ``T/E`` units as ``T/E`` entries equal to 1,
so the feasible plans are exactly the binary balanced assignments, and (9) is the balanced assignment
problem ``max <P, U>`` (``||P||^2 = T`` is constant). A feasible plan exists iff
``E * capacity >= T + E - gcd(T, E)`` (book, Proposition 4.4): ``capacity >= T/E`` is necessary (rows of 1
and ``P >= 0`` force entries ``<= 1``) but not sufficient (T=5, E=3 needs 3). Below that
:func:`sparsity_constrained_plan` raises ``ValueError`` naming :func:`smallest_feasible_capacity`.
"""
from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

from ._checks import check_int, check_positive_float, check_scores, reads_are_free

METHODS = ("adam", "annealed")
DEFAULT_ITERS = {"adam": 20, "annealed": 100}
DEFAULT_LR = {"adam": 1e-2, "annealed": 3e-2}


class SparseOTResult(NamedTuple):
    """What :func:`sparsity_constrained_plan` returns with ``return_info=True``.

    ``plan (..., T, E)`` is read off the potentials ``alpha (..., T)``; ``value (...)`` is the semi-dual
    ``h(alpha)`` (an upper bound on the optimum of eq. 9); ``iterations`` counts solver steps;
    ``row_error`` and ``max_row_error`` are the mean and the largest ``|P 1 - 1|`` over all tokens of
    the batch (the columns are exact by construction).
    """

    plan: torch.Tensor
    alpha: torch.Tensor
    value: torch.Tensor
    iterations: int
    row_error: float
    max_row_error: float


def _working_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _project(values: torch.Tensor, keep: int, total: float, scale: float = 1.0) -> torch.Tensor:
    """Projection of each vector along the last dim onto ``{p >= 0, sum p = total, ||p||_0 <= keep}``,
    for ``1 <= keep <= values.shape[-1]``, times ``scale``; no argument checks."""
    return _dense(*_project_kept(values, keep, total, scale), values)


def _dense(kept, index, like):
    """The entries ``kept`` at ``index`` (last dim) in zeros of the shape of ``like``: a contiguous
    result (as an out-of-place scatter returns), written in place, so that the later sums over the
    last dim run in the same order whatever the layout of ``like``."""
    return like.new_zeros(like.shape).scatter_(-1, index, kept)


def _project_kept(values, keep, total, scale=1.0, divide=1.0):
    """:func:`_project` of ``values / divide`` as its ``keep`` entries that may be nonzero: ``(kept,
    index)``, both ``(..., keep)``. Dividing the selected entries only gives the same numbers as
    dividing all of them first (``divide > 0`` keeps the order; two entries that only the division
    rounds to equal can be selected the other way round at the cut, with the same values)."""
    top, index = values.topk(keep, dim=-1)  # sorted, largest first
    if divide != 1.0:
        top = top / divide
    # The projection ignores a common shift of the entries: measuring them from the largest keeps
    # the total from vanishing in rounding next to large values.
    top = top - top[..., :1]
    excess = top.cumsum(-1) - total
    rank = torch.arange(1, keep + 1, dtype=values.dtype, device=values.device)
    # Simplex projection of the kept entries: p = max(v - theta, 0). For sorted v the entries that
    # stay positive are a prefix, those with v_j > (cumsum_j - total) / j; the first always does.
    size = (top * rank > excess).sum(-1, keepdim=True)
    theta = excess.gather(-1, size - 1) / size
    kept = (top - theta).clamp_min(0)
    if scale != 1.0:  # on the kept entries only: scale * 0 is 0, so the same numbers as scaling p
        kept = kept * scale
    return kept, index


def sparse_simplex_projection(values: torch.Tensor, max_nonzeros: int, *, total: float = 1.0) -> torch.Tensor:
    """Euclidean projection of each vector along the last dim onto the sparse simplex (exact).

    Solves ``min ||p - v||  s.t.  p >= 0, sum p = total, ||p||_0 <= max_nonzeros``. Kyrillidis et al.
    (2013) show that keeping the ``max_nonzeros`` largest entries and projecting them onto the simplex
    is optimal; cost O(n + k log k) per vector. The inner step of the semi-dual of Liu et al. eq. (9).
    Book: chapter 4, section "Projection onto the sparse simplex".

    Args:
        values: ``(..., n)`` floating tensor, n >= 1; leading dims are independent vectors.
        max_nonzeros: ``k >= 1``; ``k >= n`` is the ordinary simplex projection.
        total: the mass ``> 0`` the projection must carry.

    Returns:
        ``(..., n)`` in the dtype of ``values``. Ties at the k-th place are broken as ``torch.topk``
        breaks them (every choice gives the same distance).
    """
    check_scores(values, "values", min_dim=1)
    max_nonzeros = check_int(max_nonzeros, "max_nonzeros", low=1)
    total = check_positive_float(total, "total")
    n = values.shape[-1]
    if n == 0:
        raise ValueError("values must have at least one entry along the last dim (nothing can carry the total)")
    dtype = _working_dtype(values.dtype)
    return _project(values.to(dtype), min(max_nonzeros, n), total).to(values.dtype)


def smallest_feasible_capacity(tokens: int, experts: int) -> int:
    """The smallest ``C`` for which eq. (9) has a feasible plan: ``ceil((T + E - gcd(T, E)) / E)``.

    Book: chapter 4, Proposition 4.4. The support of a feasible plan has at most ``gcd(T, E)``
    connected components (each must hold a whole number of tokens, ``T/E`` per expert), hence at
    least ``T + E - gcd(T, E)`` nonzeros, and the north-west corner rule attains the bound.
    """
    tokens = check_int(tokens, "tokens", low=1)
    experts = check_int(experts, "experts", low=1)
    return -(-(tokens + experts - math.gcd(tokens, experts)) // experts)


def _check_problem(utility, capacity, gamma):
    check_scores(utility, "utility")
    *_, T, E = utility.shape
    if T == 0 or E == 0:
        raise ValueError(f"utility must have at least one token and one expert, got shape {tuple(utility.shape)}")
    capacity = check_int(capacity, "capacity", low=1)
    smallest = smallest_feasible_capacity(T, E)
    if capacity < smallest:
        raise ValueError(
            f"capacity={capacity} makes eq. (9) infeasible for T={T} tokens and E={E} experts: a feasible "
            f"plan needs E * capacity >= T + E - gcd(T, E) nonzeros (T/E = {T / E:g} units per column, "
            f"entries <= 1); the smallest feasible capacity is {smallest}")
    gamma = check_positive_float(gamma, "gamma")
    return min(capacity, T), gamma


def _columns(by_expert, alpha, keep, gamma, with_value=True):
    """The inner maxima of the semi-dual at ``alpha`` for the utilities ``by_expert = U (B, T, E)``
    transposed, ``(B, E, T)``: plan ``(B, T, E)`` and column values ``(B, E)`` (``None`` when
    ``with_value=False``: the plain Adam steps need only the plan's row sums)."""
    E, T = by_expert.shape[-2:]
    beta = T / E
    # (B, E, T): one vector per expert. The solver passes a contiguous by_expert: the selection of each
    # expert's best tokens then reads contiguous rows, 0.1-0.25 ms a step faster at T = 4096, E = 64
    # (0.67 against 0.75-0.80 ms on one processor, 0.79-0.95 against 0.98-1.21 ms on another).
    shifted = by_expert - alpha[:, None, :]
    kept, index = _project_kept(shifted, keep, 1.0, scale=beta, divide=gamma * beta)
    pi = _dense(kept, index, shifted)
    return pi.transpose(1, 2), (_column_values(pi, shifted, gamma) if with_value else None)


def _row_sums(by_expert, alpha, keep, gamma, work):
    """The plan's row sums ``P 1`` ``(B, T)`` at ``alpha``, without the plan: each expert's at most ``keep``
    nonzeros added into their tokens' rows (``E * keep`` numbers, not a ``T x E`` plan and a sum across
    it; the same sums in expert order, which is the dense sum's order for E <= 8). ``work``, a buffer of the shape of ``by_expert``, takes ``U - alpha``: a fresh megabyte at every
    step cost 0.2-0.3 ms at T = 4096, E = 64 inside the solver (the allocator handing back pages that
    must be faulted in again), as much as the rest of the step but the selection."""
    E, T = by_expert.shape[-2:]
    beta = T / E
    shifted = torch.sub(by_expert, alpha[:, None, :], out=work)
    kept, index = _project_kept(shifted, keep, 1.0, scale=beta, divide=gamma * beta)
    if not reads_are_free(alpha):
        # on an accelerator (or compiled) a scatter-add is atomic, its order and so its rounding not
        # fixed from run to run: sum the dense plan there
        return _dense(kept, index, shifted).sum(-2)
    return alpha.new_zeros(alpha.shape).scatter_add_(1, index.flatten(1), kept.flatten(1))


def _column_values(pi, shifted, gamma):
    """Column values ``(B, E)`` of the semi-dual for the plan ``pi`` and ``shifted = U - alpha``, both
    ``(B, E, T)``."""
    return (pi * shifted).sum(-1) - 0.5 * gamma * (pi * pi).sum(-1)


def sparsity_constrained_semi_dual(utility: torch.Tensor, alpha: torch.Tensor, capacity: int, *,
                                   gamma: float = 1.0) -> torch.Tensor:
    """The semi-dual ``h(alpha)`` of eq. (9) of Liu et al. (2024) (module docstring), shape ``(...)``.

    ``h(alpha) >= `` the optimum of (9) for every ``alpha`` (weak duality) and ``h`` is convex; its
    gradient is ``1 - P 1`` for the plan ``P`` read off ``alpha``, and autograd through this function
    returns exactly that (envelope theorem). Book: chapter 4, section "The semi-dual".

    Args:
        utility: ``(..., T, E)``; alpha: token prices ``(..., T)``; capacity, gamma: as in
            :func:`sparsity_constrained_plan`.
    """
    keep, gamma = _check_problem(utility, capacity, gamma)
    check_scores(alpha, "alpha", min_dim=1)
    *batch, T, E = utility.shape
    if tuple(alpha.shape) != (*batch, T):
        raise ValueError(f"alpha must have shape {(*batch, T)} (one price per token), got {tuple(alpha.shape)}")
    dtype = _working_dtype(torch.promote_types(utility.dtype, alpha.dtype))
    U = utility.reshape(-1, T, E).to(dtype)
    a = alpha.reshape(-1, T).to(dtype)
    _, value = _columns(U.transpose(1, 2), a, keep, gamma)
    return (a.sum(-1) + value.sum(-1)).reshape(batch).to(utility.dtype)


def sparsity_constrained_plan(
    utility: torch.Tensor,
    capacity: int,
    *,
    gamma: float = 1.0,
    method: str = "annealed",
    max_iter: int | None = None,
    tol: float = 0.0,
    lr: float | None = None,
    init: torch.Tensor | None = None,
    return_info: bool = False,
):
    """The sparsity-constrained OT plan of Liu et al. (2024) eq. (9), through its semi-dual (module docstring).

    Book: chapter 4, sections "The semi-dual" and "The solver". No gradient flows through the plan
    (routers only allocate with it).

    Args:
        utility: ``(..., T, E)`` floating tensor (the router's softmax in the paper); every leading dim
            is an independent problem. float64 is solved in float64, other dtypes in float32.
        capacity: ``C``, the largest number of nonzeros per expert column; must be ``>= T/E`` (else
            the problem is infeasible: ``ValueError``); ``C >= T`` is plain quadratic OT.
        gamma: weight of the quadratic regulariser ``(gamma/2) ||P||^2`` (> 0; the paper's 1/2 is
            ``gamma = 1``).
        method: ``"annealed"`` (default) or ``"adam"`` (the authors' solver); module docstring.
        max_iter: Adam steps; default 20 for ``"adam"`` (as the authors), 100 for ``"annealed"`` (per
            continuation stage: ``1 + ceil(log10(spread / (30 gamma)))`` stages when the spread ``max(U) -
            min(U)`` of a problem exceeds ``30 gamma``, else one; module docstring).
        tol: stop early once every row sum is within ``tol`` of 1; ``tol=0`` (default) runs all
            ``max_iter`` steps (a check costs a device synchronisation).
        lr: Adam's learning rate (for ``"annealed"`` the initial one, in units of ``s + min(s, gamma)``
            with ``s = max(U) - min(U)``, the scale of the prices); default 1e-2 for ``"adam"``, 3e-2 for
            ``"annealed"``.
        init: token prices ``alpha (..., T)`` to start from (default 0: a warm start is possible; it
            skips the continuation).
        return_info: return a :class:`SparseOTResult` instead of the plan alone.

    Returns:
        The plan ``(..., T, E)`` in the dtype of ``utility``: ``>= 0``, every column summing to ``T/E``
        with at most ``capacity`` nonzeros; rows only approximately 1. Or a :class:`SparseOTResult`.

    Warns:
        RuntimeWarning: once per call when the mean ``|P 1 - 1|`` over the batch (``row_error``)
        exceeds 1 (``ROW_ERROR_WARNING``: above the 10-75% that "adam" leaves on softmax utilities,
        below the 1.1-1.8 of a solver that failed); it names the error, the spread of ``U`` and the remedy.
    """
    keep, gamma = _check_problem(utility, capacity, gamma)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    max_iter = DEFAULT_ITERS[method] if max_iter is None else check_int(max_iter, "max_iter", low=0)
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (tol >= 0 and math.isfinite(tol)):
        raise ValueError(f"tol must be a finite number >= 0, got {tol!r}")
    lr = None if lr is None else check_positive_float(lr, "lr")
    *batch, T, E = utility.shape
    dtype = _working_dtype(utility.dtype)
    if init is not None:
        check_scores(init, "init", min_dim=1)
        if tuple(init.shape) != (*batch, T):
            raise ValueError(f"init must be token prices of shape {(*batch, T)}, got {tuple(init.shape)}")
    with torch.no_grad():
        plan, alpha, value, iterations, error = solve_plan(utility, keep, gamma, method, max_iter, tol, lr, init)
        mean_error = float(error.mean()) if error.numel() else 0.0
        if mean_error > ROW_ERROR_WARNING:
            U = utility.detach().to(dtype)
            spread = float(U.amax() - U.amin())
            if spread == 0:
                advice = "the utilities are constant: every token ties, and the symmetric steps cannot break the ties"
            elif method == "adam":
                advice = ("use method='annealed', whose steps follow the spread, or rescale U and gamma (adam's fixed "
                          "steps suit a spread of U / gamma of about 0.1 to 1)")
            else:
                advice = "raise max_iter (steps per continuation stage)" + (
                    " or drop init (a warm start skips the continuation)" if init is not None else "")
            warnings.warn(
                f"sparsity_constrained_plan: the plan's rows are off by {mean_error:.3g} on average (max "
                f"{float(error.max()):.3g}; the columns are exact) after {iterations} steps of method={method!r} on "
                f"utilities spread over max(U) - min(U) = {spread:.3g} with gamma={gamma:g}: not converged; "
                f"{advice} (the plan depends on U / gamma only)", RuntimeWarning, stacklevel=2)
        if not return_info:
            return plan
        max_error = float(error.max()) if error.numel() else 0.0
        return SparseOTResult(plan, alpha, value, iterations, mean_error, max_error)


def solve_plan(utility, capacity, gamma, method, max_iter, tol, lr=None, init=None):
    """:func:`sparsity_constrained_plan` for a caller that has checked the arguments (a router), without
    the warning and without a host read of its own (those of ``tol > 0`` and of the annealed continuation's stages aside): plan
    ``(..., T, E)``, prices ``(..., T)`` and values ``(...)`` in the dtype of ``utility``, the
    number of steps, and each row's error ``|P 1 - 1|`` ``(..., T)`` in the working dtype.
    ``lr=None`` is the method's default."""
    *batch, T, E = utility.shape
    keep = min(capacity, T)
    lr = DEFAULT_LR[method] if lr is None else lr
    dtype = _working_dtype(utility.dtype)
    U = utility.detach().reshape(-1, T, E).to(dtype)
    alpha = U.new_zeros(U.shape[:2]) if init is None else init.detach().reshape(-1, T).to(dtype).clone()
    if U.shape[0] == 0:
        plan, value, iterations = torch.zeros_like(U), U.new_zeros(0), 0
    else:
        by_expert = U.transpose(1, 2).contiguous()  # (B, E, T): each expert's utilities in one row
        alpha, plan, value, iterations = _adam(by_expert, alpha, keep, gamma, max_iter, tol, lr,
                                               annealed=method == "annealed", continuation=init is None)
    plan = plan.reshape(utility.shape).to(utility.dtype)
    error = (plan.to(dtype).sum(-1) - 1).abs()
    return (plan, alpha.reshape(*batch, T).to(utility.dtype), value.reshape(batch).to(utility.dtype), iterations,
            error)


ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
ANNEAL_STEPS = 10  # the annealed learning rate halves after this many steps
CONTINUATION_RATIO = 30.0  # "annealed" continues in gamma when max(U) - min(U) > this * gamma
CONTINUATION_FACTOR = 10.0  # ... dividing gamma by this from one stage to the next
ROW_ERROR_WARNING = 1.0  # warn when the mean |row sum - 1| of the returned plan exceeds this


def _stages(U, gamma):
    """Continuation stages per problem: the smallest ``S >= 1`` with ``RATIO * gamma * FACTOR^(S-1) >=
    max(U) - min(U)``, so that the first stage's gamma is within a factor ``RATIO`` of the spread."""
    spread = U.amax((-2, -1)) - U.amin((-2, -1))
    stages = torch.ones(spread.shape, dtype=torch.long, device=U.device)
    top = torch.full_like(spread, gamma)
    while True:  # comparisons only: exact, and the same for a problem alone or in a batch
        more = top * CONTINUATION_RATIO < spread
        if not bool(more.any()):
            return stages
        stages += more
        top = torch.where(more, top * CONTINUATION_FACTOR, top)


def _adam(by_expert, alpha, keep, gamma, max_iter, tol, lr, annealed, continuation=False):
    """Adam on the semi-dual for the utilities ``by_expert = U (B, T, E)`` transposed, ``(B, E, T)``.
    Returns ``(alpha, plan, h(alpha), steps)``.

    ``annealed=False``: constant learning rate, last iterate (the authors' code). ``annealed=True``:
    learning rate ``lr * scale / (1 + step / ANNEAL_STEPS)`` per problem, with ``scale = s + min(s,
    gamma)`` for the spread ``s = max(U) - min(U)`` (``gamma`` if ``s = 0``; the prices move on the
    scale of ``s``), and the iterate whose plan has the smallest mean row error (see
    :func:`sparsity_constrained_plan`). ``continuation=True``
    (annealed only): ``max_iter`` steps at each ``gamma_j = gamma * FACTOR^(S-1-j)`` of
    :func:`_stages`, each stage restarting Adam from the best prices of the one before with ``scale =
    FACTOR * gamma_j`` (the previous stage left the prices right on that scale); a problem with fewer
    stages than the batch sits the first ones out, so it is solved as it would be alone."""
    if annealed and continuation:
        stages = _stages(by_expert, gamma)
        total = int(stages.max())
    else:  # one stage: nothing to read
        stages, total = torch.ones(by_expert.shape[0], dtype=torch.long, device=by_expert.device), 1
    steps = 0
    for j in range(total):
        remaining = total - 1 - j  # stages after this one: gamma_j = gamma * FACTOR^remaining
        stage_gamma = gamma * CONTINUATION_FACTOR ** remaining
        active = (stages > remaining) if total > 1 else None
        first = stages == remaining + 1  # this is the problem's first stage
        alpha, plan, value, taken = _descend(by_expert, alpha, keep, stage_gamma, max_iter,
                                             tol if remaining == 0 else 0.0, lr, annealed, active, first)
        steps += taken
    return alpha, plan, alpha.sum(-1) + value.sum(-1), steps


def _descend(by_expert, alpha, keep, gamma, max_iter, tol, lr, annealed, active=None, first=None):
    """One stage of :func:`_adam` at one ``gamma``: ``(alpha, plan, column values, steps)``. ``active``
    (``(B,)`` bool or None for all) freezes the prices of the other problems; ``first`` marks the
    problems that start here (``scale = gamma + max(U) - min(U)``; the others ``FACTOR * gamma``)."""
    b1, b2 = ADAM_BETAS
    first_moment, second = torch.zeros_like(alpha), torch.zeros_like(alpha)
    # the plain steps need only the plan's row sums; their plan is read off the last prices, once
    if not annealed:
        work = torch.empty_like(by_expert)
        rows = _row_sums(by_expert, alpha, keep, gamma, work)
    else:
        plan, value = _columns(by_expert, alpha, keep, gamma)
        spread = (by_expert.amax((-2, -1)) - by_expert.amin((-2, -1)))[:, None]
        scale = torch.where(spread > 0, spread + spread.clamp_max(gamma), torch.full_like(spread, gamma))
        if active is not None:
            scale = torch.where(first[:, None], scale, torch.full_like(scale, CONTINUATION_FACTOR * gamma))
        best_alpha, best_plan, best_value = alpha, plan, value
        best_error = (1 - plan.sum(-1)).abs().mean(-1)
    steps = 0
    for step in range(1, max_iter + 1):
        grad = 1 - (plan.sum(-1) if annealed else rows)
        if tol > 0 and float(grad.abs().max()) <= tol:
            break
        first_moment.mul_(b1).add_(grad, alpha=1 - b1)
        second.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        correction = math.sqrt(1 - b2 ** step) / (1 - b1 ** step)
        step_size = lr * correction * (scale / (1 + step / ANNEAL_STEPS) if annealed else 1.0)
        moved = alpha - step_size * first_moment / (second.sqrt() + ADAM_EPS * math.sqrt(1 - b2 ** step))
        alpha = moved if active is None else torch.where(active[:, None], moved, alpha)
        steps = step
        if not annealed:
            if step < max_iter:
                rows = _row_sums(by_expert, alpha, keep, gamma, work)
        else:
            plan, value = _columns(by_expert, alpha, keep, gamma)
            error = (1 - plan.sum(-1)).abs().mean(-1)
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best_alpha = torch.where(better[:, None], alpha, best_alpha)
            best_plan = torch.where(better[:, None, None], plan, best_plan)
            best_value = torch.where(better[:, None], value, best_value)
    if annealed:
        alpha, plan, value = best_alpha, best_plan, best_value
    else:  # the last iterate
        plan, value = _columns(by_expert, alpha, keep, gamma)
    return alpha, plan, value, steps
