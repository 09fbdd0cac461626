"""Checkers for chapter 9 (What the routers teach us): a paired interval, and Holm's correction."""
from __future__ import annotations

import math
import random

import torch

from ..experiments import stats
from ._harness import CheckFailed, checker, run_checks


@checker
def check_paired_interval(student_fn, *, seed: int = 0, verbose: bool = True) -> bool:
    """Exercise 9.5: ``student_fn(a, b)`` takes two routers' results on the same seeds (lists of
    floats, seed by seed) and returns ``(mean, low, high)``: the mean of ``a - b`` and its 95%
    Student-t interval, eq. (eq-ch9-interval). Checked against :func:`minimoe.experiments.stats.paired`,
    on two seeds (one degree of freedom) up to twenty, and on data whose seed effect an unpaired
    interval would not remove."""
    rng = random.Random(seed)
    cases = [("two seeds: one degree of freedom, t = 12.71", [1.0, 2.0], [0.8, 1.9]),
             ("a shared seed effect cancels: the interval is narrow", [10.0, 20.0, 30.0, 40.0],
              [9.0 + 0.01, 19.0 - 0.01, 29.0 + 0.02, 39.0 - 0.02]),
             ("equal results on every seed: a zero-width interval", [0.5, 0.7, 0.9], [0.5, 0.7, 0.9])]
    for i, n in enumerate((3, 5, 8, 8, 20)):
        base = [rng.gauss(0, 1) for _ in range(n)]
        cases.append((f"random instance {i} ({n} seeds)", [x + rng.gauss(0.2, 0.3) for x in base], base))

    def make(a, b):
        def check():
            got = student_fn(list(a), list(b))
            if not isinstance(got, (tuple, list)) or len(got) != 3:
                raise CheckFailed(f"a={a}, b={b}: return (mean, low, high), got {got!r}")
            want = stats.paired(a, b)
            for name, g, w in zip(("mean", "low", "high"), got, (want.mean, want.low, want.high)):
                if not math.isclose(float(g), w, rel_tol=1e-6, abs_tol=1e-9):
                    hint = ("; did you pair the seeds (t on the differences, n - 1 degrees of freedom)?"
                            if name != "mean" else "")
                    raise CheckFailed(f"a={[round(x, 4) for x in a]}, b={[round(x, 4) for x in b]}: {name} "
                                      f"should be {w:.6g}, got {float(g):.6g}{hint}")
        return check

    return run_checks("paired_interval", [(d, make(a, b)) for d, a, b in cases], verbose)


@checker
def check_holm(student_fn, *, seed: int = 0, verbose: bool = True) -> bool:
    """Exercise 9.6: ``student_fn(p_values)`` returns Holm's adjusted p-values in the input order:
    sort, multiply the i-th smallest by (m - i + 1), carry the running maximum, cap at 1. Checked
    against :func:`minimoe.experiments.stats.holm`, with ties, values that cap at 1, and an
    unsorted input."""
    gen = torch.Generator().manual_seed(seed)
    cases = [("one test: unchanged", [0.03]),
             ("already sorted", [0.001, 0.01, 0.02, 0.04]),
             ("unsorted: the answer keeps the input order", [0.04, 0.001, 0.3, 0.01]),
             ("the running maximum: a later smaller product is raised", [0.01, 0.011, 0.012]),
             ("large p-values cap at 1", [0.5, 0.6, 0.9]),
             ("ties", [0.02, 0.02, 0.02, 0.5])]
    for i in range(10):
        m = int(torch.randint(2, 15, (1,), generator=gen))
        cases.append((f"random family {i} ({m} tests)", (torch.rand(m, generator=gen) ** 3).tolist()))

    def make(p):
        def check():
            got = [float(x) for x in student_fn(list(p))]
            want = stats.holm(p)
            if len(got) != len(want) or any(not math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-12)
                                            for g, w in zip(got, want)):
                raise CheckFailed(f"p={[round(x, 4) for x in p]}: expected {[round(x, 4) for x in want]}, "
                                  f"got {[round(x, 4) for x in got]}")
        return check

    return run_checks("holm", [(d, make(p)) for d, p in cases], verbose)
