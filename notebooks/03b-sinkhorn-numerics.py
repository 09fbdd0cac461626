# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Sinkhorn's numerics: convergence, the log domain, and gradients
#
# Companion to chapter 2 (Routing as optimal transport), after {doc}`03-sinkhorn-from-scratch`. That
# notebook wrote Sinkhorn in ten lines and looked at what its plans are. This one looks at how a
# solver gets there, and at what it costs: how fast the iterations converge and how much
# over-relaxation and Newton's method on the semi-dual buy, why float32 needs the log domain, and
# how the value and the plan are differentiated.
#
# **You will learn to**
#
# 1. measure Sinkhorn's linear rate and put it beside the Birkhoff bound, and compare `minimoe`'s
#    three solvers at a realistic size;
# 2. predict the rate of over-relaxed Sinkhorn from one singular value (Young's formula);
# 3. check the semi-dual's gradient and Hessian against autograd and watch Newton's method square
#    the error;
# 4. see the exp-domain iteration overflow in float32, and a continuation in $\varepsilon$ succeed
#    where a cold start fails;
# 5. verify strong duality, the envelope identity and the implicit gradient of the plan.
#
# *Prerequisites:* {doc}`03-sinkhorn-from-scratch` (the ten-line loop and the closed form of the
# plan); chapter 2, {ref}`ch2-duality`, {ref}`ch2-sinkhorn` (with its log domain, rate,
# over-relaxation and semi-dual) and {ref}`ch2-implicit`.
#
# *Run time:* under 10 seconds at CPU scale on a 2-core laptop CPU, the default. `MINIMOE_SCALE=gpu` chooses
# the larger configuration, for a GPU: the solver table uses 16,384 tokens and 64 experts instead of 2,048 and
# 32, about 16 times the arithmetic per Sinkhorn iteration; nothing else changes.

# %%
# Install minimoe when it is missing (e.g. on Colab).
import importlib.util
import subprocess
import sys

if importlib.util.find_spec("minimoe") is None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                           "minimoe[book] @ git+https://github.com/minimoe-book/minimoe"])

# %%
import math
import os
import time
import warnings

import matplotlib.pyplot as plt
import numpy as np
import torch

import minimoe
from minimoe.ops import linear_assignment, sinkhorn

SCALE = os.environ.get("MINIMOE_SCALE", "cpu")  # "gpu" runs the larger configuration: chosen, never automatic
DEVICE = "cuda" if SCALE == "gpu" else "cpu"
if SCALE == "cpu":
    torch.set_num_threads(1)  # the problems here are small; extra threads mostly wait on each other
torch.manual_seed(0)
print(f"SCALE={SCALE}, device={DEVICE}, minimoe {minimoe.__version__}, torch {torch.__version__}")

# %% [markdown]
# (nb03b-loop)=
# ## The loop again, with an over-relaxation factor
#
# The loop of {doc}`03-sinkhorn-from-scratch`, rows summing to $1$ and columns to $T/E$, in the log
# domain, with one change that the section on over-relaxation needs: each update moves the potential
# only part of the way, or past it, $f \leftarrow (1-\omega) f + \omega f^{\text{exact}}$, and the same for $g$. At
# $\omega = 1$ it is plain Sinkhorn. It returns the relative marginal error after every iteration
# (rows and columns; after a column update at $\omega = 1$ only the rows are off).

# %%
def sinkhorn_errors(S, eps, omega=1.0, max_iter=5000, tol=1e-10):
    """Log-domain Sinkhorn (rows sum to 1, columns to T/E), updates over-relaxed by omega.
    Returns the relative marginal error after every iteration."""
    T, E = S.shape
    L, log_b = S / eps, math.log(T / E)
    f, g = torch.zeros(T, dtype=S.dtype), torch.zeros(E, dtype=S.dtype)
    errors = []
    for _ in range(max_iter):
        f = (1 - omega) * f + omega * -torch.logsumexp(L + g, dim=1)                 # rows
        g = (1 - omega) * g + omega * (log_b - torch.logsumexp(L + f[:, None], dim=0))  # columns
        P = (L + f[:, None] + g).exp()
        errors.append(max((P.sum(1) - 1).abs().max().item(), ((P.sum(0) - T / E).abs() / (T / E)).max().item()))
        if errors[-1] <= tol:
            break
    return errors


