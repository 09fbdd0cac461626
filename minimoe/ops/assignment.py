"""Balanced linear assignment: each token to one expert, at most ``capacity`` tokens per expert.

Book: chapter 2, section "The two limits of eps" (the assignment linear program is
the eps -> 0 limit of the entropic plan) and "BASE layers". The problem

    max_z  sum_t scores[t, z_t]   subject to   #{t : z_t = e} <= capacity   for every expert e

is a transportation problem; copying each expert ``capacity`` times turns it into an ordinary
assignment problem between T tokens and E * capacity slots, which is how scipy and the auction see it.

* ``method="auto"``: the exact solvers of :func:`minimoe.ops.solve_assignment` (chapter 5) with its
  rule: a sort for E = 2, cycle cancelling in torch when k << n (T >= 1024 and T / E >= 64) or when
  scipy is not installed, else scipy. Exact, and needs nothing beyond torch.
* ``method="scipy"``: :func:`scipy.optimize.linear_sum_assignment` on the (T, E * capacity) matrix
  (Jonker-Volgenant, exact), one problem at a time on the CPU. scipy is optional (the ``test``
  extra); this method raises ``ImportError`` without it.
* ``method="auction"``: Bertsekas' auction algorithm in torch, all problems of the batch at once
  without leaving torch. It is much slower than scipy at the sizes of this book, even on a GPU
  after counting the copy to the host (thousands of bidding rounds; see ``python -m benchmarks``),
  so ``"auto"`` does not use it; the auction is there as a pure-torch reference. Each round every unassigned
  token bids for its best expert, raising that expert's price by its margin over the second-best
  choice plus ``eps``; an expert keeps its ``capacity`` highest bids. With eps-scaling, the result is
  within ``n * eps_final`` of the optimum (n = E * capacity), and eps_final is ``1e-6 / n`` times the
  score range, so the total score is within ``1e-6 * range`` of optimal; exact whenever the best
  assignment beats the second best by more than that.
"""
from __future__ import annotations

import math

import torch

from ._checks import check_int, check_scores
from .gumbel_matching import _auto_method, _cycle_cancelling, _require_scipy, _scipy_assignment, _top2

METHODS = ("auto", "scipy", "auction")


def linear_assignment(scores: torch.Tensor, capacity: int, *, method: str = "auto") -> torch.Tensor:
    """The expert of each token maximising the total score, each expert taking at most ``capacity``.

    Args:
        scores: ``(..., T, E)``; every leading dimension is an independent problem.
        capacity: tokens per expert, ``E * capacity >= T`` (otherwise some token has nowhere to go).
            ``capacity = T // E`` with ``E`` dividing ``T`` is the perfectly balanced BASE assignment.
        method: ``"auto"`` (exact, with or without scipy: see the module docstring), ``"scipy"``
            (exact, needs scipy; tensors on other devices are copied to the host and back) or
            ``"auction"`` (batched torch, within ``1e-6`` times the score range of optimal).

    Returns:
        ``LongTensor (..., T)`` of expert indices. Ties between equally good assignments are broken
        by the solver.
    """
    check_scores(scores)
    *batch, T, E = scores.shape
    capacity = check_int(capacity, "capacity", low=1)
    if E * capacity < T:
        raise ValueError(f"capacity={capacity} is too small: {E} experts x {capacity} slots cannot hold "
                         f"{T} tokens (need capacity >= {-(-T // E)})")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "scipy":
        _require_scipy('linear_assignment(method="scipy")')
    capacity = min(capacity, T)  # more slots than tokens never helps
    flat = scores.detach().reshape(math.prod(batch), T, E)
    if T == 0 or flat.shape[0] == 0:
        return torch.zeros((*batch, T), dtype=torch.long, device=scores.device)
    if method == "auto":
        method = _auto_method(T, E)  # "top2", "cycle" or "assignment" (scipy)
    if method in ("scipy", "assignment"):
        experts = _scipy_assignment(flat, capacity)
    elif method == "auction":
        experts = _auction_assignment(flat, capacity)
    elif E == 1:
        experts = torch.zeros((flat.shape[0], T), dtype=torch.long, device=scores.device)
    elif method == "top2":
        experts = _top2(flat.double(), capacity)
    else:
        experts = _cycle_cancelling(flat.double(), capacity)
    return experts.reshape(*batch, T)


