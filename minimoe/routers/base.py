"""The router base class and the registry that builds routers by name.

A router maps a group of tokens ``x (G, T, d)`` to a :class:`~minimoe.routing.Routing`. It owns
the gate ``W`` (``nn.Linear(d_model, n_experts, bias=False)``; logits ``S = x W``) and nothing
else; the mathematics lives in :mod:`minimoe.ops`.

The base class is the one gate every input passes: :meth:`Router.forward` checks ``x`` and
:meth:`Router.route` checks the logits, answers an empty group (T = 0) with an empty routing, and
only then calls the subclass's ``_route``. A subclass therefore sees finite logits of the right
shape with at least one token.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from ..ops._checks import check_int, check_scores, check_tensor, unknown_options
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


def option_names(cls) -> list[str]:
    """The keyword options a router class takes (besides ``d_model`` and ``n_experts``), following
    ``**options`` up to the parent class that a subclass passes them to."""
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass in (Router, nn.Module, object):
            continue
        params = inspect.signature(klass.__init__).parameters
        names += [p.name for p in params.values() if p.kind is p.KEYWORD_ONLY and p.name not in names]
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    return names


def build(name: str, d_model: int, n_experts: int, **options) -> "Router":
    """Build the router registered as ``name``; ``options`` are its keyword arguments."""
    if not isinstance(name, str):
        raise TypeError(f"router name must be a string, got {name!r}; available routers: {', '.join(available())}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown router name {name!r}; available routers: {', '.join(available())}")
    cls = _REGISTRY[name]
    valid = option_names(cls)
    unknown = [key for key in options if key not in valid]
    if unknown:
        raise TypeError(unknown_options(f"router {name!r}", unknown, valid))
    return cls(d_model, n_experts, **options)


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4: no device argument
        return torch.is_autocast_enabled() if device_type == "cuda" else torch.is_autocast_cpu_enabled()


class Router(nn.Module):
    """Base class: the gate, input checks, and the train/eval switch (``router.train()/.eval()``)."""

    name = "router"

    def __init__(self, d_model: int, n_experts: int):
        super().__init__()
        self.d_model = check_int(d_model, "d_model", low=1)
        self.n_experts = check_int(n_experts, "n_experts", low=1)
        self.gate = nn.Linear(self.d_model, self.n_experts, bias=False)

    def forward(self, x: torch.Tensor) -> Routing:
        """Route a batch of groups ``x (G, T, d_model)`` (or one group ``(T, d_model)``)."""
        check_tensor(x, "x", min_dim=2, max_dim=3, last_dim=self.d_model,
                     shape_hint="(groups, tokens, d_model) or (tokens, d_model)")
        self._check_dtype(x)
        # routers without a gate (Soft MoE: its slot parameters take the gate's place) route from x alone
        return self.route(self.gate(x) if self.gate is not None else None, x)

    def _check_dtype(self, x: torch.Tensor) -> None:
        weight = next(self.parameters(), None)
        if weight is not None and x.dtype != weight.dtype and not _autocast_on(x.device.type):
            raise TypeError(f"x has dtype {x.dtype} but the router's parameters are {weight.dtype}: convert one "
                            f"to the other (x.to({weight.dtype}) or router.to({x.dtype})), or run under "
                            "torch.autocast")

    def route(self, logits: torch.Tensor | None, x: torch.Tensor | None = None) -> Routing:
        """Route from router logits ``(..., T, E)`` directly (no gate): used by tests, benchmarks and
        training-free re-routing. ``x`` is only needed by routers whose noise depends on the input.
        A group of zero tokens gets an empty routing (every tensor with T = 0, no aux loss)."""
        if logits is not None:
            check_scores(logits, "logits")
            if logits.shape[-1] != self.n_experts:
                raise ValueError(f"logits have {logits.shape[-1]} experts, the router has n_experts={self.n_experts}")
            if logits.shape[-2] == 0 or logits.numel() == 0:
                return self._empty(logits)
        return self._route(logits, x)

    def _route(self, logits: torch.Tensor, x: torch.Tensor | None) -> Routing:
        """The router's own rule; logits are checked and the group is not empty."""
        raise NotImplementedError

    def _empty(self, logits: torch.Tensor) -> Routing:
        position = torch.full(logits.shape, -1, dtype=torch.long, device=logits.device)
        return Routing(combine=torch.zeros_like(logits), position=position, capacity=None,
                       probs=torch.zeros_like(logits), aux_loss=logits.new_zeros(()))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_experts={self.n_experts}"
