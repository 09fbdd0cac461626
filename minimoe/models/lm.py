"""A tiny decoder-only Transformer language model with MoE feed-forward blocks."""
from __future__ import annotations

import torch
from torch import nn

from ..ops._checks import check_int, check_tensor
from ..routers import DEFAULT_ROUTER
from .blocks import MoEModelMixin, build_blocks


class TinyLM(MoEModelMixin, nn.Module):
    """GPT-style character model. Every ``moe_every``-th block (counting from the last) is a MoE
    block with ``n_experts`` experts routed by ``router`` (a registered name) with ``router_options``.
    ``n_experts=0`` gives the dense baseline. ``forward(idx)`` returns logits ``(B, L, vocab)``.
    ``routing_groups`` (see :class:`~minimoe.models.Block`): ``"sequence"`` routes each sequence as a
    group, ``"position"`` the batch's tokens at one position (causal for every router).
    ``n_shared_experts`` (DeepSeekMoE's shared experts) and ``moe_options`` (``activation``, ``bias``)
    go to every MoE layer.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        block_size: int = 64,
        n_experts: int = 8,
        d_hidden: int = 128,
        router: str = DEFAULT_ROUTER,
        router_options: dict | None = None,
        moe_every: int = 1,
        routing_groups: str = "sequence",
        moe_path: str = "index",
        n_shared_experts: int = 0,
        moe_options: dict | None = None,
    ):
        super().__init__()
        self.vocab_size = check_int(vocab_size, "vocab_size", low=1)
        self.block_size = check_int(block_size, "block_size", low=1)
        check_int(d_model, "d_model", low=1)
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.blocks = build_blocks(n_layers=n_layers, d_model=d_model, n_heads=n_heads, d_hidden=d_hidden,
                                   n_experts=n_experts, router=router, router_options=router_options,
                                   moe_every=moe_every, routing_groups=routing_groups, moe_path=moe_path,
                                   causal=True, n_shared_experts=n_shared_experts, moe_options=moe_options)
        self.ln_out = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        check_tensor(idx, "idx", floating=False, shape_hint=f"(batch, length <= {self.block_size}, the block_size)")
        if idx.dtype not in (torch.long, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"idx must hold token ids (an integer tensor), got dtype {idx.dtype}")
        if idx.dim() != 2 or idx.shape[1] > self.block_size:
            raise ValueError(f"idx must have shape (batch, length <= {self.block_size}, the block_size), got "
                             f"{tuple(idx.shape)}; build the model with a larger block_size, or feed the last "
                             "block_size tokens")
        # (on the CPU only: on a GPU the check would wait for the device every step)
        if idx.device.type == "cpu" and idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.vocab_size):
            raise ValueError(f"idx must hold token ids in [0, vocab_size={self.vocab_size}), got values in "
                             f"[{int(idx.min())}, {int(idx.max())}]")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x, token_keys=idx)  # a hash router routes each token by its id
        return self.head(self.ln_out(x))
