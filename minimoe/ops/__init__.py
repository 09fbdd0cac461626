"""Pure functions on tensors: the mathematics of the routers, one file per idea.

Shapes: ``scores``/``logits`` are ``(..., T, E)`` (tokens, experts). Each function's docstring
names the equation it implements and the book section that derives it.
"""
from .allocation import expert_choice_allocation, token_choice_allocation, top_k
from .assignment import AssignmentResult, linear_assignment
from .balanced_estimators import (ESTIMATORS, EstimatorSample, SkipSample, estimator_coefficients,
                                  expected_loss_gradient, reinforce_surrogate, sample_categorical,
                                  sample_estimator, sinkhorn_balance, skip_mask, skip_sample)
from .bias_balancing import BIAS_UPDATES, bias_update, expert_loads, max_violation
from .capacity import compute_capacity
from .gumbel_matching import (balanced_assignments, count_balanced_assignments, floyd_warshall,
                              gumbel_matching_conditionals, gumbel_matching_sample, move_costs, sample_gumbel,
                              solve_assignment)
from .group_limited import GROUP_SCORES, check_group_limits, group_limited_scores
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
from .sparse_ot import (SparseOTResult, smallest_feasible_capacity, sparse_simplex_projection,
                        sparsity_constrained_plan, sparsity_constrained_semi_dual)

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
    "group_limited_scores",
    "check_group_limits",
    "GROUP_SCORES",
    "expert_loads",
    "bias_update",
    "max_violation",
    "BIAS_UPDATES",
    "expert_choice_allocation",
    "sinkhorn",
    "linear_assignment",
    "AssignmentResult",
    "gumbel_matching_sample",
    "gumbel_matching_conditionals",
    "solve_assignment",
    "move_costs",
    "floyd_warshall",
    "sample_gumbel",
    "balanced_assignments",
    "count_balanced_assignments",
    "ESTIMATORS",
    "EstimatorSample",
    "SkipSample",
    "sample_categorical",
    "skip_mask",
    "skip_sample",
    "sinkhorn_balance",
    "estimator_coefficients",
    "sample_estimator",
    "reinforce_surrogate",
    "expected_loss_gradient",
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
    "sparse_simplex_projection",
    "smallest_feasible_capacity",
    "sparsity_constrained_plan",
    "sparsity_constrained_semi_dual",
    "SparseOTResult",
    "token_choice_allocation",
    "top_k",
]
