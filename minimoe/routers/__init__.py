"""Routers: one ``nn.Module`` per router, registered by name.

``available()`` lists them; ``build(name, d_model, n_experts, **options)`` makes one.
"""
from .base import Router, available, build, register
from .expert_choice import ExpertChoice
from .base_layer import BaseLayerRouter
from .sinkhorn import SinkhornExpertChoice, SinkhornTokenChoice
from .softmax_topk import SoftmaxTopK
from .ssr import SelectiveSinkhorn
from .usmoe import USMoE, reroute
from .probmoe import ProbMoEDynamic, ProbMoEExact
from .densemixer import DenseMixer

__all__ = ["Router", "available", "build", "register", "SoftmaxTopK", "ExpertChoice", "SinkhornTokenChoice",
           "SinkhornExpertChoice", "BaseLayerRouter", "SelectiveSinkhorn", "USMoE", "reroute",
           "ProbMoEExact", "ProbMoEDynamic", "DenseMixer"]
