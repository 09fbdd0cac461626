"""The router base class and the registry that builds routers by name.

A router maps a group of tokens ``x (G, T, d)`` to a :class:`~minimoe.routing.Routing`. It owns
the gate ``W`` (``nn.Linear(d_model, n_experts, bias=False)``; logits ``S = x W``) and nothing
else; the mathematics lives in :mod:`minimoe.ops`.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops._checks import check_int, check_scores
from ..routing import Routing

_REGISTRY: dict[str, type] = {}


def register(name: str):
    """Class decorator: make a router buildable as ``build(name, ...)``."""

    def deco(cls):
        if name in _REGISTRY:
            raise ValueError(f"router name {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available() -> list[str]:
    """Names of the registered routers, sorted."""
    return sorted(_REGISTRY)


def build(name: str, d_model: int, n_experts: int, **options) -> "Router":
    """Build the router registered as ``name``; ``options`` are its keyword arguments."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown router name {name!r}; available routers: {', '.join(available())}")
    return _REGISTRY[name](d_model, n_experts, **options)


class Router(nn.Module):
    """Base class: the gate, input checks, and the train/eval switch (``router.train()/.eval()``)."""

    name = "router"

    def __init__(self, d_model: int, n_experts: int):
        super().__init__()
        self.d_model = check_int(d_model, "d_model", low=1)
        self.n_experts = check_int(n_experts, "n_experts", low=1)
        self.gate = nn.Linear(d_model, n_experts, bias=False)

    def forward(self, x: torch.Tensor) -> Routing:
        """Route a batch of groups ``x (G, T, d_model)`` (or one group ``(T, d_model)``)."""
        if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (groups, tokens, d_model) or (tokens, d_model), got {shape}")
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x has d_model={x.shape[-1]} but the router was built with d_model={self.d_model}")
        # routers without a gate (Soft MoE: its slot parameters take the gate's place) route from x alone
        return self.route(self.gate(x) if self.gate is not None else None, x)

    def route(self, logits: torch.Tensor, x: torch.Tensor | None = None) -> Routing:
        """Route from router logits ``(..., T, E)`` directly (no gate): used by tests, benchmarks and
        training-free re-routing. ``x`` is only needed by routers whose noise depends on the input."""
        raise NotImplementedError

    def _check_logits(self, logits: torch.Tensor) -> torch.Tensor:
        check_scores(logits, "logits")
        if logits.shape[-1] != self.n_experts:
            raise ValueError(f"logits have {logits.shape[-1]} experts, the router has n_experts={self.n_experts}")
        return logits

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_experts={self.n_experts}"
