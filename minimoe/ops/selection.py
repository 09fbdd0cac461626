"""Routing as one selection problem: global top-c, the unified score, and the drop probability.

Book: chapter 6 (Routing as a linear program). Given a score matrix ``S (T, E)`` and a budget of
``c`` token-expert pairs, the selection problem

    max_X  <S, X>   subject to   sum X = c,   X in {0, 1}^{T x E}                      (USMoE eq. 2)

is solved by the ``c`` largest entries of ``S`` (section "The optimum is the c largest entries"). Token
choice adds "every row sums to k", expert choice "every column sums to C"; the linear programs of
all three are built by :mod:`minimoe.ops.selection_lp` for checking with ``scipy.optimize.linprog``.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ._checks import check_int, check_scores, reads_are_free

EC_SCORES = ("sigmoid", "column_softmax")


def global_topc(scores: torch.Tensor, c: int) -> torch.Tensor:
    """Bool mask ``(..., T, E)`` of the ``c`` largest entries of each ``(T, E)`` matrix (eq. 6-7).

    Exactly ``c`` entries per matrix, also when values tie: ties at the threshold are broken by
    position (row-major, earlier first), so the result is deterministic. ``c`` is an exact budget
    (``sum X = c``); with a budget ``sum X <= c`` the optimum would skip negative entries
    (chapter 6, Proposition 6.2(b)).
    """
    check_scores(scores)
    *batch, T, E = scores.shape
    c = check_int(c, "c", low=0, high=T * E)
    flat = scores.detach().reshape(math.prod(scores.shape[:-2]), T * E)
    if c == 0 or flat.numel() == 0:
        return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    # the c-th largest value is the threshold: everything above it is in, ties fill the rest in order
    threshold = _cth_largest(flat, c)
    above = flat > threshold
    tied = flat == threshold
    room = c - above.sum(-1, keepdim=True)
    if reads_are_free(flat) and bool((tied.sum(-1, keepdim=True) <= room).all()):
        mask = above | tied  # the usual case, one entry at the threshold: no count along the T*E entries
    else:
        mask = above | (tied & (tied.cumsum(-1) <= room))
    return mask.reshape(scores.shape)


def _cth_largest(flat: torch.Tensor, c: int) -> torch.Tensor:
    """The ``c``-th largest entry of each row of ``flat (G, n)``, shape (G, 1).

    The value is the same whichever algorithm selects it. On a CPU numpy's introselect
    (``np.partition``) finds it without sorting: 1.4 ms against 2.4 ms for ``torch.topk``, which
    also sorts the c values it returns, at n = 262,144, c = 4096 (T = 4096, E = 64, k = 1)."""
    if reads_are_free(flat) and flat.dtype in (torch.float32, torch.float64):
        n = flat.shape[-1]
        return torch.from_numpy(np.partition(flat.numpy(), n - c, axis=-1)[:, n - c:n - c + 1])
    return flat.topk(c, dim=-1).values[:, -1:]


def topc_threshold(scores: torch.Tensor, c: int) -> torch.Tensor:
    """The ``c``-th largest entry of each ``(T, E)`` matrix, shape ``(...)``: the dual variable of the
    budget (chapter 6, "The dual: one threshold for everyone"). Entries above it are selected."""
    check_scores(scores)
    *batch, T, E = scores.shape
    c = check_int(c, "c", low=1, high=T * E)
    flat = scores.detach().reshape(math.prod(batch), T * E)
    return _cth_largest(flat, c).reshape(batch)


def unified_score(logits: torch.Tensor, alpha: float = 0.5, *, ec_score: str = "sigmoid") -> torch.Tensor:
    """USMoE's unified score ``U = (1 - alpha) * softmax_row(logits) + alpha * S_e`` (Def. 3.1, eq. 21).

    ``S_e`` is the expert-choice score: ``"sigmoid"`` is ``(2 / E) * sigmoid(logits)``, the authors'
    released code (a logit of 0 maps to ``1 / E``, the mean of a softmax entry, so both terms live on
    the same scale); ``"column_softmax"`` is the softmax over the tokens of the group (axis -2), as
    Def. 3.1 writes it. ``alpha = 0`` is the token-choice score, ``alpha = 1`` the expert-choice one.
    With the sigmoid ``S_e`` (and at ``alpha = 0``) every entry of ``U`` is the same increasing
    function of its logit within a row, so ``U`` keeps each row's order and each token's selected
    experts are the top of its own row: USMoE is token choice with a variable k per token (chapter 6,
    "Unified scores keep each row's order"). The column softmax divides each column by its own
    normaliser, so it can reorder a row.
    """
    check_scores(logits)
    check_alpha(alpha)
    if ec_score not in EC_SCORES:
        raise ValueError(f"ec_score must be one of {EC_SCORES}, got {ec_score!r}")
    E = logits.shape[-1]
    token_score = torch.softmax(logits, dim=-1)
    if ec_score == "sigmoid":
        expert_score = (2.0 / E) * torch.sigmoid(logits)
    else:
        expert_score = torch.softmax(logits, dim=-2)
    return (1.0 - alpha) * token_score + alpha * expert_score


def check_alpha(alpha) -> float:
    """The unified score's mixing weight, a number in [0, 1]."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
    return float(alpha)


def selection_budget(k: float, tokens: int, experts: int) -> int:
    """Pairs kept for ``tokens`` tokens at an average of ``k`` experts per token: ``floor(k * tokens)``
    (USMoE Alg. 1, fractional ``k`` allowed), at most ``tokens * experts``."""
    tokens = check_int(tokens, "tokens", low=0)
    experts = check_int(experts, "experts", low=1)
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not (0 < k <= experts):
        raise ValueError(f"k (experts per token on average) must be in (0, {experts}], got {k!r}")
    # the small slack keeps e.g. 1.1 * 10 = 11.000000000000002 from losing a pair to rounding
    return min(int(math.floor(k * tokens + 1e-9)), tokens * experts)


def exchangeable_drop_probability(tokens: int, experts: int, selected: int) -> float:
    """Probability that a given token gets no expert when ``selected`` of the ``tokens * experts`` pairs
    are chosen uniformly at random (i.i.d. continuous scores): ``C(TE - E, n) / C(TE, n)``, computed as
    ``prod_{m < E} (1 - n / (TE - m))`` (chapter 6, "Token dropping")."""
    tokens = check_int(tokens, "tokens", low=1)
    experts = check_int(experts, "experts", low=1)
    selected = check_int(selected, "selected", low=0, high=tokens * experts)
    total = tokens * experts
    if selected > total - experts:
        return 0.0
    p = 1.0
    for m in range(experts):
        p *= 1.0 - selected / (total - m)
    return p