def _auction_assignment(scores: torch.Tensor, capacity: int, *, scaling: float = 5.0,
                        max_rounds: int = 200_000) -> torch.Tensor:
    """Jacobi auction with eps-scaling on the symmetric problem (dummy tokens fill spare slots).

    Prices live on slots (``price[b, e, c]``); an expert's asking price is its cheapest slot. A token's
    bid for its best expert ``e1`` is ``scores[e1] - w2 + eps`` where ``w2`` is its second-best value
    (another expert, or the second-cheapest slot of ``e1``), so the token would still be within eps
    of its best option at the price it pays (eps-complementary slackness). Float64 throughout: bids
    must keep rising by eps, which float32 cannot resolve at large prices.
    """
    B, T, E = scores.shape
    device = scores.device
    n = E * capacity
    S = torch.zeros(B, n, E, dtype=torch.float64, device=device)  # dummies (rows >= T) score 0
    S[:, :T] = scores.double()
    spread = (S.amax(dim=(1, 2)) - S.amin(dim=(1, 2))).clamp_min(1e-12)  # (B,)
    eps_final = spread * 1e-6 / n
    eps = spread / 4
    price = torch.zeros(B, E, capacity, dtype=torch.float64, device=device)
    holder = torch.full((B, E, capacity), -1, dtype=torch.long, device=device)
    batch_index = torch.arange(B, device=device)
    owner = torch.full((B, n), -1, dtype=torch.long, device=device)  # expert of each token
    paid = torch.zeros(B, n, dtype=torch.float64, device=device)  # price of each token's slot
    rounds = 0
    while True:
        # A new phase keeps every token that is still within the new eps of its best option and
        # frees the others (their slots keep their prices); the first phase starts empty.
        if bool((owner >= 0).any()):
            ask = price.amin(-1)
            best = (S - ask[:, None, :]).amax(-1)
            mine = S.gather(-1, owner.clamp_min(0)[..., None])[..., 0] - paid
            unhappy = (owner >= 0) & (mine < best - eps[:, None])
            holder = torch.where(unhappy.gather(1, holder.clamp_min(0).reshape(B, -1)).reshape_as(holder)
                                 & (holder >= 0), -1, holder)
            owner = torch.where(unhappy, -1, owner)
        while True:
            free = owner < 0
            if not free.any():
                break
            rounds += 1
            if rounds > max_rounds:
                raise RuntimeError("linear_assignment(method='auction') did not finish in "
                                   f"{max_rounds} rounds; use method='auto' (exact)")
            cheapest = price.topk(min(2, capacity), dim=-1, largest=False).values  # (B, E, <=2)
            ask = cheapest[..., 0]
            second_ask = cheapest[..., 1] if capacity > 1 else torch.full_like(ask, float("inf"))
            value = S - ask[:, None, :]  # (B, n, E)
            if E > 1:
                top = value.topk(2, dim=-1)
                e1, w_other = top.indices[..., 0], top.values[..., 1]
            else:
                e1 = torch.zeros(B, n, dtype=torch.long, device=device)
                w_other = torch.full_like(value[..., 0], -float("inf"))
            s1 = S.gather(-1, e1[..., None])[..., 0]
            w_same = s1 - second_ask.gather(-1, e1)
            bid = s1 - torch.maximum(w_other, w_same) + eps[:, None]
            # no second option at all (one expert with one slot): bid the asking price plus eps
            bid = torch.where(torch.isfinite(bid), bid, ask.gather(-1, e1) + eps[:, None])
            # candidates per expert: its current holders (at their prices) and the new bids
            cand_b = torch.cat([batch_index[:, None, None].expand(B, E, capacity).reshape(B, -1),
                                batch_index[:, None].expand(B, n)], 1)
            cand_e = torch.cat([torch.arange(E, device=device)[None, :, None].expand(B, E, capacity).reshape(B, -1),
                                e1], 1)
            cand_t = torch.cat([holder.reshape(B, -1), torch.arange(n, device=device).expand(B, n)], 1)
            cand_p = torch.cat([price.reshape(B, -1), bid], 1)
            valid = torch.cat([holder.reshape(B, -1) >= 0, free], 1)
            cand_p = torch.where(valid, cand_p, -float("inf"))
            # rank candidates within (problem, expert) by price, highest first
            groups = (cand_b * E + cand_e).reshape(-1)
            order = torch.argsort(cand_p.reshape(-1), descending=True, stable=True)
            order = order[torch.argsort(groups[order], stable=True)]
            group = groups[order]
            starts = torch.searchsorted(group, group, right=False)
            rank = torch.arange(group.numel(), device=device) - starts
            keep = (rank < capacity) & valid.reshape(-1)[order] & torch.isfinite(cand_p.reshape(-1)[order])
            # slots: the kept candidates in rank order; unkept slots become free at their old price
            kept = order[keep]
            kb, ke, kr = (group[keep] // E), (group[keep] % E), rank[keep]
            new_price = price.clone()
            new_holder = torch.full_like(holder, -1)
            new_price[kb, ke, kr] = cand_p.reshape(-1)[kept]
            new_holder[kb, ke, kr] = cand_t.reshape(-1)[kept]
            # a slot left without a holder keeps the lowest price the expert had (prices never fall)
            empty = new_holder < 0
            new_price = torch.where(empty, torch.maximum(price, ask[..., None]), new_price)
            price, holder = new_price, new_holder
            owner = torch.full((B, n), -1, dtype=torch.long, device=device)
            held = holder >= 0
            hb = batch_index[:, None, None].expand_as(holder)[held]
            he = torch.arange(E, device=device)[None, :, None].expand_as(holder)[held]
            owner[hb, holder[held]] = he
            paid[hb, holder[held]] = price[held]
        if bool((eps <= eps_final).all()):
            return owner[:, :T]
        eps = torch.maximum(eps / scaling, eps_final)
