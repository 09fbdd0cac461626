"""Sinkhorn Token Choice and Sinkhorn Expert Choice (Liu et al. §2.2 and §2.4; Clark et al. 2022).

Book: chapter 2, section "Sinkhorn routers are top-k with per-expert biases". The entropic OT plan of the (noisy) logits,
with every expert receiving T/E units (:func:`minimoe.ops.sinkhorn`), replaces the softmax as the
score that *allocates*: Algorithm 1 (token choice) or Algorithm 2 (expert choice) runs on the plan.
The combine weights stay the softmax values at the dispatched pairs ("the plan dispatches, the
softmax combines"), which is how the router's gate still gets a gradient: the plan is a constant.
``combine="plan"`` uses the plan's entries instead (then the gate gets no gradient from the task).

Within a token's row the plan is ``exp((S_te + g_e) / eps)`` up to the token's own factor, so token
choice on the plan is top-k of the logits shifted by a per-expert bias ``g`` re-solved for every
batch (chapter 2, Proposition 2.12, "What a router sees in the plan").
"""
from __future__ import annotations

import warnings

import torch

from .. import losses
from ..ops import sinkhorn
from ..ops._checks import check_bool, check_choice, check_int, check_nonnegative_float, check_positive_float
from ..ops.allocation import expert_choice_allocation, token_choice_allocation
from ..routing import Routing
from .base import Router, register

# the plan's largest relative marginal error the routers accept before going on (see balance_tol)
BALANCE_TOL = 0.05
BALANCE_MAX_ITER = 1000


class _SinkhornRouter(Router):
    """The options and the plan both Sinkhorn routers share (declared once; see
    :class:`SinkhornTokenChoice` for their meaning)."""

    def __init__(self, d_model, n_experts, allow_dropless=True, *, capacity_factor: float | None = 1.0,
                 capacity_rounding: str = "round",
                 min_capacity: int = 0, eps: float = 1.0, sinkhorn_iters: int = 20, sinkhorn_tol: float = 0.0,
                 last_update: str = "rows", balance_tol: float | None = BALANCE_TOL, combine: str = "softmax",
                 noise: str | None = None, noise_std: float | None = None, z_loss_weight: float = 0.0,
                 generator: torch.Generator | None = None):
        # (allow_dropless is positional: not an option a user passes, but whether the subclass has a
        # dropless form)
        super().__init__(d_model, n_experts)
        self._init_capacity(capacity_factor, capacity_rounding, min_capacity, allow_none=allow_dropless)
        self.eps = check_positive_float(eps, "eps")
        self.sinkhorn_iters = check_int(sinkhorn_iters, "sinkhorn_iters", low=1)
        self.sinkhorn_tol = check_nonnegative_float(sinkhorn_tol, "sinkhorn_tol")
        self.last_update = check_choice(last_update, "last_update", ("rows", "columns"))
        self.balance_tol = check_positive_float(balance_tol, "balance_tol", allow_none=True)
        self.combine = check_choice(combine, "combine", ("softmax", "plan"))
        self._init_noise(noise, noise_std, generator)
        self.z_loss_weight = check_nonnegative_float(z_loss_weight, "z_loss_weight")

    @classmethod
    def study_options(cls, *, group_size: int, n_experts: int) -> dict:
        return {"capacity_factor": 1.0}

    def _scores(self, logits):
        """(softmax probabilities of the noisy logits, their plan without gradient, the plan's
        largest relative marginal error)."""
        noisy = self._vmoe_noise(logits)
        probs = torch.softmax(noisy, dim=-1)
        result = sinkhorn(noisy.detach(), self.eps, max_iter=self.sinkhorn_iters, tol=self.sinkhorn_tol,
                          method="sinkhorn", last_update=self.last_update, return_potentials=True)
        # (compiled: the fixed iterations only, as balance_tol=None; reading the error would break the graph)
        if self.balance_tol is not None and not torch.compiler.is_compiling() and result.error > self.balance_tol:
            # The fixed iterations stop balancing once |logits| / eps is large (Sinkhorn's rate tends to 1):
            # go on from where they stopped with the converging solver (eps-scaling, Newton).
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                result = sinkhorn(noisy.detach(), self.eps, tol=self.balance_tol, max_iter=BALANCE_MAX_ITER,
                                  init=result.g, last_update=self.last_update, return_potentials=True)
            if result.error > self.balance_tol:
                warnings.warn(f"{self.name}: the Sinkhorn plan's marginals are still off by {result.error:.3g} "
                              f"(balance_tol={self.balance_tol:g}) after {BALANCE_MAX_ITER} more iterations; the "
                              "routing is not balanced. Raise eps or keep the logits smaller (z_loss_weight)",
                              RuntimeWarning, stacklevel=4)
        return probs, result.plan, result.error

    def _finish(self, logits, probs, plan, capacity, error, position=None, choices=None):
        """The Routing from the slot table ``position (..., T, E)``, or from each token's choices
        ``(expert, slot)`` (token choice), with the combine weights of ``self.combine``."""
        aux = logits.new_zeros(())
        if self.training and self.z_loss_weight:
            aux = aux + self.z_loss_weight * losses.z_loss(logits)
        stats = {"plan_marginal_error": error}
        weights = probs if self.combine == "softmax" else plan
        if choices is not None:
            expert, slot = choices
            weight = weights.gather(-1, expert) * (slot >= 0)  # exactly 0 for a dropped choice
            return Routing(choice_expert=expert, choice_slot=slot, choice_weight=weight, capacity=capacity,
                           probs=probs, aux_loss=aux, extra_stats=stats)
        return Routing(combine=weights * (position >= 0), position=position, capacity=capacity, probs=probs,
                       aux_loss=aux, extra_stats=stats)


