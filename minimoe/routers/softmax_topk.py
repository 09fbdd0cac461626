"""Softmax Token Choice (Liu et al. §2.1, Alg. 1; Shazeer et al. 2017; Switch; GShard; V-MoE).

Book: chapter 1, section "Token choice". Each token takes its top-k experts of
``softmax(x W + noise)``; the experts' buffers are filled by Algorithm 1 (first choices before
second choices, token order or Batch Priority Routing), and the combine weights are the softmax
values at the kept pairs, *not* renormalised unless ``renormalize=True`` (eq. 1 of Liu et al.).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import losses
from ..ops.allocation import largest, token_choice_allocation
from ..ops.group_limited import check_group_limits, group_limited_scores
from ..ops._checks import check_bool, check_choice, check_int, check_nonnegative_float, check_positive_float, randn_like
from ..routing import Routing
from .base import Router, register

NOISE_KINDS = (None, "vmoe", "shazeer")
BALANCE_LOSSES = (None, "switch", "vmoe")
BALANCE_SCOPES = ("group", "batch")


@register("softmax_topk")
class SoftmaxTopK(Router):
    """Token-choice top-k routing.

    Args:
        k: experts per token (1 <= k <= n_experts).
        capacity_factor: slots per expert ``C = round(capacity_factor * k * T / E)`` per group, or
            ``None`` for dropless routing (every choice is kept).
        capacity_rounding, min_capacity: passed to :func:`minimoe.ops.compute_capacity`.
        noise: ``None``; ``"vmoe"`` adds ``N(0, noise_std^2)`` to the logits in training
            (V-MoE, eq. 6; ``noise_std`` defaults to 1/E); ``"shazeer"`` adds
            ``N(0, 1) * softplus(x W_noise)`` with a learned ``W_noise`` (Shazeer et al. 2017).
        renormalize: divide the top-k gate values by their sum (GShard/Mixtral) instead of keeping
            the raw softmax values (Switch, V-MoE, Liu et al. eq. 1).
        batch_priority: Batch Priority Routing (Riquelme et al. 2021): visit tokens by decreasing
            top-1 probability when filling buffers.
        balance_loss: ``None``, ``"switch"`` (Switch/GShard ``E * sum f_e P_e``) or ``"vmoe"``
            (importance + load, Liu et al. App. A; needs noise).
        balance_loss_weight: weight of each balance term (default 0.01 for switch, 0.005 for vmoe).
        balance_scope: where the Switch loss takes its statistics ``f_e`` and ``P_e``: ``"group"``
            (each routing group, then the mean over groups; the default) or ``"batch"`` (all groups of
            the call pooled: the global-batch balance of Qwen's MoE, chapter 10).
        z_loss_weight: weight of the router z-loss (ST-MoE); 0 disables it.
        generator: a ``torch.Generator`` for the noise and the jitter (reproducible runs); ``None``
            uses torch's.
        eval_capacity_factor: the capacity factor in eval mode (DeepSpeed-MoE's
            ``eval_capacity_factor``, e.g. 2.0 against 1.0 in training); ``None``: ``capacity_factor``.
        n_group, topk_group, group_score: group-limited (device-limited) selection of DeepSeek-V2: the
            experts form ``n_group`` equal groups, each scored by its best probability
            (``group_score="max"``, the default) or the sum of its two best (``"top2"``, DeepSeek-V3),
            and a token takes its ``k`` experts inside its ``topk_group`` best groups only
            (:func:`minimoe.ops.group_limited_scores`; default 1 and 1: no limit).
        routed_scaling: multiplies the combine weights (DeepSeek-V2/V3's ``routed_scaling_factor``;
            default 1).
        router_dtype: ``None`` or ``"float32"``: the logits, probabilities and losses in float32
            whatever the model's dtype (Switch's ``router_dtype``; see :meth:`Router.gate_logits`).
        jitter_noise: ``eps`` of the multiplicative input jitter ``x * U(1 - eps, 1 + eps)`` in
            training (Switch's and Mixtral's ``router_jitter_noise``; :meth:`Router.router_input`); 0
            (default) disables it.

    ``route(..., token_mask=m)`` (and ``router(x, token_mask=m)``) takes a padding mask: the balance
    loss, V-MoE's importance and load terms and the z-loss then average over the tokens with
    ``m = True`` only, as Hugging Face's ``load_balancing_loss_func`` does with an attention mask;
    the routing itself is unchanged (padding tokens are routed, and with a capacity take slots).

    With ``balance_loss="vmoe"``, ``routing.stats`` also holds the two terms, ``importance_loss`` and
    ``load_loss`` (unweighted). The importance term is computed from the *clean* softmax, as in V-MoE,
    so that it does not depend on the noise draw; the noisy softmax selects and combines.
    """

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        *,
        k: int = 1,
        capacity_factor: float | None = 1.0,
        capacity_rounding: str = "round",
        min_capacity: int = 0,
        noise: str | None = None,
        noise_std: float | None = None,
        renormalize: bool = False,
        batch_priority: bool = False,
        balance_loss: str | None = None,
        balance_loss_weight: float | None = None,
        balance_scope: str = "group",
        z_loss_weight: float = 0.0,
        generator: torch.Generator | None = None,
        eval_capacity_factor: float | None = None,
        n_group: int = 1,
        topk_group: int = 1,
        group_score: str = "max",
        routed_scaling: float = 1.0,
        router_dtype: str | torch.dtype | None = None,
        jitter_noise: float = 0.0,
    ):
        super().__init__(d_model, n_experts)
        self.k = check_int(k, "k", low=1, high=self.n_experts)
        self._init_capacity(capacity_factor, capacity_rounding, min_capacity, choices_per_token=self.k,
                            eval_capacity_factor=eval_capacity_factor)
        self._init_noise(noise, noise_std, generator, kinds=NOISE_KINDS)
        self._init_precision(router_dtype)
        self._init_jitter(jitter_noise)
        self.n_group, self.topk_group, self.group_score = check_group_limits(self.n_experts, self.k, n_group,
                                                                             topk_group, group_score)
        self.routed_scaling = check_positive_float(routed_scaling, "routed_scaling")
        self.balance_loss = check_choice(balance_loss, "balance_loss", BALANCE_LOSSES)
        if self.balance_loss == "vmoe" and noise is None:
            raise ValueError("balance_loss='vmoe' (importance + load) needs noise='vmoe' or 'shazeer': "
                             "the load term is a probability over the noise")
        if noise == "shazeer":
            self.noise_gate = nn.Linear(d_model, n_experts, bias=False)
            nn.init.zeros_(self.noise_gate.weight)  # softplus(0) = log 2: a moderate starting noise
        self.renormalize = check_bool(renormalize, "renormalize")
        self.batch_priority = check_bool(batch_priority, "batch_priority")
        default_weight = {"switch": 0.01, "vmoe": 0.005, None: 0.0}[self.balance_loss]
        self.balance_loss_weight = check_nonnegative_float(
            default_weight if balance_loss_weight is None else balance_loss_weight, "balance_loss_weight")
        self.balance_scope = check_choice(balance_scope, "balance_scope", BALANCE_SCOPES)
        if self.balance_scope == "batch" and self.balance_loss != "switch":
            raise ValueError(f"balance_scope='batch' pools the Switch loss over the groups; it needs "
                             f"balance_loss='switch', got balance_loss={self.balance_loss!r}")
        self.z_loss_weight = check_nonnegative_float(z_loss_weight, "z_loss_weight")

    takes_token_mask = True

    # Switch Transformer at one expert per token; the variant is its dropless form under the same
    # loss, the comparator of loss-free balancing (Wang et al. compare the two dropless)
    STUDY_VARIANTS = {"softmax_topk_dropless": {"k": 1, "capacity_factor": None, "balance_loss": "switch"}}

    @classmethod
    def study_options(cls, *, group_size: int, n_experts: int) -> dict:
        return {"k": 1, "capacity_factor": 1.0, "balance_loss": "switch"}

    def _route(self, logits: torch.Tensor, x: torch.Tensor | None = None,
               token_mask: torch.Tensor | None = None) -> Routing:
        T = logits.shape[-2]
        noisy, noise_scale = self._vmoe_noise(logits), None
        if self.training and self.noise == "vmoe":
            noise_scale = self.noise_std
        elif self.training and self.noise == "shazeer":
            if x is None:
                raise ValueError("noise='shazeer' learns its noise scale from the tokens: call the router on x, "
                                 "or route(logits, x)")
            noise_scale = F.softplus(self.noise_gate(x))
            noisy = logits + noise_scale * randn_like(logits, self.generator)
        probs = torch.softmax(noisy, dim=-1)

        capacity = self.capacity(T)
        select = probs.detach()
        if self.n_group > 1:  # group-limited: the k experts come from the topk_group best groups only
            select = group_limited_scores(select, self.n_group, self.topk_group, self.group_score,
                                          checked=True)
        top = largest(select, self.k)  # once, for the allocation and the balance loss
        # each token's k choices (expert, slot), not a (T, E) table: the layer reads them directly
        expert, slot, counts = token_choice_allocation(select, self.k, capacity,
                                                       batch_priority=self.batch_priority, top=top,
                                                       return_counts=True, choices=True, checked=True)
        gates = probs
        if self.renormalize:
            chosen = torch.zeros_like(probs).scatter(-1, top.indices, 1.0)
            gates = probs * chosen / (probs * chosen).sum(-1, keepdim=True)
        weight = gates.gather(-1, expert) * (slot >= 0)  # exactly 0 for a dropped choice
        if self.routed_scaling != 1.0:
            weight = weight * self.routed_scaling
        if token_mask is not None:  # the padding's choices leave the statistics: f_e counts real tokens only
            real = token_mask.unsqueeze(-1).expand_as(top.indices).to(counts.dtype)
            counts = torch.zeros_like(counts).scatter_add_(-1, top.indices.flatten(-2), real.flatten(-2))

        aux = logits.new_zeros(())
        extra = {}
        if self.training and self.balance_loss == "switch":
            # f_e from the allocation's counts of each expert's choices: no (T, E) mask to build
            pooled = (probs, counts, token_mask)
            if self.balance_scope == "batch":  # one pool of all groups' tokens: (1, G*T, E)
                pooled = (probs.reshape(1, -1, self.n_experts), counts.reshape(-1, self.n_experts).sum(0, keepdim=True),
                          None if token_mask is None else token_mask.reshape(1, -1))
            aux = aux + self.balance_loss_weight * losses.switch_balance_loss_from_counts(*pooled[:2],
                                                                                        token_mask=pooled[2])
        elif self.training and self.balance_loss == "vmoe" and noise_scale is not None:
            # V-MoE: importance from the clean softmax (independent of the noise draw), load from both
            importance = losses.importance_loss(torch.softmax(logits, dim=-1), token_mask=token_mask)
            load = losses.load_loss(logits, noisy, noise_scale, self.k, token_mask=token_mask)
            aux = aux + self.balance_loss_weight * (importance + load)
            extra["importance_loss"], extra["load_loss"] = importance.detach(), load.detach()
        if self.training and self.z_loss_weight:
            aux = aux + self.z_loss_weight * losses.z_loss(logits, token_mask=token_mask)
        return Routing(choice_expert=expert, choice_slot=slot, choice_weight=weight, capacity=capacity,
                       probs=probs, aux_loss=aux, extra_stats=extra, max_pairs=self.k * logits[..., 0].numel())

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, k={self.k}, capacity_factor={self.capacity_factor}, noise={self.noise}, "
                f"batch_priority={self.batch_priority}, balance_loss={self.balance_loss}")
