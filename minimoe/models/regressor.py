"""A one-MoE-layer regressor for the clustered task, where each input's right expert is known."""
from __future__ import annotations

import torch
from torch import nn

from ..layers import MoELayer
from ..ops._checks import check_int, check_tensor
from ..routers import DEFAULT_ROUTER
from .blocks import moe_layer_options


class MoERegressor(nn.Module):
    """``x -> W_in x -> h + MoE(LN(h)) -> W_out LN(.)``. Inputs ``(N, d_in)`` are routed in groups of
    ``group_size`` consecutive rows (``N`` must be a multiple). ``n_experts=0`` replaces the MoE layer
    by a dense MLP of the same hidden width (the baseline). ``n_shared_experts`` and ``moe_options``
    (``activation``, ``bias``) go to the MoE layer."""

    def __init__(self, d_in: int, d_out: int, *, d_model: int = 32, d_hidden: int = 32, n_experts: int = 8,
                 router: str = DEFAULT_ROUTER, router_options: dict | None = None, group_size: int = 64,
                 moe_path: str = "index", n_shared_experts: int = 0, moe_options: dict | None = None):
        super().__init__()
        for value, name in ((d_in, "d_in"), (d_out, "d_out"), (d_model, "d_model"), (d_hidden, "d_hidden")):
            check_int(value, name, low=1)
        n_experts = check_int(n_experts, "n_experts (0: a dense model)", low=0)
        self.group_size = check_int(group_size, "group_size", low=1)
        self.d_in = d_in
        self.inp = nn.Linear(d_in, d_model)
        self.ln = nn.LayerNorm(d_model)
        if n_experts > 0:
            self.moe = MoELayer(d_model, d_hidden, n_experts, router, router_options=router_options, path=moe_path,
                                **moe_layer_options(n_shared_experts, moe_options))
        else:
            from .blocks import MLP

            self.moe = MLP(d_model, d_hidden)
        self.ln_out = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, d_out)

    def moe_layers(self) -> list[MoELayer]:
        return [self.moe] if isinstance(self.moe, MoELayer) else []

    def aux_loss(self) -> torch.Tensor:
        return sum((m.aux_loss for m in self.moe_layers()), torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor(x, "x", shape_hint=f"(N, d_in={self.d_in})")
        if x.dim() != 2 or x.shape[1] != self.d_in or x.shape[0] % self.group_size:
            raise ValueError(f"x must have shape (N, d_in={self.d_in}) with N a multiple of group_size={self.group_size}, "
                             f"got {tuple(x.shape)}")
        h = self.inp(x)
        # a hash router routes by the raw input itself
        extra = {"token_keys": x} if getattr(self.moe, "takes_token_keys", False) else {}
        h = h + self.moe(self.ln(h), group_size=self.group_size, **extra)
        return self.out(self.ln_out(h))
