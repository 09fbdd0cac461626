"""Kool, Maddison & Mnih: top-1 routing with capacity trained by unbiased REINFORCE.

Book: chapter 5, section "The routers in a MoE layer". The router ``p(z | x) = softmax(x W)`` is a
distribution to sample from, not a gate: in training each token goes to one sampled expert with
combine weight 1, and the expert's output is the layer's output for that token.

* ``kool_skip``: independent samples from ``softmax(logits / tau)`` (or its Sinkhorn balancing),
  then a uniformly random ``min(n_e, C)`` of each expert's tokens is kept (the others are skipped:
  they get 0, and the residual connection carries them). :func:`minimoe.ops.skip_sample`.
* ``kool_gumbel_matching``: one exact draw of the n x k Gumbel-Matching distribution, every token
  placed, each expert at most ``C``. :func:`minimoe.ops.gumbel_matching_sample`.

The routing carries ``log_prob`` (``log p(z_t | x_t)``, with gradient) and ``reinforce_weight``
(the estimator's ``w_t``; :func:`minimoe.ops.estimator_coefficients`). Both rules of the surrogate
(K1) are the router's, through the router protocol: :meth:`adjust_output` scales the gradient
through token t's output by ``w_t`` (the pathwise term), and :meth:`extra_loss` is the REINFORCE
term from the per-token losses, which :func:`minimoe.train.train` adds with its moving-average
baseline (by hand: :func:`minimoe.losses.reinforce_loss`). **Without it the gate gets no
gradient**, since the combine weights are constants.

At evaluation both route every token to its argmax expert with no capacity: the paper's test-time
routing ``z* = argmax p(z | x)`` (the objective it trains is the expectation that this
approximates), and a token at inference should not depend on which other tokens share its batch, as
a balanced assignment would make it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import losses
from ..ops import compute_capacity
from ..ops._checks import check_bool, check_choice, check_generator, check_positive_float
from ..ops.allocation import dropless_choice_slots, dropless_positions
from ..ops.balanced_estimators import sample_estimator
from ..ops.gumbel_matching import METHODS
from ..routing import Routing
from .base import Router, register


class _ReinforceRouter(Router):
    """Shared: sample in training (through :func:`minimoe.ops.sample_estimator`), argmax at evaluation."""

    ESTIMATORS: tuple = ()
    training_rule = "REINFORCE surrogate with a moving-average baseline"

    def __init__(self, d_model: int, n_experts: int, *, capacity_factor, capacity_rounding, min_capacity, tau,
                 estimator, sinkhorn_proposal, generator, method):
        super().__init__(d_model, n_experts)
        self._init_capacity(capacity_factor, capacity_rounding, min_capacity)
        self.tau = check_positive_float(tau, "tau")
        self.estimator = check_choice(estimator, "estimator", self.ESTIMATORS)
        self.sinkhorn_proposal = check_bool(sinkhorn_proposal, "sinkhorn_proposal")
        self.generator = check_generator(generator)
        self.method = check_choice(method, "method", METHODS)

    @classmethod
    def study_options(cls, *, group_size: int, n_experts: int) -> dict:
        return {"capacity_factor": 1.0}

    def adjust_output(self, layer, x, routing, out):
        """The pathwise term of (K1), chapter 5: the same value, the gradient through token t's output
        scaled by ``sg(w_t)`` (in training, where the routing carries the coefficients)."""
        if routing.reinforce_weight is None or not torch.is_grad_enabled():
            return out
        weight = routing.reinforce_weight.detach().to(out.dtype).reshape(out.shape[:-1]).unsqueeze(-1)
        return out.detach() + (out - out.detach()) * weight

    def extra_loss(self, routing, loss_per_token, *, baseline=0.0):
        """The REINFORCE term of (K1), ``mean_t sg(w_t) sg(f_t - b) log p(z_t | x_t)``, as a value-free
        surrogate (:func:`minimoe.losses.reinforce_term`); None at evaluation (no coefficients)."""
        if routing.reinforce_weight is None:
            return None
        return losses.reinforce_term(routing, loss_per_token, baseline)

    def _route(self, logits: torch.Tensor, x: torch.Tensor | None = None) -> Routing:
        T, E = logits.shape[-2:]
        log_p = torch.log_softmax(logits, dim=-1)
        probs = log_p.exp()
        if not self.training:
            chosen = F.one_hot(logits.detach().argmax(-1), E).bool()
            return Routing(combine=chosen.to(logits.dtype), position=dropless_positions(chosen), capacity=None,
                           probs=probs, aux_loss=logits.new_zeros(()))
        capacity = self.capacity(T)
        drawn = sample_estimator(logits, self.estimator, capacity, tau=self.tau,
                                 sinkhorn_proposal=self.sinkhorn_proposal, generator=self.generator,
                                 method=self.method)
        # each token's one choice: its drawn expert, kept or skipped (no (T, E) table)
        expert, kept = drawn.assignment[..., None], drawn.keep[..., None]
        weight = drawn.coef.to(logits.dtype)
        return Routing(choice_expert=expert, choice_slot=dropless_choice_slots(expert, kept, E),
                       choice_weight=kept.to(logits.dtype), capacity=capacity, probs=probs, aux_loss=logits.new_zeros(()),
                       extra_stats={"max_reinforce_weight": lambda: float(weight.max()) if weight.numel() else 0.0},
                       log_prob=log_p.gather(-1, drawn.assignment[..., None])[..., 0], reinforce_weight=weight)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, capacity_factor={self.capacity_factor}, tau={self.tau}, "
                f"estimator={self.estimator!r}")


@register("kool_skip")
class KoolSkip(_ReinforceRouter):
    """Independent sampling with uniform skipping of the overflow (Kool et al. §2.1, eq. 3).

    Args:
        capacity_factor: slots per expert ``C = round(capacity_factor * T / E)`` per group, or ``None``
            (no capacity: the plain tempered sampler "Sample").
        capacity_rounding, min_capacity: passed to :func:`minimoe.ops.compute_capacity`.
        tau: proposal temperature (> 0); the weights correct for it.
        estimator: ``"skip_iw"`` (unbiased: ``n_z / min(n_z, C) * p / q``), ``"skip"`` (biased: the
            survivors averaged) or ``"skip_no_iw"`` (no importance weights at all).
        sinkhorn_proposal: sample from the Sinkhorn balancing of ``softmax(logits / tau)`` (App. E).
        generator: a ``torch.Generator`` for the draws (reproducible runs); ``None`` uses torch's.
    """

    ESTIMATORS = ("skip_iw", "skip", "skip_no_iw")

    def __init__(self, d_model: int, n_experts: int, *, capacity_factor: float | None = 1.0,
                 capacity_rounding: str = "round", min_capacity: int = 0, tau: float = 1.0,
                 estimator: str = "skip_iw", sinkhorn_proposal: bool = False,
                 generator: torch.Generator | None = None):
        super().__init__(d_model, n_experts, capacity_factor=capacity_factor, capacity_rounding=capacity_rounding,
                         min_capacity=min_capacity, tau=tau, estimator=estimator,
                         sinkhorn_proposal=sinkhorn_proposal, generator=generator, method="auto")


@register("kool_gumbel_matching")
class KoolGumbelMatching(_ReinforceRouter):
    """One exact Gumbel-Matching draw per group (Kool et al. §2.2, eqs. 4 and 6).

    Args:
        capacity_factor: >= 1; slots per expert ``C = max(round(capacity_factor * T / E), ceil(T / E))``
            (every token must be placed). 1 with E dividing T is the paper's perfectly balanced case.
        capacity_rounding, min_capacity: passed to :func:`minimoe.ops.compute_capacity`.
        tau: temperature of the perturbed problem (> 0).
        estimator: ``"gm_iw"`` (unbiased: ``p / q(z_t | G_-t)``), ``"gm_sh"`` (``p / P~``, Sinkhorn),
            ``"gm"`` (``p / softmax(logits / tau)``) or ``"gm_no_iw"`` (weights 1); the last three are
            biased.
        method: the solver (:func:`minimoe.ops.gumbel_matching_sample`; all exact).
        generator: a ``torch.Generator`` for the Gumbel noise; ``None`` uses torch's.
    """

    ESTIMATORS = ("gm_iw", "gm_sh", "gm", "gm_no_iw")

    def __init__(self, d_model: int, n_experts: int, *, capacity_factor: float = 1.0,
                 capacity_rounding: str = "round", min_capacity: int = 0, tau: float = 1.0,
                 estimator: str = "gm_iw", method: str = "auto", generator: torch.Generator | None = None):
        if capacity_factor is None or check_positive_float(capacity_factor, "capacity_factor") < 1:
            raise ValueError(f"capacity_factor must be >= 1 for Gumbel-Matching (every token is placed), "
                             f"got {capacity_factor}")
        super().__init__(d_model, n_experts, capacity_factor=capacity_factor, capacity_rounding=capacity_rounding,
                         min_capacity=min_capacity, tau=tau, estimator=estimator, sinkhorn_proposal=False,
                         generator=generator, method=method)

    def capacity(self, tokens: int) -> int:
        # at least ceil(T / E) slots: a floor, not a second rounding (few tokens, many experts would
        # otherwise round the capacity to 0 before the floor applies)
        return compute_capacity(tokens, self.n_experts, self.capacity_factor, rounding=self.capacity_rounding,
                                min_capacity=max(self.min_capacity, math.ceil(tokens / self.n_experts)))
