"""Sparsity-constrained Expert Choice (Liu et al. 2024, §2.5, eq. 9; OT of Liu, Puigcerver & Blondel 2023).

Book: chapter 4 (Six routers, one formulation), section "The sparsity-constrained problem". The
router's softmax ``U = softmax(x W)`` is the utility of the sparsity-constrained OT problem (9): a plan
with rows summing to 1, columns to ``T/E`` and at most ``C`` nonzeros per expert
(:func:`minimoe.ops.sparsity_constrained_plan`, under ``no_grad``). Each expert then takes its top-``C``
tokens of the plan's column (Algorithm 2) -- but only tokens with a positive plan entry, so a column
with fewer than ``C`` nonzeros leaves slots empty rather than filling them with tokens the plan gave
nothing. As in the other OT routers the plan dispatches and the softmax combines: the combine weights
are the softmax values at the dispatched pairs, which is how the gate learns.

The problem is infeasible below ``smallest_feasible_capacity(T, E)`` (at least ``T/E``; book,
Proposition 4.4), which ``round`` can produce (196 tokens, 32 experts, factor 1: ``round(6.125) = 6``,
the bound is 7); the router then raises ``ValueError`` -- use ``capacity_rounding="ceil"``.
"""
from __future__ import annotations

import torch

from .. import losses
from ..ops._checks import check_choice, check_int, check_positive_float, reads_are_free
from ..ops.allocation import expert_choice_allocation
from ..ops.sparse_ot import DEFAULT_ITERS, METHODS, smallest_feasible_capacity, solve_plan, sparsity_constrained_plan
from ..routing import Routing
from .base import register
from .expert_choice import ExpertChoice


@register("sparsity_constrained_ec")
class SparsityConstrainedExpertChoice(ExpertChoice):
    """Expert choice (Algorithm 2) on the sparsity-constrained OT plan; softmax combine weights.

    Args:
        capacity_factor: slots per expert ``C = round(capacity_factor * T / E)`` per group; ``C`` is also
            the plan's l0 bound per column. Must give ``C >= T/E`` (feasibility).
        capacity_rounding, min_capacity: passed to :func:`minimoe.ops.compute_capacity`.
        gamma: weight of the plan's quadratic regulariser (the paper: 1).
        ot_method: ``"adam"`` (default; the authors' solver: lr 1e-2, 20 steps) or ``"annealed"``
            (better rows, 5x the cost at its default 100 steps); see :mod:`minimoe.ops.sparse_ot`.
        ot_iters: solver steps (default: 20 for ``"adam"``, 100 for ``"annealed"``).
        ot_lr: solver learning rate (default: the method's).
        noise: ``None`` or ``"vmoe"`` (``N(0, noise_std^2)`` on the logits in training, std 1/E); the
            plan and the combine softmax both see the noisy logits.
        z_loss_weight: weight of the router z-loss; 0 disables it.
        generator: a ``torch.Generator`` for the noise; ``None`` uses torch's.

    ``Routing.extra_stats["plan_row_error"]`` is the mean ``|row sum - 1|`` of the plan (its columns are
    exact; the rows are where the solver falls short). On the CPU the solver warns when it is above 1
    (not converged); on an accelerator it does not warn, so that with ``ot_method="adam"`` the forward
    reads nothing on the host (``"annealed"`` still reads its number of continuation stages): read the
    statistic there.
    """

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        *,
        capacity_factor: float = 1.0,
        capacity_rounding: str = "round",
        min_capacity: int = 0,
        gamma: float = 1.0,
        ot_method: str = "adam",
        ot_iters: int | None = None,
        ot_lr: float | None = None,
        noise: str | None = None,
        noise_std: float | None = None,
        z_loss_weight: float = 0.0,
        generator: torch.Generator | None = None,
    ):
        # capacity, noise and z-loss options are expert choice's; the solver options are ours
        super().__init__(d_model, n_experts, capacity_factor=capacity_factor, capacity_rounding=capacity_rounding,
                         min_capacity=min_capacity, noise=noise, noise_std=noise_std, z_loss_weight=z_loss_weight,
                         generator=generator)
        self.gamma = check_positive_float(gamma, "gamma")
        self.ot_method = check_choice(ot_method, "ot_method", METHODS)
        self.ot_iters = DEFAULT_ITERS[ot_method] if ot_iters is None else check_int(ot_iters, "ot_iters", low=0)
        self.ot_lr = check_positive_float(ot_lr, "ot_lr", allow_none=True)

    @classmethod
    def study_options(cls, *, group_size: int, n_experts: int) -> dict:
        # ceil: the plan is infeasible below T/E slots (Proposition 4.4)
        return {"capacity_factor": 1.0, "capacity_rounding": "ceil"}

    def capacity(self, tokens: int) -> int:
        capacity = super().capacity(tokens)
        smallest = smallest_feasible_capacity(tokens, self.n_experts)
        if capacity < smallest:
            raise ValueError(
                f"capacity_factor={self.capacity_factor} gives capacity={capacity} slots per expert for "
                f"{tokens} tokens and {self.n_experts} experts, but the sparsity-constrained plan (eq. 9) is "
                f"infeasible below capacity={smallest} (book, Proposition 4.4). Use capacity_rounding='ceil', "
                f"min_capacity={smallest} or a larger capacity_factor")
        return capacity

    def _route(self, logits: torch.Tensor, x: torch.Tensor | None = None) -> Routing:
        capacity = self.capacity(logits.shape[-2])
        probs = torch.softmax(self._vmoe_noise(logits), dim=-1)
        if reads_are_free(probs):
            info = sparsity_constrained_plan(probs.detach(), capacity, gamma=self.gamma, method=self.ot_method,
                                             max_iter=self.ot_iters, lr=self.ot_lr, return_info=True)
            plan, row_error = info.plan, logits.new_tensor(info.row_error)
        else:  # on an accelerator the row error stays there: no host read, and so no warning
            with torch.no_grad():
                plan, *_, error = solve_plan(probs.detach(), capacity, self.gamma, self.ot_method, self.ot_iters, 0.0,
                                         self.ot_lr)
            row_error = error.mean().to(logits.dtype)
        # Top-C of a column with fewer than C nonzeros would also pick tokens the plan gave nothing;
        # those slots stay empty. The positive entries rank first, so the kept slots are 0, 1, ...
        position = expert_choice_allocation(plan, capacity, positive_only=True, checked=True)
        mask = position >= 0
        aux = logits.new_zeros(())
        if self.training and self.z_loss_weight:
            aux = aux + self.z_loss_weight * losses.z_loss(logits)
        return Routing(combine=probs * mask, position=position, capacity=capacity, probs=probs, aux_loss=aux,
                       extra_stats={"plan_row_error": row_error})

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, gamma={self.gamma}, "
                f"ot_method={self.ot_method!r}, ot_iters={self.ot_iters}")
