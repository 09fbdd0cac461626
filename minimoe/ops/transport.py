"""The exact capacitated assignment of T tokens to E << T experts, through the experts' prices.

Book: chapter 2, section "Solving the assignment exactly". The problem

    max_z  sum_t S[t, z_t]   subject to   #{t : z_t = e} <= C_e   for every expert e      (P)

is a transportation problem. Its dual has one price ``p_e >= 0`` per expert and one utility ``u_t`` per
token:

    min  sum_t u_t + sum_e C_e p_e   subject to   u_t + p_e >= S[t, e]   for all t, e.      (D)

An assignment ``z`` and prices ``p`` are both optimal exactly when (complementary slackness)

    (CS1) every token takes an expert of largest ``S[t, e] - p_e``  (then ``u_t = S[t, z_t] - p_{z_t}``),
    (CS2) an expert with a positive price is full,  and  (P) holds: no expert is over capacity.

Both phases below keep (CS1) at every step, starting from ``p = 0`` and every token at its best
expert; only the capacities are violated, by the *overflow* ``sum_e max(0, n_e - C_e)``. They also keep
(CS2') "an expert with a positive price holds at least ``C_e`` tokens" when there is slack
(``sum_e C_e > T``); in a balanced group (``sum_e C_e = T``) every expert ends full, prices are free
(the constraints are equalities), and one shift at the end makes them ``>= 0``. Once the overflow is 0
the assignment is optimal, certified by ``(p, u)``.

* **Price rounds** (all experts at once), each a push and, in balanced groups, a pull:

  - *push*: an overfull expert ``e`` keeps its ``C_e`` tokens of largest margin (their value at ``e``
    minus their best other value) and raises its price by the margin of the first one it lets go,
    which moves to its best other expert (among equals, the one with the most room). The kept tokens
    still prefer ``e`` (other prices only rose), so (CS1) and (CS2') hold;
  - *pull*: an expert ``k`` tokens short of full lowers its price by the ``k``-th smallest loss a token
    elsewhere would take to move to it, and takes those ``k`` tokens (every token with a smaller loss,
    then tokens exactly at the cut, those of overfull experts first).

  One round works on the tokens of overfull experts and the columns of short ones, and removes most of
  the overflow; ties at a threshold can make tokens bounce between experts, so the rounds stop when the
  overflow falls by less than a tenth.
* **Shortest paths** on the E-node graph: moving a token ``t`` from expert ``a`` to ``b`` costs its reduced
  cost ``(S[t,a] - p_a) - (S[t,b] - p_b) >= 0``; edge ``a -> b`` costs the cheapest such move. Bellman-Ford
  from every overfull expert at once gives each expert its distance ``d_e`` and the overfull expert its
  path starts from (its *root*); a price update ``p_e += max(0, D - d_e)`` makes every edge of the
  shortest-path trees up to distance ``D`` cost 0 and keeps every cost ``>= 0``, and moving one token
  along each edge of a path removes one unit of overflow and keeps (CS1). The trees of different roots
  share no edge, so each root sends one unit at once to the nearest expert with a free slot in its tree
  (with slack, ``D`` stops at the nearest expert with a free slot that would stay short of full, which
  must not rise). This is the successive-shortest-path method of min-cost flow on the experts' graph,
  with one augmentation per root; it is exact and ends after at most as many searches as the overflow
  left by the rounds. Only the tokens of smallest margin can lie on a short path, so each search looks
  at the ``K`` tokens of smallest margin: a path through any other token is at least as long as the
  ``(K + 1)``-th margin (less what prices have risen since), and the candidates are drawn again when a
  path would reach that bound.

Everything is float64; batched over leading dimensions; the same code on CPU and CUDA.
"""
from __future__ import annotations

import math

import torch

from .allocation import stable_argsort_ids

INF = math.inf
MAX_ROUNDS = 32  # price rounds at most; they stop earlier once the overflow stops falling
STALL = 0.9  # by a tenth a round


