"""Selective Sinkhorn Routing (Nguyen et al. 2026), SSR-L and SSR-S.

Book: chapter 3. In training, each SSR layer flips its own coin on every forward pass: with
probability ``p`` it routes with the entropic OT plan of the cost (``C = S`` for SSR-L,
``C = softmax(S)`` for SSR-S) at temperature ``eps`` (the paper's xi), taking each token's top-k plan
entries renormalised as combine weights (Proposition 3.1: the KL projection of the plan's row onto
k-sparse distributions); otherwise it is plain softmax top-k. Optional parameter-free Gaussian noise
``noise_scale * N(0, 1)`` on the cost (eq. 6) in training. At eval: softmax top-k, no Sinkhorn, no
noise (the paper's default; ``eval_mode`` gives its Table 3 ablations). No auxiliary loss.

Choices where the paper is silent (chapter 3 says why): the plan is detached by default
(``detach_plan=True``: Sinkhorn steps then teach the experts but not the gate); noise is added on
every training forward, experts are selected with the noisy cost and weighted with the clean
logits (``noisy_weights=False``); dropless (``capacity_factor=None``).
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from ..ops import sinkhorn
from ..ops._checks import (check_bool, check_choice, check_int, check_nonnegative_float, check_positive_float,
                           check_probability, generator_from_seed, randn_like)
from ..ops.allocation import largest, token_choice_allocation
from ..routing import Routing
from .base import Router, register

EVAL_MODES = ("softmax", "sinkhorn_p", "noise", "both")


@register("ssr")
class SelectiveSinkhorn(Router):
    """SSR router.

    Args:
        k: experts per token (the paper uses 2).
        cost: ``"linear"`` (SSR-L, the logits) or ``"softmax"`` (SSR-S, the row softmax of the logits).
        p: probability that a training forward of this layer takes the Sinkhorn branch (the paper
            uses 1e-4 to 1e-2; ``p=1`` is "always-on" OT routing with plan weights).
        eps: entropic regularisation of the plan (the paper's xi, default 0.5).
        max_iter, tol: passed to :func:`minimoe.ops.sinkhorn` (the paper's eta=100, delta=1e-4).
        noise_scale: std of the Gaussian noise added to the cost in training (the paper's
            alpha_noise with sigma = 1); 0 disables it.
        noisy_weights: softmax-branch weights from the noisy logits instead of the clean ones
            (SSR-L only: noisy probabilities can be negative).
        detach_plan: treat the plan as a constant (default). False: the plan carries its exact
            implicit gradient (``grad="implicit"``), so Sinkhorn steps also train the gate.
        capacity_factor: None (dropless, as the paper) or slots per expert ``round(c * k * T / E)``.
        capacity_rounding, min_capacity: passed to :func:`minimoe.ops.compute_capacity`.
        eval_mode: ``"softmax"`` (default), or the paper's Table 3 ablations: ``"sinkhorn_p"`` (the coin
            is also flipped at eval), ``"noise"`` (noise at eval), ``"both"``.
        seed: seed of this router's own generator, which draws the coin and the noise; None draws both
            from torch's global generator.

    Every call's ``routing.stats["used_sinkhorn"]`` is 1.0 or 0.0; ``router.sinkhorn_calls`` counts them
    (in eager mode). Under ``torch.compile`` the coin is drawn on the device and ``torch.cond`` runs
    the branch it picks: the same draws from the same generator, one graph.
    """

    def __init__(self, d_model: int, n_experts: int, *, k: int = 2, cost: str = "linear", p: float = 1e-3,
                 eps: float = 0.5, max_iter: int = 100, tol: float = 1e-4, noise_scale: float = 0.0,
                 noisy_weights: bool = False, detach_plan: bool = True, capacity_factor: float | None = None,
                 capacity_rounding: str = "round", min_capacity: int = 0, eval_mode: str = "softmax",
                 seed: int | None = None):
        super().__init__(d_model, n_experts)
        self.k = check_int(k, "k", low=1, high=self.n_experts)
        self.cost = check_choice(cost, "cost", ("linear", "softmax"))
        self.p = check_probability(p, "p")
        self.eps = check_positive_float(eps, "eps")
        self.max_iter = check_int(max_iter, "max_iter", low=1)
        self.tol = check_nonnegative_float(tol, "tol")
        self.noise_scale = check_nonnegative_float(noise_scale, "noise_scale")
        self.noisy_weights = check_bool(noisy_weights, "noisy_weights")
        if self.noisy_weights and cost == "softmax":
            raise ValueError("noisy_weights=True needs cost='linear': noisy probabilities can be negative")
        self.detach_plan = check_bool(detach_plan, "detach_plan")
        self._init_capacity(capacity_factor, capacity_rounding, min_capacity, choices_per_token=self.k)
        self.eval_mode = check_choice(eval_mode, "eval_mode", EVAL_MODES)
        self.generator = generator_from_seed(seed)
        self.sinkhorn_calls = 0

    # the coin switched off: the same noisy softmax top-1, never a Sinkhorn step. Against ``ssr`` it
    # isolates what the selective Sinkhorn steps add to the noise (the ablation the SSR paper lacks)
    STUDY_VARIANTS = {"ssr_p0": {"k": 1, "p": 0.0, "noise_scale": 0.5}}

    @classmethod
    def study_options(cls, *, group_size: int, n_experts: int) -> dict:
        return {"k": 1, "p": 0.05, "noise_scale": 0.5}

    def flip_coin(self) -> bool:
        """One draw of the per-layer, per-forward coin: True with probability ``p``."""
        return bool(torch.rand((), generator=self.generator) < self.p)

    def _route(self, logits: torch.Tensor, x: torch.Tensor | None = None) -> Routing:
        training = self.training
        coin_allowed = training or self.eval_mode in ("sinkhorn_p", "both")
        noisy = self.noise_scale > 0 and (training or self.eval_mode in ("noise", "both"))
        # compiled (with the plan detached, the default): the coin stays on the device and torch.cond runs
        # the branch it picks, so the routing is one graph
        on_device = torch.compiler.is_compiling() and self.detach_plan and coin_allowed and self.p > 0
        if on_device:
            # drawn as flip_coin draws it (the same generator, on the CPU), then moved
            coin = (torch.rand((), generator=self.generator) < self.p).to(logits.device)
        else:
            coin = coin_allowed and self.p > 0 and self.flip_coin()

        cost = logits if self.cost == "linear" else torch.softmax(logits, dim=-1)
        if noisy:
            cost = cost + self.noise_scale * randn_like(cost, self.generator)
        softmax_branch = self._softmax_branch(noisy)
        if on_device:
            # the selection under torch.cond (no gradient flows through it: the plan is detached), the
            # softmax weights outside it, chosen by the coin
            def sinkhorn_branch(cost):
                scores, values, indices, weights = self._sinkhorn_branch(None, cost)
                return scores, values, indices, weights

            def plain_branch(cost):
                top = largest(cost, self.k)
                return cost.clone(), top.values, top.indices, torch.zeros_like(top.values)

            scores, values, indices, plan_weights = torch.cond(coin, sinkhorn_branch, plain_branch, (cost.detach(),))
            source = cost if (self.noisy_weights and noisy) else logits
            weights = torch.where(coin, plan_weights, torch.softmax(source.gather(-1, indices), dim=-1))
            used_sinkhorn = coin.to(logits.dtype)
        else:
            if coin:
                self.sinkhorn_calls += 1
            scores, values, indices, weights = (self._sinkhorn_branch if coin else softmax_branch)(logits, cost)
            used_sinkhorn = float(coin)
        capacity = self.capacity(logits.shape[-2])
        # each token's k choices (expert, slot), not (T, E) tables: the layer reads them directly
        expert, slot = token_choice_allocation(scores.detach(), self.k, capacity, top=(values.detach(), indices),
                                               choices=True, checked=True)
        weight = weights.to(logits.dtype) * (slot >= 0)  # exactly 0 for a dropped choice
        return Routing(choice_expert=expert, choice_slot=slot, choice_weight=weight, capacity=capacity,
                       probs=torch.softmax(logits, dim=-1), aux_loss=logits.new_zeros(()),
                       extra_stats={"used_sinkhorn": used_sinkhorn}, max_pairs=self.k * logits[..., 0].numel())

    def _sinkhorn_branch(self, logits, cost):
        """The OT branch: each token's top-k entries of the plan, renormalised (Proposition 3.1)."""
        # SSR-L at small eps may stop at max_iter, as in the paper: no warning (compiled, sinkhorn gives none)
        with contextlib.nullcontext() if torch.compiler.is_compiling() else warnings.catch_warnings():
            if not torch.compiler.is_compiling():
                warnings.simplefilter("ignore", RuntimeWarning)
            scores = sinkhorn(cost if not self.detach_plan else cost.detach(), self.eps, max_iter=self.max_iter,
                              tol=self.tol, grad="none" if self.detach_plan else "implicit")
        top = largest(scores, self.k)
        return scores, top.values, top.indices, top.values / top.values.sum(-1, keepdim=True)

    def _softmax_branch(self, noisy: bool):
        """The plain branch: top-k of the (noisy) cost, softmax weights of the clean logits."""
        def branch(logits, cost):
            top = largest(cost.detach(), self.k)
            source = cost if (self.noisy_weights and noisy) else logits
            return cost, top.values, top.indices, torch.softmax(source.gather(-1, top.indices), dim=-1)
        return branch

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, k={self.k}, cost={self.cost!r}, p={self.p}, eps={self.eps}, "
                f"noise_scale={self.noise_scale}, detach_plan={self.detach_plan}")
