"""Sinkhorn Token Choice and Sinkhorn Expert Choice (Liu et al. §2.2 and §2.4; Clark et al. 2022).

Book: chapter 2, section "Sinkhorn routers are top-k with per-expert biases". The entropic OT plan of the (noisy) logits,
with every expert receiving T/E units (:func:`minimoe.ops.sinkhorn`), replaces the softmax as the
score that *allocates*: Algorithm 1 (token choice) or Algorithm 2 (expert choice) runs on the plan.
The combine weights stay the softmax values at the dispatched pairs ("the plan dispatches, the
softmax combines"), which is how the router's gate still gets a gradient: the plan is a constant.
``combine="plan"`` uses the plan's entries instead (then the gate gets no gradient from the task).

Within a token's row the plan is ``exp((S_te + g_e) / eps)`` up to the token's own factor, so token
choice on the plan is top-k of the logits shifted by a per-expert bias ``g`` re-solved for every
batch (chapter 2, Proposition 2.11, "What a router sees in the plan").
"""
from __future__ import annotations

import torch

from .. import losses
from ..ops import compute_capacity, sinkhorn
from ..ops._checks import check_int, check_positive_float
from ..ops.allocation import _expert_choice_allocation, _token_choice_allocation
from ..routing import Routing
from .base import Router, register


class _SinkhornRouter(Router):
    def __init__(self, d_model, n_experts, *, eps, sinkhorn_iters, sinkhorn_tol, combine, noise, noise_std,
                 z_loss_weight):
        super().__init__(d_model, n_experts)
        self.eps = check_positive_float(eps, "eps")
        self.sinkhorn_iters = check_int(sinkhorn_iters, "sinkhorn_iters", low=1)
        if not (isinstance(sinkhorn_tol, (int, float)) and sinkhorn_tol >= 0):
            raise ValueError(f"sinkhorn_tol must be a number >= 0 (0: run exactly sinkhorn_iters), got {sinkhorn_tol!r}")
        self.sinkhorn_tol = float(sinkhorn_tol)
        if combine not in ("softmax", "plan"):
            raise ValueError(f"combine must be 'softmax' or 'plan', got {combine!r}")
        self.combine = combine
        if noise not in (None, "vmoe"):
            raise ValueError(f"noise must be None or 'vmoe', got {noise!r}")
        self.noise = noise
        self.noise_std = check_positive_float(noise_std if noise_std is not None else 1.0 / n_experts, "noise_std")
        self.z_loss_weight = float(z_loss_weight)

    def _scores(self, logits):
        """(softmax probabilities of the noisy logits, their plan without gradient)."""
        noisy = logits
        if self.training and self.noise == "vmoe":
            noisy = logits + self.noise_std * torch.randn_like(logits)
        probs = torch.softmax(noisy, dim=-1)
        plan = sinkhorn(noisy.detach(), self.eps, max_iter=self.sinkhorn_iters, tol=self.sinkhorn_tol,
                        method="sinkhorn")
        return probs, plan

    def _finish(self, logits, probs, plan, position, capacity):
        mask = position >= 0
        weights = probs if self.combine == "softmax" else plan
        aux = logits.new_zeros(())
        if self.training and self.z_loss_weight:
            aux = aux + self.z_loss_weight * losses.z_loss(logits)
        return Routing(combine=weights * mask, position=position, capacity=capacity, probs=probs, aux_loss=aux)


