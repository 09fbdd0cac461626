"""Routers: one ``nn.Module`` per router, registered by name.

``available()`` lists them; ``build(name, d_model, n_experts, **options)`` makes one.
"""
from .base import Router, available, build, register
from .expert_choice import ExpertChoice
from .softmax_topk import SoftmaxTopK

__all__ = ["Router", "available", "build", "register", "SoftmaxTopK", "ExpertChoice"]
