"""Checkers for chapter 6 (Routing as a linear program)."""
from __future__ import annotations

import torch

from ..ops import exchangeable_drop_probability
from ._harness import CheckFailed, checker, assert_close, run_checks


@checker
def check_global_topc(student_fn, *, seed: int = 0, verbose: bool = True) -> bool:
    """Exercise 6.1: ``student_fn(scores (T, E), c)`` returns a bool mask with exactly ``c`` entries
    whose total score is the largest possible (any tie-breaking is accepted)."""
    gen = torch.Generator().manual_seed(seed)
    cases = [("c = 0 selects nothing", torch.randn(3, 4, generator=gen, dtype=torch.float64), 0),
             ("c = T * E selects everything", torch.randn(3, 4, generator=gen, dtype=torch.float64), 12),
             ("negative scores still count: the budget is exact", -torch.rand(4, 3, generator=gen,
                                                                              dtype=torch.float64), 5),
             ("ties at the threshold", torch.tensor([[1.0, 2.0, 2.0], [2.0, 0.0, 2.0]], dtype=torch.float64), 3)]
    for i in range(20):
        T, E = (int(v) for v in torch.randint(1, 9, (2,), generator=gen))
        c = int(torch.randint(0, T * E + 1, (1,), generator=gen))
        cases.append((f"random instance {i} (T={T}, E={E}, c={c})", torch.randn(T, E, generator=gen,
                                                                                   dtype=torch.float64), c))

    def make(S, c):
        def check():
            got = torch.as_tensor(student_fn(S.clone(), c))
            if got.shape != S.shape or got.dtype != torch.bool:
                raise CheckFailed(f"expected a bool mask of shape {tuple(S.shape)}, got {got.dtype} {tuple(got.shape)}")
            if int(got.sum()) != c:
                raise CheckFailed(f"c={c}: the mask selects {int(got.sum())} entries")
            best = S.flatten().topk(c).values.sum() if c else S.new_zeros(())
            assert_close((S * got).sum(), best, f"scores=\n{S}\nc={c}: total selected score", atol=1e-10)
        return check

    return run_checks("global_topc", [(d, make(S, c)) for d, S, c in cases], verbose)


@checker
def check_drop_probability(student_fn, *, verbose: bool = True) -> bool:
    """Exercise 6.3: ``student_fn(tokens, experts, selected)`` returns the probability that a given token
    gets no expert when ``selected`` of the ``tokens * experts`` pairs form a uniformly random subset."""
    cases = [(1, 4, 2), (4, 2, 1), (4, 2, 7), (4, 2, 8), (10, 8, 15), (64, 16, 128), (128, 64, 1024), (3, 3, 0)]

    def make(T, E, n):
        def check():
            want = torch.tensor(exchangeable_drop_probability(T, E, n), dtype=torch.float64)
            assert_close(float(student_fn(T, E, n)), want, f"tokens={T}, experts={E}, selected={n}", atol=1e-12)
        return check

    return run_checks("drop_probability", [(f"T={T}, E={E}, n={n}", make(T, E, n)) for T, E, n in cases], verbose)