# %% [markdown]
# (nb03-convergence)=
# ## How fast Sinkhorn converges
#
# `sinkhorn_errors` records the relative marginal error after every iteration. We run it on a larger
# problem (256 tokens, 8 experts, standard normal logits with a popularity offset) for several
# $\varepsilon$, down to an error of $10^{-10}$. Chapter 2 bounds the linear rate by
# $\kappa^2 = \tanh^2(\Delta/4)$, where $\Delta$ is the largest log cross-ratio of the kernel; we
# compare the measured rate per iteration with that bound.

# %%
def kappa_squared(S, eps):
    """tanh(Delta / 4)^2 with Delta = max_{i,j,k,l} (S_ik - S_il + S_jl - S_jk) / eps."""
    D = S[:, :, None] - S[:, None, :]  # D[i, k, l] = S_ik - S_il
    delta = (D.amax(0) - D.amin(0)).max().item() / eps
    return math.tanh(delta / 4) ** 2


torch.manual_seed(1)
T1, E1 = 256, 8
popularity = torch.tensor([2.0, 1.0, 0.5, 0.0, 0.0, -0.5, -1.0, -2.0], dtype=torch.float64)
S1 = torch.randn(T1, E1, dtype=torch.float64) + popularity
EPS_CONV = [1.0, 0.3, 0.1, 0.05]
curves = {}
print(f"{'eps':>5s} {'iterations':>10s} {'rate/iter':>10s} {'kappa^2 bound':>14s}")
for eps in EPS_CONV:
    errs = sinkhorn_errors(S1, eps, max_iter=20_000, tol=1e-10)
    curves[eps] = errs
    half = len(errs) // 2
    rate = (errs[-1] / errs[half]) ** (1 / (len(errs) - 1 - half))
    bound = kappa_squared(S1, eps)
    print(f"{eps:5g} {len(errs):10d} {rate:10.4f} {bound:14.10f}")
    assert errs[-1] <= 1e-10, "converged to 1e-10"
    assert rate <= bound + 1e-12, "measured linear rate is within the Birkhoff bound"
counts = [len(curves[eps]) for eps in EPS_CONV]
assert counts == sorted(counts), "smaller eps needs more iterations"

fig, ax = plt.subplots(figsize=(6, 3.8))
for eps in EPS_CONV:
    ax.plot(range(1, len(curves[eps]) + 1), curves[eps], label=f"$\\varepsilon$ = {eps:g}")
ax.set_yscale("log")
ax.set_xscale("log")
ax.set_xlabel("iteration")
ax.set_ylabel("relative marginal error")
ax.set_title(f"Our log-domain Sinkhorn, T={T1}, E={E1}")
ax.legend()
plt.show()

# %% [markdown]
# The error falls geometrically, at a rate that gets worse quickly as $\varepsilon$ shrinks. The
# Birkhoff bound holds but is nearly 1 here, so it says little: the measured rates are much
# better. Now `minimoe`'s three solvers at a realistic size, in float32 with the default
# tolerance $10^{-4}$: `"log"` (the same loop as ours), `"sinkhorn"` (exp-domain iterations with
# absorption) and `"auto"` (those iterations over-relaxed, then Newton's method on the semi-dual
# when even they are slow). The iteration column counts Sinkhorn iterations plus Newton steps, and
# a Newton step costs much more than an iteration. Times are the best of three runs and vary from machine to
# machine. With `SCALE == "gpu"` this table uses 16384 tokens and 64 experts on the GPU; the other
# sections are small float64 checks that run on the CPU at either scale.

# %%
torch.manual_seed(2)
T2, E2 = (2048, 32) if SCALE == "cpu" else (16384, 64)
S2 = (torch.randn(T2, E2) + torch.linspace(1.5, -1.5, E2)).to(DEVICE)


def timed(fn, *args, repeats=3, **kwargs):
    best = float("inf")
    for _ in range(repeats):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return out, best * 1e3


table = []
for eps in [1.0, 0.1, 0.01]:
    reference = sinkhorn(S2.double(), eps, tol=1e-10, max_iter=20_000)  # float64, tight tolerance
    for m in ["log", "sinkhorn", "auto"]:
        res, ms = timed(sinkhorn, S2, eps, method=m, max_iter=5000, return_potentials=True)
        dev = (res.plan.double() - reference).abs().max().item()
        table.append((eps, m, res.iterations, res.error, dev, ms))