@register("sinkhorn_token_choice")
class SinkhornTokenChoice(_SinkhornRouter):
    """Token choice (Algorithm 1) on the Sinkhorn plan; softmax combine weights.

    Args:
        k: experts per token.
        capacity_factor: slots per expert ``round(capacity_factor * k * T / E)``, or None (dropless).
        capacity_rounding, min_capacity: passed to :func:`minimoe.ops.compute_capacity`.
        eps: entropic regularisation of the plan (Liu et al. use 1).
        sinkhorn_iters, sinkhorn_tol: iteration cap and tolerance of :func:`minimoe.ops.sinkhorn`;
            ``sinkhorn_tol=0`` (default) runs exactly ``sinkhorn_iters`` iterations, as V-MoE does (20).
        last_update: ``"rows"`` (default, as V-MoE through OTT: the iterations end on the row update,
            so every token's plan row sums to 1 and the columns carry what is left of the error) or
            ``"columns"`` (every expert's column exact). Chapter 2, "Sinkhorn routers in practice".
        balance_tol: when the plan's relative marginal error after ``sinkhorn_iters`` iterations is
            above this (large logits: 20 iterations stop balancing), go on with the converging solver
            until it is below, and warn if even that fails; ``None`` keeps V-MoE's fixed iterations
            whatever the error. ``routing.stats["plan_marginal_error"]`` reports the error either way.
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
        generator: a ``torch.Generator`` for the noise; ``None`` uses torch's.
    """

    def __init__(self, d_model: int, n_experts: int, *, k: int = 1, batch_priority: bool = False,
                 renormalize: bool = False, eval_routing: str = "plan", **options):
        super().__init__(d_model, n_experts, True, **options)
        self.k = self.choices_per_token = check_int(k, "k", low=1, high=self.n_experts)
        self.renormalize = check_bool(renormalize, "renormalize")
        self.eval_routing = check_choice(eval_routing, "eval_routing", ("plan", "softmax"))
        self.batch_priority = check_bool(batch_priority, "batch_priority")

    @classmethod
    def study_options(cls, *, group_size: int, n_experts: int) -> dict:
        return {"k": 1, "capacity_factor": 1.0}

    def _route(self, logits: torch.Tensor, x: torch.Tensor | None = None) -> Routing:
        capacity = self.capacity(logits.shape[-2])
        if not self.training and self.eval_routing == "softmax":
            probs = torch.softmax(logits, dim=-1)
            plan, error = probs, 0.0  # "plan" combine falls back to the softmax too: there is no plan at eval
            ranked = probs.detach()
        else:
            probs, plan, error = self._scores(logits)
            ranked = plan
        # each token's k choices (expert, slot), not a (T, E) table: the layer reads them directly
        expert, slot = token_choice_allocation(ranked, self.k, capacity, batch_priority=self.batch_priority,
                                               choices=True, checked=True)
        routing = self._finish(logits, probs, plan, capacity, error, choices=(expert, slot))
        if self.renormalize:  # on the (T, E) combine table: the routing becomes a table routing
            total = routing.combine.sum(-1, keepdim=True)
            routing = routing.with_combine(routing.combine / torch.where(total > 0, total, torch.ones_like(total)))
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

    def __init__(self, d_model: int, n_experts: int, *, capacity_factor: float = 1.0, **options):
        super().__init__(d_model, n_experts, False, capacity_factor=capacity_factor, **options)

    def _route(self, logits: torch.Tensor, x: torch.Tensor | None = None) -> Routing:
        probs, plan, error = self._scores(logits)
        capacity = self.capacity(logits.shape[-2])
        position = expert_choice_allocation(plan, capacity, checked=True)
        return self._finish(logits, probs, plan, capacity, error, position=position)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, capacity_factor={self.capacity_factor}, eps={self.eps}"