@register("sinkhorn_token_choice")
class SinkhornTokenChoice(_SinkhornRouter):
    """Token choice (Algorithm 1) on the Sinkhorn plan; softmax combine weights.

    Args:
        k: experts per token.
        capacity_factor: slots per expert ``round(capacity_factor * k * T / E)``, or None (dropless).
        eps: entropic regularisation of the plan (Liu et al. use 1).
        sinkhorn_iters, sinkhorn_tol: iteration cap and tolerance of :func:`minimoe.ops.sinkhorn`;
            ``sinkhorn_tol=0`` (default) runs exactly ``sinkhorn_iters`` iterations, as V-MoE does (20).
        combine: ``"softmax"`` (Liu et al.) or ``"plan"``.
        noise: None or ``"vmoe"`` (Gaussian noise of std ``noise_std``, default 1/E, on the logits in
            training; the plan is computed from the noisy logits).
        batch_priority: Batch Priority Routing on the plan's top-1 values.
        renormalize: divide each token's combine weights by their sum (the Sinkhorn baseline of the
            SSR paper and of Clark et al.); the default keeps the raw softmax values (Liu et al.).
        eval_routing: ``"plan"`` (default; Liu et al. route with the plan at test time too) or
            ``"softmax"``: at eval, top-k of the softmax, so that a token's routing does not depend on
            the other tokens of its group (needed for a causal language model).
        z_loss_weight: router z-loss weight.
    """

    def __init__(self, d_model: int, n_experts: int, *, k: int = 1, capacity_factor: float | None = 1.0,
                 eps: float = 1.0, sinkhorn_iters: int = 20, sinkhorn_tol: float = 0.0, combine: str = "softmax",
                 noise: str | None = None, noise_std: float | None = None, batch_priority: bool = False,
                 renormalize: bool = False, eval_routing: str = "plan", z_loss_weight: float = 0.0):
        super().__init__(d_model, n_experts, eps=eps, sinkhorn_iters=sinkhorn_iters, sinkhorn_tol=sinkhorn_tol,
                         combine=combine, noise=noise, noise_std=noise_std, z_loss_weight=z_loss_weight)
        self.k = check_int(k, "k", low=1, high=n_experts)
        self.renormalize = bool(renormalize)
        if eval_routing not in ("plan", "softmax"):
            raise ValueError(f"eval_routing must be 'plan' or 'softmax', got {eval_routing!r}")
        self.eval_routing = eval_routing
        self.capacity_factor = None if capacity_factor is None else check_positive_float(capacity_factor, "capacity_factor")
        self.batch_priority = bool(batch_priority)

    def capacity(self, tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return compute_capacity(tokens, self.n_experts, self.capacity_factor, k=self.k)

    def route(self, logits: torch.Tensor, x: torch.Tensor | None = None) -> Routing:
        logits = self._check_logits(logits)
        capacity = self.capacity(logits.shape[-2])
        if not self.training and self.eval_routing == "softmax":
            probs = torch.softmax(logits, dim=-1)
            plan = probs  # "plan" combine falls back to the softmax too: there is no plan at eval
            position = _token_choice_allocation(probs.detach(), self.k, capacity, self.batch_priority)
        else:
            probs, plan = self._scores(logits)
            position = _token_choice_allocation(plan, self.k, capacity, self.batch_priority)
        routing = self._finish(logits, probs, plan, position, capacity)
        if self.renormalize:
            total = routing.combine.sum(-1, keepdim=True)
            routing.combine = routing.combine / torch.where(total > 0, total, torch.ones_like(total))
        return routing

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, k={self.k}, capacity_factor={self.capacity_factor}, eps={self.eps}"


@register("sinkhorn_expert_choice")
class SinkhornExpertChoice(_SinkhornRouter):
    """Expert choice (Algorithm 2) on the Sinkhorn plan; softmax combine weights (Liu et al. §2.4).

    A column of the plan ranks tokens by ``S_te + f_t``: the row potential ``f_t`` demotes tokens that
    every expert wants, so fewer tokens are left without an expert than under softmax expert choice.
    Options as :class:`SinkhornTokenChoice`, with ``capacity_factor`` giving ``round(c * T / E)``.
    """

    def __init__(self, d_model: int, n_experts: int, *, capacity_factor: float = 1.0, eps: float = 1.0,
                 sinkhorn_iters: int = 20, sinkhorn_tol: float = 0.0, combine: str = "softmax",
                 noise: str | None = None, noise_std: float | None = None, z_loss_weight: float = 0.0):
        super().__init__(d_model, n_experts, eps=eps, sinkhorn_iters=sinkhorn_iters, sinkhorn_tol=sinkhorn_tol,
                         combine=combine, noise=noise, noise_std=noise_std, z_loss_weight=z_loss_weight)
        self.capacity_factor = check_positive_float(capacity_factor, "capacity_factor")

    def capacity(self, tokens: int) -> int:
        return compute_capacity(tokens, self.n_experts, self.capacity_factor)

    def route(self, logits: torch.Tensor, x: torch.Tensor | None = None) -> Routing:
        logits = self._check_logits(logits)
        probs, plan = self._scores(logits)
        capacity = self.capacity(logits.shape[-2])
        position = _expert_choice_allocation(plan, capacity)
        return self._finish(logits, probs, plan, position, capacity)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, capacity_factor={self.capacity_factor}, eps={self.eps}"
