"""Checkers for chapter 2 (Routing as optimal transport)."""
from __future__ import annotations

import torch

from ..ops.sinkhorn import col_update, row_update
from ._harness import CheckFailed, checker, assert_close, run_checks


@checker
def check_sinkhorn_step(student_fn, *, seed: int = 0, verbose: bool = True) -> bool:
    """Exercise 2.1: one log-domain Sinkhorn iteration with eps = 1.

    ``student_fn(log_kernel (T, E), f (T,), g (E,), col_sums (E,))`` returns ``(f_new, g_new)``: first
    the row update ``f_new = -logsumexp_e(log_kernel + g)`` (rows of ``exp(log_kernel + f + g)`` sum to
    1), then the column update ``g_new = log(col_sums) - logsumexp_t(log_kernel + f_new)``.
    """
    gen = torch.Generator().manual_seed(seed)
    cases = [("one token, one expert", torch.tensor([[0.3]], dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
              torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)),
             ("large scores (needs logsumexp, not log(sum(exp)))",
              torch.tensor([[800.0, 0.0], [0.0, 900.0], [850.0, 850.0]], dtype=torch.float64),
              torch.zeros(3, dtype=torch.float64), torch.zeros(2, dtype=torch.float64),
              torch.full((2,), 1.5, dtype=torch.float64))]
    for i in range(20):
        T, E = int(torch.randint(1, 12, (1,), generator=gen)), int(torch.randint(1, 6, (1,), generator=gen))
        L = 3 * torch.randn(T, E, generator=gen, dtype=torch.float64)
        cases.append((f"random instance {i} (T={T}, E={E})", L, torch.randn(T, generator=gen, dtype=torch.float64),
                      torch.randn(E, generator=gen, dtype=torch.float64), torch.full((E,), T / E, dtype=torch.float64)))

    def make(L, f, g, b):
        def check():
            f_want = row_update(L[None], g[None], torch.zeros(1, L.shape[0], dtype=L.dtype))[0]
            g_want = col_update(L[None], f_want[None], b.log()[None])[0]
            out = student_fn(L.clone(), f.clone(), g.clone(), b.clone())
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                raise CheckFailed("return a pair (f_new, g_new)")
            assert_close(out[0], f_want, f"log_kernel=\n{L}\ng={g}: f_new")
            assert_close(out[1], g_want, f"log_kernel=\n{L}\ncol_sums={b}: g_new (use the *new* f)")
        return check

    return run_checks("sinkhorn_step", [(d, make(*args)) for d, *args in cases], verbose)


@checker
def check_two_by_two_plan(student_fn, *, seed: int = 0, verbose: bool = True) -> bool:
    """Exercise 2.2: the closed-form plan for two tokens, two experts, all marginals 1.

    ``student_fn(scores (2, 2), eps)`` returns the plan ``[[p, 1-p], [1-p, p]]`` with
    ``p = sigmoid((S11 + S22 - S12 - S21) / (2 eps))``; compared with the solver's plan.
    """
    from ..ops import sinkhorn

    gen = torch.Generator().manual_seed(seed)
    cases = [("indifferent scores", torch.zeros(2, 2, dtype=torch.float64), 1.0),
             ("diagonal preferred, small eps", torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64), 0.05),
             ("anti-diagonal preferred", torch.tensor([[0.0, 2.0], [1.0, 0.0]], dtype=torch.float64), 0.5)]
    for i in range(15):
        cases.append((f"random instance {i}", torch.randn(2, 2, generator=gen, dtype=torch.float64),
                      float(torch.rand((), generator=gen)) * 2 + 0.05))

    def make(S, eps):
        def check():
            want = sinkhorn(S, eps, col_sums=torch.ones(2, dtype=S.dtype), tol=1e-14, max_iter=100000)
            assert_close(student_fn(S.clone(), eps), want, f"scores=\n{S}\neps={eps}: plan", atol=1e-8)
        return check

    return run_checks("two_by_two_plan", [(d, make(S, e)) for d, S, e in cases], verbose)
