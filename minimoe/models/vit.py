"""A tiny Vision Transformer with MoE feed-forward blocks (V-MoE "every-2" layout)."""
from __future__ import annotations

import torch
from torch import nn

from ..ops._checks import check_int, check_tensor
from ..routers import DEFAULT_ROUTER
from .blocks import MoEModelMixin, build_blocks


class TinyViT(MoEModelMixin, nn.Module):
    """Patches -> Transformer (MoE in every ``moe_every``-th block, counting from the last) ->
    mean pool -> linear head. Routing groups are single images by default (``routing_groups="sequence"``).
    ``n_shared_experts`` and ``moe_options`` (``activation``, ``bias``) go to every MoE layer."""

    def __init__(
        self,
        n_classes: int,
        *,
        image_size: int = 16,
        patch_size: int = 4,
        channels: int = 1,
        d_model: int = 64,
        n_layers: int = 4,
        n_heads: int = 4,
        n_experts: int = 8,
        d_hidden: int = 128,
        router: str = DEFAULT_ROUTER,
        router_options: dict | None = None,
        moe_every: int = 2,
        routing_groups: str = "sequence",
        moe_path: str = "index",
        n_shared_experts: int = 0,
        moe_options: dict | None = None,
    ):
        super().__init__()
        check_int(n_classes, "n_classes", low=1)
        image_size = check_int(image_size, "image_size", low=1)
        patch_size = check_int(patch_size, "patch_size", low=1, high=image_size)
        self.channels = check_int(channels, "channels", low=1)
        self.image_size = image_size
        if image_size % patch_size:
            raise ValueError(f"image_size={image_size} must be divisible by patch_size={patch_size}")
        self.patch_size = patch_size
        n_patches = (image_size // patch_size) ** 2
        self.patch_emb = nn.Linear(channels * patch_size**2, d_model)
        self.pos_emb = nn.Parameter(torch.zeros(1, n_patches, d_model))
        nn.init.normal_(self.pos_emb, std=0.02)
        self.blocks = build_blocks(n_layers=n_layers, d_model=d_model, n_heads=n_heads, d_hidden=d_hidden,
                                   n_experts=n_experts, router=router, router_options=router_options,
                                   moe_every=moe_every, routing_groups=routing_groups, moe_path=moe_path,
                                   causal=False, n_shared_experts=n_shared_experts, moe_options=moe_options)
        self.ln_out = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        shape = f"(batch, channels={self.channels}, {self.image_size}, {self.image_size})"
        check_tensor(images, "images", shape_hint=shape)
        if images.dim() != 4 or tuple(images.shape[1:]) != (self.channels, self.image_size, self.image_size):
            raise ValueError(f"images must have shape {shape}, got {tuple(images.shape)}")
        B, C, H, W = images.shape
        p = self.patch_size
        patches = images.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(B, -1, C * p * p)
        x = self.patch_emb(patches) + self.pos_emb
        for block in self.blocks:
            x = block(x, token_keys=patches)  # a hash router routes each patch by its pixels
        return self.head(self.ln_out(x).mean(1))
