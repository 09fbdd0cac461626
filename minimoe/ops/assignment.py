"""Balanced linear assignment: each token to one expert, at most ``capacity`` tokens per expert.

Book: chapter 2, sections "The two limits of eps" (the assignment linear program is the eps -> 0
limit of the entropic plan), "BASE layers" and "Solving the assignment exactly". The problem

    max_z  sum_t scores[t, z_t]   subject to   #{t : z_t = e} <= capacity_e   for every expert e

is a transportation problem with E << T columns. Its dual has one price per expert and one utility
per token, and that is what the solver works with:

* ``method="auto"``: :func:`minimoe.ops.transport.transport_assignment`, exact, pure torch, batched,
  on the device of ``scores``: price rounds that move tokens away from overfull experts in bulk, then
  shortest augmenting paths on the E-node graph of the experts (see that module). With
  ``return_duals=True`` it also returns the prices and utilities that certify the optimum.
* ``method="scipy"``: :func:`scipy.optimize.linear_sum_assignment` on the (T, sum_e capacity_e) matrix of
  replicated columns (Jonker-Volgenant, exact), one problem at a time on the host. scipy is optional
  (the ``test`` extra): this method is the test oracle, and raises ``ImportError`` without it.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._checks import check_bool, check_int, check_scores
from .transport import transport_assignment

METHODS = ("auto", "scipy")


class AssignmentResult(NamedTuple):
    """What :func:`linear_assignment` returns with ``return_duals=True``: the optimal ``assignment``
    ``(..., T)``, and a dual certificate of its optimality, ``prices (..., E) >= 0`` and
    ``utilities (..., T)`` (float64) with ``utilities[t] + prices[e] >= scores[t, e]`` for every pair,
    equality on the assignment, and a price of 0 for every expert that is not full."""

    assignment: torch.Tensor
    prices: torch.Tensor
    utilities: torch.Tensor


def linear_assignment(scores: torch.Tensor, capacity, *, method: str = "auto", return_duals: bool = False):
    """The expert of each token maximising the total score, expert ``e`` taking at most ``capacity_e``.

    Args:
        scores: ``(..., T, E)``; every leading dimension is an independent problem. Solved in float64.
        capacity: tokens per expert: an int (the same for every expert), or a sequence / integer tensor
            broadcastable to ``(..., E)``; each ``>= 0``, and ``sum_e capacity_e >= T`` (otherwise some
            token has nowhere to go). ``capacity = T // E`` with ``E`` dividing ``T`` is the perfectly
            balanced BASE assignment.
        method: ``"auto"`` (exact, pure torch, on the device of ``scores``) or ``"scipy"`` (exact, needs
            scipy; tensors on other devices are copied to the host and back).
        return_duals: also return the certificate (``method="auto"`` only): an :class:`AssignmentResult`.

    Returns:
        ``LongTensor (..., T)`` of expert indices, or an :class:`AssignmentResult`. Ties between equally
        good assignments are broken deterministically (the same input gives the same output).
    """
    check_scores(scores)
    *batch, T, E = scores.shape
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return_duals = check_bool(return_duals, "return_duals")
    if return_duals and method != "auto":
        raise ValueError("return_duals=True needs method='auto' (scipy's solver returns no prices)")
    B = math.prod(batch)
    if torch.compiler.is_compiling() and not return_duals and isinstance(capacity, int):
        # compiled: the solver as one opaque operation (its rounds depend on the data)
        check_int(capacity, "capacity", low=-(-T // max(E, 1)) if T else 1)
        flat = scores.detach().reshape(B, T, E)
        return torch.ops.minimoe.linear_assignment(flat, capacity, method).reshape(*batch, T)
    slots = _capacities(capacity, batch, E, T, scores.device)  # (B, E)
    flat = scores.detach().reshape(B, T, E)
    if T == 0 or B == 0 or E == 1:
        assignment = torch.zeros((B, T), dtype=torch.long, device=scores.device)
        prices = torch.zeros((B, E), dtype=torch.float64, device=scores.device)
    elif method == "scipy":
        require_scipy('linear_assignment(method="scipy")')
        assignment = _scipy_assignment(flat, slots)
    else:
        assignment, prices = transport_assignment(flat, slots)
    assignment = assignment.reshape(*batch, T)
    if not return_duals:
        return assignment
    values = flat.double() - prices[:, None, :]
    utilities = values.gather(2, assignment.reshape(B, T, 1))[..., 0] if T else values.new_zeros(B, 0)
    return AssignmentResult(assignment, prices.reshape(*batch, E), utilities.reshape(*batch, T))


@torch.library.custom_op("minimoe::linear_assignment", mutates_args=())
def _assignment_op(scores: torch.Tensor, capacity: int, method: str) -> torch.Tensor:
    """:func:`linear_assignment` of ``(B, T, E)`` scores with an int capacity, as one operation of a
    compiled graph (``torch.compile`` sees its output's shape, not its rounds)."""
    return linear_assignment(scores, capacity, method=method).clone()


@_assignment_op.register_fake
def _(scores, capacity, method):
    return scores.new_empty(scores.shape[:-1], dtype=torch.long)


def _scipy_available() -> bool:
    try:
        import scipy.optimize  # noqa: F401
    except ImportError:
        return False
    return True


def require_scipy(what: str) -> None:
    if not _scipy_available():
        raise ImportError(f"{what} needs scipy, which is not installed (it is optional): pip install scipy, "
                          "or pip install 'minimoe[test]'. method=\"auto\" works without it (an exact "
                          "pure-torch solver).")


def _capacities(capacity, batch, E, T, device) -> torch.Tensor:
    """``capacity`` as a ``(B, E)`` long tensor, checked: integers >= 0, room for every token."""
    if isinstance(capacity, (torch.Tensor, list, tuple)):
        values = torch.as_tensor(capacity, device=device)
        if values.is_floating_point() or values.dtype == torch.bool:
            raise TypeError(f"capacity must hold integers, got dtype {values.dtype}")
        try:
            values = values.long().broadcast_to((*batch, E)).reshape(-1, E) if E else \
                values.long().reshape(-1, 0)
        except RuntimeError:
            raise ValueError(f"capacity must be an int or broadcast to shape {(*batch, E)} (one per expert), "
                             f"got shape {tuple(values.shape)}") from None
        if bool((values < 0).any()):
            raise ValueError(f"capacity must be >= 0 for every expert, got {values.min().item()}")
    else:
        check_int(capacity, "capacity", low=1)
        values = torch.full((math.prod(batch), E), capacity, dtype=torch.long, device=device)
    if values.shape[0] and T and bool((values.sum(-1) < T).any()):
        room = int(values.sum(-1).min())
        raise ValueError(f"capacity is too small: the experts have {room} slots for {T} tokens "
                         f"(an int capacity needs >= {-(-T // max(E, 1))})")
    return values.clamp_max(T)  # more slots than tokens never helps


def _scipy_assignment(scores: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
    """(B, T, E) scores, (B, E) capacities -> (B, T): scipy's Jonker-Volgenant on replicated columns."""
    import numpy as np
    from scipy.optimize import linear_sum_assignment

    B, T, E = scores.shape
    values = scores.double().cpu().numpy()
    out = np.empty((B, T), dtype=np.int64)
    for b in range(B):
        columns = np.repeat(np.arange(E), capacity[b].cpu().numpy())  # column j belongs to expert columns[j]
        rows, cols = linear_sum_assignment(values[b][:, columns], maximize=True)
        out[b, rows] = columns[cols]
    return torch.from_numpy(out).to(scores.device)
