"""The n x k Gumbel-Matching distribution: sampling, exact solvers, and the conditionals of Kool et al.

Book: chapter 5 (Balanced assignments with unbiased gradients), sections "Gumbel-matching",
"Solving it: cycle cancelling" and "The conditionals". A Gumbel-Matching sample (Kool, Maddison &
Mnih, eq. 4) is the optimal solution of

    max_z  sum_t s[t, z_t]   with   s = logits / tau + G,   G iid Gumbel(0, 1),
           subject to  #{t : z_t = e} <= capacity   for every expert e,

which must be solved *exactly*: the conditionals below are only valid at the optimum. Four solvers:

* ``method="auto"`` (default): the package's exact solver, :func:`minimoe.ops.linear_assignment`
  (prices and shortest paths on the experts' graph; chapter 2, "Solving the assignment exactly"),
  the one every caller of the package uses. The three below are kept for the chapter and as checks.
* ``method="assignment"``: scipy's Jonker-Volgenant (:func:`scipy.optimize.linear_sum_assignment`)
  on the column-replicated matrix, O(T^3) per problem, on the host. scipy is optional (the
  ``test`` extra): this method needs it, the other two are pure torch.
* ``method="cycle"``: cycle cancelling on the E-node graph of cheapest moves (App. D.2), batched in
  torch. A greedy start that respects capacity, then passes of: move costs by a scatter-min over
  tokens, O(T E); a negative-cycle search on the E x E cost matrix, O(E^3); moving one token along
  every edge of that cycle. It stops when no cycle is cheaper than ``-tol`` and the answer is
  certified by Floyd-Warshall (no negative diagonal). The cycle is extracted with Bellman-Ford's
  predecessor walk, whose cycle is provably negative, instead of Floyd-Warshall's next-hop
  pointers, which do not describe a cycle once distances have gone negative (the paper's footnote
  3); both cost O(E^3) per pass. A cycle counts only below ``-tol``, ``tol = 1e-9 (1 + max |s|)``,
  so rounding cannot make it cycle forever; the answer is optimal to ``E * tol``.
* ``method="top2"`` (two experts): expert 1 takes the tokens with the largest ``s[:, 1] - s[:, 0]``,
  as many as are positive, clipped to ``[T - capacity, capacity]``: a sort, O(T log T).

Slack (``E * capacity > T``): the paper assumes every expert is full. We add ``E * capacity - T``
dummy tokens that score 0 everywhere; then every expert is full and everything of App. D holds
unchanged for the padded problem, whose optimal real part is the optimum of the "<=" problem. A
dummy moves between experts at cost 0, so an expert with a free slot gets cost ``min(d, 0)`` on its
outgoing edges (its free slot can go anywhere for free); nothing is materialised.

Everything is float64 internally: the scores of all solvers and the conditionals are
``logits.double() / tau + gumbels`` with float64 Gumbels.
"""
from __future__ import annotations

import math

import torch

from ._checks import check_generator, check_int, check_positive_float, check_scores
from .assignment import require_scipy, linear_assignment

METHODS = ("auto", "assignment", "cycle", "top2")
RELATIVE_TOL = 1e-9  # a negative cycle must beat -RELATIVE_TOL * (1 + max |score|) to count
MAX_ENUMERATION = 200_000


def sample_gumbel(shape, *, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64,
                  device=None) -> torch.Tensor:
    """Standard Gumbel(0, 1) noise ``-log(-log U)``, with ``U`` kept inside ``[tiny, 1 - eps]`` of the
    dtype so that no draw is infinite (chapter 5, "The Gumbel-max trick")."""
    check_generator(generator)
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    source = generator.device if generator is not None else device  # draw where the generator lives
    info = torch.finfo(dtype)
    u = torch.rand(shape, generator=generator, dtype=dtype, device=source).to(device or source)
    u = u.clamp_(info.tiny, 1 - info.eps)
    return -torch.log(-torch.log(u))


