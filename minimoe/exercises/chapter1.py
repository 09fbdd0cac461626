"""Checkers for chapter 1 (The MoE layer and its routers)."""
from __future__ import annotations


import torch

from ..ops import compute_capacity, token_choice_allocation
from ._harness import CheckFailed, checker, run_checks


def _as_position(result, T: int, E: int) -> torch.Tensor:
    result = torch.as_tensor(result)
    if result.shape == (T, E):
        return result.long()
    raise CheckFailed(f"expected a slot table of shape ({T}, {E}), got shape {tuple(result.shape)}")


@checker
def check_token_choice_allocation(student_fn, *, seed: int = 0, n_random: int = 60, verbose: bool = True) -> bool:
    """Exercise 1.2: implement Algorithm 1 (token choice) for one group.

    ``student_fn(scores, k, capacity)`` takes ``scores (T, E)``, ``k`` and ``capacity`` and returns
    the slot table ``position (T, E)``: the slot of token t in expert e's buffer, or -1. Compared with
    :func:`minimoe.ops.token_choice_allocation` on hand-made edge cases and random instances.
    """
    gen = torch.Generator().manual_seed(seed)
    cases = [
        ("one token, one expert", torch.tensor([[1.0]]), 1, 1),
        ("second choice loses to a later first choice", torch.tensor([[0.6, 0.4, 0.0], [0.1, 0.8, 0.1]]), 2, 1),
        ("everyone wants expert 0", torch.tensor([[0.9, 0.1]] * 5), 1, 2),
        ("capacity >= tokens: nothing dropped", torch.rand(6, 3, generator=gen), 2, 6),
    ]
    for i in range(n_random):
        T = int(torch.randint(1, 30, (1,), generator=gen))
        E = int(torch.randint(1, 8, (1,), generator=gen))
        k = int(torch.randint(1, E + 1, (1,), generator=gen))
        C = int(torch.randint(1, T + 1, (1,), generator=gen))
        cases.append((f"random instance {i} (T={T}, E={E}, k={k}, capacity={C})",
                      torch.softmax(torch.randn(T, E, generator=gen), -1), k, C))

    def make(scores, k, C):
        def check():
            want = token_choice_allocation(scores, k, C)
            got = _as_position(student_fn(scores.clone(), k, C), *scores.shape)
            if not torch.equal(got, want):
                t, e = (got != want).nonzero()[0].tolist()
                raise CheckFailed(f"scores=\n{scores}\nk={k}, capacity={C}: position[{t}, {e}] should be "
                                  f"{int(want[t, e])}, got {int(got[t, e])}\nexpected=\n{want}\ngot=\n{got}")
        return check

    return run_checks("token_choice_allocation", [(d, make(s, k, C)) for d, s, k, C in cases], verbose)


@checker
def check_capacity(student_fn, *, verbose: bool = True) -> bool:
    """Exercise 1.1: ``student_fn(tokens, experts, capacity_factor)`` returns
    ``round_half_up(capacity_factor * tokens / experts)``, capped at ``tokens``, and raises
    ``ValueError`` when that is below 1."""
    cases = []
    for tokens, experts, factor in [(196, 32, 1.0), (49, 32, 2.0), (10, 4, 1.0), (18, 4, 1.0), (16, 2, 4.0),
                                    (8192, 64, 2.0), (7, 7, 1.0), (3, 2, 1.0)]:
        def check(tokens=tokens, experts=experts, factor=factor):
            want = compute_capacity(tokens, experts, factor)
            got = student_fn(tokens, experts, factor)
            if got != want:
                hint = " (Python's round() rounds halves to even; use floor(x + 0.5))" if got == round(
                    factor * tokens / experts) else ""
                raise CheckFailed(f"tokens={tokens}, experts={experts}, capacity_factor={factor}: "
                                  f"expected {want}, got {got}{hint}")
        cases.append((f"tokens={tokens}, experts={experts}, factor={factor}", check))

    def raises():
        try:
            got = student_fn(10, 64, 1.0)
        except ValueError:
            return
        raise CheckFailed(f"tokens=10, experts=64, capacity_factor=1.0 gives {10 / 64:.3f} slots, which rounds to "
                          f"0: expected a ValueError, got {got}")
    cases.append(("too few tokens per expert raises ValueError", raises))
    return run_checks("capacity", cases, verbose)
