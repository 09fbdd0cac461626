"""Checkers for chapter 8 (Expert parallelism)."""
from __future__ import annotations

import torch

from ..parallel.analysis import expected_overflow, send_counts
from ._harness import CheckFailed, checker, assert_close, run_checks


@checker
def check_send_counts(student_fn, *, seed: int = 0, verbose: bool = True) -> bool:
    """Exercise 8.1: ``student_fn(position, world_size)`` takes a slot table ``position (..., T, E)``
    (``-1``: not dispatched) and returns the ``(world_size,)`` numbers of (token, expert) pairs sent to
    each rank when rank ``r`` holds experts ``r*E/W, ..., (r+1)*E/W - 1``."""
    gen = torch.Generator().manual_seed(seed)
    cases = [
        ("nothing dispatched", torch.full((5, 4), -1), 2),
        ("one rank holds everything", torch.randint(-1, 2, (6, 4), generator=gen), 1),
        ("one expert per rank", torch.randint(-1, 2, (6, 4), generator=gen), 4),
        ("a token sent to two experts on the same rank counts twice", torch.tensor([[0, 0, -1, -1]]), 2),
        ("experts are split in contiguous blocks, not round-robin",
         torch.tensor([[0, -1, -1, -1, -1, -1], [-1, 0, -1, -1, -1, -1], [-1, -1, -1, 0, -1, -1]]), 2),
    ]
    for i in range(12):
        W = [1, 2, 4][i % 3]
        E = W * int(torch.randint(1, 4, (1,), generator=gen))
        G, T = (int(v) for v in torch.randint(1, 5, (2,), generator=gen))
        position = torch.where(torch.rand(G, T, E, generator=gen) < 0.5,
                               torch.randint(0, T, (G, T, E), generator=gen), -1)
        cases.append((f"random routing {i} (groups={G}, T={T}, E={E}, W={W})", position, W))

    def make(position, W):
        def check():
            want = send_counts(position, W)
            got = torch.as_tensor(student_fn(position.clone(), W))
            if got.shape != want.shape:
                raise CheckFailed(f"expected shape {tuple(want.shape)}, got {tuple(got.shape)}")
            if not torch.equal(got.long(), want):
                raise CheckFailed(f"position=\n{position}\nworld_size={W}: expected {want.tolist()}, "
                                  f"got {got.tolist()}")
        return check

    return run_checks("send_counts", [(d, make(p, W)) for d, p, W in cases], verbose)


@checker
def check_expected_overflow(student_fn, *, verbose: bool = True) -> bool:
    """Exercise 8.2: ``student_fn(tokens, experts, capacity)`` returns the expected share of the
    ``tokens`` requests that are dropped when every token of a group picks one of ``experts`` experts
    uniformly at random and each expert keeps at most ``capacity`` of them (exact, not approximate)."""
    cases = [(1, 1, 1), (4, 2, 2), (5, 3, 1), (8, 8, 1), (10, 2, 10), (32, 8, 4), (256, 8, 32), (256, 8, 40),
             (1000, 16, 70)]

    def make(T, E, C):
        def check():
            want = torch.tensor(expected_overflow(T, E, C)[0], dtype=torch.float64)
            assert_close(float(student_fn(T, E, C)), want, f"tokens={T}, experts={E}, capacity={C}", atol=1e-10)
        return check

    return run_checks("expected_overflow", [(f"T={T}, E={E}, C={C}", make(T, E, C)) for T, E, C in cases], verbose)
