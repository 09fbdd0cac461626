"""Checkers for chapter 10 (Loss-free balancing is dual ascent)."""
from __future__ import annotations

import torch

from ..ops import bias_update, solve_selection_lp
from ._harness import CheckFailed, assert_close, checker, run_checks


@checker
def check_bias_update(student_fn, *, seed: int = 0, verbose: bool = True) -> bool:
    """Exercise 10.1: ``student_fn(bias (E,), loads (E,), rate, update)`` returns the new bias of
    eq. (eq-ch10-update): ``update="sign"`` or ``"proportional"`` (mean load 0: no change)."""
    gen = torch.Generator().manual_seed(seed)
    cases = [("balanced loads leave the bias alone (sign)", torch.zeros(4), torch.full((4,), 5.0), 0.1, "sign"),
             ("balanced loads leave the bias alone (proportional)", torch.ones(3), torch.full((3,), 2.0), 0.1,
              "proportional"),
             ("no tokens at all: no change", torch.randn(5, generator=gen), torch.zeros(5), 0.5, "proportional"),
             ("one overloaded expert (sign)", torch.zeros(4), torch.tensor([10.0, 2.0, 2.0, 2.0]), 1e-3, "sign"),
             ("the proportional step is relative to the mean", torch.zeros(2), torch.tensor([3.0, 1.0]), 1.0,
              "proportional")]
    for i in range(20):
        E = int(torch.randint(1, 10, (1,), generator=gen))
        loads = torch.randint(0, 20, (E,), generator=gen).float()
        update = ("sign", "proportional")[i % 2]
        cases.append((f"random instance {i} (E={E}, {update})", torch.randn(E, generator=gen), loads,
                      float(torch.rand((), generator=gen)), update))

    def make(bias, loads, rate, update):
        def check():
            got = student_fn(bias.clone(), loads.clone(), rate, update)
            want = bias_update(bias, loads, rate, update)
            assert_close(got, want, f"bias={bias.tolist()}, loads={loads.tolist()}, rate={rate:.4g}, "
                                    f"update={update!r}: new bias", atol=1e-6)
        return check

    return run_checks("bias_update", [(d, make(*c)) for d, *c in cases], verbose)


def _dual(S: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """D(b) of eq. (eq-ch10-dual): sum_t top_k(S_t + b) - (kT/E) sum_e b_e."""
    T, E = S.shape
    return (S + b).topk(k, dim=-1).values.sum() - k * T / E * b.sum()


@checker
def check_dual_function(student_fn, *, seed: int = 0, verbose: bool = True) -> bool:
    """Exercise 10.2: ``student_fn(scores (T, E), bias (E,), k)`` returns the dual function D(b) of
    the balanced selection LP (eq. eq-ch10-dual), a scalar. On small instances the checker also
    minimises your D by the loss-free update and compares the minimum with scipy's LP optimum."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for i, (T, E, k) in enumerate([(4, 2, 1), (6, 3, 1), (8, 4, 2), (12, 4, 3), (10, 5, 1), (16, 8, 2)]):
        S = torch.randn(T, E, generator=gen, dtype=torch.float64)
        cases.append((f"instance {i} (T={T}, E={E}, k={k}), zero bias", S, torch.zeros(E, dtype=torch.float64), k))
        cases.append((f"instance {i}, random bias", S, torch.randn(E, generator=gen, dtype=torch.float64), k))
    S = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    cases.append(("a constant shift of the bias changes nothing", S, torch.full((4,), 3.0, dtype=torch.float64), 2))

    def make(S, b, k):
        def check():
            got = torch.as_tensor(student_fn(S.clone(), b.clone(), k), dtype=torch.float64)
            assert_close(got.reshape(()), _dual(S, b, k), f"scores=\n{S}\nbias={b.tolist()}, k={k}: D(b)", atol=1e-9)
        return check

    def weak_duality():
        S = torch.randn(8, 4, generator=gen, dtype=torch.float64)
        best = solve_selection_lp(S, per_token=2, per_expert=4).objective
        for _ in range(10):
            b = torch.randn(4, generator=gen, dtype=torch.float64)
            value = float(student_fn(S.clone(), b, 2))
            if value < best - 1e-9:
                raise CheckFailed(f"D(b) = {value:.6f} is below the LP optimum {best:.6f}: weak duality fails")

    checks = [(d, make(*c)) for d, *c in cases] + [("D(b) is never below the LP optimum", weak_duality)]
    return run_checks("dual_function", checks, verbose)