def loads_of(assignment: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Tokens per expert ``(B, E)`` of an assignment ``(B, T)``."""
    ones = torch.ones_like(assignment)
    return torch.zeros(assignment.shape[0], n_experts, dtype=torch.long,
                       device=assignment.device).scatter_add_(1, assignment, ones)


def _best_other(values: torch.Tensor, assignment: torch.Tensor):
    """``(own value, best value at another expert)`` of every token; ``values (..., E)``, ``assignment
    (...)`` (-inf when E = 1)."""
    own = values.gather(-1, assignment[..., None])[..., 0]
    return own, values.scatter(-1, assignment[..., None], -INF).amax(-1)


def _margins(values: torch.Tensor, assignment: torch.Tensor, *, consume: bool = False) -> torch.Tensor:
    """Each token's value at its expert minus its best value elsewhere (>= 0 under CS1). ``consume``:
    ``values`` is a temporary of the caller's, overwritten here instead of copied (at T = 4096, E = 64
    a 2 MB copy less)."""
    own = values.gather(-1, assignment[..., None])[..., 0]
    masked = values.scatter_(-1, assignment[..., None], -INF) if consume else \
        values.scatter(-1, assignment[..., None], -INF)
    return (own - masked.amax(-1)).clamp_min(0)  # amax: no index needed, faster


def price_rounds(S: torch.Tensor, capacity: torch.Tensor, prices: torch.Tensor, assignment: torch.Tensor,
                 balanced: torch.Tensor, max_rounds: int = MAX_ROUNDS):
    """The first phase (module docstring). ``S (B, T, E)`` float64, ``capacity (B, E)`` long, ``balanced
    (B,)``: the groups with ``sum_e C_e = T``."""
    B, T, E = S.shape
    pull = bool(balanced.any())
    previous = None
    for _ in range(max_rounds):
        loads = loads_of(assignment, E)
        overflow = int((loads - capacity).clamp_min(0).sum(-1).max())
        if overflow == 0 or (previous is not None and overflow > STALL * previous):
            break
        previous = overflow
        prices, assignment = _push(S, capacity, prices, assignment, loads)
        if pull:
            prices, assignment = _pull(S, capacity, prices, assignment, balanced)
    return prices, assignment


def _push(S, capacity, prices, assignment, loads):
    """Every overfull expert keeps its ``C_e`` tokens of largest margin and prices the others out."""
    B, T, E = S.shape
    # only the tokens of overfull experts take part: rank them within their expert by decreasing
    # margin (then by token index), with two stable sorts on the flat list
    g, t = (loads > capacity).gather(1, assignment).nonzero(as_tuple=True)
    z = assignment[g, t]
    rows = S[g, t] - prices[g]  # (n, E) net values
    margin = _margins(rows, z)
    key = g * E + z
    by_margin = torch.argsort(margin, descending=True, stable=True)
    order = by_margin[stable_argsort_ids(key[by_margin], B * E)]  # (a radix sort on a CPU: the same permutation)
    counts = torch.bincount(key, minlength=B * E)
    first = (counts.cumsum(0) - counts)[key[order]]
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=S.device) - first)
    limit = capacity.view(-1)[key]
    raise_by = torch.zeros(B * E, dtype=S.dtype, device=S.device).scatter_reduce_(
        0, key, torch.where(rank == limit, margin, 0.0), reduce="amax", include_self=True)
    prices = prices + raise_by.view(B, E)
    # an evicted token goes to its best other expert, unless its own is still strictly better
    out = rank >= limit
    rows = rows[out] - raise_by.view(B, E)[g[out]]
    z = z[out]
    own, best_other = _best_other(rows, z)
    # among equally good other experts, the one with the most room (then the first)
    room = (capacity - loads)[g[out]]
    tied = rows.scatter(-1, z[:, None], -INF) == best_other[:, None]
    other = torch.where(tied, room, torch.iinfo(room.dtype).min).argmax(-1)
    return prices, assignment.index_put((g[out], t[out]), torch.where(own > best_other, z, other))


def _pull(S, capacity, prices, assignment, balanced):
    """Every expert short of full by ``k`` lowers its price until ``k`` more tokens find it as good as
    their own, and takes them (balanced groups only: with slack an expert that is not full must keep
    the lowest price)."""
    B, T, E = S.shape
    loads = loads_of(assignment, E)
    short = torch.where(balanced[:, None], capacity - loads, 0).clamp_min(0)
    most, count = int(short.max()), int((short > 0).sum(-1).max())
    if most == 0:
        return prices, assignment
    # only the experts short of full (F of them, padded with a full one where a group has fewer)
    deficit, expert = short.topk(count, dim=1)  # (B, F)
    values = S.gather(2, expert[:, None, :].expand(B, T, count)) - prices.gather(1, expert)[:, None, :]
    own = (S.gather(2, assignment[..., None]) - prices.gather(1, assignment)[..., None])[..., 0]  # (B, T)
    gap = (own[..., None] - values).masked_fill_(assignment[..., None] == expert[:, None, :], INF)
    gap = gap.transpose(1, 2)  # (B, F, T): what token t gives up to move to expert f
    width = min(most + 1, T)  # one past the largest deficit: is the cut tied?
    smallest = gap.topk(width, dim=2, largest=False, sorted=True)
    lower = torch.where(deficit > 0, smallest.values.gather(2, (deficit - 1).clamp_min(0)[..., None])[..., 0], 0.0)
    prices = prices.scatter_add(1, expert, -lower)
    # expert f takes exactly deficit_f tokens: every token with a gap below its price cut (they now
    # prefer f), then tokens exactly at the cut (indifferent), those of overfull experts first
    # Without a tie at the cut (the next smallest gap lies above it) the deficit_f smallest gaps are
    # exactly the tokens at or below the cut, whatever order the selection returned them in: a set,
    # so no second selection is needed. With a tie, the rule decides who is taken.
    following = smallest.values.gather(2, deficit.clamp_max(width - 1)[..., None])[..., 0]
    tied = (deficit > 0) & (deficit < width) & (following == lower)
    if not bool(tied.any()):
        taken = smallest.indices[..., :min(most, T)]  # (B, F, most)
    else:
        lower_ = lower[..., None]
        overfull = (loads > capacity).gather(1, assignment)[:, None, :]
        key = torch.where(gap < lower_, 0, torch.where(gap == lower_, torch.where(overfull, 1, 2), 3))
        key = key * T + torch.arange(T, device=S.device)
        taken = key.topk(min(most, T), dim=2, largest=False, sorted=True).indices  # (B, F, most)
    taken_ok = torch.arange(taken.shape[2], device=S.device) < deficit[..., None]
    wants = torch.zeros(B, count, T, dtype=torch.bool, device=S.device).scatter_(2, taken, taken_ok)
    # a token taken by several goes to the best of them, and stays where it is if that is better still
    # (its own price may have fallen too). Every token that now strictly prefers an expert f had a
    # gap below f's cut, so f took it: the moves keep CS1
    own = own + torch.zeros_like(prices).scatter_(1, expert, lower).gather(1, assignment)
    best, pick = (values + lower[:, None, :]).masked_fill_(~wants.transpose(1, 2), -INF).max(-1)
    return prices, torch.where(best >= own, expert.gather(1, pick), assignment)


def shortest_paths(S: torch.Tensor, capacity: torch.Tensor, prices: torch.Tensor, assignment: torch.Tensor,
                   balanced: torch.Tensor, candidates: int | None = None):
    """The second phase (module docstring): exact, ends with no expert over capacity."""
    B, T, E = S.shape
    device = S.device
    batch = torch.arange(B, device=device)[:, None]
    eye = torch.eye(E, dtype=torch.bool, device=device)
    nodes = torch.arange(E, device=device).expand(B, E)
    # with sum_e C_e = T (balanced) every expert ends full, so a target may take a price rise and stay
    # short of full (CS2' asks nothing of it); with slack it may not (see `limit` below)
    width = candidates or 4 * E  # candidates beyond 4 per unit of overflow; doubled when too few
    while True:
        loads = loads_of(assignment, E)
        overflow = int((loads - capacity).clamp_min(0).sum(-1).max())
        if overflow == 0:
            return prices, assignment
        margin = _margins(S - prices[:, None, :], assignment, consume=True)
        K = min(T, width + 4 * overflow)
        if K < T:
            smallest = margin.topk(K + 1, dim=1, largest=False)
            chosen, bound = smallest.indices[:, :K], smallest.values[:, K]
        else:
            chosen = torch.arange(T, device=device).expand(B, T)
            bound = torch.full((B,), INF, dtype=S.dtype, device=device)
        S_k = S.gather(1, chosen[..., None].expand(B, K, E))
        z_k = torch.cat([assignment.gather(1, chosen), assignment.new_zeros(B, 1)], 1)  # slot K: a sink
        slots = torch.arange(K, device=device)
        moved = False
        while True:
            over = loads > capacity
            active = over.any(-1)
            if not bool(active.any()):
                break
            values = S_k - prices[:, None, :]
            own = z_k[:, :K, None]
            # (B, K, E): move token to expert e. CS1 makes it >= 0; clamping the rounding error keeps
            # float64 from closing a cycle of cost -1e-16 that Bellman-Ford would go round for ever
            cost = (values.gather(2, own) - values).clamp_min_(0)
            source = own.expand(B, K, E)
            edge = torch.full((B, E, E), INF, dtype=S.dtype, device=device).scatter_reduce(
                1, source, cost, reduce="amin", include_self=True).masked_fill_(eye, INF)
            # Bellman-Ford from every overfull expert (all costs >= 0: at most E - 1 relaxations); each
            # expert also learns the overfull expert its shortest path starts from (its root)
            dist = torch.where(over, 0.0, INF).to(S.dtype)
            parent = torch.full((B, E), -1, dtype=torch.long, device=device)
            root = torch.where(over, nodes, -1)
            for _ in range(E - 1):
                best, via = (dist[:, :, None] + edge).min(1)
                better = best < dist
                if not bool(better.any()):
                    break
                dist = torch.where(better, best, dist)
                parent = torch.where(better, via, parent)
                root = torch.where(better, root.gather(1, via), root)
            # every root sends one token to the nearest expert with a free slot in its tree: the trees
            # are disjoint, so the paths share no token. A path through a token outside the candidates
            # costs >= bound: trust only shorter ones
            free = loads < capacity
            reach = torch.where(free & (dist <= bound[:, None]), dist, INF)
            home = root.clamp_min(0)
            nearest = torch.full_like(dist, INF).scatter_reduce(1, home, reach, reduce="amin")
            is_nearest = (reach < INF) & (reach == nearest.gather(1, home))
            target = torch.full_like(root, E).scatter_reduce(
                1, home, torch.where(is_nearest, nodes, E), reduce="amin")  # (B, E) per root, E: none
            # D: the distance every price is lifted to. With slack, an expert with a free slot that
            # would stay short of full must not rise, so D stops at the nearest such expert
            sent = torch.zeros((B, E + 1), dtype=torch.bool, device=device).scatter_(1, target, True)[:, :E]
            stays_short = free & ~(sent & (capacity - loads == 1))
            limit = torch.where(balanced, INF, torch.where(stays_short, dist, INF).amin(-1))
            D = torch.minimum(torch.where(nearest < INF, nearest, -INF).amax(-1), limit)
            send = (nearest <= D[:, None]) & (target < E)
            ok = active & send.any(-1)
            moved = moved or bool(ok.any())
            D = torch.where(ok, D, 0.0)
            prices = prices + (D[:, None] - dist).clamp_min(0)
            bound = bound - D
            # the cheapest token of every edge (the first one, for determinism), then walk the paths back
            tight = cost == edge.gather(1, source)
            token = torch.full((B, E, E), K, dtype=torch.long, device=device).scatter_reduce(
                1, source, torch.where(tight, slots[None, :, None], K), reduce="amin", include_self=True)
            node = torch.where(send, target, -1)
            for _ in range(E):  # a path has at most E - 1 edges
                if not bool((node >= 0).any()):
                    break
                prev = parent.gather(1, node.clamp_min(0))
                move = (node >= 0) & (prev >= 0)
                t = torch.where(move, token[batch, prev.clamp_min(0), node.clamp_min(0)], K)
                z_k = z_k.scatter(1, t, node.clamp_min(0))
                m = move.long()
                loads = loads.scatter_add(1, node.clamp_min(0), m).scatter_add(1, prev.clamp_min(0), -m)
                node = torch.where(move, prev, -1)
            if not bool(ok[active].all()):
                break  # some group reached its bound: draw its candidates again
        assignment = assignment.scatter(1, chosen, z_k[:, :K])
        if not moved:
            width *= 2  # no path was short enough to trust: look at more tokens


def transport_assignment(S: torch.Tensor, capacity: torch.Tensor):
    """Optimal ``(assignment (B, T), prices (B, E))`` of (P) for ``S (B, T, E)`` and ``capacity (B, E)``
    with ``sum_e C_e >= T``. ``S`` is converted to float64."""
    S = S.double()
    prices = torch.zeros(S.shape[0], S.shape[2], dtype=S.dtype, device=S.device)
    assignment = S.argmax(-1)
    balanced = capacity.sum(-1) == S.shape[1]
    prices, assignment = price_rounds(S, capacity, prices, assignment, balanced)
    prices, assignment = shortest_paths(S, capacity, prices, assignment, balanced)
    # pulling may have left prices below 0 in a balanced group; there every expert is full, so one
    # shift of all prices (and of all utilities, the other way) keeps the certificate and makes p >= 0
    prices = torch.where(balanced[:, None], prices - prices.amin(-1, keepdim=True), prices)
    return assignment, prices
