"""Auxiliary-loss-free balancing (Wang et al. 2024; DeepSeek-V3): a bias per expert for selection only.

Book: chapter 10, "Loss-free balancing is dual ascent". Each token takes the top-k experts of
``score + b`` (the bias ``b`` added to the logits, or to the scores themselves as DeepSeek-V3 does on
its sigmoid affinities); its combine weights are the *unbiased* scores of the chosen experts, so the
bias never enters the gradient. After each routing call in training, the bias moves against the
load error of that call (:func:`minimoe.ops.bias_update`): a (sign-)subgradient step on the dual of
the balanced selection LP (chapter 6, Prop. 6.3). In eval the bias is frozen. It depends only on
earlier calls, so, unlike expert choice, a token's routing never sees later tokens.
"""
from __future__ import annotations

import torch

from .. import losses
from ..ops.allocation import dropless_choice_slots, largest, token_choice_allocation
from ..ops.bias_balancing import BIAS_UPDATES, bias_update, expert_loads, max_violation
from ..ops.group_limited import check_group_limits, group_limited_scores
from ..ops._checks import check_choice, check_finite, check_int, check_nonnegative_float, check_positive_float
from ..routing import Routing
from .base import Router, register

SCORES = ("softmax", "sigmoid")
BIAS_ON = ("logits", "scores")


