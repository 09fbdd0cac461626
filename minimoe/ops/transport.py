"""The exact capacitated assignment of T tokens to E << T experts, through the experts' prices.

Book: chapter 2, section "Solving the assignment exactly". The problem

    max_z  sum_t S[t, z_t]   subject to   #{t : z_t = e} <= C_e   for every expert e      (P)

is a transportation problem. Its dual has one price ``p_e >= 0`` per expert and one utility ``u_t`` per
token:

    min  sum_t u_t + sum_e C_e p_e   subject to   u_t + p_e >= S[t, e]   for all t, e.      (D)

An assignment ``z`` and prices ``p`` are both optimal exactly when (complementary slackness)

    (CS1) every token takes an expert of largest ``S[t, e] - p_e``  (then ``u_t = S[t, z_t] - p_{z_t}``),
    (CS2) an expert with a positive price is full,  and  (P) holds: no expert is over capacity.

Both phases below keep (CS1) and the weaker (CS2') "an expert with a positive price holds at least
``C_e`` tokens" at every step, starting from ``p = 0`` and every token at its best expert; only the
capacities are violated, by the *overflow* ``sum_e max(0, n_e - C_e)``. Once the overflow is 0, (CS2')
is (CS2) and the assignment is optimal, certified by ``(p, u)``.

* **Price rounds** (all experts at once): an overfull expert ``e`` keeps its ``C_e`` tokens of largest
  margin (their value at ``e`` minus their best other value) and raises its price by the margin of the
  first one it lets go, which then moves to its best other expert. The kept tokens still prefer ``e``
  (other prices only rose), so (CS2') holds. One round is a sort and a few passes over the values of
  the tokens of overfull experts (the others do not move), and removes most of the overflow; ties at
  the threshold can make tokens bounce between experts, so the rounds stop when the overflow stops
  falling.
* **Shortest paths** on the E-node graph: moving a token ``t`` from expert ``a`` to ``b`` costs its reduced
  cost ``(S[t,a] - p_a) - (S[t,b] - p_b) >= 0``; edge ``a -> b`` costs the cheapest such move. A shortest
  path (Bellman-Ford from every overfull expert) to the nearest expert with a free slot, a price
  update ``p_e += max(0, D - d_e)`` (which makes the path's edges cost 0 and keeps every cost >= 0),
  and moving one token along each edge removes one unit of overflow and keeps (CS1) and (CS2'). This is
  the successive-shortest-path method of min-cost flow on the experts' graph; it is exact and ends after
  as many paths as the overflow left by the rounds. Only the tokens of smallest margin can lie on a
  short path, so each path is searched among the ``K`` tokens of smallest margin: a path through any
  other token is at least as long as the ``(K + 1)``-th margin (less what prices have risen since),
  and the candidates are drawn again when a path would reach that bound.

Everything is float64; batched over leading dimensions; the same code on CPU and CUDA.
"""
from __future__ import annotations

import math

import torch

INF = math.inf
MAX_ROUNDS = 32  # price rounds at most; they stop earlier once the overflow stops falling


