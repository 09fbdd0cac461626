"""Softmax Expert Choice (Zhou et al. 2022; Liu et al. §2.3, Alg. 2).

Book: chapter 1, section "Expert choice". Each expert takes the ``C = round(capacity_factor * T/E)``
tokens with the largest ``softmax(x W)[:, e]`` in its routing group; the combine weights are those
softmax values. Every expert is exactly full; a token may be taken by 0 to E experts. Because an
expert compares tokens across the group, a token's routing depends on the other tokens of the
group -- in a decoder, on future tokens (chapter 1, "Expert choice and causality").
"""
from __future__ import annotations

import torch

from .. import losses
from ..ops.allocation import expert_choice_allocation
from ..ops._checks import check_nonnegative_float
from ..routing import Routing
from .base import Router, register


@register("expert_choice")
class ExpertChoice(Router):
    """Expert-choice routing.

    Args:
        capacity_factor: tokens per expert ``C = round(capacity_factor * T / E)`` per group.
        capacity_rounding, min_capacity: passed to :func:`minimoe.ops.compute_capacity`.
        noise: ``None`` or ``"vmoe"`` (``N(0, noise_std^2)`` on the logits in training, std 1/E).
        z_loss_weight: weight of the router z-loss; 0 disables it.
        generator: a ``torch.Generator`` for the noise (reproducible runs); ``None`` uses torch's.
    """

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        *,
        capacity_factor: float = 1.0,
        capacity_rounding: str = "round",
        min_capacity: int = 0,
        noise: str | None = None,
        noise_std: float | None = None,
        z_loss_weight: float = 0.0,
        generator: torch.Generator | None = None,
    ):
        super().__init__(d_model, n_experts)
        self._init_capacity(capacity_factor, capacity_rounding, min_capacity, allow_none=False)
        self._init_noise(noise, noise_std, generator)
        self.z_loss_weight = check_nonnegative_float(z_loss_weight, "z_loss_weight")

    @classmethod
    def study_options(cls, *, group_size: int, n_experts: int) -> dict:
        return {"capacity_factor": 1.0}

    def _route(self, logits: torch.Tensor, x: torch.Tensor | None = None) -> Routing:
        probs = torch.softmax(self._vmoe_noise(logits), dim=-1)
        capacity = self.capacity(logits.shape[-2])
        position = expert_choice_allocation(probs.detach(), capacity, checked=True)
        mask = position >= 0
        combine = probs * mask  # exactly 0 off the dispatch
        aux = logits.new_zeros(())
        if self.training and self.z_loss_weight:
            aux = aux + self.z_loss_weight * losses.z_loss(logits)
        return Routing(combine=combine, position=position, capacity=capacity, probs=probs,
                       aux_loss=aux, max_pairs=capacity * logits[..., 0, :].numel())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, capacity_factor={self.capacity_factor}, noise={self.noise}"
