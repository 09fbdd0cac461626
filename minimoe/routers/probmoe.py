"""ProbMoE (Zhao et al.): sample the expert subset in training, straight-through marginal gradients.

Book: chapter 7 (Probabilistic routing over expert subsets), section "The straight-through router gradient".
In training each token draws its subset ``S`` exactly from the k-subset law
``P(S) ∝ exp(sum_{j in S} r_j)`` (:func:`minimoe.ops.ksubset_sample`), or from the range law with
``k_min <= |S| <= k_max`` for dynamic-k, and only the sampled experts run. The combine weights are

    w = (z + m - stopgrad(m)) * softmax(r)                                  (ProbMoE eq. 7)

with ``z`` the sampled 0/1 mask and ``m`` the exact inclusion marginals
(:func:`minimoe.ops.ksubset_marginals`): in the forward pass ``w`` is the softmax at the sampled
experts, and in the backward pass every logit receives ``sum_{j in S} delta_j pi_j Cov(z_i, z_j)``
through ``m`` on top of the softmax path (``delta_j`` = the loss's sensitivity to expert j's weight).
At evaluation the subset is the most probable one: top-k for exact-k
(:func:`minimoe.ops.range_subset_map` for dynamic-k). Nothing is dropped (no capacity).
"""
from __future__ import annotations

import torch

from ..ops._checks import check_bool, check_generator, check_int
from ..ops.allocation import dropless_positions, largest
from ..ops.ksubset import (ksubset_marginals, ksubset_sample, range_subset_map, range_subset_marginals,
                           range_subset_sample)
from ..routing import Routing
from .base import Router, register


class _SubsetRouter(Router):
    """Shared by both ProbMoE routers: sample in training, MAP at evaluation, straight-through weights."""

    def __init__(self, d_model: int, n_experts: int, k_min: int, k_max: int, renormalize: bool,
                 generator: torch.Generator | None):
        super().__init__(d_model, n_experts)
        self.k_max = check_int(k_max, "k_max" if k_min != k_max else "k", low=1, high=n_experts)
        self.k_min = check_int(k_min, "k_min" if k_min != k_max else "k", low=1, high=self.k_max)
        self.renormalize = check_bool(renormalize, "renormalize")
        self.generator = check_generator(generator)

    def _sample(self, logits):
        raise NotImplementedError

    def _marginals(self, logits):
        raise NotImplementedError

    def _map(self, logits):
        raise NotImplementedError

    def _route(self, logits: torch.Tensor, x: torch.Tensor | None = None) -> Routing:
        probs = torch.softmax(logits, dim=-1)
        if self.training:
            mask = self._sample(logits.detach())
            marginals = self._marginals(logits)
            # forward value exactly the 0/1 mask; backward the marginals' covariance Jacobian
            straight_through = mask.to(probs.dtype) + (marginals - marginals.detach())
            gates = straight_through * probs
        else:
            mask = self._map(logits.detach())
            gates = probs * mask
        if self.renormalize:
            gates = gates / (probs * mask).sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
        return Routing(combine=gates, position=dropless_positions(mask), capacity=None, probs=probs,
                       aux_loss=logits.new_zeros(()), max_pairs=self.k_max * logits[..., 0].numel())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, k_min={self.k_min}, k_max={self.k_max}, renormalize={self.renormalize}"


@register("probmoe_exact")
class ProbMoEExact(_SubsetRouter):
    """ProbMoE exact-k: an exact sample of the k-subset law in training, top-k at evaluation.

    Args:
        k: experts per token.
        renormalize: divide the weights by the softmax mass of the chosen experts (off in the paper,
            as in OLMoE and Qwen1.5-MoE).
        generator: a ``torch.Generator`` for the subset draws (reproducible runs); ``None`` uses torch's.
    """

    def __init__(self, d_model: int, n_experts: int, *, k: int = 2, renormalize: bool = False,
                 generator: torch.Generator | None = None):
        super().__init__(d_model, n_experts, k, k, renormalize, generator)
        self.k = self.k_max

    @classmethod
    def study_options(cls, *, group_size: int, n_experts: int) -> dict:
        return {"k": 1}

    def _sample(self, logits):
        return ksubset_sample(logits, self.k, generator=self.generator)

    def _marginals(self, logits):
        return ksubset_marginals(logits, self.k)

    def _map(self, logits):
        top = largest(logits, self.k).indices
        return torch.zeros_like(logits, dtype=torch.bool).scatter(-1, top, True)


@register("probmoe_dynamic")
class ProbMoEDynamic(_SubsetRouter):
    """ProbMoE dynamic-k: the subset law restricted to ``k_min <= |S| <= k_max``.

    In training an exact two-stage sample (size, then subset); at evaluation the MAP subset, the top
    ``clip(#{j : r_j > 0}, k_min, k_max)`` experts (the paper's Alg. 3 as printed always picks k_max;
    chapter 7 errata). The law depends on the absolute level of the logits, not only on their
    differences: a gate whose logits are all raised by c makes larger subsets likelier.

    Args:
        k_min, k_max: the allowed subset sizes, ``1 <= k_min <= k_max <= E``.
        renormalize, generator: as for :class:`ProbMoEExact`.
    """

    def __init__(self, d_model: int, n_experts: int, *, k_min: int = 1, k_max: int = 2,
                 renormalize: bool = False, generator: torch.Generator | None = None):
        n_experts = check_int(n_experts, "n_experts", low=1)  # before k_max is checked against it
        k_max = check_int(k_max, "k_max", low=1, high=n_experts)
        k_min = check_int(k_min, "k_min", low=1, high=k_max)
        super().__init__(d_model, n_experts, k_min, k_max, renormalize, generator)

    @classmethod
    def study_options(cls, *, group_size: int, n_experts: int) -> dict:
        return {"k_min": 1, "k_max": 2}  # draws 1 or 2: the study records the measured experts per token

    def _sample(self, logits):
        return range_subset_sample(logits, self.k_min, self.k_max, generator=self.generator)

    def _marginals(self, logits):
        return range_subset_marginals(logits, self.k_min, self.k_max)

    def _map(self, logits):
        return range_subset_map(logits, self.k_min, self.k_max)
