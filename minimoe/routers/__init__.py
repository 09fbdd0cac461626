"""Routers: one ``nn.Module`` per router, registered by name.

``available()`` lists them (``baselines()`` the four controls that do not learn: hash, random,
dense, dense_wide); ``build(name, d_model, n_experts, **options)`` makes one;
``router_class(name)`` is the class. What a router needs of the layer and the training loop it says
through the router protocol, the methods of :class:`Router` (its module docstring has the table).
"""
from .base import DEFAULT_ROUTER, Router, available, baselines, build, register, router_class
from .expert_choice import ExpertChoice
from .base_layer import BaseLayerRouter
from .sinkhorn import SinkhornExpertChoice, SinkhornTokenChoice
from .softmax_topk import SoftmaxTopK
from .ssr import SelectiveSinkhorn
from .usmoe import USMoE
from .probmoe import ProbMoEDynamic, ProbMoEExact
from .densemixer import DenseMixer
from .kool import KoolGumbelMatching, KoolSkip
from .sparse_expert_choice import SparsityConstrainedExpertChoice
from .soft_moe import SoftMoE
from .loss_free import LossFreeBalancing
from .controls import DenseRouter, DenseWideRouter, HashRouter, RandomRouter

__all__ = ["DEFAULT_ROUTER", "Router", "available", "baselines", "build", "register", "router_class", "SoftmaxTopK", "ExpertChoice", "SinkhornTokenChoice",
           "SinkhornExpertChoice", "BaseLayerRouter", "SelectiveSinkhorn", "USMoE",
           "ProbMoEExact", "ProbMoEDynamic", "DenseMixer", "KoolSkip", "KoolGumbelMatching",
           "SparsityConstrainedExpertChoice", "SoftMoE", "LossFreeBalancing",
           "HashRouter", "RandomRouter", "DenseRouter", "DenseWideRouter"]
