"""The selection problems of chapter 6 written as linear programs, for ``scipy.optimize.linprog``.

Book: chapter 6, section "The global selection problem" (the LPs and Proposition 6.1, integrality)
and "The dual: one threshold for everyone". For teaching and tests, not for routing: routers use
:func:`minimoe.ops.global_topc` and the allocations, which give the same optimum in
``O(TE log c)`` instead of an LP solve.

The variable is ``x = vec(X)`` (row-major: ``x[t * E + e] = X[t, e]``), ``0 <= x <= 1``, and the
objective ``max <S, X>`` is passed to ``linprog`` (a minimiser) as ``min <-S, X>``. Constraints:

* ``budget=c``: ``sum X = c`` (``budget_equality=True``, the package's exact budget) or ``<= c``
  (USMoE's eq. 2 as printed);
* ``per_token=k``: every row sums to ``k`` (token choice, eq. 3);
* ``per_expert=C``: every column sums to ``C`` (expert choice, eq. 4).

Both ``per_token`` and ``per_expert`` together give the balanced assignment of chapter 2.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class SelectionLP(NamedTuple):
    """Keyword arguments for ``scipy.optimize.linprog`` (``c`` is the cost vector ``-vec(S)``)."""

    c: np.ndarray
    A_ub: np.ndarray | None
    b_ub: np.ndarray | None
    A_eq: np.ndarray | None
    b_eq: np.ndarray | None
    bounds: tuple


class SelectionLPSolution(NamedTuple):
    """The LP optimum: ``x (T, E)``, the objective ``<S, x>``, and the dual variables of the maximisation
    (``budget_dual``: the shared threshold lambda; ``token_duals (T,)`` / ``expert_duals (E,)``: one
    threshold per token / per expert; None where that constraint is absent)."""

    x: np.ndarray
    objective: float
    budget_dual: float | None
    token_duals: np.ndarray | None
    expert_duals: np.ndarray | None


def selection_lp(scores, *, budget: int | None = None, budget_equality: bool = False,
                 per_token: int | None = None, per_expert: int | None = None) -> SelectionLP:
    """Build the LP relaxation of a selection problem on ``scores (T, E)``; see the module docstring."""
    S = _as_matrix(scores)
    T, E = S.shape
    if budget is None and per_token is None and per_expert is None:
        raise ValueError("give at least one of budget, per_token, per_expert")
    rows_ub, rhs_ub, rows_eq, rhs_eq = [], [], [], []
    if budget is not None:
        if not 0 <= budget <= T * E:
            raise ValueError(f"budget must be in [0, {T * E}], got {budget}")
        (rows_eq if budget_equality else rows_ub).append(np.ones((1, T * E)))
        (rhs_eq if budget_equality else rhs_ub).append([budget])
    if per_token is not None:
        if not 0 <= per_token <= E:
            raise ValueError(f"per_token must be in [0, {E}], got {per_token}")
        rows_eq.append(np.kron(np.eye(T), np.ones((1, E))))  # row t: the E entries of token t
        rhs_eq.append(np.full(T, per_token))
    if per_expert is not None:
        if not 0 <= per_expert <= T:
            raise ValueError(f"per_expert must be in [0, {T}], got {per_expert}")
        rows_eq.append(np.kron(np.ones((1, T)), np.eye(E)))  # row e: the T entries of expert e
        rhs_eq.append(np.full(E, per_expert))

    def stack(rows, rhs):
        return (np.vstack(rows), np.concatenate([np.asarray(r, dtype=float) for r in rhs])) if rows else (None, None)

    A_ub, b_ub = stack(rows_ub, rhs_ub)
    A_eq, b_eq = stack(rows_eq, rhs_eq)
    return SelectionLP(-S.reshape(-1), A_ub, b_ub, A_eq, b_eq, (0.0, 1.0))


def solve_selection_lp(scores, **constraints) -> SelectionLPSolution:
    """Solve :func:`selection_lp` with HiGHS and return the solution with its dual variables.

    HiGHS reports the sensitivity of the *minimised* cost to each right-hand side; the dual of the
    maximisation is its negative (a larger budget can only raise ``<S, X>``). Needs scipy (an optional
    dependency: ``pip install scipy``); :func:`selection_lp` itself does not."""
    try:
        from scipy.optimize import linprog
    except ImportError as error:
        raise ImportError("solve_selection_lp needs scipy (HiGHS via scipy.optimize.linprog), which is not "
                          "installed (it is optional): pip install scipy, or pip install 'minimoe[test]'. "
                          "The routers use minimoe.ops.global_topc and the allocations, which need no scipy."
                          ) from error

    S = _as_matrix(scores)
    T, E = S.shape
    lp = selection_lp(S, **constraints)
    res = linprog(lp.c, A_ub=lp.A_ub, b_ub=lp.b_ub, A_eq=lp.A_eq, b_eq=lp.b_eq, bounds=lp.bounds, method="highs")
    if res.status != 0:
        raise ValueError(f"the selection LP is infeasible or failed: {res.message}")
    budget_dual = token_duals = expert_duals = None
    eq = -np.asarray(res.eqlin.marginals) if lp.A_eq is not None else np.zeros(0)
    offset = 0
    if constraints.get("budget") is not None:
        if constraints.get("budget_equality", False):
            budget_dual, offset = float(eq[0]), 1
        else:
            budget_dual = float(-res.ineqlin.marginals[0])
    if constraints.get("per_token") is not None:
        token_duals, offset = eq[offset:offset + T], offset + T
    if constraints.get("per_expert") is not None:
        expert_duals = eq[offset:offset + E]
    return SelectionLPSolution(res.x.reshape(T, E), float(-res.fun), budget_dual, token_duals, expert_duals)


def _as_matrix(scores) -> np.ndarray:
    S = scores.detach().cpu().double().numpy() if isinstance(scores, torch.Tensor) else np.asarray(scores, float)
    if S.ndim != 2:
        raise ValueError(f"scores must be one (T, E) matrix, got shape {S.shape}")
    if not np.isfinite(S).all():
        raise ValueError("scores must be finite")
    return S