print(f"T={T2}, E={E2}, float32 on {DEVICE}, tol=1e-4")
print(f"{'eps':>5s} {'method':>9s} {'iterations':>10s} {'error':>9s} {'max|P-P64|':>10s} {'ms':>8s}")
for eps, m, it, err, dev, ms in table:
    print(f"{eps:5g} {m:>9s} {it:10d} {err:9.1e} {dev:10.1e} {ms:8.1f}")
    # tol=1e-4, up to float32 rounding: at eps=0.01 the log-kernel S/eps is in the hundreds, where
    # float32 numbers are 3e-5 apart, so the solver's own error estimate is that coarse
    assert err <= 1.5e-4, "every method meets tol (up to float32 rounding)"
    assert dev < 1e-2, "and is within 1e-2 of the float64 plan"

# %% [markdown]
# All three reach the tolerance (the log-domain solver can overshoot it slightly in float32 at
# $\varepsilon = 0.01$: its stopping test subtracts log-sum-exps in the hundreds, whose float32
# spacing is $3\times10^{-5}$). The column `max|P-P64|` compares each plan with a float64 plan
# solved to $10^{-10}$: at small $\varepsilon$ a marginal error of $10^{-4}$ still leaves plan
# entries off by about $10^{-3}$, because the plan is then sensitive to small changes of the
# potentials. The exp-domain iterations cost much less than log-sum-exps. Where plain Sinkhorn
# needs many iterations, `"auto"` needs several times fewer: that is over-relaxation, the subject of
# the next section. The benchmarks (`python -m benchmarks`) time all three against POT.

# %% [markdown]
# (nb03-overrelax)=
# ## Over-relaxation: Young's formula, measured
#
# Chapter 2 ({ref}`ch2-overrelax`) linearises Sinkhorn at the solution and finds a Gauss–Seidel
# iteration. Successive over-relaxation theory then predicts the contraction per iteration of
# $f \leftarrow (1-\omega) f + \omega f^{\text{exact}}$ (and the same for $g$) from a single
# number, the second singular value $\mu$ of $\mathrm{diag}(a)^{-1/2} P^\star \mathrm{diag}(b)^{-1/2}$:
# $\mu^2$ at $\omega = 1$, the best rate $\omega^\star - 1$ at
# $\omega^\star = 2/(1+\sqrt{1-\mu^2})$, and $\omega - 1$ beyond. We measure the rate for a sweep of
# $\omega$ on a small float64 problem and draw the prediction over it.

# %%
torch.manual_seed(21)
Tr, Er, eps_r = 80, 6, 0.1
Sr = 2 * torch.randn(Tr, Er, dtype=torch.float64)
ar, br = torch.ones(Tr, dtype=torch.float64), torch.full((Er,), Tr / Er, dtype=torch.float64)
Pr = sinkhorn(Sr, eps_r, tol=1e-14, max_iter=100_000)  # the solution, to float64 precision
mu = torch.linalg.svdvals(Pr / ar.sqrt()[:, None] / br.sqrt())[1].item()
omega_star = 2 / (1 + math.sqrt(1 - mu**2))


def relaxed_rate(omega):
    errors = sinkhorn_errors(Sr, eps_r, omega)
    start = next(i for i, e in enumerate(errors) if e < 1e-6)  # the asymptotic regime
    return (errors[-1] / errors[start]) ** (1 / (len(errors) - 1 - start)), len(errors)


def young_rate(omega):
    if omega >= omega_star:
        return omega - 1
    x = omega * mu / 2 + math.sqrt((omega * mu / 2) ** 2 - (omega - 1))
    return x * x


