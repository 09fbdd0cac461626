"""Checkers for chapter 3 (Selective Sinkhorn Routing)."""
from __future__ import annotations

import torch

from ..ops import gaussian_top1_probability, top_k
from ._harness import CheckFailed, checker, assert_close, run_checks


@checker
def check_kl_projection(student_fn, *, seed: int = 0, verbose: bool = True) -> bool:
    """Exercise 3.1 (Proposition 3.1): ``student_fn(q (E,), k)`` returns the distribution ``alpha (E,)``
    with at most ``k`` nonzeros closest to ``q`` in ``KL(alpha || q)``: q's top-k entries renormalised."""
    gen = torch.Generator().manual_seed(seed)
    cases = [("k = E keeps q", torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64), 3),
             ("k = 1 is one-hot", torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64), 1)]
    for i in range(25):
        E = int(torch.randint(2, 10, (1,), generator=gen))
        k = int(torch.randint(1, E + 1, (1,), generator=gen))
        cases.append((f"random instance {i} (E={E}, k={k})",
                      torch.softmax(2 * torch.randn(E, generator=gen, dtype=torch.float64), -1), k))

    def make(q, k):
        def check():
            values, indices = top_k(q, k, renormalize=True)
            want = torch.zeros_like(q).scatter(-1, indices, values)
            got = torch.as_tensor(student_fn(q.clone(), k), dtype=q.dtype)
            if (got != 0).sum() > k:
                raise CheckFailed(f"q={q}, k={k}: alpha has {(got != 0).sum()} nonzeros, at most k allowed")
            assert_close(got, want, f"q={q}, k={k}: alpha", atol=1e-10)
        return check

    return run_checks("kl_projection", [(d, make(q, k)) for d, q, k in cases], verbose)


@checker
def check_gaussian_top1(student_fn, *, seed: int = 0, verbose: bool = True) -> bool:
    """Exercise 3.2 (Proposition 3.3): ``student_fn(scores (E,), noise_std)`` returns the exact
    probability that each expert has the largest ``scores + noise_std * z``, z i.i.d. N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    cases = [("two experts", torch.tensor([0.5, 0.0], dtype=torch.float64), 1.0),
             ("three equal experts: 1/3 each, not 1/4", torch.zeros(3, dtype=torch.float64), 1.0),
             ("eight equal experts", torch.zeros(8, dtype=torch.float64), 0.3)]
    for i in range(10):
        E = int(torch.randint(2, 7, (1,), generator=gen))
        cases.append((f"random instance {i} (E={E})", torch.randn(E, generator=gen, dtype=torch.float64),
                      float(torch.rand((), generator=gen)) + 0.2))

    def make(s, std):
        def check():
            assert_close(student_fn(s.clone(), std), gaussian_top1_probability(s, std), f"scores={s}, noise_std={std}",
                   atol=1e-5)
        return check

    return run_checks("gaussian_top1", [(d, make(s, std)) for d, s, std in cases], verbose)