def loads_of(assignment: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Tokens per expert ``(B, E)`` of an assignment ``(B, T)``."""
    ones = torch.ones_like(assignment)
    return torch.zeros(assignment.shape[0], n_experts, dtype=torch.long,
                       device=assignment.device).scatter_add_(1, assignment, ones)


def _best_other(values: torch.Tensor, assignment: torch.Tensor):
    """``(own value, best value at another expert, that expert)`` of every token; ``values (..., E)``,
    ``assignment (...)`` (-inf when E = 1)."""
    own = values.gather(-1, assignment[..., None])[..., 0]
    other, index = values.scatter(-1, assignment[..., None], -INF).max(-1)
    return own, other, index


def _margins(values: torch.Tensor, assignment: torch.Tensor) -> torch.Tensor:
    """Each token's value at its expert minus its best value elsewhere (>= 0 under CS1)."""
    own = values.gather(-1, assignment[..., None])[..., 0]
    other = values.scatter(-1, assignment[..., None], -INF).amax(-1)  # amax: no index needed, faster
    return (own - other).clamp_min(0)


def price_rounds(S: torch.Tensor, capacity: torch.Tensor, prices: torch.Tensor, assignment: torch.Tensor,
                 max_rounds: int = MAX_ROUNDS):
    """The first phase (module docstring). ``S (B, T, E)`` float64, ``capacity (B, E)`` long."""
    B, T, E = S.shape
    previous, stalled = None, 0
    for _ in range(max_rounds):
        loads = loads_of(assignment, E)
        overflow = int((loads - capacity).clamp_min(0).sum(-1).max())
        if overflow == 0:
            break
        stalled = stalled + 1 if previous is not None and overflow >= previous else 0
        if stalled >= 2:
            break
        previous = overflow
        # only the tokens of overfull experts take part in a round: rank them within their expert by
        # decreasing margin (then by token index), with two stable sorts on the flat list
        g, t = (loads > capacity).gather(1, assignment).nonzero(as_tuple=True)
        z = assignment[g, t]
        rows = S[g, t] - prices[g]  # (n, E) net values
        margin = _margins(rows, z)
        key = g * E + z
        by_margin = torch.argsort(margin, descending=True, stable=True)
        order = by_margin[torch.argsort(key[by_margin], stable=True)]
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
        own, best_other, other = _best_other(rows, z)
        assignment = assignment.index_put((g[out], t[out]), torch.where(own > best_other, z, other))
    return prices, assignment


def shortest_paths(S: torch.Tensor, capacity: torch.Tensor, prices: torch.Tensor, assignment: torch.Tensor,
                   candidates: int | None = None):
    """The second phase (module docstring): exact, ends with no expert over capacity."""
    B, T, E = S.shape
    device = S.device
    batch = torch.arange(B, device=device)
    eye = torch.eye(E, dtype=torch.bool, device=device)
    width = candidates or 4 * E  # candidates beyond 4 per unit of overflow; doubled when too few
    while True:
        loads = loads_of(assignment, E)
        overflow = int((loads - capacity).clamp_min(0).sum(-1).max())
        if overflow == 0:
            return prices, assignment
        margin = _margins(S - prices[:, None, :], assignment)
        K = min(T, width + 4 * overflow)
        if K < T:
            smallest = margin.topk(K + 1, dim=1, largest=False)
            chosen, bound = smallest.indices[:, :K], smallest.values[:, K]
        else:
            chosen = torch.arange(T, device=device).expand(B, T)
            bound = torch.full((B,), INF, dtype=S.dtype, device=device)
        S_k = S.gather(1, chosen[..., None].expand(B, K, E))
        z_k = assignment.gather(1, chosen)
        slots = torch.arange(K, device=device)
        moved = False
        while True:
            over = loads > capacity
            active = over.any(-1)
            if not bool(active.any()):
                break
            values = S_k - prices[:, None, :]
            cost = values.gather(2, z_k[..., None]) - values  # (B, K, E): move token to expert e
            source = z_k[..., None].expand(B, K, E)
            edge = torch.full((B, E, E), INF, dtype=S.dtype, device=device).scatter_reduce(
                1, source, cost, reduce="amin", include_self=True).masked_fill_(eye, INF)
            # Bellman-Ford from every overfull expert (all costs >= 0: at most E - 1 relaxations)
            dist = torch.where(over, 0.0, INF).to(S.dtype)
            parent = torch.full((B, E), -1, dtype=torch.long, device=device)
            for _ in range(E - 1):
                best, via = (dist[:, :, None] + edge).min(1)
                better = best < dist
                if not bool(better.any()):
                    break
                dist, parent = torch.where(better, best, dist), torch.where(better, via, parent)
            reach, target = torch.where(loads < capacity, dist, INF).min(-1)
            # a path through a token outside the candidates costs >= bound: trust only shorter ones
            ok = active & (reach <= bound)
            moved = moved or bool(ok.any())
            reach = torch.where(ok, reach, 0.0)
            prices = prices + torch.where(ok[:, None], (reach[:, None] - dist).clamp_min(0), 0.0)
            bound = bound - reach
            # the cheapest token of every edge (the first one, for determinism), then walk the path back
            tight = cost == edge.gather(1, source)
            token = torch.full((B, E, E), K, dtype=torch.long, device=device).scatter_reduce(
                1, source, torch.where(tight, slots[None, :, None], K), reduce="amin", include_self=True)
            node = torch.where(ok, target, -1)
            while bool((node >= 0).any()):
                step = node >= 0
                prev = parent.gather(1, node.clamp_min(0)[:, None])[:, 0]
                move = step & (prev >= 0)
                t = token[batch, prev.clamp_min(0), node.clamp_min(0)]
                z_k = torch.where(move[:, None] & (slots[None] == t[:, None]), node[:, None], z_k)
                gain = torch.zeros_like(loads).scatter_(1, node.clamp_min(0)[:, None], move[:, None].long())
                loss = torch.zeros_like(loads).scatter_(1, prev.clamp_min(0)[:, None], move[:, None].long())
                loads = loads + gain - loss
                node = torch.where(move, prev, -1)
            if not bool(ok[active].all()):
                break  # some group reached its bound: draw its candidates again
        assignment = assignment.scatter(1, chosen, z_k)
        if not moved:
            width *= 2  # no path was short enough to trust: look at more tokens


def transport_assignment(S: torch.Tensor, capacity: torch.Tensor):
    """Optimal ``(assignment (B, T), prices (B, E))`` of (P) for ``S (B, T, E)`` and ``capacity (B, E)``
    with ``sum_e C_e >= T``. ``S`` is converted to float64."""
    S = S.double()
    prices = torch.zeros(S.shape[0], S.shape[2], dtype=S.dtype, device=S.device)
    assignment = S.argmax(-1)
    prices, assignment = price_rounds(S, capacity, prices, assignment)
    prices, assignment = shortest_paths(S, capacity, prices, assignment)
    return assignment, prices
