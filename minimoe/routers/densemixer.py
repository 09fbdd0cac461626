"""DenseMixer (Yao et al.): top-k in the forward pass, a dense straight-through gradient for the router.

Book: chapter 7 (Probabilistic routing over expert subsets), section "Baselines". The forward pass is
ordinary softmax top-k. In training the layer also runs *every* expert on every token and returns
``sparse.detach() + dense - dense.detach()`` with ``dense = sum_e softmax(r)_e f_e(x)``
(:meth:`minimoe.MoELayer._dense_straight_through`), so the router's gradient is
``sum_{e=1}^{E} delta_e dpi_e/dr`` over all experts, as if top-k were the identity, while each expert
still learns only from the tokens routed to it. This follows the authors' reference implementation;
ProbMoE's eq. (11) adds a term ``1[j in S] 1[i = j]`` that the implementation does not have
(chapter 7 errata). In training it runs the dense pass on top of the sparse one, (E + k) / k
times the expert FLOPs; evaluation is plain top-k.
"""
from __future__ import annotations

import torch

from ..routing import Routing
from .base import register
from .softmax_topk import SoftmaxTopK


@register("densemixer")
class DenseMixer(SoftmaxTopK):
    """Softmax top-k whose router gradient is dense in training (DenseMixer).

    Args:
        k: experts per token; the other options are those of :class:`SoftmaxTopK` (default dropless,
            ``capacity_factor=None``, as in the fine-tuning runs ProbMoE compares with).
    """

    def __init__(self, d_model: int, n_experts: int, *, k: int = 2, capacity_factor: float | None = None,
                 **options):
        super().__init__(d_model, n_experts, k=k, capacity_factor=capacity_factor, **options)

    def _route(self, logits: torch.Tensor, x: torch.Tensor | None = None) -> Routing:
        routing = super()._route(logits, x)
        routing.dense_backward = self.training  # (not dataclasses.replace: it would build the (T, E) tables)
        return routing
