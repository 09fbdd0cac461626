"""A pre-LayerNorm Transformer block whose feed-forward part is dense or a MoE layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import MoELayer
from ..ops._checks import check_bool, check_choice, check_int


class MLP(nn.Module):
    def __init__(self, d_model: int, d_hidden: int):
        super().__init__()
        self.fc_in = nn.Linear(d_model, d_hidden)
        self.fc_out = nn.Linear(d_hidden, d_model)

    def forward(self, x, group_size=None):
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    """``x + Attn(LN(x))`` then ``x + FFN(LN(x))``; the FFN is a :class:`MoELayer` when given one.

    ``routing_groups="sequence"`` routes each sequence (or image) as its own group;
    ``"batch"`` routes all tokens of the batch together; ``"position"`` routes together the tokens
    at the same position of every sequence of the batch, so that no router (expert choice, Sinkhorn,
    Soft MoE, ...) lets a token's output depend on later tokens of its own sequence: the causal
    grouping for a decoder (chapter 6, "Which tokens compete"). The layer then sees the tokens in
    position-major order ``(L, B)``.
    """

    def __init__(self, d_model: int, n_heads: int, ffn: nn.Module, *, causal: bool, routing_groups: str = "sequence"):
        super().__init__()
        d_model, n_heads = check_int(d_model, "d_model", low=1), check_int(n_heads, "n_heads", low=1)
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        routing_groups = check_choice(routing_groups, "routing_groups", ("sequence", "batch", "position"))
        self.n_heads, self.causal, self.routing_groups = n_heads, check_bool(causal, "causal"), routing_groups
        self.ln_attn = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_ffn = nn.LayerNorm(d_model)
        self.ffn = ffn

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoELayer)

    def forward(self, x: torch.Tensor, token_keys: torch.Tensor | None = None) -> torch.Tensor:
        """``x (B, L, d)``; ``token_keys`` ``(B, L)`` or ``(B, L, D)``, the model's input per token, goes
        to the feed-forward part only when it asks for it (an MoE layer whose router routes by it,
        :attr:`minimoe.MoELayer.takes_token_keys`); any other feed-forward module is called as before."""
        B, L, d = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).view(B, L, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(attn.transpose(1, 2).reshape(B, L, d))
        wants_keys = token_keys is not None and getattr(self.ffn, "takes_token_keys", False)
        if self.routing_groups == "position":
            extra = {"token_keys": token_keys.transpose(0, 1).contiguous()} if wants_keys else {}
            routed = self.ffn(self.ln_ffn(x).transpose(0, 1).contiguous(), group_size=B, **extra)
            return x + routed.transpose(0, 1)
        group_size = L if self.routing_groups == "sequence" else B * L
        extra = {"token_keys": token_keys} if wants_keys else {}
        return x + self.ffn(self.ln_ffn(x), group_size=group_size, **extra)


#: The MoE layer's options a model passes through ``moe_options`` (the rest the model sets itself).
MOE_OPTIONS = ("activation", "bias", "shared_expert_gate")


def moe_layer_options(n_shared_experts: int = 0, moe_options: dict | None = None) -> dict:
    """The keyword options of every :class:`MoELayer` of a model: ``n_shared_experts`` and the
    ``moe_options`` of :data:`MOE_OPTIONS`, checked."""
    if moe_options is not None and not isinstance(moe_options, dict):
        raise TypeError(f"moe_options must be a dict of MoELayer options {MOE_OPTIONS}, got {moe_options!r}")
    unknown = sorted(set(moe_options or {}) - set(MOE_OPTIONS))
    if unknown:
        raise ValueError(f"moe_options has {unknown}; a model passes only {MOE_OPTIONS} to its MoE layers "
                         "(router, sizes, grouping and path are the model's own arguments)")
    return {"n_shared_experts": n_shared_experts, **(moe_options or {})}


def build_blocks(*, n_layers, d_model, n_heads, d_hidden, n_experts, router, router_options, moe_every,
                 routing_groups, moe_path, causal, n_shared_experts=0, moe_options=None) -> nn.ModuleList:
    """``n_layers`` blocks; every ``moe_every``-th one, counting from the last, has a MoE feed-forward
    layer (``n_experts=0``: all dense, the baseline) with ``n_shared_experts`` shared experts and the
    further :class:`MoELayer` options ``moe_options``."""
    layer_options = moe_layer_options(n_shared_experts, moe_options)
    n_layers = check_int(n_layers, "n_layers", low=1)
    n_experts = check_int(n_experts, "n_experts (0: a dense model)", low=0)
    moe_every = check_int(moe_every, "moe_every", low=1)
    check_int(d_hidden, "d_hidden", low=1)
    if router_options is not None and not isinstance(router_options, dict):
        raise TypeError(f"router_options must be a dict of the router's options, got {router_options!r}")
    blocks = []
    for i in range(n_layers):
        is_moe = n_experts > 0 and (n_layers - 1 - i) % moe_every == 0
        ffn = (MoELayer(d_model, d_hidden, n_experts, router, router_options=router_options, path=moe_path,
                        **layer_options)
               if is_moe else MLP(d_model, d_hidden))
        blocks.append(Block(d_model, n_heads, ffn, causal=causal, routing_groups=routing_groups))
    return nn.ModuleList(blocks)


class MoEModelMixin:
    """What the training loop asks of a model with MoE blocks in ``self.blocks``."""

    def moe_layers(self) -> list[MoELayer]:
        return [b.ffn for b in self.blocks if b.is_moe]

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE layers' (already weighted) auxiliary losses from the last forward."""
        return sum((m.aux_loss for m in self.moe_layers()), torch.zeros(()))