@register("loss_free")
class LossFreeBalancing(Router):
    """Token choice on ``score + bias``, the bias updated from the loads without gradient.

    Args:
        k: experts per token (1 <= k <= n_experts).
        score: ``"softmax"`` (combine weights: the softmax probabilities of the chosen experts) or
            ``"sigmoid"`` (DeepSeek-V3: ``sigmoid(logits)`` of the chosen experts divided by their sum).
        bias_rate: step size ``u`` of the bias update (default 1e-3).
        update: ``"sign"`` (Wang et al.: ``b += u * sign(mean load - load)``) or ``"proportional"``
            (``b += u * (mean load - load) / mean load``).
        bias_on: ``"logits"`` (select on ``logits + b``) or ``"scores"`` (select on ``s + b`` with
            ``s`` the softmax or sigmoid scores, as DeepSeek-V3 does).
        capacity_factor: ``None`` for dropless routing (default), else slots per expert
            ``C = round(capacity_factor * k * T / E)`` per group, filled first choices first.
        capacity_rounding, min_capacity: passed to :func:`minimoe.ops.compute_capacity`.
        n_group, topk_group: group-limited (node-limited) selection of DeepSeek-V2/V3: the experts
            form ``n_group`` equal groups, each group is scored by the sum of its two largest biased
            scores, and a token chooses its ``k`` experts among the ``topk_group`` best groups only
            (default 1 and 1: no limit). With experts placed group by group on devices, a token then
            reaches at most ``topk_group`` devices (:func:`minimoe.ops.group_limited_scores`).
        group_score: ``"top2"`` (DeepSeek-V3, the default: a group's two best biased scores summed)
            or ``"max"`` (DeepSeek-V2: its best one).
        routed_scaling: multiplies the combine weights (DeepSeek-V3's ``routed_scaling_factor``;
            default 1).
        sequence_balance_weight: ``alpha`` of DeepSeek-V3's complementary sequence-wise balance loss
            (its eqs. 17-20), added to ``aux_loss`` in training beside the bias: for each routing group
            (a sequence when the model routes each sequence as a group),
            ``alpha * sum_i f_i P_i`` with ``f_i = E / (k T) * #{t: i chosen by t}`` and
            ``P_i = mean_t s'_{t,i}``, ``s'`` the scores normalised over the experts (sigmoid scores
            divided by their sum); the mean over groups. DeepSeek-V3 uses ``alpha = 1e-4``; 0
            (default) disables it.
        eval_capacity_factor: the capacity factor in eval mode (DeepSpeed-MoE); ``None``: the same.
        router_dtype: ``None`` or ``"float32"``: logits and scores in float32 whatever the model's
            dtype (DeepSeek-V3 computes its router in float32; see :meth:`Router.gate_logits`).

    ``route(..., token_mask=m)`` takes a padding mask: the loads that move the bias, ``max_violation``
    and the sequence-wise loss then count the real tokens (``m = True``) only; the routing itself
    is unchanged.

    The bias is the buffer ``expert_bias`` (float32, ``(E,)``, saved in ``state_dict``). In training
    mode, after each call it takes one step from the loads of *all* groups of the call (the global
    batch), passed through the router protocol's :meth:`reduce_loads` (identity on one process; the
    expert-parallel layer makes it an all-reduce over ranks). The loads count each token's top-k choices, before any capacity drop.
    ``routing.stats`` adds ``"max_violation"`` (``max load / mean load - 1`` of this call) and
    ``"bias"`` (a copy of the bias this call selected with, before its update).
    """

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        *,
        k: int = 1,
        score: str = "softmax",
        bias_rate: float = 1e-3,
        update: str = "sign",
        bias_on: str = "logits",
        capacity_factor: float | None = None,
        capacity_rounding: str = "round",
        min_capacity: int = 0,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling: float = 1.0,
        group_score: str = "top2",
        sequence_balance_weight: float = 0.0,
        eval_capacity_factor: float | None = None,
        router_dtype: str | torch.dtype | None = None,
    ):
        super().__init__(d_model, n_experts)
        self.k = check_int(k, "k", low=1, high=self.n_experts)
        self.score = check_choice(score, "score", SCORES)
        self.bias_rate = check_nonnegative_float(bias_rate, "bias_rate")
        self.update = check_choice(update, "update", BIAS_UPDATES)
        self.bias_on = check_choice(bias_on, "bias_on", BIAS_ON)
        self._init_capacity(capacity_factor, capacity_rounding, min_capacity, choices_per_token=self.k,
                            eval_capacity_factor=eval_capacity_factor)
        self._init_precision(router_dtype)
        self.register_buffer("expert_bias", torch.zeros(self.n_experts, dtype=torch.float32), persistent=True)
        self.n_group, self.topk_group, self.group_score = check_group_limits(self.n_experts, self.k, n_group,
                                                                             topk_group, group_score)
        self.routed_scaling = check_positive_float(routed_scaling, "routed_scaling")
        self.sequence_balance_weight = check_nonnegative_float(sequence_balance_weight, "sequence_balance_weight")

    takes_token_mask = True

    training_rule = "bias moved by the loads after each call (no gradient)"

    @classmethod
    def study_options(cls, *, group_size: int, n_experts: int) -> dict:
        # DeepSeek-V3's balancing (chapter 10): top-1 dropless on logits + bias, bias moved by sign
        # steps of Wang et al.'s default size 1e-3 from the loads of the whole step; no auxiliary loss
        return {"k": 1, "capacity_factor": None, "update": "sign", "bias_rate": 1e-3}

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The unbiased affinities ``s``: softmax or sigmoid of the logits."""
        return torch.softmax(logits, dim=-1) if self.score == "softmax" else torch.sigmoid(logits)

    def _apply(self, fn, recurse=True):
        # .to(dtype), .half(), .double() convert floating buffers; the bias stays float32 (its steps of
        # 1e-3 are below half a bfloat16 ulp of a bias near 1, so a bfloat16 bias would never move)
        bias = self._buffers["expert_bias"]
        super()._apply(fn, recurse)
        moved = self._buffers["expert_bias"]
        if moved.dtype != torch.float32:
            self._buffers["expert_bias"] = bias.to(device=moved.device, dtype=torch.float32)
        return self

    def _route(self, logits: torch.Tensor, x: torch.Tensor | None = None,
               token_mask: torch.Tensor | None = None) -> Routing:
        check_finite(self.expert_bias, "loss_free's expert_bias buffer")
        s = self.scores(logits)
        bias = self.expert_bias.detach().clone()
        with torch.no_grad():
            base = logits if self.bias_on == "logits" else s
            key = base.to(torch.float32) + bias.to(base.device)
            if self.n_group > 1:  # group-limited: only the topk_group best groups (by their two best scores)
                key = group_limited_scores(key, self.n_group, self.topk_group, self.group_score, checked=True)
            top = largest(key, self.k)
            chosen = torch.zeros_like(key, dtype=torch.bool).scatter_(-1, top.indices, True)
            capacity = self.capacity(logits.shape[-2])
            # each token's k choices (no (T, E) table). Dropless: each expert's slots in token order;
            # with a capacity, Algorithm 1 of chapter 1
            expert = top.indices
            slot = (dropless_choice_slots(expert, torch.ones_like(expert, dtype=torch.bool), self.n_experts)
                    if capacity is None else
                    token_choice_allocation(key, self.k, capacity, top=top, choices=True, checked=True)[1])
        if self.score == "softmax":
            gates, probs = s, s
        else:  # DeepSeek-V3: the chosen sigmoid gates, normalised to sum 1
            picked = s * chosen
            gates = picked / picked.sum(-1, keepdim=True).clamp_min(torch.finfo(s.dtype).tiny)
            probs = s / s.sum(-1, keepdim=True)
        weight = gates.gather(-1, expert) * (slot >= 0)  # exactly 0 for a dropped choice
        if self.routed_scaling != 1.0:
            weight = weight * self.routed_scaling

        aux = logits.new_zeros(())
        extra = {}
        real_chosen = chosen if token_mask is None else chosen & token_mask.unsqueeze(-1)  # padding chose nothing
        if self.training and self.sequence_balance_weight:
            # DeepSeek-V3's L_Bal: the Switch formula E * sum_i (n_i / kT) P_i of each sequence, on the
            # normalised scores s' (probs); f_i counts the chosen experts (before any capacity drop)
            counts = real_chosen.sum(-2)
            balance = losses.switch_balance_loss_from_counts(probs, counts, token_mask=token_mask)
            aux = aux + self.sequence_balance_weight * balance
            extra["sequence_balance_loss"] = balance.detach()
        with torch.no_grad():
            loads = self.reduce_loads(expert_loads(real_chosen))
            violation = max_violation(loads)
            if self.training:
                self.expert_bias.copy_(bias_update(self.expert_bias, loads.to(self.expert_bias.device),
                                                   self.bias_rate, self.update))
        return Routing(choice_expert=expert, choice_slot=slot, choice_weight=weight, capacity=capacity, probs=probs,
                       aux_loss=aux, extra_stats={"max_violation": violation, "bias": bias, **extra},
                       max_pairs=self.k * logits[..., 0].numel())

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, k={self.k}, score={self.score!r}, bias_rate={self.bias_rate}, "
                f"update={self.update!r}, bias_on={self.bias_on!r}, capacity_factor={self.capacity_factor}")
