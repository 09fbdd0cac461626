"""Exact answers for small problems, and the papers' pseudocode as printed: the oracles that the
tests, the notebooks and a reader's own checks share (one copy of each).

Nothing here is fast; every function is written to be read against its chapter.

* chapter 5 (Kool et al.): every outcome of independent sampling followed by uniform skipping
  (`skip_outcomes`), the coupled losses that break separability (`coupled_losses`,
  `coupled_true_gradient`), the maximum-entropy distribution with given marginals
  (`fit_max_entropy`);
* chapter 6 (USMoE): a counted binary-heap selection (`heap_top`, Proposition 6.9(b));
* chapter 7 (ProbMoE): the appendix's `PrUpToK`, `MarginalsBand` and `CompileExactlyK` as printed and
  corrected (`pr_up_to_k`, `marginals_band`, `compile_exactly_k`, `circuit_upward`), see the errata.
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

__all__ = ["skip_outcomes", "coupled_losses", "coupled_true_gradient", "fit_max_entropy", "heap_top",
           "LOG_ZERO", "pr_up_to_k", "marginals_band", "compile_exactly_k", "circuit_upward"]


# --------------------------------------------------------------------------- chapter 5

def skip_outcomes(theta: torch.Tensor, capacity: int, tau: float = 1.0):
    """Every (z, kept set) of independent sampling from softmax(theta / tau) followed by keeping a
    uniformly random min(n_j, capacity) of each expert's tokens, with its probability.

    theta (n, k). Returns z (M, n) long, keep (M, n) bool, probs (M,) summing to 1, and the proposal's
    log-probabilities log_q (n, k). M grows like k^n: for n up to about 8."""
    n, k = theta.shape
    log_q = torch.log_softmax(theta / tau, -1)
    zs, keeps, probs = [], [], []
    for z in itertools.product(range(k), repeat=n):
        prob_z = math.exp(sum(float(log_q[i, z[i]]) for i in range(n)))
        groups = [[i for i in range(n) if z[i] == j] for j in range(k)]
        kept_sets = list(itertools.product(*[itertools.combinations(g, min(len(g), capacity)) for g in groups]))
        for kept in kept_sets:
            keep = torch.zeros(n, dtype=torch.bool)
            keep[[i for part in kept for i in part]] = True
            zs.append(z)
            keeps.append(keep)
            probs.append(prob_z / len(kept_sets))
    return torch.tensor(zs), torch.stack(keeps), torch.tensor(probs, dtype=theta.dtype), log_q


def coupled_losses(base: torch.Tensor, cross: torch.Tensor, gamma: float, z: torch.Tensor) -> torch.Tensor:
    """f_i(z) = base[i, z_i] + gamma * cross[i, z_{i+1 mod n}]: token i's loss also depends on the
    expert of the next token (a stand-in for attention after the MoE layer). z (..., n)."""
    rows = torch.arange(base.shape[0])
    return base[rows, z] + gamma * cross[rows, z.roll(-1, -1)]


def coupled_true_gradient(theta, base, cross, gamma) -> torch.Tensor:
    """Autograd of E_{z ~ prod softmax(theta)}[1/n sum_i f_i(z)], written out over all k^n z."""
    n, k = theta.shape
    Z = torch.tensor(list(itertools.product(range(k), repeat=n)))
    x = theta.clone().requires_grad_(True)
    log_prob = torch.log_softmax(x, -1)[torch.arange(n), Z].sum(-1)
    (grad,) = torch.autograd.grad((log_prob.exp() * coupled_losses(base, cross, gamma, Z).mean(-1)).sum(), x)
    return grad


def fit_max_entropy(P: torch.Tensor, onehot: torch.Tensor, iterations: int = 100, tol: float = 1e-13):
    """The maximum-entropy distribution on a listed set of assignments with marginals P (n, k).

    onehot (M, n, k) lists the assignments. Newton on the convex dual
    F(lambda) = logsumexp_z <z, lambda> - <lambda, P>, whose gradient is the Gibbs marginals minus P
    and whose Hessian is the covariance of z; the pseudo-inverse ignores the gauge directions
    lambda_ij + rho_i + kappa_j, and a backtracking line search guards the step. Returns the
    potentials lambda (n, k), the distribution alpha (M,) and the largest marginal error."""
    Zf = onehot.reshape(len(onehot), -1)
    target = P.reshape(-1)
    lam = torch.zeros_like(target)

    def value(lam):
        return float(torch.logsumexp(Zf @ lam, 0) - lam @ target)

    for _ in range(iterations):
        w = torch.softmax(Zf @ lam, 0)
        mu = w @ Zf
        grad = mu - target
        if grad.abs().max() < tol:
            break
        hessian = Zf.T @ (w[:, None] * Zf) - torch.outer(mu, mu)
        step = torch.linalg.pinv(hessian, hermitian=True, rtol=1e-10) @ grad
        t = 1.0
        while value(lam - t * step) > value(lam) - 0.25 * t * float(grad @ step) and t > 1e-8:
            t /= 2
        lam = lam - t * step
    alpha = torch.softmax(Zf @ lam, 0)
    return lam.reshape(P.shape), alpha, float((alpha @ Zf - target).abs().max())


# --------------------------------------------------------------------------- chapter 6

def heap_top(values, n: int):
    """Indices of the n largest of ``values`` with a binary min-heap of size n, and the number of
    comparisons it made (each ``less`` call is one)."""
    count = 0

    def less(a, b):
        nonlocal count
        count += 1
        return values[a] < values[b]

    heap = list(range(n))

    def sift_down(i):
        while 2 * i + 1 < n:
            child = 2 * i + 1
            if child + 1 < n and less(heap[child + 1], heap[child]):
                child += 1
            if not less(heap[child], heap[i]):
                return
            heap[i], heap[child] = heap[child], heap[i]
            i = child

    for i in reversed(range(n // 2)):
        sift_down(i)
    for j in range(n, len(values)):
        if less(heap[0], j):
            heap[0] = j
            sift_down(0)
    return set(heap), count


# --------------------------------------------------------------------------- chapter 7

LOG_ZERO = -1e30  # log 0 in the pseudocode's tables: finite, so that autograd through a table has no NaN


def pr_up_to_k(log_p: torch.Tensor, log_q: torch.Tensor, k_max: int, literal: bool) -> torch.Tensor:
    """ProbMoE's PrUpToK: a[i, j] = logaddexp(a[i-1, j-1] + log p_i, a[i-1, j] + log q_i), rows
    i = 0..n. literal=True reads a[i-1, j-1] at j = 0 as printed (index -1: the last column, in
    PyTorch as in NumPy); literal=False treats it as log 0."""
    neg = torch.tensor(LOG_ZERO, dtype=log_p.dtype)
    a = [torch.tensor([0.0] + [LOG_ZERO] * k_max, dtype=log_p.dtype)]
    for i in range(1, len(log_p) + 1):
        take = [a[i - 1][j - 1] if (literal or j > 0) else neg for j in range(k_max + 1)]
        a.append(torch.logaddexp(torch.stack(take) + log_p[i - 1], a[i - 1] + log_q[i - 1]))
    return torch.stack(a)


def marginals_band(r: torch.Tensor, k_min: int, k_max: int, stop_gradient: bool) -> torch.Tensor:
    """ProbMoE's MarginalsBand: log q = log(1 - exp(log p)), L = logsumexp_{c in [k_min, k_max]} a[n, c],
    mu = grad of L in log p. As printed (stop_gradient=False) log q is a function of log p."""
    log_p = F.logsigmoid(r).detach().requires_grad_(True)
    log_q = torch.log1p(-torch.exp(log_p))
    if stop_gradient:
        log_q = log_q.detach()
    a = pr_up_to_k(log_p, log_q, k_max, literal=False)
    return torch.autograd.grad(torch.logsumexp(a[-1, k_min:k_max + 1], 0), log_p)[0]


def compile_exactly_k(n: int, k: int, corrected: bool):
    """ProbMoE's CompileExactlyK (Algorithm 6). Nodes are tuples: ("+", i) / ("-", i) literals,
    ("or", ((prime, sub), ...)) decisions, hash-consed in `unique`. As printed, the elements pair
    dp_prev[2i][j'] with dp_prev[2i+1][j - j'] for every 0 <= j' <= j (an IndexError once k >= 2);
    corrected, only counts the two child blocks can hold. Returns the root and `unique`."""
    unique = {}
    dp_prev = [[("-", i), ("+", i)] for i in range(n)]
    m = n
    while m > 1:
        m //= 2
        dp_curr = []
        for i in range(m):
            left, right = dp_prev[2 * i], dp_prev[2 * i + 1]
            row = []
            for j in range(min(k, n // m) + 1):
                lo, hi = (max(0, j - len(right) + 1), min(j, len(left) - 1)) if corrected else (0, j)
                elements = tuple((left[jp], right[j - jp]) for jp in range(lo, hi + 1))
                row.append(unique.setdefault(("or", elements), ("or", elements)))
            dp_curr.append(row)
        dp_prev = dp_curr
    return dp_prev[0][k], unique


def circuit_upward(node, log_p, log_q, cache=None):
    """CircuitUpward: literals get log p_i / log q_i; a decision node is the logsumexp of prime + sub."""
    cache = {} if cache is None else cache
    if node[0] in "+-":
        return (log_p if node[0] == "+" else log_q)[node[1]]
    key = id(node)
    if key not in cache:
        cache[key] = torch.logsumexp(torch.stack([circuit_upward(p, log_p, log_q, cache)
                                                  + circuit_upward(s, log_p, log_q, cache)
                                                  for p, s in node[1]]), 0)
    return cache[key]