# %%
omegas = np.linspace(1.0, 1.9, 19)
measured = [relaxed_rate(w) for w in omegas]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
grid = np.linspace(1.0, 1.9, 200)
ax1.plot(grid, [young_rate(w) for w in grid], label="Young's SOR formula")
ax1.plot(omegas, [r for r, _ in measured], "o", label="measured")
ax1.axvline(omega_star, color="gray", ls=":", label=f"$\\omega^\\star$ = {omega_star:.3f}")
ax1.set_xlabel("over-relaxation factor $\\omega$")
ax1.set_ylabel("contraction of the marginal error per iteration")
ax1.set_title(f"Rate vs $\\omega$ (T={Tr}, E={Er}, $\\varepsilon$={eps_r}, $\\mu^2$={mu**2:.3f})")
ax1.legend()
ax2.plot(omegas, [n for _, n in measured], "o-")
ax2.set_xlabel("over-relaxation factor $\\omega$")
ax2.set_ylabel("iterations to a marginal error of $10^{-10}$")
ax2.set_title("Iterations vs $\\omega$")
plt.tight_layout()
plt.show()
worst = max(abs(r - young_rate(w)) for w, (r, _) in zip(omegas, measured))
print(f"mu^2 = {mu**2:.4f}, omega* = {omega_star:.4f}; largest |measured - predicted| rate: {worst:.1e}")
print(f"iterations: {measured[0][1]} at omega = 1, {relaxed_rate(omega_star)[1]} at omega*")
assert worst < 1e-2, "Young's formula predicts the measured rates"

# %% [markdown]
# The measured rates sit on Young's curve. The best factor cuts the iteration count several times
# over, and past $\omega^\star$ the rate is exactly $\omega - 1$, which gets worse again. In practice
# $\mu$ is not known in advance, but plain Sinkhorn's measured rate *is* $\mu^2$. So `"auto"` runs two
# checks of plain iterations, sets $\omega = \min(1.8, \omega^\star)$ from the rate it measured, and
# falls back to $\omega = 1$ if the error ever grows between two checks.

# %% [markdown]
# (nb03-semidual)=
# ## The semi-dual and Newton's method
#
# Proposition 2.6 gives the gradient and Hessian of the semi-dual
# $\tilde\Psi(g) = \varepsilon\sum_i \mathrm{LSE}_j\big((S_{ij} + g_j)/\varepsilon\big) - \langle b, g\rangle$
# (here $a = \mathbf 1$): $\nabla\tilde\Psi = P(g)^\top\mathbf 1 - b$ and
# $\nabla^2\tilde\Psi = \big(\mathrm{diag}(P(g)^\top\mathbf 1) - P(g)^\top P(g)\big)/\varepsilon$, with
# null space $\mathrm{span}(\mathbf 1)$. We check both formulas against autograd of $\tilde\Psi$ itself, then
# run Newton's method from scratch (with backtracking, and $\mathbf 1\mathbf 1^\top/E$ added to the Hessian
# for the gauge) and watch the error square at every step near the end: the quadratic convergence of the
# cited theorem in chapter 2.

# %%
torch.manual_seed(31)
Tn, En, eps_n = 200, 8, 0.1
Sn = torch.randn(Tn, En, dtype=torch.float64) + torch.linspace(1, -1, En, dtype=torch.float64)
bn = torch.full((En,), Tn / En, dtype=torch.float64)


def semidual(g):
    return eps_n * torch.logsumexp((Sn + g) / eps_n, 1).sum() - bn @ g


def plan_of(g):
    """P(g): the rows are exact, P(g)_i = softmax((S_i + g) / eps)."""
    return torch.softmax((Sn + g) / eps_n, 1)


g_test = torch.randn(En, dtype=torch.float64)
P = plan_of(g_test)
hess_formula = (torch.diag(P.sum(0)) - P.T @ P) / eps_n
grad_error = (torch.autograd.functional.jacobian(semidual, g_test) - (P.sum(0) - bn)).abs().max().item()
hess_error = (torch.autograd.functional.hessian(semidual, g_test) - hess_formula).abs().max().item()
values, vectors = torch.linalg.eigh(hess_formula)
print(f"Prop. 2.6 vs autograd: gradient {grad_error:.1e}, Hessian {hess_error:.1e}; "
      f"two smallest eigenvalues {values[0]:.1e}, {values[1]:.1e}")
assert grad_error < 1e-10 and hess_error < 1e-10
assert abs(values[0]) < 1e-10 < 1e-4 < values[1], "PSD, one null direction ..."
assert torch.allclose(vectors[:, 0].abs(), torch.full((En,), En ** -0.5, dtype=torch.float64)), "... the gauge 1"

