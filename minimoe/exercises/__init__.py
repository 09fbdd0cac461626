"""Coursework checkers: ``check_<name>(student_fn)`` runs a student's function against the
reference implementation on random and edge-case inputs and prints a clear pass/fail report.

Each checker returns ``True`` when every case passes (so a notebook cell can ``assert`` it) and
prints the first failing case with the input, the expected and the received output. The exercises
themselves are stated at the end of each book chapter.
"""
from ._harness import CheckFailed, run_checks
from .chapter1 import check_capacity, check_token_choice_allocation
from .chapter2 import check_sinkhorn_step, check_two_by_two_plan
from .chapter3 import check_gaussian_top1, check_kl_projection
from .chapter4 import check_sparse_simplex_projection
from .chapter5 import check_gumbel_max_sample, check_skip_weights
from .chapter6 import check_drop_probability, check_global_topc
from .chapter7 import check_ksubset_log_partition, check_ksubset_sample
from .chapter8 import check_expected_overflow, check_send_counts
from .chapter9 import check_holm, check_paired_interval
from .chapter10 import check_bias_update, check_dual_function

__all__ = ["CheckFailed", "run_checks", "check_token_choice_allocation", "check_capacity", "check_sinkhorn_step",
           "check_two_by_two_plan", "check_kl_projection", "check_gaussian_top1", "check_global_topc",
           "check_drop_probability", "check_ksubset_log_partition", "check_ksubset_sample",
           "check_sparse_simplex_projection", "check_skip_weights", "check_gumbel_max_sample",
           "check_send_counts", "check_expected_overflow", "check_paired_interval", "check_holm", "check_bias_update",
           "check_dual_function"]
