"""Pure functions on tensors: the mathematics of the routers, one file per idea.

Shapes: ``scores``/``logits`` are ``(..., T, E)`` (tokens, experts). Each function's docstring
names the equation it implements and the book section that derives it.
"""
from .allocation import expert_choice_allocation, token_choice_allocation, top_k
from .capacity import compute_capacity

__all__ = [
    "compute_capacity",
    "expert_choice_allocation",
    "token_choice_allocation",
    "top_k",
]