g, newton_errors = torch.zeros(En, dtype=torch.float64), []
for _ in range(50):
    P = plan_of(g)
    grad = P.sum(0) - bn
    newton_errors.append((grad.abs() / bn).max().item())
    if newton_errors[-1] < 1e-13:
        break
    d = -torch.linalg.solve((torch.diag(P.sum(0)) - P.T @ P) / eps_n + 1 / En, grad)
    t = 1.0  # backtracking; the slack 1e-9 is float64 rounding of the semi-dual
    while semidual(g + t * d) > semidual(g) + 1e-4 * t * (grad @ d) + 1e-9:
        t /= 2
    g = g + t * d
plain_errors = sinkhorn_errors(Sn, eps_n, tol=1e-13)
print("Newton, relative column error per step:", " ".join(f"{e:.1e}" for e in newton_errors))
print(f"Newton steps: {len(newton_errors) - 1}; Sinkhorn iterations to the same error: {len(plain_errors)}")
assert newton_errors[-1] < 1e-13
assert all(after <= 10 * before**2 for before, after in zip(newton_errors, newton_errors[1:]) if before < 1e-2), \
    "quadratic convergence near the solution"
assert (plan_of(g) - sinkhorn(Sn, eps_n, tol=1e-12, max_iter=100_000)).abs().max() < 1e-9, "the same plan"

# %% [markdown]
# (nb03-overflow)=
# ## Why the log domain: float32 overflow
#
# The textbook iteration $u \leftarrow 1/(Kv)$, $v \leftarrow b/(K^\top u)$ stores the kernel
# $K = e^{S/\varepsilon}$. In float32, $e^x$ is `inf` for $x > 88.72$. Router logits with standard
# deviation 3 reach that at quite ordinary values of $\varepsilon$:

# %%
def naive_sinkhorn(S, eps, n_iter=300):
    T, E = S.shape
    K = torch.exp(S / eps)
    v = torch.ones(E, dtype=S.dtype)
    for _ in range(n_iter):
        u = 1 / (K @ v)
        v = (T / E) / (K.T @ u)
    return u[:, None] * K * v[None, :], K


def marginal_error(P):
    T, E = P.shape
    return max((P.sum(1) - 1).abs().max().item(), ((P.sum(0) - T / E).abs() / (T / E)).max().item())


torch.manual_seed(3)  # each section seeds itself, so its numbers do not depend on SCALE
S3 = 3 * torch.randn(64, 8)  # float32
FLOAT32_EXP_LIMIT = math.log(torch.finfo(torch.float32).max)  # 88.72
print(f"{'eps':>5s} {'max S/eps':>9s} {'K finite':>8s} {'naive plan':>11s} {'naive err':>9s} "
      f"{'minimoe finite':>14s} {'minimoe err':>11s}")
for eps in [1.0, 0.3, 0.1, 0.03]:
    P_naive, K = naive_sinkhorn(S3, eps)
    res = sinkhorn(S3, eps, max_iter=5000, return_potentials=True)
    naive_ok = bool(torch.isfinite(P_naive).all())
    naive_err = marginal_error(P_naive) if naive_ok else float("nan")
    print(f"{eps:5g} {S3.max().item() / eps:9.1f} {bool(torch.isfinite(K).all())!s:>8s} "
          f"{'finite' if naive_ok else 'inf/NaN':>11s} {naive_err:9.1e} "
          f"{bool(torch.isfinite(res.plan).all())!s:>14s} {res.error:11.1e}")
    assert torch.isfinite(res.plan).all() and res.error <= 1e-4, "minimoe stays finite and meets tol"
    if S3.max().item() / eps > FLOAT32_EXP_LIMIT:
        assert not torch.isfinite(K).all() and torch.isnan(P_naive).any(), "naive kernel overflows, plan is NaN"
    else:
        assert naive_ok and marginal_error(P_naive) < 1e-4
        assert (P_naive - res.plan).abs().max() < 1e-3, "where it is finite, the naive plan is the same plan"

