"""Four routers that do not learn: the controls a learned router must beat (book: chapter 9,
"Baselines that do not learn").

A learned router earns its place only against choices made without learning. Each control runs
through the same :class:`~minimoe.MoELayer` as every router, so the layer, the experts, the
optimiser and the data are the same and only the choice of experts differs:

* ``hash``: each token to one expert fixed by its *key*, before training and forever (Roller et al.
  2021, "Hash Layers For Large Sparse Models"). The key is what the model knows of the token before
  any layer has learned anything: its id in a language model (``e = ((a * id + b) mod p) mod E``, a
  universal hash with ``p = 2^31 - 1``), or its raw input vector elsewhere (``e`` = the sign pattern
  of ``ceil(log2 E)`` fixed random projections, read as a binary number, mod ``E``: random-hyperplane
  hashing). The second is the first's analogue: a fixed function of the token's content, drawn once
  from ``seed``, that sends equal tokens to the same expert (and, for vectors, nearby tokens usually
  too), with no parameter that training could move. Like a hash of token ids, which sends every
  space character to one expert, it balances the *distinct* keys, not the tokens: equal inputs (a
  blank patch) all go to one expert, and when ``E`` is not a power of 2 the codes ``mod E`` favour
  the low experts.
* ``random``: each token to a uniformly random expert, drawn again at every forward (balanced in
  expectation, and in nothing else).
* ``dense``: every token to expert 0. The layer is then exactly one feed-forward network of width
  ``d_hidden``: the same active compute as one expert per token, and no routing at all.
* ``dense_wide``: every token to every expert with weight 1. Since ``sum_e W2_e act(W1_e x + b1_e)``
  is one network of width ``E * d_hidden`` (the experts' weights stacked), this is a dense layer with
  the same total parameters as the ``E`` experts, at ``E`` times the active compute.

All four have no gate and no auxiliary loss; their combine weight is 1. They route dropless (no
capacity), so none drops a token. ``Routing.probs`` is the distribution each token's expert is drawn
from: one-hot for ``hash`` and ``dense``, uniform for ``random`` and ``dense_wide``. They are
registered as baselines (:func:`~minimoe.routers.baselines`), not as routers, so ``available()``
lists only the routers a practitioner would choose between.
"""
from __future__ import annotations

import math

import torch

from ..ops._checks import check_generator, check_int
from ..ops.allocation import dropless_choice_slots
from ..routing import Routing
from .base import Router, register

#: The prime of the universal hash of token ids (2^31 - 1: ``a * (id mod p)`` stays inside int64).
HASH_PRIME = 2**31 - 1


