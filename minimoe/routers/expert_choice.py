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
from ..ops import compute_capacity
from ..ops.allocation import _expert_choice_allocation
from ..ops._checks import check_int, check_positive_float
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
    ):
        super().__init__(d_model, n_experts)
        self.capacity_factor = check_positive_float(capacity_factor, "capacity_factor")
        if capacity_rounding not in ("round", "ceil"):
            raise ValueError(f"capacity_rounding must be 'round' or 'ceil', got {capacity_rounding!r}")
        self.capacity_rounding = capacity_rounding
        self.min_capacity = check_int(min_capacity, "min_capacity", low=0)
        if noise not in (None, "vmoe"):
            raise ValueError(f"noise must be None or 'vmoe' for {self.name}, got {noise!r}")
        self.noise = noise
        self.noise_std = check_positive_float(noise_std if noise_std is not None else 1.0 / n_experts, "noise_std")
        self.z_loss_weight = float(z_loss_weight)

    def capacity(self, tokens: int) -> int:
        return compute_capacity(tokens, self.n_experts, self.capacity_factor,
                                rounding=self.capacity_rounding, min_capacity=self.min_capacity)

    def route(self, logits: torch.Tensor, x: torch.Tensor | None = None) -> Routing:
        logits = self._check_logits(logits)
        noisy = logits
        if self.training and self.noise == "vmoe":
            noisy = logits + self.noise_std * torch.randn_like(logits)
        probs = torch.softmax(noisy, dim=-1)
        capacity = self.capacity(logits.shape[-2])
        position = _expert_choice_allocation(probs.detach(), capacity)
        mask = position >= 0
        combine = probs * mask  # exactly 0 off the dispatch
        aux = logits.new_zeros(())
        if self.training and self.z_loss_weight:
            aux = aux + self.z_loss_weight * losses.z_loss(logits)
        return Routing(combine=combine, position=position, capacity=capacity, probs=probs,
                       aux_loss=aux)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, capacity_factor={self.capacity_factor}, noise={self.noise}"