# %% [markdown]
# Once $\max S/\varepsilon$ passes 88.72, $K$ contains `inf`, the row with it gets $u = 0$, and
# $\infty \cdot 0$ makes the plan `NaN`. This is the failure of SSR-L at small $\xi$ in SSR's
# Table 6. `minimoe.ops.sinkhorn` never forms $e^{S/\varepsilon}$, so it stays finite and meets
# the marginals.
#
# An extreme case: scores of size $10^4$ in float32 at $\varepsilon = 1$. At
# $|S|/\varepsilon \approx 10^4$ the rows of a cold start are one-hot in floating point, so
# Sinkhorn's rate is practically 1 and Newton's step fails (the semi-dual Hessian is numerically
# zero). Plain Sinkhorn (`method="sinkhorn"`) stays finite with exact columns but does **not** meet
# the row marginals, and says so with a `RuntimeWarning`. The default `method="auto"` first solves
# the problem at larger $\varepsilon$ and passes each column potential $g$ on as a warm start
# (a continuation, or "$\varepsilon$-scaling"); it converges, to the balanced hard assignment that
# notebook 03 reaches as $\varepsilon \to 0$ ({ref}`nb03-eps-zero`). The same continuation by hand,
# through `init`, shows what it does.

# %%
torch.manual_seed(4)
S4 = 1e4 * torch.randn(64, 8)  # float32
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    direct = sinkhorn(S4, 1.0, max_iter=2000, method="sinkhorn", return_potentials=True)
print("plain Sinkhorn:", [str(w.message) for w in caught])
print(f"  finite: {bool(torch.isfinite(direct.plan).all())}, column sums {direct.plan.sum(0).numpy().round(4)}, "
      f"row sums in [{direct.plan.sum(1).min():.3f}, {direct.plan.sum(1).max():.3f}]")
assert torch.isfinite(direct.plan).all(), "finite even at |S| = 1e4"
assert ((direct.plan.sum(0) - 8).abs() / 8).max() < 1e-4, "columns exact (they were updated last)"
assert any(issubclass(w.category, RuntimeWarning) for w in caught), "non-convergence is reported"

with warnings.catch_warnings():
    warnings.simplefilter("error")  # method="auto" (the default) converges: no warning
    automatic = sinkhorn(S4, 1.0, max_iter=2000, return_potentials=True)
print(f"method='auto': error {automatic.error:.1e} after {automatic.iterations} iterations in all stages")
assert automatic.error <= 1.5e-4

g = None
for eps in [3e3, 1e3, 3e2, 1e2, 30.0, 10.0, 3.0, 1.0]:
    continued = sinkhorn(S4, eps, max_iter=2000, init=g, return_potentials=True)
    g = continued.g
z4 = linear_assignment(S4.double(), capacity=8)
agree4 = (continued.plan.argmax(1) == z4).float().mean().item()
print(f"continuation: error {continued.error:.1e}, top-1 agrees with linear_assignment on {agree4:.0%} of tokens")
assert torch.isfinite(continued.plan).all() and continued.error <= 1e-4
assert agree4 == 1.0
assert (automatic.plan.argmax(1) == z4).all(), "auto reaches the same assignment"

# %% [markdown]
# (nb03-duality)=
# ## Duality, the envelope identity, and the gradient of the plan
#
# Proposition 2.4: the optimal value $W_\varepsilon(S) = \langle P, S\rangle + \varepsilon H(P)$
# equals the dual value $-\langle a, f\rangle - \langle b, g\rangle$ at the returned potentials,
# and every other pair of potentials gives a dual value $\Psi(f, g)$ at least as large. The value
# is a smooth function of the scores whose gradient is the plan (envelope identity).

# %%
torch.manual_seed(7)
T7, E7, eps7 = 16, 4, 0.5
S7 = torch.randn(T7, E7, dtype=torch.float64)
a7, b7 = torch.ones(T7, dtype=torch.float64), torch.full((E7,), T7 / E7, dtype=torch.float64)


def value(S):
    P = sinkhorn(S, eps7, tol=1e-13, max_iter=10_000)
    return (P * S).sum() - eps7 * torch.special.xlogy(P, P).sum()


def dual(S, f, g):
    return eps7 * ((S + f[:, None] + g[None, :]) / eps7).exp().sum() - a7 @ f - b7 @ g - eps7 * T7


res7 = sinkhorn(S7, eps7, tol=1e-13, max_iter=10_000, return_potentials=True)
primal = value(S7).item()
dual_value = (-(a7 @ res7.f) - b7 @ res7.g).item()
print(f"primal <P,S> + eps H(P) = {primal:.12f}, dual -<a,f> - <b,g> = {dual_value:.12f}")
assert abs(primal - dual_value) < 1e-10, "strong duality"
assert abs(dual(S7, res7.f, res7.g).item() - primal) < 1e-10
perturbed = [dual(S7, res7.f + 0.3 * torch.randn(T7, dtype=torch.float64),
                  res7.g + 0.3 * torch.randn(E7, dtype=torch.float64)).item() for _ in range(100)]
