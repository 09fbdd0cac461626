"""Checkers for chapter 7 (Probabilistic routing over expert subsets)."""
from __future__ import annotations

import itertools

import torch

from ..ops import ksubset_log_partition
from ._harness import CheckFailed, checker, assert_close, run_checks


def _chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square with ``df`` degrees of freedom: the regularised upper incomplete
    gamma function Q(df / 2, x / 2), in float64 (what ``scipy.stats.chi2.sf`` computes)."""
    if x <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


@checker
def check_ksubset_log_partition(student_fn, *, seed: int = 0, verbose: bool = True) -> bool:
    """Exercise 7.1: ``student_fn(logits (E,), k)`` returns ``log e_k(exp(logits))`` (a float or 0-d tensor)."""
    gen = torch.Generator().manual_seed(seed)
    cases = [("k = 1 is a log-sum-exp", torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64), 1),
             ("k = E is the sum of the logits", torch.tensor([0.3, -1.0, 2.0, 0.5], dtype=torch.float64), 4),
             ("16 logits at -100, k = 4 (a -300 sentinel fails)", torch.full((16,), -100.0, dtype=torch.float64), 4),
             ("logits of size 100", 100 * torch.randn(8, generator=gen, dtype=torch.float64), 3)]
    for i in range(15):
        E = int(torch.randint(1, 11, (1,), generator=gen))
        k = int(torch.randint(1, E + 1, (1,), generator=gen))
        cases.append((f"random instance {i} (E={E}, k={k})", 2 * torch.randn(E, generator=gen, dtype=torch.float64), k))

    def make(r, k):
        def check():
            want = ksubset_log_partition(r, k)
            assert_close(torch.as_tensor(student_fn(r.clone(), k), dtype=r.dtype).reshape(()), want,
                         f"logits={r}, k={k}: log e_k", atol=1e-8)
        return check

    return run_checks("ksubset_log_partition", [(d, make(r, k)) for d, r, k in cases], verbose)


@checker
def check_ksubset_sample(student_fn, *, draws: int = 20000, verbose: bool = True) -> bool:
    """Exercise 7.2: ``student_fn(logits (E,), k, generator)`` returns one bool mask (E,) with exactly k
    Trues, drawn from P(S) ∝ exp(sum_{j in S} logits_j). Each instance draws ``draws`` subsets and
    compares their frequencies with the exact probabilities by a chi-square test (p > 1e-4 to pass,
    so a correct sampler fails one instance in 10,000)."""
    instances = [("E=4, k=2", torch.tensor([0.3, -0.2, 1.0, 0.0], dtype=torch.float64), 2),
                 ("E=5, k=3", torch.tensor([1.5, 0.0, -1.0, 0.5, -0.5], dtype=torch.float64), 3),
                 ("E=4, k=1 (a softmax)", torch.tensor([2.0, 1.0, 0.0, -1.0], dtype=torch.float64), 1)]

    def make(r, k, seed):
        def check():
            gen = torch.Generator().manual_seed(seed)
            subsets = list(itertools.combinations(range(len(r)), k))
            weights = torch.stack([r[list(s)].sum() for s in subsets]).exp()
            probs = weights / weights.sum()
            counts = torch.zeros(len(subsets), dtype=torch.float64)
            index = {s: i for i, s in enumerate(subsets)}
            for _ in range(draws):
                z = torch.as_tensor(student_fn(r.clone(), k, gen)).bool()
                if z.shape != r.shape or int(z.sum()) != k:
                    raise CheckFailed(f"logits={r}, k={k}: got a mask with {int(z.sum())} Trues, shape {tuple(z.shape)}")
                counts[index[tuple(z.nonzero().flatten().tolist())]] += 1
            expected = draws * probs
            stat = float(((counts - expected) ** 2 / expected).sum())
            p = _chi2_sf(stat, len(subsets) - 1)
            if p < 1e-4:
                worst = int(((counts - expected).abs() / expected.sqrt()).argmax())
                raise CheckFailed(f"logits={r}, k={k}: frequencies do not match the law (chi-square p={p:.1e}); "
                                  f"subset {subsets[worst]}: {int(counts[worst])} draws, expected {expected[worst]:.0f}")
        return check

    return run_checks("ksubset_sample", [(d, make(r, k, i)) for i, (d, r, k) in enumerate(instances)], verbose)