def gumbel_matching_sample(logits: torch.Tensor, capacity: int, *, tau: float = 1.0,
                           generator: torch.Generator | None = None, gumbels: torch.Tensor | None = None,
                           method: str = "auto", return_gumbels: bool = False):
    """One draw of the n x k Gumbel-Matching distribution (Kool et al. eq. 4; chapter 5,
    "Gumbel-matching").

    Args:
        logits: ``(..., T, E)``; every leading dimension is an independent problem. Only
            ``logits / tau`` matters, and adding a constant to a row changes nothing.
        capacity: tokens per expert, ``E * capacity >= T``. ``capacity = T / E`` is the paper's
            perfectly balanced case; more leaves slack (see the module docstring).
        tau: temperature (> 0): the noise is added to ``logits / tau``. ``tau -> 0`` gives the
            deterministic BASE assignment; no capacity limit gives independent softmax sampling.
        generator: for the Gumbel noise (ignored when ``gumbels`` is given).
        gumbels: ``(..., T, E)`` noise to use instead of fresh draws (tests, and the conditionals).
        method: ``"auto"`` (the package's exact solver, :func:`minimoe.ops.linear_assignment`),
            ``"assignment"`` (scipy, which must be installed), ``"cycle"`` or ``"top2"`` (E = 2 only);
            see the module docstring. All are exact.
        return_gumbels: also return the float64 noise used, which
            :func:`gumbel_matching_conditionals` needs.

    Returns:
        ``LongTensor (..., T)``: the expert of each token, each expert taking at most ``capacity``;
        with ``return_gumbels=True`` the pair ``(assignment, gumbels)``.
    """
    check_scores(logits, "logits")
    tau = check_positive_float(tau, "tau")
    T, E = logits.shape[-2:]
    capacity = _check_capacity(capacity, T, E)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "top2" and E != 2:
        raise ValueError(f"method='top2' needs exactly 2 experts, got {E}")
    if gumbels is None:
        gumbels = sample_gumbel(logits.shape, generator=generator, device=logits.device)
    else:
        gumbels = _check_gumbels(gumbels, logits)
    scores = logits.detach().double() / tau + gumbels
    assignment = solve_assignment(scores, capacity, method=method)
    return (assignment, gumbels) if return_gumbels else assignment


def solve_assignment(scores: torch.Tensor, capacity: int, *, method: str = "auto") -> torch.Tensor:
    """The exact solution of ``max sum_t scores[t, z_t]`` with at most ``capacity`` tokens per expert,
    by the solvers of :func:`gumbel_matching_sample` (which calls it on the perturbed scores).
    Returns ``LongTensor (..., T)``."""
    check_scores(scores)
    *batch, T, E = scores.shape
    capacity = _check_capacity(capacity, T, E)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "assignment":
        require_scipy('solve_assignment(method="assignment")')
    if method == "top2" and E != 2:
        raise ValueError(f"method='top2' needs exactly 2 experts, got {E}")
    B = math.prod(batch)
    flat = scores.detach().double().reshape(B, T, E)
    if flat.shape[0] == 0 or T == 0 or E == 1:
        return torch.zeros((*batch, T), dtype=torch.long, device=scores.device)
    capacity = min(capacity, T)
    if method in ("auto", "assignment"):  # the package's exact solver, or scipy's
        assignment = linear_assignment(flat, capacity, method="auto" if method == "auto" else "scipy")
    elif method == "top2":
        assignment = _top2(flat, capacity)
    else:
        assignment = _cycle_cancelling(flat, capacity)
    return assignment.reshape(*batch, T)


