"""USMoE (Do, Le & Tran): global top-c of the unified score, and training-free re-routing.

Book: chapter 6 (Routing as a linear program), sections "The unified score" and "Which tokens compete".
Each selection group keeps the ``floor(k * tokens)`` pairs with the largest unified score
``U = (1 - alpha) softmax_row + alpha S_e`` (:func:`minimoe.ops.unified_score`), so a token gets
anywhere from 0 to E experts and ``k`` may be fractional (1.5). The combine weights are ``U`` at the
selected pairs, as in the authors' code (``renormalize=True`` divides by their sum per token).

Which tokens compete for the budget (``grouping``):

* ``"position"`` (default): the tokens at the same position of the sequences routed together (the
  layer's groups), as the authors' Transformer-XL code does through its ``(length, batch, d)`` layout.
  Causal: a token's experts depend on other *sequences*, never on later tokens of its own.
* ``"sequence"``: the tokens of one group (one sequence), as the paper describes it. A token's
  experts then depend on the later tokens of its sequence: in a decoder that leaks the future,
  like expert choice does (chapter 6, "Which tokens compete").

With one token per selection group and the sigmoid ``S_e`` (or ``alpha < 1``), both reduce to token
choice with ``floor(k)`` experts: ``"position"`` does so whenever a call routes a single group (one
sequence, or a layer whose group is the whole batch), which is why it warns in training then. Its
budget also follows the batch: served one sequence at a time, a model trained at ``k = 1.5`` runs
``floor(1.5) = 1`` expert per token. For images (no causality to protect) use ``"sequence"``, one image
per group.
"""
from __future__ import annotations

import warnings

import torch

from .. import losses
from ..ops._checks import check_bool, check_choice, check_nonnegative_float
from ..ops.allocation import dropless_positions
from ..ops.selection import EC_SCORES, check_alpha, global_topc, selection_budget, unified_score
from ..routing import Routing
from .base import Router, register

GROUPINGS = ("position", "sequence")


@register("usmoe")
class USMoE(Router):
    """Global top-c routing on the unified score (USMoE, Alg. 1).

    Args:
        k: experts per token on average (> 0, fractional allowed); each selection group of ``n``
            tokens keeps ``floor(k * n)`` token-expert pairs.
        alpha: weight of the expert-choice score in ``U`` (0: token-choice score, 1: expert-choice).
        ec_score: ``"sigmoid"`` (``(2/E) sigmoid``, the released code) or ``"column_softmax"`` (Def. 3.1).
        grouping: ``"position"`` (causal; default) or ``"sequence"`` (the paper; sees later tokens).
        renormalize: divide each token's combine weights by their sum (off in the paper's code).
        balance_loss: ``None`` or ``"switch"`` (the paper's appendix trains with a standard balance
            loss; the released layer has none), computed per routed group (sequence) whatever the
            grouping; ``balance_loss_weight`` defaults to 0.01.
        z_loss_weight: weight of the router z-loss; 0 disables it.
    """

    def __init__(self, d_model: int, n_experts: int, *, k: float = 2.0, alpha: float = 0.5,
                 ec_score: str = "sigmoid", grouping: str = "position", renormalize: bool = False,
                 balance_loss: str | None = None, balance_loss_weight: float | None = None,
                 z_loss_weight: float = 0.0):
        super().__init__(d_model, n_experts)
        selection_budget(k, 1, n_experts)  # checks 0 < k <= E
        self.k = float(k)
        self.alpha = check_alpha(alpha)
        self.ec_score = check_choice(ec_score, "ec_score", EC_SCORES)
        self.grouping = check_choice(grouping, "grouping", GROUPINGS)
        self.renormalize = check_bool(renormalize, "renormalize")
        self.balance_loss = check_choice(balance_loss, "balance_loss", (None, "switch"))
        self.balance_loss_weight = check_nonnegative_float(0.01 if balance_loss_weight is None else balance_loss_weight,
                                                           "balance_loss_weight")
        self.z_loss_weight = check_nonnegative_float(z_loss_weight, "z_loss_weight")
        self._warned = False

    @classmethod
    def study_options(cls, *, group_size: int, n_experts: int) -> dict:
        # the selection competes inside the layer's routing group; the LM's groups are already the
        # same-position tokens of the batch (causal), so no second regrouping
        return {"k": 1.0, "grouping": "sequence"}

    def _route(self, logits: torch.Tensor, x: torch.Tensor | None = None) -> Routing:
        grouped = logits if logits.dim() == 3 else logits.reshape(-1, *logits.shape[-2:])  # (G, T, E)
        # the selection groups: sequences as they come, or positions (tokens t of all G sequences)
        if self.grouping == "position" and grouped.shape[0] == 1 and self.training and not self._warned:
            warnings.warn("usmoe with grouping='position' got a single group: each position is a selection "
                          "group of one token, so this is token choice with floor(k) experts. Route several "
                          "sequences as separate groups, or use grouping='sequence'", RuntimeWarning, stacklevel=3)
            self._warned = True
        selection = grouped if self.grouping == "sequence" else grouped.transpose(0, 1)
        scores = unified_score(selection, self.alpha, ec_score=self.ec_score)
        budget = selection_budget(self.k, selection.shape[-2], self.n_experts)
        mask = global_topc(scores, budget)
        if self.grouping == "position":
            scores, mask = scores.transpose(0, 1), mask.transpose(0, 1)
        scores, mask = scores.reshape(logits.shape), mask.reshape(logits.shape)

        gates = scores * mask
        if self.renormalize:
            gates = gates / gates.sum(-1, keepdim=True).clamp_min(torch.finfo(gates.dtype).tiny)
        position = dropless_positions(mask)
        probs = torch.softmax(logits, dim=-1)
        aux = logits.new_zeros(())
        if self.training and self.balance_loss == "switch":
            aux = aux + self.balance_loss_weight * losses.switch_balance_loss(probs, mask)
        if self.training and self.z_loss_weight:
            aux = aux + self.z_loss_weight * losses.z_loss(logits)
        return Routing(combine=gates, position=position, capacity=None, probs=probs, aux_loss=aux,
                       extra_stats={"budget_per_group": budget}, max_pairs=budget * selection[..., 0, 0].numel())

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, k={self.k}, alpha={self.alpha}, ec_score={self.ec_score!r}, "
                f"grouping={self.grouping!r}")

