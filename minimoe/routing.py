"""The result of a router: which token goes to which expert slot, and with what weight.

Book: chapter 1, section "The unified layer". Liu et al. write every MoE layer with two
(tokens x experts x slots) tensors, dispatch D and combine C (eq. 2). Sparse routers fill them with
0/1 and the gate values, so we store them compactly:

* ``position (..., T, E)``: slot of token t in expert e's buffer, -1 when not dispatched;
* ``combine (..., T, E)``: the weight of expert e's output in token t's output, 0 off the mask.

Soft routers (Soft MoE) store the dense ``slot_dispatch`` and ``slot_combine`` ``(..., T, E, S)``.
``dispatch_tensor()`` / ``combine_tensor()`` rebuild the unified tensors for teaching and tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Routing:
    combine: torch.Tensor | None = None
    position: torch.Tensor | None = None
    capacity: int | None = None
    probs: torch.Tensor | None = None
    aux_loss: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    extra_stats: dict = field(default_factory=dict)
    slot_dispatch: torch.Tensor | None = None
    slot_combine: torch.Tensor | None = None
    # DenseMixer: the layer adds a dense straight-through term so the router's gradient sees every
    # expert's output (chapter 7, "Baselines"); the forward value stays the sparse output
    dense_backward: bool = False
    # REINFORCE routers (Kool et al., chapter 5): log p(z_t | x_t) of each token's sampled expert
    # (with gradient) and its detached coefficient w_t (0 for a skipped token), both (..., T). The
    # layer scales the gradient through token t's output by w_t; minimoe.losses.reinforce_loss adds
    # the score-function term
    log_prob: torch.Tensor | None = None
    reinforce_weight: torch.Tensor | None = None
    # An upper bound on the dispatched (token, expert) pairs of the whole routing that the router knows
    # from its rule alone (k per token for top-k, C per expert for expert choice), or None. With it
    # the layer's grouped path sizes its pair list without reading the routing on the host (no
    # accelerator synchronisation)
    max_pairs: int | None = None

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
        return self.position >= 0

    @property
    def num_slots(self) -> int:
        """Slots per expert per group: the capacity, or (dropless) the largest load."""
        if self.is_soft:
            return self.slot_dispatch.shape[-1]
        if self.capacity is not None:
            return self.capacity
        if self.position.numel() == 0:
            return 1
        return max(int(self.position.max()) + 1, 1)

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
