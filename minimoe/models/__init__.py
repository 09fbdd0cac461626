"""Tiny models whose feed-forward blocks are MoE layers that take any registered router."""
from .blocks import Block, MLP
from .lm import TinyLM
from .regressor import MoERegressor
from .vit import TinyViT

__all__ = ["Block", "MLP", "TinyLM", "TinyViT", "MoERegressor"]
