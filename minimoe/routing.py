"""The result of a router: which token goes to which expert slot, and with what weight.

Book: chapter 1, section "The unified layer". Liu et al. write every MoE layer with two
(tokens x experts x slots) tensors, dispatch D and combine C (eq. 2). Sparse routers fill them with
0/1 and the gate values, so we store them compactly:

* ``position (..., T, E)``: slot of token t in expert e's buffer, -1 when not dispatched;
* ``combine (..., T, E)``: the weight of expert e's output in token t's output, 0 off the mask.

A router whose tokens each make k choices (softmax top-k, DenseMixer) may instead give the choices
themselves, ``(..., T, k)``: ``choice_expert`` (the expert of token t's j-th choice),
``choice_slot`` (its slot, -1 when the choice was dropped) and ``choice_weight`` (its combine
weight, 0 when dropped). That is k/E of the memory of the two tables; ``position`` and ``combine``
are then built from the choices the first time something reads them, and the layer's fast paths
read the choices directly (``MoELayer._slots``, ``MoELayer._grouped``). Conversions are explicit:
``routing.to_table()`` is the same routing as tables, ``routing.with_combine(weights)`` a table
routing with other combine weights; writing ``position`` or ``combine`` of a routing given by its
choices is an error. Both forms describe the same dispatch (tests/test_routing.py).

Soft routers (Soft MoE) store the dense ``slot_dispatch`` and ``slot_combine`` ``(..., T, E, S)``.
``dispatch_tensor()`` / ``combine_tensor()`` rebuild the unified tensors for teaching and tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


class _FromChoices:
    """A ``Routing`` field (``position`` or ``combine``) that, when not given, is built from the
    per-token choices on first read and then kept (a data descriptor, so the dataclass's generated
    ``__init__`` stores the given value through it and ``None`` stays its default)."""

    def __set_name__(self, owner, name):
        self.name, self.slot = name, "_" + name

    def __get__(self, routing, owner=None):
        if routing is None:  # the class attribute: the dataclass reads it as the field's default
            return None
        value = routing.__dict__.get(self.slot)
        if value is None and routing.choice_expert is not None:
            value = getattr(routing, f"_{self.name}_from_choices")()
            routing.__dict__[self.slot] = value
        return value

    def __set__(self, routing, value):
        if value is not None and routing.__dict__.get("choice_expert") is not None:
            raise AttributeError(f"this Routing is given by each token's choices: its {self.name} is built from "
                                 f"them and cannot be written. Use routing.to_table() for a table routing, or "
                                 "routing.with_combine(weights) for other combine weights")
        routing.__dict__[self.slot] = value


@dataclass
class Routing:
    combine: torch.Tensor | None = _FromChoices()
    position: torch.Tensor | None = _FromChoices()
    capacity: int | None = None
    probs: torch.Tensor | None = None
    aux_loss: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    extra_stats: dict = field(default_factory=dict)
    slot_dispatch: torch.Tensor | None = None
    slot_combine: torch.Tensor | None = None
    # REINFORCE routers (Kool et al., chapter 5): log p(z_t | x_t) of each token's sampled expert
    # (with gradient) and its detached coefficient w_t (0 for a skipped token), both (..., T), read by
    # the router's own rules (Router.adjust_output scales the gradient through token t's output by
    # w_t; Router.extra_loss is the score-function term)
    log_prob: torch.Tensor | None = None
    reinforce_weight: torch.Tensor | None = None
    # An upper bound on the dispatched (token, expert) pairs of the whole routing that the router knows
    # from its rule alone (k per token for top-k, C per expert for expert choice), or None. With it
    # the layer's grouped path sizes its pair list without reading the routing on the host (no
    # accelerator synchronisation)
    max_pairs: int | None = None
    # Token-choice routers may give each token's k choices instead of the (T, E) tables (see the
    # module docstring): choice_expert (..., T, k) distinct experts per token; choice_slot (..., T, k),
    # -1 for a dropped choice; choice_weight (..., T, k), 0 for a dropped choice
    choice_expert: torch.Tensor | None = None
    choice_slot: torch.Tensor | None = None
    choice_weight: torch.Tensor | None = None

    def __post_init__(self):
        given = [self.choice_expert is not None, self.choice_slot is not None, self.choice_weight is not None]
        if any(given) and not all(given):
            raise ValueError("choice_expert, choice_slot and choice_weight come together: give all three or none")

    def to_table(self) -> "Routing":
        """The same routing given by its ``(..., T, E)`` tables (itself when it already is)."""
        if not self.has_choices:
            return self
        return replace(self, combine=self.combine, position=self.position, choice_expert=None, choice_slot=None,
                       choice_weight=None)

    def with_combine(self, combine: torch.Tensor) -> "Routing":
        """A table routing with the same dispatch and ``combine (..., T, E)`` as its weights (they
        must be 0 off the dispatch), e.g. the combine weights renormalised per token."""
        if self.is_soft:
            raise ValueError("with_combine is for sparse routings (position and combine); a soft routing's "
                             "weights are its slot_dispatch and slot_combine")
        table = self.to_table()
        if combine.shape != table.position.shape:
            raise ValueError(f"combine must have the routing's shape {tuple(table.position.shape)}, "
                             f"got {tuple(combine.shape)}")
        return replace(table, combine=combine)

    @property
    def has_choices(self) -> bool:
        """Whether the routing holds each token's choices ``(..., T, k)`` (read by the layer's fast paths)."""
        return self.choice_expert is not None

    def _position_from_choices(self) -> torch.Tensor:
        position = torch.full(self._table_shape(), -1, dtype=torch.long, device=self.choice_expert.device)
        return position.scatter_(-1, self.choice_expert, self.choice_slot)

    def _combine_from_choices(self) -> torch.Tensor:
        # a scatter: the weights keep their autograd link (the gradient of entry (t, e) goes to the choice)
        zeros = self.choice_weight.new_zeros(self._table_shape())
        return zeros.scatter(-1, self.choice_expert, self.choice_weight)

    def _table_shape(self) -> tuple:
        if self.probs is None:
            raise ValueError("a Routing given by its choices needs probs (..., T, E) for the number of experts")
        return (*self.choice_expert.shape[:-1], self.probs.shape[-1])

    @property
    def stats(self) -> dict:
        """Balance metrics (drop rate, load imbalance, ...; see :func:`minimoe.metrics.routing_stats`)
        plus the router's ``extra_stats``. Computed on first access, so routing itself stays cheap: an
        ``extra_stats`` value may be a function of no arguments, called then."""
        if getattr(self, "_stats", None) is None:
            from .metrics import routing_stats

            extra = {key: value() if callable(value) else value for key, value in self.extra_stats.items()}
            self._stats = {**routing_stats(self.mask, self.probs), **extra}
        return self._stats

    @property
    def is_soft(self) -> bool:
        return self.slot_dispatch is not None

    @property
    def mask(self) -> torch.Tensor:
        """Bool ``(..., T, E)``: token t is processed by expert e."""
        if self.is_soft:
            return self.slot_combine.sum(-1) > 0
        if self.has_choices and self.__dict__.get("_position") is None:  # without building the slot table
            mask = torch.zeros(self._table_shape(), dtype=torch.bool, device=self.choice_expert.device)
            return mask.scatter_(-1, self.choice_expert, self.choice_slot >= 0)
        return self.position >= 0

    @property
    def num_slots(self) -> int:
        """Slots per expert per group: the capacity, or (dropless) the largest load."""
        if self.is_soft:
            return self.slot_dispatch.shape[-1]
        if self.capacity is not None:
            return self.capacity
        slots = self.choice_slot if self.has_choices else self.position
        if slots.numel() == 0:
            return 1
        return max(int(slots.max()) + 1, 1)

    def num_pairs(self) -> torch.Tensor:
        """The dispatched (token, expert) pairs of the whole routing, a 0-dim integer tensor."""
        if self.has_choices:
            return (self.choice_slot >= 0).sum()
        return self.mask.sum()

    def tokens_per_expert(self) -> torch.Tensor:
        """Tokens each expert processes in each group, shape ``(..., E)``."""
        return self.mask.sum(-2)

    def dispatch_tensor(self, capacity: int | None = None) -> torch.Tensor:
        """The dispatch tensor D of eq. (2), shape ``(..., T, E, C)``, in the dtype of ``combine``."""
        if self.is_soft:
            return self.slot_dispatch
        slots = self.num_slots if capacity is None else capacity
        if slots < self.num_slots:
            raise ValueError(f"capacity must be >= {self.num_slots} (the slots in use), got {capacity}")
        pos = self.position
        onehot = torch.nn.functional.one_hot(pos.clamp_min(0), slots)
        return (onehot * (pos >= 0).unsqueeze(-1)).to(self.combine.dtype)

    def combine_tensor(self, capacity: int | None = None) -> torch.Tensor:
        """The combine tensor C of eq. (2): ``D * combine`` (exactly 0 off the dispatch)."""
        if self.is_soft:
            return self.slot_combine
        return self.dispatch_tensor(capacity) * self.combine.unsqueeze(-1)
