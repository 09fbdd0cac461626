"""The router base class, the router protocol, and the registry that builds routers by name.

A router maps a group of tokens ``x (G, T, d)`` to a :class:`~minimoe.routing.Routing`. It owns
the gate ``W`` (``nn.Linear(d_model, n_experts, bias=False)``; logits ``S = x W``) and nothing
else; the mathematics lives in :mod:`minimoe.ops`.

The base class is the one gate every input passes: :meth:`Router.forward` checks ``x`` and
:meth:`Router.route` checks the logits, answers an empty group (T = 0) with an empty routing, and
only then calls the subclass's ``_route``. A subclass therefore sees finite logits of the right
shape with at least one token.

**The router protocol** (book: chapter 1, "A router carries its own rules"): everything that is
special about a router is a method of :class:`Router` with a default that fits a plain router (the
table is in its docstring). The MoE layer, the expert-parallel layer, :func:`minimoe.train.train`
and the study call these methods and never ask which router they hold.

A new router is one file in this package: a subclass with ``_route``, registered with
:func:`register`, overriding the methods its rule needs.
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import compute_capacity
from ..ops._checks import (autocast_on, check_choice, check_float, check_generator, check_int,
                           check_finite, check_positive_float, check_scores, check_tensor, randn_like, unknown_options)
from ..routing import Routing

#: The router a layer or model builds when none is named (Switch/GShard token choice).
DEFAULT_ROUTER = "softmax_topk"
CAPACITY_ROUNDINGS = ("round", "ceil")
#: The dtypes a router may compute its logits and probabilities in, whatever the model's (``router_dtype``).
ROUTER_DTYPES = {"float32": torch.float32, "float64": torch.float64}

_REGISTRY: dict[str, type] = {}
_BASELINES: set[str] = set()


def register(name: str, *, baseline: bool = False):
    """Class decorator: make a router buildable as ``build(name, ...)``. ``baseline=True`` registers
    a control that does not learn (:mod:`minimoe.routers.controls`): buildable by name, listed by
    :func:`baselines` rather than :func:`available`."""

    def deco(cls):
        if name in _REGISTRY:
            raise ValueError(f"router name {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        if baseline:
            _BASELINES.add(name)
        return cls

    return deco


def available() -> list[str]:
    """Names of the registered routers, sorted (without the :func:`baselines`)."""
    return sorted(set(_REGISTRY) - _BASELINES)


def baselines() -> list[str]:
    """Names of the registered baselines, the routers that do not learn (hash, random, dense, ...), sorted."""
    return sorted(_BASELINES)


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


def router_class(name: str) -> type:
    """The class registered as ``name``."""
    if not isinstance(name, str):
        raise TypeError(f"router name must be a string, got {name!r}; available routers: {', '.join(available())}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown router name {name!r}; available routers: {', '.join(available())} "
                         f"(baselines: {', '.join(baselines())})")
    return _REGISTRY[name]


def build(name: str, d_model: int, n_experts: int, **options) -> "Router":
    """Build the router registered as ``name``; ``options`` are its keyword arguments."""
    cls = router_class(name)
    valid = option_names(cls)
    unknown = [key for key in options if key not in valid]
    if unknown:
        raise TypeError(unknown_options(f"router {name!r}", unknown, valid))
    return cls(d_model, n_experts, **options)


class Router(nn.Module):
    """Base class: the gate, input checks, the train/eval switch (``router.train()/.eval()``) and the
    router protocol, the methods through which the layer, the training loop and the study learn what
    is special about a router:

    ========================  ===================================  ========================================
    method                    default                              overridden by
    ========================  ===================================  ========================================
    :meth:`capacity`          from the options capacity_factor,    BASE (ceil(T/E)), Gumbel-matching (at
                              capacity_rounding and min_capacity   least ceil(T/E)), the sparsity-constrained
                              (see compute_capacity); None         router (checks feasibility)
                              without a capacity factor
    :meth:`adjust_output`     the layer's output as it is          DenseMixer (dense straight-through), Kool's
                                                                   routers (REINFORCE scaling)
    :meth:`extra_loss`        None: nothing beyond aux_loss        Kool's routers (the REINFORCE term)
    :meth:`reduce_loads`      identity, or the reducer set by      none (loss-free balancing calls it)
                              :meth:`set_load_reducer`
    :meth:`study_options`     ``{}``: the router's own defaults    every router of the study
    :meth:`study_variants`    none                                 SSR (ssr_p0), softmax top-k
                                                                   (softmax_topk_dropless)
    :attr:`training_rule`     empty                                DenseMixer, Kool's routers, loss-free
    :attr:`takes_token_mask`  False: ``token_mask`` is refused     softmax top-k, loss-free (their losses
                                                                   and loads skip padding tokens), Soft
                                                                   MoE (padding stays out of its slots)
    :attr:`takes_token_keys`  False: ``token_keys`` are not read   the hash baseline (routes by each token's
                                                                   id or raw input, not by the learned x)
    ========================  ===================================  ========================================

    Options any router may offer through the helpers below (checked once here): the capacity factor
    and its evaluation value (:meth:`_init_capacity`), the dtype of the router's arithmetic
    (:meth:`_init_precision`) and multiplicative input jitter (:meth:`_init_jitter`); each is off by
    default, and a router exposes those that make sense for it as keyword options.
    """

    name = "router"
    #: One line on what the router adds to training beyond the task loss and ``aux_loss`` (shown in
    #: the study's tables); empty for a router trained by the task loss alone.
    training_rule: str = ""
    # No capacity unless a subclass calls _init_capacity: dropless
    capacity_factor: float | None = None
    capacity_rounding: str = "round"
    min_capacity: int = 0
    choices_per_token: int = 1
    eval_capacity_factor: float | None = None  # None: the training capacity factor in eval too
    router_dtype: torch.dtype | None = None    # None: the logits' own dtype
    jitter_noise: float = 0.0
    generator: torch.Generator | None = None
    #: Whether :meth:`route` may be given a ``token_mask`` (padding), which the router's ``_route``
    #: then receives: its auxiliary losses and balance statistics skip the masked tokens.
    takes_token_mask: bool = False
    #: Whether the router routes by each token's key (its id, or its raw input) rather than by the
    #: learned ``x``: :meth:`forward` then needs ``token_keys``, which the layer passes on (hash routing).
    takes_token_keys: bool = False
    _load_reducer: Callable | None = None  # (a class default too: routers pickled before it existed)

    def __init__(self, d_model: int, n_experts: int):
        super().__init__()
        self.d_model = check_int(d_model, "d_model", low=1)
        self.n_experts = check_int(n_experts, "n_experts", low=1)
        self.gate = nn.Linear(self.d_model, self.n_experts, bias=False)
        self._load_reducer: Callable | None = None

    # -- shared option groups: checked once here, for every router that takes them ------------------

    def _init_capacity(self, capacity_factor, capacity_rounding="round", min_capacity=0, *, choices_per_token=1,
                       allow_none=True, eval_capacity_factor=None) -> None:
        """The capacity options (``capacity_factor``: None for dropless where ``allow_none``; see
        :meth:`capacity`). ``choices_per_token`` is the ``k`` of ``C = c * k * T / E``: the choices
        each token makes (1 for expert choice and for sampling routers). ``eval_capacity_factor``: the
        factor in eval mode (DeepSpeed-MoE's ``eval_capacity_factor``); None keeps ``capacity_factor``."""
        self.capacity_factor = check_positive_float(capacity_factor, "capacity_factor", allow_none=allow_none)
        self.capacity_rounding = check_choice(capacity_rounding, "capacity_rounding", CAPACITY_ROUNDINGS)
        self.min_capacity = check_int(min_capacity, "min_capacity", low=0)
        self.choices_per_token = choices_per_token
        self.eval_capacity_factor = check_positive_float(eval_capacity_factor, "eval_capacity_factor", allow_none=True)

    def _init_precision(self, router_dtype) -> None:
        """``router_dtype``: None (the router computes in the logits' dtype) or ``"float32"`` /
        ``"float64"`` (or the torch dtype): the gate's matmul, the probabilities and everything the
        router computes from them are in that dtype whatever the model's (Switch Transformer's
        ``router_dtype``; Hugging Face's routers compute the softmax in float32). See :meth:`gate_logits`
        and :meth:`route`."""
        if router_dtype is None or router_dtype in ROUTER_DTYPES.values():
            self.router_dtype = router_dtype
        elif isinstance(router_dtype, str) and router_dtype in ROUTER_DTYPES:
            self.router_dtype = ROUTER_DTYPES[router_dtype]
        else:
            raise ValueError(f"router_dtype must be None, 'float32' or 'float64' (or torch.float32 / torch.float64), "
                             f"got {router_dtype!r}")

    def _init_jitter(self, jitter_noise) -> None:
        """``jitter_noise`` ``eps`` in [0, 1): in training the router's input is multiplied entrywise by
        ``U(1 - eps, 1 + eps)`` (Switch Transformer's and Mixtral's ``router_jitter_noise``), drawn from
        ``self.generator`` when one is set; 0 disables it. See :meth:`router_input`."""
        self.jitter_noise = check_float(jitter_noise, "jitter_noise", low=0.0, high=1.0, high_open=True)

    def _init_noise(self, noise, noise_std, generator, kinds=(None, "vmoe")) -> None:
        """The noise options: ``noise`` (one of ``kinds``; ``"vmoe"`` is V-MoE's eq. 6), its
        ``noise_std`` (default 1/E) and the ``generator`` that draws it."""
        self.noise = check_choice(noise, "noise", kinds)
        self.noise_std = check_positive_float(1.0 / self.n_experts if noise_std is None else noise_std, "noise_std")
        self.generator = check_generator(generator)

    def _vmoe_noise(self, logits: torch.Tensor) -> torch.Tensor:
        """V-MoE's eq. (6): ``logits + N(0, noise_std^2)`` in training with ``noise="vmoe"``, else the logits."""
        if self.training and self.noise == "vmoe":
            return logits + self.noise_std * randn_like(logits, self.generator)
        return logits

    # -- the router protocol --------------------------------------------------------------------------

    def capacity(self, tokens: int) -> int | None:
        """Slots per expert for a group of ``tokens`` tokens, or None (dropless): chapter 1, "Why
        capacity exists". ``round`` or ``ceil`` of ``capacity_factor * choices_per_token * T / E``,
        raised to ``min_capacity`` (:func:`minimoe.ops.compute_capacity`); in eval mode
        ``eval_capacity_factor`` replaces ``capacity_factor`` where it is set."""
        factor = self.capacity_factor
        if not self.training and self.eval_capacity_factor is not None:
            factor = self.eval_capacity_factor  # DeepSpeed-MoE's eval_capacity_factor
        if factor is None:
            return None
        return compute_capacity(tokens, self.n_experts, factor, k=self.choices_per_token,
                                rounding=self.capacity_rounding, min_capacity=self.min_capacity)

    def adjust_output(self, layer: nn.Module, x: torch.Tensor, routing: Routing, out: torch.Tensor) -> torch.Tensor:
        """The hook on the layer's routed output ``out (G, T, d)`` for groups ``x (G, T, d)``, called
        by the layer right after it combined the experts' outputs (before shared experts are added):
        the place for a rule that changes the gradient, not the value. Default: ``out`` unchanged.
        ``layer`` offers :meth:`minimoe.MoELayer.all_expert_outputs` for rules that need every expert."""
        return out

    def extra_loss(self, routing: Routing, loss_per_token: torch.Tensor, *,
                   baseline: float | torch.Tensor = 0.0) -> torch.Tensor | None:
        """The router's extra training loss given the task's per-token (or per-example) losses of
        the forward that produced ``routing``, added to the objective by :func:`minimoe.train.train`
        (through :func:`minimoe.layers.router_losses`); ``baseline`` is the loop's moving average of
        the loss. Default: None (the router needs nothing beyond ``routing.aux_loss``)."""
        return None

    def set_load_reducer(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """How :meth:`reduce_loads` combines this process's expert loads with other processes' (the
        expert-parallel layer sets an all-reduce over its ranks); None: this process alone."""
        if reduce is not None and not callable(reduce):
            raise TypeError(f"reduce must be callable (loads -> loads) or None, got {reduce!r}")
        self._load_reducer = reduce

    def reduce_loads(self, loads: torch.Tensor) -> torch.Tensor:
        """The expert loads ``(E,)`` of the global batch from this process's: a router that learns
        from the loads (loss-free balancing) calls it, so that every rank takes the same step."""
        return loads if self._load_reducer is None else self._load_reducer(loads)

    @classmethod
    def study_options(cls, *, group_size: int, n_experts: int) -> dict:
        """The options of this router in the head-to-head study (chapter 9), at one expert
        evaluation per token on average for routing groups of ``group_size`` tokens and
        ``n_experts`` experts. Default: ``{}``, the router's own defaults."""
        return {}

    @classmethod
    def study_variants(cls) -> dict[str, dict]:
        """Study entries that run this router with other options, ``{entry name: options}`` (the
        options replace :meth:`study_options`): declared by each class in ``STUDY_VARIANTS`` and
        not inherited, since a variant names one router."""
        return dict(vars(cls).get("STUDY_VARIANTS", {}))

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None,
                token_keys: torch.Tensor | None = None) -> Routing:
        """Route a batch of groups ``x (G, T, d_model)`` (or one group ``(T, d_model)``); ``token_mask``
        (``x.shape[:-1]``, False or 0 for padding) as in :meth:`route`. ``token_keys`` (routers with
        :attr:`takes_token_keys` only): each token's key, integer ``x.shape[:-1]`` (token ids) or float
        ``(*x.shape[:-1], D)`` (raw input vectors)."""
        check_tensor(x, "x", min_dim=2, max_dim=3, last_dim=self.d_model,
                     shape_hint="(groups, tokens, d_model) or (tokens, d_model)")
        self._check_dtype(x)
        x = self.router_input(x)
        # routers without a gate (Soft MoE: its slot parameters take the gate's place) route from x alone
        logits = self.gate_logits(x) if self.gate is not None else None
        extra = {} if token_mask is None else {"token_mask": token_mask}
        if self.takes_token_keys:
            extra["token_keys"] = self._check_token_keys(token_keys, x)
        elif token_keys is not None:
            raise ValueError(f"router {self.name!r} routes by the learned tokens x, not by token_keys; pass "
                             "token_keys only to a router that reads them (hash)")
        return self.route(logits, x, **extra)

    def _check_token_keys(self, token_keys, x: torch.Tensor) -> torch.Tensor:
        if token_keys is None and x.shape[-2] == 0:  # no tokens, no keys to read
            return torch.zeros(x.shape[:-1], dtype=torch.long, device=x.device)
        if token_keys is None:
            raise ValueError(f"router {self.name!r} routes each token by its key: pass token_keys, the token ids "
                             f"{tuple(x.shape[:-1])} or raw input vectors {(*x.shape[:-1], 'D')} (the models of "
                             "minimoe.models pass their inputs; MoELayer(x, token_keys=...))")
        if not isinstance(token_keys, torch.Tensor):
            raise TypeError(f"token_keys must be a torch.Tensor, got {type(token_keys).__name__}")
        tokens = tuple(x.shape[:-1])
        if token_keys.is_floating_point():
            if token_keys.dim() != len(tokens) + 1 or tuple(token_keys.shape[:-1]) != tokens or not token_keys.shape[-1]:
                raise ValueError(f"float token_keys must be one vector per token, shape {(*tokens, 'D')} with D >= 1, "
                                 f"got {tuple(token_keys.shape)}")
            check_finite(token_keys, "token_keys")
        elif token_keys.dtype == torch.bool or token_keys.is_complex():
            raise TypeError(f"token_keys must be integer ids or float vectors, got dtype {token_keys.dtype}")
        else:
            if tuple(token_keys.shape) != tokens:
                raise ValueError(f"integer token_keys must be one id per token, shape {tokens}, got "
                                 f"{tuple(token_keys.shape)}")
            # (on the CPU only: on a GPU the check would wait for the device every step)
            if token_keys.device.type == "cpu" and token_keys.numel() and int(token_keys.min()) < 0:
                raise ValueError(f"integer token_keys must be ids >= 0, got a minimum of {int(token_keys.min())}")
        return token_keys.to(x.device)

    def router_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the gate sees of the tokens ``x``: ``x`` itself, or in training with ``jitter_noise``
        ``eps > 0`` the multiplicative jitter ``x * u``, ``u ~ U(1 - eps, 1 + eps)`` entrywise (Switch
        Transformer; Mixtral's block applies the same draw to its experts' input too, the router here
        only to its own). Drawn from the router's ``generator`` when it has one, else from torch's
        global generator, as ``torch.empty_like(x).uniform_(1 - eps, 1 + eps)`` draws it."""
        if not (self.training and self.jitter_noise > 0):
            return x
        low, high = 1.0 - self.jitter_noise, 1.0 + self.jitter_noise
        if self.generator is None:
            u = torch.empty_like(x).uniform_(low, high)
        else:
            u = torch.empty(x.shape, dtype=x.dtype, device=self.generator.device).uniform_(
                low, high, generator=self.generator).to(x.device)
        return x * u

    def gate_logits(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The logits ``x W^T`` of the gate (or of ``weight (E, d)``, a gate held elsewhere: a Hugging
        Face block's). With ``router_dtype`` set, computed in that dtype from ``x`` and ``W`` cast to
        it, outside any autocast region (Switch's selective precision); else in ``x``'s dtype."""
        if self.router_dtype is None:
            return self.gate(x) if weight is None else F.linear(x, weight)
        weight = self.gate.weight if weight is None else weight
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(self.router_dtype), weight.to(self.router_dtype))

    def _check_dtype(self, x: torch.Tensor) -> None:
        weight = next(self.parameters(), None)
        if weight is not None and x.dtype != weight.dtype and not autocast_on(x.device.type):
            raise TypeError(f"x has dtype {x.dtype} but the router's parameters are {weight.dtype}: convert one "
                            f"to the other (x.to({weight.dtype}) or router.to({x.dtype})), or run under "
                            "torch.autocast")

    def route(self, logits: torch.Tensor | None, x: torch.Tensor | None = None, *,
              token_mask: torch.Tensor | None = None, token_keys: torch.Tensor | None = None) -> Routing:
        """Route from router logits ``(..., T, E)`` directly (no gate): used by tests, benchmarks and
        training-free re-routing. ``x`` is only needed by routers whose noise depends on the input.
        A group of zero tokens gets an empty routing (every tensor with T = 0, no aux loss). With
        ``router_dtype`` set the logits are first cast to it (a model's bfloat16 logits give float32
        probabilities, as Hugging Face's softmax of ``logits.float()`` does).

        ``token_mask`` (shape ``logits.shape[:-1]``; bool, or 0/1 as an attention mask): False marks a
        padding token, which the router's auxiliary losses and balance statistics then ignore (routers
        with :attr:`takes_token_mask`; the others refuse a mask). For the top-k routers which experts a
        token takes, and its slots, do not change; Soft MoE keeps padding out of its slot mixtures."""
        if logits is not None:
            if self.router_dtype is not None and isinstance(logits, torch.Tensor) and logits.is_floating_point():
                logits = logits.to(self.router_dtype)
            check_scores(logits, "logits")
            if logits.shape[-1] != self.n_experts:
                raise ValueError(f"logits have {logits.shape[-1]} experts, the router has n_experts={self.n_experts}")
        if token_mask is not None:
            token_mask = self._check_token_mask(token_mask, logits, x)
        if logits is not None and (logits.shape[-2] == 0 or logits.numel() == 0):
            return self._empty(logits)
        extra = {} if token_mask is None else {"token_mask": token_mask}
        if self.takes_token_keys:
            if x is None:
                raise ValueError(f"router {self.name!r} has no gate: route(None, x, token_keys=...) needs the tokens x")
            extra["token_keys"] = self._check_token_keys(token_keys, x)
        elif token_keys is not None:
            raise ValueError(f"router {self.name!r} does not read token_keys (hash routing does)")
        return self._route(logits, x, **extra)

    def _check_token_mask(self, token_mask, logits, x) -> torch.Tensor:
        if not self.takes_token_mask:
            takers = ", ".join(repr(name) for name, cls in sorted(_REGISTRY.items()) if cls.takes_token_mask)
            raise ValueError(f"router {self.name!r} does not take a token_mask: its routing statistics count every "
                             f"token (padding masks are taken by {takers})")
        if not isinstance(token_mask, torch.Tensor):
            raise TypeError(f"token_mask must be a torch.Tensor (bool, or 0/1), got {type(token_mask).__name__}")
        shape = tuple(logits.shape[:-1]) if logits is not None else tuple(x.shape[:-1])
        if tuple(token_mask.shape) != shape:
            raise ValueError(f"token_mask must have the shape of the tokens {shape} ((groups,) tokens), "
                             f"got {tuple(token_mask.shape)}")
        device = logits.device if logits is not None else x.device
        return (token_mask if token_mask.dtype == torch.bool else token_mask != 0).to(device)

    def _route(self, logits: torch.Tensor, x: torch.Tensor | None) -> Routing:
        """The router's own rule; logits are checked and the group is not empty."""
        raise NotImplementedError

    def _empty(self, logits: torch.Tensor) -> Routing:
        position = torch.full(logits.shape, -1, dtype=torch.long, device=logits.device)
        return Routing(combine=torch.zeros_like(logits), position=position, capacity=None,
                       probs=torch.zeros_like(logits), aux_loss=logits.new_zeros(()))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_experts={self.n_experts}"
