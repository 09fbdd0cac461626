"""BASE layers (Lewis et al. 2021): a balanced linear assignment in training, greedy top-1 at eval.

Book: chapter 2, section "Sinkhorn routers are top-k with per-expert biases". In training, the tokens of a group are
assigned to experts by :func:`minimoe.ops.linear_assignment` so that the total logit is maximal and
every expert takes ``ceil(T / E)`` tokens at most (exactly ``T / E`` when E divides T): the eps -> 0
limit of the entropic plan. There is nothing to balance with a loss and nothing is dropped. At eval
a token cannot wait for the others, so each goes to its highest-scoring expert. The layer output
is ``sigmoid(S_te) * expert_e(x_t)``: the gate value is how the router learns, since the assignment
itself has no gradient.
"""
from __future__ import annotations

import math

import torch

from ..ops import linear_assignment
from ..ops._checks import check_choice
from ..ops.allocation import token_choice_allocation
from ..routing import Routing
from .base import Router, register


@register("base")
class BaseLayerRouter(Router):
    """Balanced assignment routing (BASE layers).

    Args:
        method: solver of :func:`minimoe.ops.linear_assignment`: ``"auto"`` (exact, pure torch, on the
            device of the logits) or ``"scipy"`` (exact, on the host; needs scipy).
    """

    def __init__(self, d_model: int, n_experts: int, *, method: str = "auto"):
        super().__init__(d_model, n_experts)
        self.method = check_choice(method, "method", ("auto", "scipy"))

    def capacity(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / self.n_experts))

    def _route(self, logits: torch.Tensor, x: torch.Tensor | None = None) -> Routing:
        T, E = logits.shape[-2:]
        if self.training:
            capacity = self.capacity(T)
            expert = linear_assignment(logits.detach(), capacity, method=self.method)
        else:
            capacity = None
            expert = logits.detach().argmax(-1)
        chosen = torch.zeros_like(logits, dtype=torch.float32).scatter(-1, expert[..., None], 1.0)
        position = token_choice_allocation(chosen, 1, None, checked=True)  # slot = rank in token order
        combine = torch.sigmoid(logits) * (position >= 0)
        return Routing(combine=combine, position=position, capacity=capacity, probs=torch.softmax(logits, -1),
                       aux_loss=logits.new_zeros(()))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, method={self.method!r}"
