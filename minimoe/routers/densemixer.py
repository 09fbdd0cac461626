"""DenseMixer (Yao et al.): top-k in the forward pass, a dense straight-through gradient for the router.

Book: chapter 7 (Probabilistic routing over expert subsets), section "Baselines". The forward pass is
ordinary softmax top-k. In training the layer also runs *every* expert on every token and returns
``sparse.detach() + dense - dense.detach()`` with ``dense = sum_e softmax(r)_e f_e(x)``
(:meth:`DenseMixer.adjust_output`, the router protocol's hook on the layer's output), so the router's gradient is
``sum_{e=1}^{E} delta_e dpi_e/dr`` over all experts, as if top-k were the identity, while each expert
still learns only from the tokens routed to it. This follows the authors' reference implementation;
ProbMoE's eq. (11) adds a term ``1[j in S] 1[i = j]`` that the implementation does not have
(chapter 7 errata). In training it runs the dense pass on top of the sparse one, (E + k) / k
times the expert FLOPs; evaluation is plain top-k.
"""
from __future__ import annotations

import torch

from .base import register
from .softmax_topk import SoftmaxTopK


@register("densemixer")
class DenseMixer(SoftmaxTopK):
    """Softmax top-k whose router gradient is dense in training (DenseMixer).

    Args:
        k: experts per token; the other options are those of :class:`SoftmaxTopK` (default dropless,
            ``capacity_factor=None``, as in the fine-tuning runs ProbMoE compares with).
    """

    training_rule = "dense straight-through router gradient (every expert runs in the backward pass)"

    def __init__(self, d_model: int, n_experts: int, *, k: int = 2, capacity_factor: float | None = None,
                 **options):
        super().__init__(d_model, n_experts, k=k, capacity_factor=capacity_factor, **options)

    @classmethod
    def study_options(cls, *, group_size: int, n_experts: int) -> dict:
        return {"k": 1}

    def adjust_output(self, layer, x, routing, out):
        """DenseMixer's backward: ``out.detach() + dense - dense.detach()`` with
        ``dense = sum_e probs_e f_e(x)`` over *all* experts (:meth:`minimoe.MoELayer.all_expert_outputs`).
        The value is the sparse output; the router gets ``sum_e delta_e dprobs_e/dr`` from every
        expert, and each expert's weights still get gradient only from the tokens routed to it (its
        other outputs enter detached). Costs E/k times the expert FLOPs of the sparse layer. In
        training with gradients only; evaluation is plain top-k."""
        if not (self.training and torch.is_grad_enabled()):
            return out
        y_all = layer.all_expert_outputs(x, routing)  # (E, G, T, d), detached off the routed pairs
        dense = torch.einsum("gte,egtd->gtd", routing.probs.to(x.dtype), y_all)
        if self.routed_scaling != 1.0:  # the sparse output is scaled (softmax_topk's routed_scaling): so is its twin
            dense = dense * self.routed_scaling
        return out.detach() + dense - dense.detach()
