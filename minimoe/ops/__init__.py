"""Pure functions on tensors: the mathematics of the routers, one file per idea.

Shapes: ``scores``/``logits`` are ``(..., T, E)`` (tokens, experts). Each function's docstring
names the equation it implements and the book section that derives it.
"""
from .allocation import expert_choice_allocation, token_choice_allocation, top_k
from .assignment import linear_assignment
from .capacity import compute_capacity
from .gaussian_top1 import gaussian_top1_probability, gaussian_top1_product_bound
from .ksubset import (
    ksubset_covariance,
    ksubset_log_partition,
    ksubset_marginals,
    ksubset_sample,
    range_subset_covariance,
    range_subset_log_partition,
    range_subset_map,
    range_subset_marginals,
    range_subset_sample,
    range_subset_size_probs,
)
from .selection import exchangeable_drop_probability, global_topc, selection_budget, topc_threshold, unified_score
from .selection_lp import SelectionLPSolution, selection_lp, solve_selection_lp
from .sinkhorn import SinkhornResult, sinkhorn

__all__ = [
    "global_topc",
    "topc_threshold",
    "unified_score",
    "selection_budget",
    "exchangeable_drop_probability",
    "selection_lp",
    "solve_selection_lp",
    "SelectionLPSolution",
    "compute_capacity",
    "expert_choice_allocation",
    "sinkhorn",
    "linear_assignment",
    "gaussian_top1_probability",
    "gaussian_top1_product_bound",
    "ksubset_covariance",
    "ksubset_log_partition",
    "ksubset_marginals",
    "ksubset_sample",
    "range_subset_covariance",
    "range_subset_log_partition",
    "range_subset_map",
    "range_subset_marginals",
    "range_subset_sample",
    "range_subset_size_probs",
    "SinkhornResult",
    "token_choice_allocation",
    "top_k",
]
