"""Checkers for chapter 4 (Six routers, one formulation)."""
from __future__ import annotations

import torch

from ..ops import sparse_simplex_projection
from ._harness import CheckFailed, checker, run_checks


@checker
def check_sparse_simplex_projection(student_fn, *, seed: int = 0, verbose: bool = True) -> bool:
    """Exercise 4.1: ``student_fn(y (n_rows, n), C)`` projects each row of ``y`` onto the sparse simplex
    ``{p >= 0, sum p = 1, ||p||_0 <= C}`` (Euclidean projection). Any answer that is feasible and as close
    to ``y`` as the reference is accepted, so ties at the C-th place may be broken either way."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    cases = [
        ("C >= n: the ordinary simplex projection", rand(3, 5), 5),
        ("C = 1: all the mass on the largest entry", rand(4, 6), 1),
        ("negative entries only", -rand(3, 6).abs() - 1, 2),
        ("a point of the sparse simplex stays where it is",
         torch.tensor([[0.0, 0.6, 0.0, 0.4], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64), 2),
        ("large entries: only differences matter", rand(3, 7) + 1e3, 3),
        ("entries far apart: some kept entries end at 0", torch.tensor([[3.0, 0.1, 0.0, -1.0, 0.05]],
                                                                       dtype=torch.float64), 3),
        ("ties at the C-th place", torch.tensor([[0.5, 0.2, 0.2, 0.1]], dtype=torch.float64), 2),
        ("a single row of length 1", rand(1, 1), 1),
    ]
    for i in range(12):
        n = int(torch.randint(2, 10, (1,), generator=gen))
        C = int(torch.randint(1, n + 1, (1,), generator=gen))
        scale = float(torch.tensor([0.1, 1.0, 5.0])[torch.randint(0, 3, (1,), generator=gen)])
        cases.append((f"random rows {i} (n={n}, C={C})", scale * rand(4, n), C))

    def make(y, C):
        def check():
            want = sparse_simplex_projection(y, C)
            got = torch.as_tensor(student_fn(y.clone(), C), dtype=torch.float64)
            if got.shape != y.shape:
                raise CheckFailed(f"expected shape {tuple(y.shape)}, got {tuple(got.shape)}")
            where = f"y=\n{y}\nC={C}: "
            if (got < -1e-12).any():
                raise CheckFailed(f"{where}negative entries in\n{got}")
            if not torch.allclose(got.sum(-1), torch.ones(y.shape[0], dtype=torch.float64), atol=1e-9):
                raise CheckFailed(f"{where}rows must sum to 1, got sums {got.sum(-1).tolist()}")
            if ((got.abs() > 1e-12).sum(-1) > C).any():
                raise CheckFailed(f"{where}more than C={C} nonzeros in a row of\n{got}")
            distance, best = (got - y).square().sum(-1), (want - y).square().sum(-1)
            if (distance > best + 1e-9).any():
                raise CheckFailed(f"{where}feasible but not the closest point: expected\n{want}\ngot\n{got}")
        return check

    return run_checks("sparse_simplex_projection", [(d, make(y, C)) for d, y, C in cases], verbose)