def move_costs(scores: torch.Tensor, assignment: torch.Tensor, capacity: int | None = None):
    """The cheapest single move between every pair of experts (Kool et al. App. D.2; chapter 5,
    "Solving it: cycle cancelling").

    ``cost[j, j'] = min over tokens t in expert j of scores[t, j] - scores[t, j']``: what the total
    score loses when the cheapest token of ``j`` moves to ``j'``. The diagonal is 0. An expert with a
    free slot (fewer than ``capacity`` tokens) also offers a free move (a dummy token, cost 0), so its
    row is ``min(cost, 0)``; an expert with no token and no free slot cannot send anything (``inf``).

    Args:
        scores: ``(..., T, E)``.
        assignment: ``LongTensor (..., T)`` with values in ``[0, E)``.
        capacity: slots per expert; ``None`` means no expert has a free slot.

    Returns:
        ``(cost (..., E, E), token (..., E, E))``: ``token[j, j']`` is the token that realises the
        move, ``-1`` on the diagonal and where the move is a free slot's.
    """
    check_scores(scores)
    *batch, T, E = scores.shape
    assignment = _check_assignment(assignment, tuple(batch) + (T,), E)
    if capacity is not None:
        capacity = check_int(capacity, "capacity", low=1)
    B = math.prod(batch)
    cost, token = _move_costs(scores.reshape(B, T, E), assignment.reshape(B, T), capacity)
    return cost.reshape(*batch, E, E), token.reshape(*batch, E, E)


def floyd_warshall(cost: torch.Tensor, *, return_next: bool = False):
    """All-pairs shortest paths on graphs of E nodes, batched (chapter 5, "Solving it: cycle
    cancelling").

    The parallel form: for each intermediate node ``m`` in turn, every pair at once,
    ``D = min(D, D[:, m] + D[m, :])``: E sequential steps of O(E^2) parallel work. The empty path
    costs 0, so the diagonal of the input counts only when it is negative. Without negative cycles
    ``D`` holds the shortest-path costs ``d*``; with one, some diagonal entry is negative (which is how
    optimality is certified) and the other entries are not shortest paths.

    Args:
        cost: ``(..., E, E)`` edge costs ``cost[j, j']`` (``inf``: no edge).
        return_next: also return the next-hop table ``next[j, j']``: the node after ``j`` on a
            shortest path to ``j'`` (``j'`` itself for a direct edge, ``j`` on the diagonal).

    Returns:
        ``D (..., E, E)``, or ``(D, next)``.
    """
    _check_cost(cost)
    *batch, E, E2 = cost.shape
    if E != E2:
        raise ValueError(f"cost must be square in its last two dims, got shape {tuple(cost.shape)}")
    D = cost.clone()
    diagonal = D.diagonal(dim1=-2, dim2=-1)
    diagonal.copy_(diagonal.clamp(max=0.0))
    nodes = torch.arange(E, device=cost.device)
    nxt = nodes.expand(*batch, E, E).clone() if return_next else None
    for m in range(E):
        through = D[..., :, m:m + 1] + D[..., m:m + 1, :]
        better = through < D
        D = torch.where(better, through, D)
        if return_next:
            nxt = torch.where(better, nxt[..., :, m:m + 1].expand_as(nxt), nxt)
    return (D, nxt) if return_next else D


