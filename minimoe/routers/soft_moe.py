"""Soft MoE (Puigcerver et al. 2023; Liu et al. 2024, §2.6, eqs. 10-11).

Book: chapter 4 (Six routers, one formulation), section "Soft MoE: the soft end". Every expert has
``S`` slots with learned features ``Phi (d_model, E, S)``. The token-slot logits
``Z[t, e, s] = <x_t, Phi[:, e, s]>`` (eq. 10) are normalised twice (eq. 11): over the tokens of the
group, giving the dispatch weights (each slot's input is a convex combination of the group's
tokens), and over all ``E * S`` slots, giving the combine weights (each token's output is a convex
combination of the slot outputs). Nothing is sorted, solved or dropped, and everything is
differentiable.

A group must be *one* image or sequence: the slots mix the tokens of their group, so a group of several
images would make each image's output depend on the others. The models route each sequence as its
own group (``routing_groups="sequence"``, the default). Within a group the layer is not causal.

Soft MoE has no gate: ``Phi`` plays its part (the base class's ``gate`` is set to ``None``). Its
logits come from the tokens themselves, so :meth:`route` needs ``x``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..ops._checks import check_bool, check_finite, check_int, check_positive_float, check_tensor
from ..routing import Routing
from .base import Router, register


@register("soft_moe")
class SoftMoE(Router):
    """Soft MoE routing: dense dispatch (softmax over tokens) and combine (softmax over slots).

    Args:
        slots_per_expert: ``S >= 1`` slots per expert and group; the experts run ``E * S`` slots per
            group whatever the group size (Liu et al. use ``S = round(c * T / E)``).
        normalize: L2-normalise the tokens and each slot's features before the product of eq. (10)
            and multiply by a learned scalar ``scale`` (initialised to ``scale_init``), as the Soft MoE
            paper does to keep the logits from growing with the width; ``False`` is eq. (10) as
            printed. The slots still receive the raw tokens either way.
        scale_init: initial value of ``scale`` (``normalize=True`` only), > 0.

    ``Routing.probs`` is each token's combine mass per expert (``slot_combine`` summed over slots),
    ``routing.stats["dispatch_entropy"]`` the mean entropy (nats) of a slot's distribution over tokens.

    ``route(None, x, token_mask=m)`` keeps padding out of the slots: a padding token's dispatch
    logits are ``-inf``, so every slot is a mixture of the group's real tokens only and a real token's
    output does not depend on the padding (a group with no real token dispatches nothing). Unlike the
    top-k routers, where a mask only changes the statistics, here it changes the routing itself.
    """

    takes_token_mask = True

    def __init__(self, d_model: int, n_experts: int, *, slots_per_expert: int = 1, normalize: bool = True,
                 scale_init: float = 1.0):
        super().__init__(d_model, n_experts)
        self.gate = None  # Phi replaces the gate
        self.slots_per_expert = check_int(slots_per_expert, "slots_per_expert", low=1)
        self.normalize = check_bool(normalize, "normalize")
        # LeCun normal, as the Soft MoE code: each slot's logit starts with unit variance for unit tokens
        self.slot_embed = nn.Parameter(torch.randn(d_model, n_experts, self.slots_per_expert) / math.sqrt(d_model))
        if self.normalize:
            self.scale = nn.Parameter(torch.tensor(check_positive_float(scale_init, "scale_init")))
        else:
            self.register_parameter("scale", None)

    @classmethod
    def study_options(cls, *, group_size: int, n_experts: int) -> dict:
        # E * S slots = T tokens: the same number of expert evaluations as top-1 routing
        return {"slots_per_expert": max(1, group_size // n_experts)}

    def slot_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``Z (..., T, E, S)`` of eq. (10), with the normalisation and scale when ``normalize=True``."""
        return self._flat_slot_logits(x).unflatten(-1, self.slot_embed.shape[1:])

    def _flat_slot_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``Z`` as ``(..., T, E * S)``, a tensor of its own (a matmul, not a view of one)."""
        check_finite(self.slot_embed, "soft_moe's slot_embed parameter")
        if self.normalize:
            check_finite(self.scale, "soft_moe's scale parameter")
        phi = self.slot_embed.to(x.dtype)
        if self.normalize:
            x = F.normalize(x, dim=-1)
            phi = F.normalize(phi, dim=0) * self.scale.to(x.dtype)
        return torch.matmul(x, phi.flatten(1))

    def _route(self, logits: torch.Tensor | None = None, x: torch.Tensor | None = None, *,
               token_mask: torch.Tensor | None = None) -> Routing:
        """Soft MoE routes from the tokens ``x (..., T, d_model)``; ``logits`` is ignored (no gate)."""
        if x is None:
            raise TypeError("soft_moe computes its logits from the tokens (eq. 10), not from gate logits: "
                            "call router(x), or router.route(None, x) with x of shape (groups, tokens, d_model)")
        check_tensor(x, "x", min_dim=2, last_dim=self.d_model, shape_hint="(..., tokens, d_model)")
        check_finite(x, "x")
        Z = self._flat_slot_logits(x)  # (..., T, E * S)
        if token_mask is not None:  # padding leaves the slots: -inf in the softmax over the group's tokens
            real = token_mask.unsqueeze(-1)
            dispatch = torch.softmax(Z.masked_fill(~real, float("-inf")), dim=-2)
            dispatch = torch.where(real.any(-2, keepdim=True), dispatch, torch.zeros_like(dispatch))  # no real token
            combine = torch.softmax(Z, dim=-1)
        elif Z._base is None and Z.is_contiguous() and not torch.is_autocast_enabled(Z.device.type) and \
                not torch.compiler.is_compiling():
            dispatch, combine = _DispatchCombine.apply(Z)
        else:  # autocast may give the softmaxes another dtype than Z's; compiled, the compiler plans the memory
            dispatch, combine = torch.softmax(Z, dim=-2), torch.softmax(Z, dim=-1)
        # dispatch: over the tokens of the group (each slot's mixture); combine: over all E * S slots
        dispatch, combine = (w.unflatten(-1, self.slot_embed.shape[1:]) for w in (dispatch, combine))
        return Routing(slot_dispatch=dispatch, slot_combine=combine, probs=combine.sum(-1),
                       aux_loss=x.new_zeros(()), extra_stats={"dispatch_entropy": lambda: _entropy(dispatch)})

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, slots_per_expert={self.slots_per_expert}, "
                f"normalize={self.normalize}")


class _DispatchCombine(torch.autograd.Function):
    """Both softmaxes of eq. (11) from the flat logits ``Z (..., T, E * S)``: the dispatch weights over
    the tokens (dim -2) in a new tensor, the combine weights over the slots (dim -1) written over Z.

    ``Z`` is a temporary of T x E * S numbers, 64 MB at T = 4096 with E * S = T. On the CPU a new
    block that large costs about 20 ms of page faults, four times the softmax over the slots into
    existing memory: by default glibc maps every block above 32 MiB afresh and the kernel faults it
    in page by page (performance appendix, "Routing overhead").
    Reusing Z's memory saves one such block per call. The kernels are torch.softmax's, forward and
    backward, so values and gradients are the same bits as two calls of ``torch.softmax``.
    """

    @staticmethod
    def forward(ctx, logits):
        dispatch = torch.softmax(logits, dim=-2)
        combine = torch.softmax(logits, dim=-1, out=logits)  # reads each row before writing it
        ctx.mark_dirty(logits)
        ctx.save_for_backward(dispatch, combine)
        ctx.set_materialize_grads(False)
        return dispatch, combine

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_dispatch, grad_combine):
        dispatch, combine = ctx.saved_tensors
        grads = [torch._softmax_backward_data(g, w, dim, w.dtype)
                 for g, w, dim in ((grad_dispatch, dispatch, -2), (grad_combine, combine, -1)) if g is not None]
        return grads[0] + grads[1] if len(grads) == 2 else (grads[0] if grads else None)


@torch.no_grad()
def _entropy(dispatch: torch.Tensor) -> torch.Tensor:
    """Mean entropy (nats) of a slot's distribution over the tokens, a pass over all T * E * S
    weights: computed when ``routing.stats`` is first read, not on every forward."""
    d32 = dispatch.float()  # in float32 at least: in float16 the clamp's 1e-30 is 0 and 0 * log 0 is NaN
    return -torch.special.xlogy(d32, d32).sum(-3).mean() if d32.numel() else d32.new_zeros(())