assert min(perturbed) >= primal - 1e-12, "weak duality: every Psi(f, g) is above the value"

# envelope identity, with autograd through the log-domain iterations ...
S_req = S7.clone().requires_grad_(True)
P_unroll = sinkhorn(S_req, eps7, tol=1e-13, max_iter=10_000, method="log", grad="unroll")
W = (P_unroll * S_req).sum() - eps7 * torch.special.xlogy(P_unroll, P_unroll).sum()
(dW,) = torch.autograd.grad(W, S_req)
print(f"envelope: max|dW/dS - P| = {(dW - res7.plan).abs().max():.1e} (autograd, unrolled)")
assert (dW - res7.plan).abs().max() < 1e-8

# ... and with central finite differences in random directions
h = 1e-5
for _ in range(3):
    D = torch.randn(T7, E7, dtype=torch.float64)
    fd = (value(S7 + h * D) - value(S7 - h * D)).item() / (2 * h)
    print(f"          (W(S+hD) - W(S-hD)) / 2h = {fd:.9f},  <P, D> = {(res7.plan * D).sum().item():.9f}")
    assert abs(fd - (res7.plan * D).sum().item()) < 1e-6

# %% [markdown]
# The gradient of the *plan* itself (Proposition 2.7), with `grad="implicit"`, solves an
# $E \times E$ linear system instead of backpropagating through the iterations. We check it against
# central finite differences of a loss $\ell(P) = \langle G, P\rangle$ on a $5 \times 3$ problem, and
# against the unrolled gradient.

# %%
torch.manual_seed(8)
S8 = torch.randn(5, 3, dtype=torch.float64)
G8 = torch.randn(5, 3, dtype=torch.float64)
eps8 = 0.7


def loss(S, grad="none", method="auto"):
    return (G8 * sinkhorn(S, eps8, tol=1e-14, max_iter=20_000, grad=grad, method=method)).sum()


S_req = S8.clone().requires_grad_(True)
(g_implicit,) = torch.autograd.grad(loss(S_req, "implicit"), S_req)
S_req = S8.clone().requires_grad_(True)
(g_unroll,) = torch.autograd.grad(loss(S_req, "unroll", "log"), S_req)
h = 1e-5
g_fd = torch.zeros_like(S8)
for idx in np.ndindex(*S8.shape):
    bump = torch.zeros_like(S8)
    bump[idx] = h
    g_fd[idx] = (loss(S8 + bump) - loss(S8 - bump)) / (2 * h)
print(f"max|implicit - finite differences| = {(g_implicit - g_fd).abs().max():.1e}")
print(f"max|implicit - unrolled|           = {(g_implicit - g_unroll).abs().max():.1e}")
print(f"row sums of the gradient {g_implicit.sum(1).abs().max():.1e}, column sums {g_implicit.sum(0).abs().max():.1e}")
assert (g_implicit - g_fd).abs().max() < 1e-7
assert (g_implicit - g_unroll).abs().max() < 1e-9
assert g_implicit.sum(1).abs().max() < 1e-12 and g_implicit.sum(0).abs().max() < 1e-12, "zero row/column sums"


# %% [markdown]
# ## What we saw
#
# * The marginal error falls geometrically, more slowly as $\varepsilon$ shrinks, within the
#   Birkhoff bound; Newton on the semi-dual (`method="auto"`) takes over where Sinkhorn is slow.
# * Over-relaxation's rate follows Young's formula from one singular value of the plan.
# * The semi-dual's gradient and Hessian match autograd, and Newton's method on it squares the error
#   at every step near the solution.
# * The exp-domain textbook iteration gives `NaN` in float32 once $\max S/\varepsilon > 88.7$;
#   the log domain and absorption stay finite. At $|S|/\varepsilon \sim 10^4$ plain Sinkhorn does
#   not meet the row marginals (and warns); lowering $\varepsilon$ step by step with `init` does,
#   and `method="auto"` does that by itself.
# * Primal and dual values agree, the value's gradient is the plan, and the implicit gradient of
#   the plan matches finite differences.