def gumbel_matching_conditionals(logits: torch.Tensor, gumbels: torch.Tensor, assignment: torch.Tensor, *,
                                 tau: float = 1.0, capacity: int | None = None, log: bool = False) -> torch.Tensor:
    """``q(z_t = j | x, G_-t)``: each token's law given every other token's noise (Kool et al. eqs. 7-9;
    chapter 5, "The conditionals").

    With ``d*`` the shortest-path costs between experts at the optimum, forcing token t from its
    expert ``z_t`` into ``j`` costs ``s[t, z_t] - s[t, j] + d*[j, z_t]`` (eq. 7), and the Gumbel-max
    trick over the noise of token t alone gives::

        q(z_t = j | x, G_-t) = softmax_j( logits[t, j] / tau - d*[j, z_t] ),

    which does not depend on token t's own noise (it cancels). Exact; computed in float64 and
    returned in the dtype of ``logits``, without gradient (it enters the estimators through a
    stop-gradient).

    Args:
        logits, gumbels, tau: as given to :func:`gumbel_matching_sample` (``return_gumbels=True``).
        assignment: ``LongTensor (..., T)``, the *optimal* assignment for these scores; checked (a
            ``ValueError`` if some negative cycle shows it is not optimal).
        capacity: slots per expert; ``None`` means ``T / E`` (which must then be an integer).
        log: return log-probabilities (exact where the probabilities underflow).

    Returns:
        ``(..., T, E)``, rows summing to 1 (log-sum-exp 0 with ``log=True``).
    """
    check_scores(logits, "logits")
    tau = check_positive_float(tau, "tau")
    *batch, T, E = logits.shape
    gumbels = _check_gumbels(gumbels, logits)
    assignment = _check_assignment(assignment, tuple(batch) + (T,), E)
    if capacity is None:
        if E and T % E:
            raise ValueError(f"capacity=None means T / E slots per expert, but T={T} is not a multiple of "
                             f"E={E}; pass capacity")
        capacity = max(T // max(E, 1), 1)
    capacity = _check_capacity(capacity, T, E)
    with torch.no_grad():
        base = logits.detach().double() / tau
        B = math.prod(batch)
        scores = (base + gumbels).reshape(B, T, E)
        z = assignment.reshape(B, T)
        if T == 0 or scores.shape[0] == 0:
            return logits.new_zeros(logits.shape)
        counts = _counts(z, E)
        if (counts > capacity).any():
            raise ValueError(f"assignment puts more than capacity={capacity} tokens on some expert")
        cost, _ = _move_costs(scores, z, capacity, with_token=False)
        paths = floyd_warshall(cost)
        _certify(paths, scores, "assignment")
        # row t, column j: d*[j, z_t]
        to_own = paths.transpose(-1, -2).gather(1, z[:, :, None].expand(-1, -1, E))
        cond = (torch.log_softmax if log else torch.softmax)(base.reshape(B, T, E) - to_own, dim=-1)
    return cond.reshape(logits.shape).to(logits.dtype)


def balanced_assignments(n_tokens: int, n_experts: int, capacity: int, *,
                         max_count: int = MAX_ENUMERATION) -> torch.Tensor:
    """Every assignment of ``n_tokens`` tokens to ``n_experts`` experts with at most ``capacity`` per
    expert, as a ``LongTensor (N, n_tokens)`` in lexicographic order (tiny sizes: tests and notebooks;
    chapter 5, "Gumbel-matching"). With ``capacity * n_experts == n_tokens`` these are the
    ``n! / (c!)^k`` perfectly balanced assignments. Raises ``ValueError`` when there are more than
    ``max_count``."""
    n_tokens = check_int(n_tokens, "n_tokens", low=0)
    n_experts = check_int(n_experts, "n_experts", low=1)
    capacity = check_int(capacity, "capacity", low=1)
    if capacity * n_experts < n_tokens:
        raise ValueError(f"capacity={capacity} is too small: {n_experts} experts x {capacity} slots cannot hold "
                         f"{n_tokens} tokens")
    count = count_balanced_assignments(n_tokens, n_experts, capacity)
    if count > max_count:
        raise ValueError(f"there are {count} assignments of {n_tokens} tokens to {n_experts} experts with capacity "
                         f"{capacity}, more than max_count={max_count}: enumeration is for tiny problems")
    rows = []
    for counts in _count_vectors(n_tokens, n_experts, capacity):
        # every arrangement of the multiset {e repeated counts[e] times}
        rows.extend(_arrangements(counts))
    return torch.tensor(sorted(rows), dtype=torch.long).reshape(len(rows), n_tokens)


MAX_COUNT_WORK = 10**7  # products of count_balanced_assignments' recursion: about ten seconds


def count_balanced_assignments(n_tokens: int, n_experts: int, capacity: int) -> int:
    """How many assignments :func:`balanced_assignments` would list: ``sum n! / prod m_e!`` over the
    load vectors ``m`` with ``m_e <= capacity`` (exact integer)."""
    n_tokens = check_int(n_tokens, "n_tokens", low=0)
    n_experts = check_int(n_experts, "n_experts", low=1)
    capacity = check_int(capacity, "capacity", low=1)
    work = n_experts * (n_tokens + 1) * (min(capacity, n_tokens) + 1)
    if work > MAX_COUNT_WORK:
        # the count has thousands of digits there, and its exact big-integer sums take hours
        raise ValueError(f"count_balanced_assignments({n_tokens}, {n_experts}, {capacity}) would take about {work:.1e} "
                         f"big-integer products (at most {MAX_COUNT_WORK:.0e}): it is meant for the small sizes where "
                         "assignments can be listed; use fewer tokens, experts or slots")
    ways = [1] + [0] * n_tokens  # ways[t]: assignments of t (labelled) tokens to the experts so far
    for _ in range(n_experts):
        ways = [sum(math.comb(t, m) * ways[t - m] for m in range(min(capacity, t) + 1))
                for t in range(n_tokens + 1)]
    return ways[n_tokens]


# --- internals -------------------------------------------------------------------------------------

def _check_capacity(capacity, T, E) -> int:
    capacity = check_int(capacity, "capacity", low=1)
    if E * capacity < T:
        raise ValueError(f"capacity={capacity} is too small: {E} experts x {capacity} slots cannot hold "
                         f"{T} tokens (need capacity >= {-(-T // max(E, 1))})")
    return capacity


def _check_gumbels(gumbels, logits) -> torch.Tensor:
    check_scores(gumbels, "gumbels")
    if gumbels.shape != logits.shape:
        raise ValueError(f"gumbels must have the shape of logits {tuple(logits.shape)}, got {tuple(gumbels.shape)}")
    return gumbels.detach().to(device=logits.device, dtype=torch.float64)


def _check_assignment(assignment, shape, E) -> torch.Tensor:
    if not isinstance(assignment, torch.Tensor) or assignment.dtype not in (torch.int64, torch.int32, torch.int16,
                                                                          torch.int8, torch.uint8):
        raise TypeError("assignment must be an integer tensor of expert indices")
    if tuple(assignment.shape) != tuple(shape):
        raise ValueError(f"assignment must have shape {tuple(shape)}, got {tuple(assignment.shape)}")
    if assignment.numel() and (int(assignment.min()) < 0 or int(assignment.max()) >= E):
        raise ValueError(f"assignment values must be in [0, {E}), got range "
                         f"[{int(assignment.min())}, {int(assignment.max())}]")
    return assignment.long()


def _check_cost(cost):
    if not isinstance(cost, torch.Tensor) or not cost.is_floating_point():
        raise TypeError("cost must be a floating-point torch.Tensor")
    if cost.dim() < 2:
        raise ValueError(f"cost must have shape (..., E, E), got {tuple(cost.shape)}")
    if torch.isnan(cost).any() or (cost == -math.inf).any():
        raise ValueError("cost contains NaN or -inf values; entries must be finite or +inf (no edge)")


def _counts(z, E):
    counts = torch.zeros(z.shape[0], E, dtype=torch.long, device=z.device)
    return counts.scatter_add_(1, z, torch.ones_like(z))


def _move_costs(scores, z, capacity, with_token=True):
    """(B, T, E) scores, (B, T) assignment -> cost (B, E, E) and the realising token (B, E, E), or
    ``None`` for the token with ``with_token=False`` (the conditionals need the costs only)."""
    B, T, E = scores.shape
    own = scores.gather(-1, z[:, :, None])
    move = own - scores  # (B, T, E): loss of moving token t to each expert
    index = z[:, :, None].expand(B, T, E)
    cost = scores.new_full((B, E, E), math.inf).scatter_reduce(1, index, move, "amin", include_self=True)
    token = None
    if with_token:  # the token that attains each minimum (the smallest index on a tie)
        hit = move == cost.gather(1, index)
        candidates = torch.where(hit, torch.arange(T, device=scores.device)[None, :, None], T)
        token = torch.full((B, E, E), T, dtype=torch.long, device=scores.device)
        token = token.scatter_reduce(1, index, candidates, "amin", include_self=True)
        token = torch.where(token == T, -1, token)
    if capacity is not None:
        free = (_counts(z, E) < capacity)[:, :, None]  # expert j holds a dummy: its slot moves for free
        dummy = free & ~(cost <= 0)
        cost = torch.where(dummy, 0.0, cost)
        token = None if token is None else torch.where(dummy, -1, token)
    eye = torch.eye(E, dtype=torch.bool, device=scores.device)
    cost = cost.masked_fill(eye, 0.0)
    token = None if token is None else token.masked_fill(eye, -1)
    return cost, token


def _tolerance(scores):
    """Per problem: cycles above ``-tol`` are float noise, not improvements."""
    return RELATIVE_TOL * (1.0 + scores.abs().amax((-2, -1)))


def _certify(paths, scores, name):
    E = paths.shape[-1]
    slack = (paths.diagonal(dim1=-2, dim2=-1).amin(-1) + E * _tolerance(scores))
    if (slack < 0).any():
        worst = float(paths.diagonal(dim1=-2, dim2=-1).amin())
        raise ValueError(f"{name} is not optimal for these scores: a cycle of moves gains {-worst:.3g} "
                         "(the conditionals are only valid at the exact optimum)")


def _top2(scores, capacity):
    """Two experts: expert 1 takes the tokens with the largest score difference."""
    B, T, _ = scores.shape
    delta = scores[..., 1] - scores[..., 0]
    take = (delta > 0).sum(-1).clamp(min=T - capacity, max=capacity)  # (B,)
    order = torch.argsort(delta, dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(T, device=scores.device).expand(B, T))
    return (rank < take[:, None]).long()


def _greedy_start(scores, capacity):
    """A feasible start: in rounds, every unplaced token proposes to its best expert with room, and
    each expert accepts its highest-scoring proposers up to its room (Kool et al. start from an
    auction; any feasible start is correct). Each round fills an expert or places everyone: <= E rounds."""
    B, T, E = scores.shape
    device = scores.device
    z = torch.full((B, T), -1, dtype=torch.long, device=device)
    room = torch.full((B, E), capacity, dtype=torch.long, device=device)
    arange = torch.arange(T, device=device).expand(B, T)
    for _ in range(E + 1):
        free = z < 0
        if not free.any():
            return z
        value, choice = scores.masked_fill((room == 0)[:, None, :], -math.inf).max(-1)
        group = torch.where(free, choice, E)  # placed tokens wait in an extra group
        order = torch.argsort(value, dim=-1, descending=True, stable=True)
        order = order.gather(1, torch.argsort(group.gather(1, order), dim=-1, stable=True))
        sorted_group = group.gather(1, order)
        sizes = torch.zeros(B, E + 1, dtype=torch.long, device=device).scatter_add_(1, group, torch.ones_like(group))
        start = sizes.cumsum(-1) - sizes
        rank_sorted = arange - start.gather(1, sorted_group)
        rank = torch.empty_like(rank_sorted).scatter_(1, order, rank_sorted)
        accept = free & (rank < room.gather(1, choice.clamp(max=E - 1)))
        z = torch.where(accept, choice, z)
        room = room - torch.zeros_like(room).scatter_add_(1, choice, accept.long())
    raise RuntimeError("greedy start did not place every token (capacity too small?)")  # unreachable


def _negative_cycles(cost, tol):
    """Bellman-Ford from a virtual source (all distances 0), Jacobi sweeps, relaxing only by more
    than ``tol``. A node still relaxed in the E-th sweep has a predecessor chain that closes a cycle,
    and every cycle of predecessors costs less than ``-tol`` (the strict relaxation that closed it).
    If nothing relaxes in a sweep, every cycle costs at least ``-E * tol``.

    Returns ``(found (B,), on_cycle (B, E), pred (B, E))``: for the problems with a cycle, its nodes,
    and ``pred[v]``, the node before ``v`` on it."""
    B, E, _ = cost.shape
    dist = cost.new_zeros(B, E)
    pred = torch.full((B, E), -1, dtype=torch.long, device=cost.device)
    relaxed = torch.zeros(B, E, dtype=torch.bool, device=cost.device)
    for _ in range(E):
        best, via = (dist[:, :, None] + cost).min(dim=1)
        relaxed = best < dist - tol[:, None]
        if not relaxed.any():
            break
        dist = torch.where(relaxed, best, dist)
        pred = torch.where(relaxed, via, pred)
    found = relaxed.any(-1)
    on_cycle = torch.zeros(B, E, dtype=torch.bool, device=cost.device)
    if not found.any():
        return found, on_cycle, pred
    rows = torch.arange(B, device=cost.device)
    node = relaxed.long().argmax(-1)  # a node relaxed in the last sweep
    for _ in range(E):  # E steps back along the predecessors land on the cycle
        node = torch.where(found, pred[rows, node.clamp_min(0)], node).clamp_min(0)
    start, done = node, ~found
    for _ in range(E):
        on_cycle[rows, node] |= ~done
        node = pred[rows, node].clamp_min(0)
        done = done | (node == start)
    return found, on_cycle, pred


def _cycle_cancelling(scores, capacity, max_passes: int | None = None):
    B, T, E = scores.shape
    z = _greedy_start(scores, capacity)
    tol = _tolerance(scores)
    active = torch.arange(B, device=scores.device)
    max_passes = max_passes or 50 * T * E + 1000
    for _ in range(max_passes):
        if active.numel() == 0:
            break
        sub_scores, sub_z = scores[active], z[active]
        cost, token = _move_costs(sub_scores, sub_z, capacity)
        found, on_cycle, pred = _negative_cycles(cost, tol[active])
        if not found.any():
            break
        b, v = on_cycle.nonzero(as_tuple=True)
        u = pred[b, v]
        moved = token[b, u, v]  # edge u -> v moves this token from u to v (-1: a free slot's move)
        real = moved >= 0
        sub_z[b[real], moved[real]] = v[real]
        z[active] = sub_z
        active = active[found]
    else:
        raise RuntimeError(f"cycle cancelling did not converge in {max_passes} passes")
    # certificate: Floyd-Warshall on the final move costs has no negative cycle
    cost, _ = _move_costs(scores, z, capacity, with_token=False)
    _certify(floyd_warshall(cost), scores, "the cycle-cancelling solution")
    return z


def _count_vectors(n, E, c):
    """Load vectors (m_0, ..., m_{E-1}) with sum n and 0 <= m_e <= c."""
    if E == 1:
        if n <= c:
            yield (n,)
        return
    for m in range(min(c, n) + 1):
        for rest in _count_vectors(n - m, E - 1, c):
            yield (m,) + rest


def _arrangements(counts):
    """All sequences with expert e appearing counts[e] times."""
    n = sum(counts)
    out = [[]]
    remaining = [list(counts)]
    for _ in range(n):
        new_out, new_remaining = [], []
        for seq, rem in zip(out, remaining):
            for e, r in enumerate(rem):
                if r:
                    new_out.append(seq + [e])
                    rem2 = list(rem)
                    rem2[e] -= 1
                    new_remaining.append(rem2)
        out, remaining = new_out, new_remaining
    return out


__all__ = ["sample_gumbel", "gumbel_matching_sample", "solve_assignment", "move_costs", "floyd_warshall",
           "gumbel_matching_conditionals", "balanced_assignments", "count_balanced_assignments"]