class _Baseline(Router):
    """A router without a gate whose choices do not depend on the learned tokens: each token's ``k``
    experts (``_choose``), weight 1, dropless slots in token order."""

    def __init__(self, d_model: int, n_experts: int):
        super().__init__(d_model, n_experts)
        self.gate = None  # nothing is learned

    def _choose(self, x: torch.Tensor, token_keys) -> torch.Tensor:
        """``(..., T, k)`` long: each token's experts (distinct within a token)."""
        raise NotImplementedError

    def _probs(self, expert: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``(..., T, E)``: the distribution each token's expert is drawn from (default: one-hot)."""
        return torch.zeros(*expert.shape[:-1], self.n_experts, dtype=like.dtype, device=like.device).scatter_(
            -1, expert, 1.0)

    def _route(self, logits, x, token_keys=None) -> Routing:
        if x is None:
            raise ValueError(f"router {self.name!r} has no gate and routes the tokens themselves: call it on x, "
                             "or route(None, x)")
        expert = self._choose(x, token_keys)
        kept = torch.ones(expert.shape, dtype=torch.bool, device=expert.device)
        slot = (dropless_choice_slots(expert, kept, self.n_experts) if expert.numel()
                else torch.full_like(expert, -1))
        weight = torch.ones(expert.shape, dtype=x.dtype, device=x.device)
        return Routing(choice_expert=expert, choice_slot=slot, choice_weight=weight, capacity=None,
                       probs=self._probs(expert, x), aux_loss=x.new_zeros(()), max_pairs=expert.numel())


@register("hash", baseline=True)
class HashRouter(_Baseline):
    """Hash routing (Roller et al. 2021): token ``t`` to the expert its key hashes to, fixed forever.

    Args:
        seed: draws the hash (``a, b`` of the id hash; the projections of the vector hash).

    The layer passes each token's key (``MoELayer(x, token_keys=...)``; the models of
    :mod:`minimoe.models` pass their input: token ids, patch pixels, input vectors):

    * integer keys ``(..., T)`` (token ids, >= 0): ``e = ((a * key + b) mod p) mod E``, ``p = 2^31 - 1``;
    * float keys ``(..., T, D)``: ``e = (sum_j 2^j [key . r_j > 0]) mod E`` for ``ceil(log2 E)``
      fixed Gaussian directions ``r_j`` in ``R^D``.
    """

    takes_token_keys = True

    def __init__(self, d_model: int, n_experts: int, *, seed: int = 0):
        super().__init__(d_model, n_experts)
        self.seed = check_int(seed, "seed", low=0)
        gen = torch.Generator().manual_seed(self.seed)
        self.hash_a = int(torch.randint(1, HASH_PRIME, (), generator=gen))
        self.hash_b = int(torch.randint(0, HASH_PRIME, (), generator=gen))
        self.n_bits = max(1, math.ceil(math.log2(self.n_experts))) if self.n_experts > 1 else 0

    def directions(self, key_dim: int, device=None) -> torch.Tensor:
        """``(key_dim, n_bits)`` float64: the fixed random directions of the vector hash (a function of
        ``seed`` and ``key_dim`` alone)."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        return torch.randn(key_dim, self.n_bits, generator=gen, dtype=torch.float64).to(device)

    def hash_keys(self, token_keys: torch.Tensor) -> torch.Tensor:
        """Each key's expert, ``(..., T)`` long."""
        if not token_keys.is_floating_point():
            # (id mod p) first: the same value modulo p, and the product stays below 2^62 for any id
            return ((token_keys.long() % HASH_PRIME) * self.hash_a + self.hash_b) % HASH_PRIME % self.n_experts
        if self.n_bits == 0:
            return torch.zeros(token_keys.shape[:-1], dtype=torch.long, device=token_keys.device)
        above = (token_keys.double() @ self.directions(token_keys.shape[-1], token_keys.device)) > 0
        powers = 2 ** torch.arange(self.n_bits, device=token_keys.device)
        return (above.long() * powers).sum(-1) % self.n_experts

    def _choose(self, x, token_keys):
        return self.hash_keys(token_keys).unsqueeze(-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, seed={self.seed}"


@register("random", baseline=True)
class RandomRouter(_Baseline):
    """Each token to a uniformly random expert, drawn anew at every forward (in training and in
    evaluation alike) from ``generator``, or from torch's global generator when it is None."""

    def __init__(self, d_model: int, n_experts: int, *, generator: torch.Generator | None = None):
        super().__init__(d_model, n_experts)
        self.generator = check_generator(generator)

    def _choose(self, x, token_keys):
        shape = (*x.shape[:-1], 1)
        if self.generator is None:
            return torch.randint(0, self.n_experts, shape, device=x.device)
        return torch.randint(0, self.n_experts, shape, generator=self.generator,
                             device=self.generator.device).to(x.device)

    def _probs(self, expert, like):
        return torch.full((*expert.shape[:-1], self.n_experts), 1.0 / self.n_experts, dtype=like.dtype,
                          device=like.device)


@register("dense", baseline=True)
class DenseRouter(_Baseline):
    """Every token to expert 0 with weight 1: the layer is one feed-forward network of width
    ``d_hidden`` (the other experts are never used), the active compute of one expert."""

    def _choose(self, x, token_keys):
        return torch.zeros((*x.shape[:-1], 1), dtype=torch.long, device=x.device)


@register("dense_wide", baseline=True)
class DenseWideRouter(_Baseline):
    """Every token to all ``E`` experts with weight 1: one feed-forward network of width
    ``E * d_hidden``, the same parameters as the experts, ``E`` times the active compute."""

    def _choose(self, x, token_keys):
        return torch.arange(self.n_experts, device=x.device).expand(*x.shape[:-1], self.n_experts)

    def _probs(self, expert, like):
        return torch.full((*expert.shape[:-1], self.n_experts), 1.0 / self.n_experts, dtype=like.dtype,
                          device=like.device)
