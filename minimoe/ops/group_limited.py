"""Group-limited (device- or node-limited) selection: DeepSeek-V2's and DeepSeek-V3's rule.

Book: chapter 10, "Group-limited selection and routed scaling". The ``E`` experts form ``n_group``
equal groups of consecutive experts (in a deployment: the experts of one device or node). Each token
scores every group from its own selection scores ``s`` and may choose its ``k`` experts only inside
its ``topk_group`` best groups, so that its choices reach at most ``topk_group`` devices:

    group score  g_j = max_{e in group j} s_e                    (DeepSeek-V2, ``group_score="max"``)
                 g_j = sum of the two largest s_e in group j      (DeepSeek-V3, ``group_score="top2"``)
    allowed      A   = the topk_group groups with the largest g_j
    selection    top-k of s over the experts of A.
"""
from __future__ import annotations

import torch

from ._checks import check_choice, check_int, check_scores

GROUP_SCORES = ("top2", "max")


def check_group_limits(n_experts: int, k: int, n_group, topk_group, group_score: str = "top2") -> tuple[int, int, str]:
    """The group options checked against the router's sizes; returns ``(n_group, topk_group,
    group_score)``. ``n_group`` must divide ``n_experts``; ``topk_group`` is in ``[1, n_group]``; the
    allowed groups must hold at least ``k`` experts; ``group_score="top2"`` needs two experts per group."""
    n_group = check_int(n_group, "n_group", low=1, high=n_experts)
    if n_experts % n_group:
        raise ValueError(f"n_group={n_group} must divide n_experts={n_experts} (equal groups of experts)")
    topk_group = check_int(topk_group, "topk_group", low=1, high=n_group)
    group_score = check_choice(group_score, "group_score", GROUP_SCORES)
    per_group = n_experts // n_group
    if n_group > 1 and group_score == "top2" and per_group < 2:
        raise ValueError(f"group_score='top2' scores a group by its two best experts: n_experts / n_group must "
                         f"be at least 2, got {n_experts}/{n_group} (use group_score='max')")
    if n_group > 1 and topk_group * per_group < k:
        raise ValueError(f"topk_group={topk_group} groups of {per_group} experts hold fewer than k={k} experts")
    return n_group, topk_group, group_score


def group_limited_scores(scores: torch.Tensor, n_group: int, topk_group: int, group_score: str = "top2",
                         fill: float = float("-inf"), *, checked: bool = False) -> torch.Tensor:
    """``scores (..., E)`` with every expert outside each token's ``topk_group`` best groups set to
    ``fill`` (default ``-inf``), so that a top-k of the result chooses inside the allowed groups only
    (module docstring; DeepSeek-V2 §2.1.3 with ``"max"``, DeepSeek-V3 §2.1.2 with ``"top2"``).
    ``n_group=1`` (or ``topk_group=n_group``) returns ``scores`` itself. Arguments are those of
    :func:`check_group_limits` (``checked=True``: the caller, a router, checked them at construction);
    no gradient is meant to flow (a selection)."""
    if not checked:
        check_scores(scores, "scores", min_dim=1)
        n_group, topk_group, group_score = check_group_limits(scores.shape[-1], 1, n_group, topk_group, group_score)
    if n_group == 1 or topk_group == n_group:
        return scores
    per_group = scores.shape[-1] // n_group
    grouped = scores.unflatten(-1, (n_group, per_group))
    score = grouped.topk(2, dim=-1).values.sum(-1) if group_score == "top2" else grouped.amax(-1)
    best = score.topk(topk_group, dim=-1).indices
    allowed = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, best, True)
    return scores.masked_fill(~allowed.repeat_interleave(per_group, dim=-1), fill)
