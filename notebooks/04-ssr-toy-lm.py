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
# # SSR's mechanisms: the propositions, Algorithm 1, the coin and the noise
#
# Companion to {doc}`../book/03-selective-sinkhorn`. We build SSR from scratch and check the
# chapter's propositions numerically, then look at each piece of the router before any training.
#
# **You will learn to**
#
# 1. write SSR from scratch (softmax top-$k$ with a per-layer coin for a Sinkhorn step) and show it
#    equal to `minimoe`'s;
# 2. check the KL projection behind SSR's plan weights (Proposition 3.1) and the top-1 probability
#    under Gaussian noise, with the paper's product formula and its SSR-S bounds (Proposition 3.3);
# 3. see that Algorithm 1 as printed finds the worst plan, and that its stopping rule fails in
#    float32;
# 4. read the balance of the plan (Proposition 3.2), the bias form of a Sinkhorn step, whether the
#    gate learns on Sinkhorn steps, the per-layer coin and the noise.
#
# {doc}`04b-ssr-training` trains the toy LM with every router of the chapter's comparison.
#
# *Prerequisites:* chapter 3 through "What SSR does"; Sinkhorn's plans from
# {doc}`03-sinkhorn-from-scratch`.
#
# *Run time:* under 10 seconds at CPU scale on a 2-core laptop CPU, the default. `MINIMOE_SCALE=gpu` chooses
# the larger configuration, for a GPU: width 256 instead of 32, 4 layers instead of 2, 2,000 steps of 64
# sequences of 128 characters instead of 150 of 8 of 64, 3 seeds instead of 2 — about 30,000 times the
# arithmetic of the CPU scale.

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
from itertools import combinations, permutations

import matplotlib.pyplot as plt
import numpy as np
import torch

from minimoe import MoELayer
from minimoe.data import load_char_corpus
from minimoe.models import TinyLM
from minimoe.routers import SelectiveSinkhorn
from minimoe.ops import (gaussian_top1_probability, gaussian_top1_product_bound, linear_assignment, sinkhorn,
                         top_k)
from minimoe.train import pick_device

SCALE = os.environ.get("MINIMOE_SCALE", "cpu")  # "gpu" runs the larger configuration: chosen, never automatic
if SCALE == "cpu":
    torch.set_num_threads(1)  # tiny matrices: one thread is faster than two, and robust to a busy machine
    CONFIG = dict(d_model=32, n_layers=2, n_heads=4, n_experts=8, d_hidden=64, block_size=64,
                  batch_size=8, steps=150, seeds=(0, 1), lr=3e-3, p_values=(0.05, 0.3), noise_scale=1.0)
else:
    CONFIG = dict(d_model=256, n_layers=4, n_heads=8, n_experts=8, d_hidden=512, block_size=128,
                  batch_size=64, steps=2000, seeds=(0, 1, 2), lr=1e-3, p_values=(0.05, 0.3), noise_scale=1.0)
DEVICE = pick_device()
print(f"SCALE={SCALE}, device={DEVICE}, config={CONFIG}")
NOTEBOOK_START = time.perf_counter()

# %% [markdown]
# (nb04-scratch)=
# ## SSR from scratch
#
# An SSR layer is a softmax top-$k$ router that, on a coin toss of probability $p$ per training
# forward, routes with the Sinkhorn plan instead (chapter 3, "What SSR does"). On a plain step it
# takes the top-$k$ logits and weights them by a softmax over the chosen ones; on a coin step it
# takes the plan's top-$k$ and weights them by the plan's own entries, renormalised. At evaluation
# there is no coin. (The plan here is solved to a tolerance, at SSR's $\varepsilon = 0.5$.)

# %% tags=["from-scratch"]
import torch


def sinkhorn_plan(cost, eps, tol=1e-7, max_iter=10_000):
    """Rows sum to 1, columns to T/E, iterated until the rows are within tol."""
    T, E = cost.shape
    K, v = torch.exp((cost - cost.max()) / eps), torch.ones(E, dtype=cost.dtype)
    for _ in range(max_iter):
        u = 1.0 / (K @ v)
        v = (T / E) / (K.T @ u)
        plan = u[:, None] * K * v
        if (plan.sum(1) - 1).abs().max() < tol:
            break
    return plan


def ssr_route(logits, k, coin, eps=0.5):
    """Each token's k experts and their weights; `coin`: this layer's toss for this forward pass."""
    if coin:                                                 # a Sinkhorn step: the plan selects and weights
        top = sinkhorn_plan(logits, eps).topk(k, dim=-1)
        return top.indices, top.values / top.values.sum(-1, keepdim=True)
    top = logits.topk(k, dim=-1)                             # a plain step: softmax top-k
    return top.indices, torch.softmax(top.values, dim=-1)

# %%
from minimoe.routers import router_class

torch.manual_seed(0)
x_small = torch.randn(1, 24, 8, dtype=torch.float64)
for p in (0.0, 1.0):                                         # p = 1: the coin always says Sinkhorn
    router = router_class("ssr")(8, 4, k=2, p=p, tol=1e-7, max_iter=10_000).double().train()
    routing = router(x_small)
    experts, weights = ssr_route(router.gate(x_small)[0].detach(), 2, coin=bool(routing.stats["used_sinkhorn"]))
    assert torch.equal(experts, routing.choice_expert[0])
    torch.testing.assert_close(weights, routing.choice_weight[0].detach(), rtol=0, atol=1e-7)
    print(f"p = {p:g}: used the plan: {bool(routing.stats['used_sinkhorn'])}; the same experts and weights")

# %% [markdown]
# (nb04-prop41)=
# ## Proposition 3.1 by brute force
#
# SSR's Sinkhorn branch keeps each token's $k$ largest plan entries and renormalises them.
# {ref}`Proposition 3.1 <ch3-prop-kl-projection>` says that this is the $k$-sparse distribution
# $w$ closest to the row $q$ in $\mathrm{KL}(w\,\|\,q)$, with minimum $-\log\sum_{j\in K}q_j$.
# We check it without the proof: for random positive rows, enumerate **every** support $A$ with
# $1 \le |A| \le k$, take the renormalised row on $A$ (the best weights on that support, step 2 of
# the proof) and also 200 random distributions on $A$, and compare all their divergences with the
# weights of `minimoe.ops.top_k(q, k, renormalize=True)`.

# %%
def kl(w, q):
    """KL(w || q) over the support of w (0 log 0 = 0)."""
    support = w > 0
    return float((w[support] * (w[support] / q[support]).log()).sum())


torch.manual_seed(0)  # the random competitors
gen = torch.Generator().manual_seed(0)
E41 = 6
checked = 0
for trial in range(5):
    q = torch.softmax(2 * torch.randn(E41, generator=gen, dtype=torch.float64), -1)
    for k in (1, 2, 3):
        values, indices = top_k(q, k, renormalize=True)
        w_topk = torch.zeros(E41, dtype=torch.float64).scatter(-1, indices, values)
        kl_topk = kl(w_topk, q)
        assert abs(kl_topk - (-math.log(q[indices].sum()))) < 1e-12, "minimum is -log(sum of the top k)"
        best_other = math.inf
        for size in range(1, k + 1):
            for A in combinations(range(E41), size):
                A = list(A)
                w = torch.zeros(E41, dtype=torch.float64)
                w[A] = q[A] / q[A].sum()  # the best weights on support A
                best_other = min(best_other, kl(w, q))
                # random competitors on the same support (Dirichlet(1) weights)
                rand = torch.distributions.Dirichlet(torch.ones(size, dtype=torch.float64)).sample((200,))
                kls = (rand * (rand / q[A]).log()).sum(-1)  # every entry of rand is > 0
                assert (kls >= kl_topk - 1e-12).all(), "a random k-sparse w beat the top-k projection"
                checked += 201
        assert abs(best_other - kl_topk) < 1e-12, "no support does better than the top-k support"
print(f"checked {checked} candidate distributions: top_k(renormalize=True) is always the minimiser")


# %%
# One row in detail: the best KL on every support of size <= 2, best first.
q = torch.softmax(2 * torch.randn(E41, generator=gen, dtype=torch.float64), -1)
rows = []
for size in (1, 2):
    for A in combinations(range(E41), size):
        rows.append((-math.log(q[list(A)].sum()), A))
print("q =", np.round(q.numpy(), 3))
print(f"{'support':>10s} {'min KL(w||q) on it':>20s}")
for value, A in sorted(rows)[:6]:
    print(f"{str(A):>10s} {value:20.4f}")
values, indices = top_k(q, 2, renormalize=True)
print(f"top_k(q, 2): experts {indices.tolist()}, weights {np.round(values.numpy(), 4).tolist()}")

# %% [markdown]
# The best support is the set of the $k$ largest entries, and its divergence is the smallest value
# in the table. Note that the supports of size 1 are never better: adding an expert always
# increases $\sum_{j\in A} q_j$. Nothing here involved transport: the same projection applied to a
# softmax row gives the softmax branch's renormalised weights.

# %% [markdown]
# (nb04-prop43)=
# ## Proposition 3.3: which expert wins under noise
#
# With noisy scores $\tilde c_j = c_j + \gamma Z_j$, expert $e$ is the top-1 choice with probability
# $P_e$. The paper multiplies the pairwise probabilities $\Phi\big((c_e - c_j)/(\sqrt2\gamma)\big)$;
# {ref}`Proposition 3.3 <ch3-prop-noise>` shows that the product is only a lower bound and gives the
# exact one-dimensional integral. We compare both with a Monte Carlo estimate from 400,000 draws,
# for logits (SSR-L's cost) and for a softmax row (SSR-S's cost).

# %%
N_MC = 400_000
logits_row = torch.tensor([1.5, 1.0, 0.5, 0.0, 0.0, -0.5, -1.0, -2.0], dtype=torch.float64)
CASES = {
    "logits, gamma=1": (logits_row, 1.0),
    "logits, gamma=0.5": (logits_row, 0.5),
    "softmax row (SSR-S), gamma=1": (torch.softmax(logits_row, -1), 1.0),
    "softmax row (SSR-S), gamma=0.1": (torch.softmax(logits_row, -1), 0.1),
}
mc_gen = torch.Generator().manual_seed(1)


def monte_carlo_top1(scores, gamma, n=N_MC):
    z = torch.randn(n, scores.shape[-1], generator=mc_gen, dtype=torch.float64)
    winners = (scores + gamma * z).argmax(-1)
    return torch.bincount(winners, minlength=scores.shape[-1]).double() / n


for name, (scores, gamma) in CASES.items():
    E = scores.shape[-1]
    exact = gaussian_top1_probability(scores, gamma)
    product = gaussian_top1_product_bound(scores, gamma)
    freq = monte_carlo_top1(scores, gamma)
    se = (exact * (1 - exact) / N_MC).sqrt()
    print(f"\n{name}: exact sums to {exact.sum():.6f}, the paper's product to {product.sum():.4f}")
    print(f"{'expert':>6s} {'score':>7s} {'Monte Carlo':>12s} {'± s.e.':>8s} {'exact':>9s} {'product':>9s} {'product/exact':>14s}")
    for e in range(E):
        print(f"{e:6d} {float(scores[e]):7.3f} {float(freq[e]):12.5f} {float(se[e]):8.5f} {float(exact[e]):9.5f}"
              f" {float(product[e]):9.5f} {float(product[e] / exact[e]):14.3f}")
    assert abs(float(exact.sum()) - 1) < 1e-6, "the exact probabilities sum to 1"
    assert ((freq - exact).abs() <= 4 * se + 1e-12).all(), "exact value within 4 standard errors of Monte Carlo"
    assert (product <= exact * (1 + 1e-9)).all(), "the product is a lower bound"
    assert float(product.sum()) < 1, "for E >= 3 the products do not sum to 1"
    if "softmax" in name:  # Proposition 3.3(c): SSR-S bound
        bound_c = float(torch.special.ndtr(torch.tensor(-1 / (math.sqrt(2) * gamma)))) ** (E - 1)
        assert (exact > bound_c).all()
        print(f"Proposition 3.3(c) bound Phi(-1/(sqrt2 gamma))^(E-1) = {bound_c:.2e} < min exact {float(exact.min()):.2e}")

# Two experts: the product is exact.
two = torch.tensor([0.7, -0.2], dtype=torch.float64)
assert torch.allclose(gaussian_top1_probability(two, 0.8), gaussian_top1_product_bound(two, 0.8), atol=1e-9)

# %% [markdown]
# Monte Carlo agrees with the integral to within its standard error, and the product falls short,
# most for the experts in the middle of the ranking. For the softmax row with $\gamma = 1$ the noise
# swamps the scores, which differ by less than $1$: every expert wins almost equally often.
#
# **The counterexample.** With $E$ equal scores every expert wins with probability $1/E$ by
# symmetry, while the product gives $2^{-(E-1)}$.

# %%
E_RANGE = list(range(2, 9))
counter = []
for E in E_RANGE:
    scores = torch.zeros(E, dtype=torch.float64)
    exact = float(gaussian_top1_probability(scores, 1.0)[0])
    product = float(gaussian_top1_product_bound(scores, 1.0)[0])
    freq = float(monte_carlo_top1(scores, 1.0)[0])
    se = math.sqrt((1 / E) * (1 - 1 / E) / N_MC)
    assert abs(exact - 1 / E) < 1e-9 and abs(product - 2.0 ** -(E - 1)) < 1e-12
    assert abs(freq - 1 / E) <= 4 * se
    counter.append((E, freq, se, exact, product))
assert abs(counter[-1][3] / counter[-1][4] - 16) < 1e-6  # E = 8: 1/8 against 1/128

print(f"{'E':>3s} {'Monte Carlo':>12s} {'exact = 1/E':>12s} {'product = 2^-(E-1)':>19s} {'ratio':>7s}")
for E, freq, se, exact, product in counter:
    print(f"{E:3d} {freq:12.5f} {exact:12.5f} {product:19.5f} {exact / product:7.1f}")

Es, freqs, ses, exacts, products = map(np.array, zip(*counter))
fig, ax = plt.subplots(figsize=(6, 3.8))
ax.plot(Es, exacts, "o-", color="tab:blue", label="exact (quadrature) = 1/E")
ax.errorbar(Es, freqs, yerr=4 * ses, fmt="x", color="black", capsize=3, label="Monte Carlo (± 4 s.e.)")
ax.plot(Es, products, "s--", color="tab:red", label="paper's product = $2^{-(E-1)}$")
ax.set_yscale("log")
ax.set_xlabel("number of experts E (all scores equal)")
ax.set_ylabel("P(a given expert is the top-1)")
ax.set_title("Equal scores: the product formula is only a lower bound")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# **The SSR-S bounds.** For softmax costs the paper states two different closed-form lower bounds,
# $\Phi^E\big(-1/(\sqrt2\gamma)\big)$ in the main text and $\Phi^E\big(-\sqrt2/\gamma\big)$ in its
# appendix ({ref}`errata-ssr-prop43-bound`); Proposition 3.3(c) gives $\Phi^{E-1}\big(-1/(\sqrt2\gamma)\big)$.
# All three hold, and all are far below the worst case, which is the exact probability of an expert
# at score $0$ against $E-1$ experts at score $1$ (the integral bound). We check the chain of
# inequalities for $E = 8$ and $\gamma = 1$, the worst case against Monte Carlo, and that no
# softmax row of 200 random ones does worse.

# %%
E_b, gamma_b = 8, 1.0
Phi = lambda v: float(torch.special.ndtr(torch.tensor(v, dtype=torch.float64)))
bounds = {
    "appendix: Phi^E(-sqrt2/gamma)": Phi(-math.sqrt(2) / gamma_b) ** E_b,
    "main text: Phi^E(-1/(sqrt2 gamma))": Phi(-1 / (math.sqrt(2) * gamma_b)) ** E_b,
    "Prop. 3.3(c): Phi^(E-1)(-1/(sqrt2 gamma))": Phi(-1 / (math.sqrt(2) * gamma_b)) ** (E_b - 1),
}
worst_case_scores = torch.tensor([0.0] + [1.0] * (E_b - 1), dtype=torch.float64)
integral_bound = float(gaussian_top1_probability(worst_case_scores, gamma_b)[0])
worst_mc = float(monte_carlo_top1(worst_case_scores, gamma_b)[0])
worst_se = math.sqrt(integral_bound * (1 - integral_bound) / N_MC)
rows_b = torch.softmax(3 * torch.randn(200, E_b, generator=torch.Generator().manual_seed(17), dtype=torch.float64), -1)
min_exact = float(torch.stack([gaussian_top1_probability(r, gamma_b) for r in rows_b]).min())
for name, value in bounds.items():
    print(f"{name:44s} {value:.2e}")
print(f"{'integral bound (worst case, exact)':44s} {integral_bound:.3f}  (Monte Carlo {worst_mc:.4f} ± {worst_se:.4f})")
print(f"{'smallest P_e over 200 random softmax rows':44s} {min_exact:.3f}")
values_b = list(bounds.values())
assert values_b[0] < values_b[1] < values_b[2] < integral_bound <= min_exact, "the chain of bounds"
assert abs(worst_mc - integral_bound) <= 4 * worst_se, "the worst case is what Monte Carlo sees"
assert abs(values_b[2] - 4.6e-5) < 0.05e-5 and abs(integral_bound - 0.022) < 0.001

# %% [markdown]
# (nb04-kernel-sign)=
# ## Algorithm 1's kernel sign: the printed algorithm finds the worst plan
#
# The paper's Algorithm 1 scales the kernel $K = e^{-C/\xi}$, the kernel of a *minimisation*, while
# SSR maximises ({ref}`ch3-kernel-sign`). We transcribe Algorithm 1 literally (the $v$-update, then
# the $u$-update, from $u = \mathbf 1$) with either sign, on one group of $T = 8$ tokens and $E = 4$
# experts with $C = S$ (SSR-L), and compare both plans with **every** balanced hard assignment (each
# expert takes exactly $T/E = 2$ tokens; there are $8!/(2!)^4 = 2520$ of them), enumerated by brute force.
# At small $\xi$ the printed kernel lands on the balanced assignment of *smallest* total score, ours on
# the largest, and at any $\xi$ the printed plan scores below the uniform plan, ours above.

# %%
def algorithm1(cost, r, s, xi, kernel_sign, iters=3000):
    """SSR's Algorithm 1 as printed, with K = exp(kernel_sign * cost / xi); float64, no stopping test."""
    K = torch.exp(kernel_sign * cost / xi)
    u = torch.ones_like(r)
    for _ in range(iters):
        v = s / (K.T @ u)
        u = r / (K @ v)
    return u[:, None] * K * v[None, :]


KS_T, KS_E = 8, 4
S_ks = torch.randn(KS_T, KS_E, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
rows, cols = torch.ones(KS_T, dtype=torch.float64), torch.full((KS_E,), KS_T / KS_E, dtype=torch.float64)
assignments = sorted(set(permutations([e for e in range(KS_E) for _ in range(KS_T // KS_E)])))
assert len(assignments) == 2520
scores = torch.tensor([float(S_ks[torch.arange(KS_T), list(a)].sum()) for a in assignments], dtype=torch.float64)
best, worst = assignments[int(scores.argmax())], assignments[int(scores.argmin())]
uniform_score = float(S_ks.sum() / KS_E)
print(f"balanced assignments: best score {scores.max():.3f}, worst {scores.min():.3f}, uniform plan {uniform_score:.3f}")
print(f"{'xi':>6s} {'<P,S> printed kernel exp(-C/xi)':>32s} {'<P,S> ours exp(+C/xi)':>23s}")
for xi in (1.0, 0.5, 0.2, 0.05):
    iters = 3000 if xi > 0.1 else 20000  # slower convergence at small xi
    printed = algorithm1(S_ks, rows, cols, xi, kernel_sign=-1.0, iters=iters)
    ours = algorithm1(S_ks, rows, cols, xi, kernel_sign=+1.0, iters=iters)
    for plan in (printed, ours):  # both are perfectly good transport plans: the marginals hold
        assert torch.allclose(plan.sum(1), rows) and torch.allclose(plan.sum(0), cols, atol=1e-7)
    if xi > 0.1:
        assert torch.allclose(ours, sinkhorn(S_ks, xi, tol=1e-12, max_iter=20000), atol=1e-8), "ours is minimoe's"
    score_printed, score_ours = float((printed * S_ks).sum()), float((ours * S_ks).sum())
    assert score_printed < uniform_score < score_ours, "printed kernel: below uniform; ours: above"
    print(f"{xi:6.2f} {score_printed:32.3f} {score_ours:23.3f}")
# at xi = 0.05 each row is nearly one-hot: read off the hard assignment of each plan
assert tuple(printed.argmax(1).tolist()) == worst, "the printed kernel converges to the WORST balanced assignment"
assert tuple(ours.argmax(1).tolist()) == best, "the corrected kernel converges to the best one"
print(f"xi = 0.05: printed kernel -> {tuple(printed.argmax(1).tolist())} = worst assignment; "
      f"ours -> {tuple(ours.argmax(1).tolist())} = best assignment")

# %% [markdown]
# The printed algorithm does not fail in any visible way: its marginals are exact, its loads perfectly
# balanced. It simply sends every token to the experts that score it lowest.

# %% [markdown]
# (nb04-stopping)=
# ## Algorithm 1's stopping rule in float32
#
# Algorithm 1 stops when both marginal errors are below an absolute $\delta = 10^{-4}$
# ({ref}`ch3-stopping`). We run it in float32 at the paper's size, $T = 48\times512 = 24{,}576$ tokens
# and $E = 16$ experts, on random logits (SSR-L, $\xi = 0.5$), once with SSR's marginals (rows $1$,
# columns $T/E = 1536$) and once with probability vectors (rows $1/T$, columns $1/E$), as §3.2 states
# the algorithm. The error is the max norm; any other norm over the 16 columns is larger.

# %%
def algorithm1_stopping(cost, r, s, xi, delta=1e-4, eta=100):
    """Algorithm 1 (corrected kernel sign) with the paper's stopping test; returns (iterations, column error)."""
    K = torch.exp(cost / xi)
    u = torch.ones_like(r)
    for it in range(1, eta + 1):
        v = s / (K.T @ u)
        u = r / (K @ v)
        row_err = (u * (K @ v) - r).abs().max().item()
        col_err = (v * (K.T @ u) - s).abs().max().item()
        if row_err < delta and col_err < delta:
            break
    return it, col_err


ST_T, ST_E = 24_576, 16
S_st = torch.randn(ST_T, ST_E, generator=torch.Generator().manual_seed(12))  # float32
stop = {
    "SSR marginals (1, T/E)": algorithm1_stopping(S_st, torch.ones(ST_T), torch.full((ST_E,), ST_T / ST_E), 0.5),
    "probability vectors (1/T, 1/E)": algorithm1_stopping(S_st, torch.full((ST_T,), 1 / ST_T),
                                                          torch.full((ST_E,), 1 / ST_E), 0.5),
}
spacing = float(torch.finfo(torch.float32).eps) * 1024  # the float32 spacing in [1024, 2048)
assert spacing == 2 ** -13 and spacing > 1e-4
for name, (iters, col_err) in stop.items():
    print(f"{name:32s} stopped after {iters:3d} iterations, column error {col_err:.2e}")
assert stop["SSR marginals (1, T/E)"][0] == 100 and stop["SSR marginals (1, T/E)"][1] > 1e-4, "never fires"
assert stop["probability vectors (1/T, 1/E)"][0] < 100, "fires"
print(f"float32 spacing near 1536: {spacing:.2e} > delta = 1e-4")

# %% [markdown]
# With SSR's marginals the column error stays at the float32 rounding floor, above $\delta$, and the
# loop runs all $\eta = 100$ iterations; with probability vectors the same plan, divided by $T$,
# passes the absolute test almost at once. The paper does not say which scaling its code used.

# %% [markdown]
# (nb04-balance)=
# ## Proposition 3.2: what the column constraint gives
#
# {ref}`Proposition 3.2 <ch3-prop-balance>`: (a) the mean of the plan's rows is exactly uniform for
# any cost; (b) a single token's row is uniform whatever its scores; (c) for $T = E = 2$ the plan
# has a closed form, and token 1's favourite expert flips when its neighbour's score $a$ crosses $1$.
# We also check the remark after the proof: for top-1 and small enough $\varepsilon$ the *counts* of
# the plan's argmaxes are exactly $T/E$, equal to the balanced assignment
# ({py:func}`minimoe.ops.linear_assignment`), while at $\varepsilon = 1$ they need not be.

# %%
gen_b = torch.Generator().manual_seed(13)
for cost_scale in (0.1, 1.0, 5.0):  # (a) for any cost
    c = cost_scale * torch.randn(3, 12, 4, generator=gen_b, dtype=torch.float64)
    plan = sinkhorn(c, 0.5, tol=1e-12, max_iter=20000)
    assert torch.allclose(plan.mean(-2), torch.full((3, 4), 0.25, dtype=torch.float64), atol=1e-10)
for c1 in (torch.tensor([[3.0, -1.0, 0.5, 0.0]]), torch.tensor([[-9.0, 4.0, 0.0, 0.0]])):  # (b) one token
    assert torch.allclose(sinkhorn(c1.double(), 0.5), torch.full((1, 4), 0.25, dtype=torch.float64))
eps_b = 0.5
for a in (0.0, 0.5, 1.5, 3.0):  # (c) the 2 x 2 closed form
    c = torch.tensor([[1.0, 0.0], [a, 0.0]], dtype=torch.float64)
    row = sinkhorn(c, eps_b, tol=1e-13, max_iter=10000)[0]
    q = 1 / (1 + math.exp(-(1 - a) / (2 * eps_b)))
    assert torch.allclose(row, torch.tensor([q, 1 - q], dtype=torch.float64), atol=1e-10)
    assert int(row.argmax()) == (0 if a < 1 else 1), "token 1's top expert flips at a = 1"
    print(f"a = {a:3.1f}: token 1's plan row ({row[0]:.3f}, {row[1]:.3f}) = (sigma((1-a)/2eps), sigma((a-1)/2eps))")

# top-1 counts: exactly T/E below some eps_0 (Proposition 2.9(c)); not at eps = 1
S_b = torch.randn(24, 4, generator=gen_b, dtype=torch.float64)
hard = linear_assignment(S_b, 6)
counts = {}
for eps in (1.0, 0.1, 0.02):
    top1 = sinkhorn(S_b, eps, tol=1e-12, max_iter=100_000).argmax(-1)
    counts[eps] = torch.bincount(top1, minlength=4).tolist()
    print(f"eps = {eps:4.2f}: top-1 counts of the plan {counts[eps]}"
          f"{'  = the balanced assignment' if torch.equal(top1, hard) else ''}")
assert torch.equal(sinkhorn(S_b, 0.02, tol=1e-12, max_iter=100_000).argmax(-1), hard)
assert counts[0.02] == [6, 6, 6, 6] and counts[1.0] != [6, 6, 6, 6]

# %% [markdown]
# (nb04-bias)=
# ## A Sinkhorn step is a softmax step with a per-expert bias
#
# Eq. {eq}`eq-ch3-bias`: the experts and the weights of a Sinkhorn step are those of softmax top-$k$
# at temperature $\varepsilon$ on the cost shifted by the column potential $g$ that
# `sinkhorn(..., return_potentials=True)` returns. We check the form of the plan,
# $\Pi_{te} = e^{(C_{te} + f_t + g_e)/\varepsilon}$, and the two consequences, for both costs.

# %%
logits_bias = torch.randn(48, 6, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
logits_bias[:, 0] += 2  # a popular expert
for name, cost in (("SSR-L", logits_bias), ("SSR-S", torch.softmax(logits_bias, -1))):
    out = sinkhorn(cost, 0.5, tol=1e-12, max_iter=20000, return_potentials=True)
    assert torch.allclose(out.plan, torch.exp((cost + out.f[:, None] + out.g[None, :]) / 0.5), atol=1e-12)
    values, indices = top_k(out.plan, 2, renormalize=True)
    shifted = (cost + out.g) / 0.5
    assert torch.equal(indices, shifted.topk(2, -1).indices), "same experts"
    assert torch.allclose(values, torch.softmax(shifted.gather(-1, indices), -1), atol=1e-10), "same weights"
    print(f"{name}: column potential g = {np.round(out.g.numpy(), 3).tolist()} (the popular expert 0 gets the lowest)")
    assert int(out.g.argmin()) == 0

# %% [markdown]
# (nb04-gradient)=
# ## Does the gate learn on Sinkhorn steps?
#
# The paper says that on Sinkhorn steps the gate $W_g$ "is decoupled from the computational graph
# because it is not included in the OT objective" ({ref}`ch3-gradient`). We take one MoE layer with
# the SSR router in float64 and compute the gate's gradient of a loss on a softmax step ($p = 0$), on a
# Sinkhorn step with the default detached plan, and on a Sinkhorn step with the plan's implicit
# gradient (`detach_plan=False`). Then a central finite difference of the same loss along a random
# direction of $W$: it says whether the loss *depends* on $W$ on a Sinkhorn step, whatever autograd is told.

# %%
x_grad = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(15), dtype=torch.float64)
direction = torch.randn(4, 8, generator=torch.Generator().manual_seed(16), dtype=torch.float64)
grad_report = {}
for label, p, detach in (("softmax step", 0.0, True), ("Sinkhorn step, detached plan", 1.0, True),
                         ("Sinkhorn step, implicit gradient", 1.0, False)):
    torch.manual_seed(1)  # the same layer each time
    layer = MoELayer(8, 16, 4, router="ssr",
                     router_options=dict(k=2, p=p, detach_plan=detach, tol=1e-13, max_iter=5000)).double()
    W = layer.router.gate.weight
    assert W.shape == direction.shape
    layer(x_grad).square().sum().backward()
    autograd = 0.0 if W.grad is None else float((W.grad * direction).sum())
    h = 1e-6
    with torch.no_grad():
        W += h * direction
        plus = layer(x_grad).square().sum().item()
        W -= 2 * h * direction
        minus = layer(x_grad).square().sum().item()
        W += h * direction
    finite = (plus - minus) / (2 * h)
    grad_report[label] = (autograd, finite, layer.experts.w_in.grad.abs().sum().item())
    print(f"{label:34s} autograd dL/dW.d = {autograd:+.6f}   finite difference {finite:+.6f}")
soft, detached, implicit = grad_report.values()
assert abs(soft[0] - soft[1]) < 1e-5 * max(1, abs(soft[1])), "softmax step: the gate's gradient is exact"
assert detached[0] == 0.0 and abs(detached[1]) > 1e-3, "detached: no gradient, yet the loss depends on W"
assert abs(implicit[0] - implicit[1]) < 1e-5 * max(1, abs(implicit[1])), "implicit gradient = finite difference"
assert all(r[2] > 0 for r in grad_report.values()), "the experts learn on every step"

# %% [markdown]
# On a Sinkhorn step the loss does depend on $W$ (the finite difference is not zero): $W$ produces the
# cost, and the plan is a smooth function of the cost. The gate is "decoupled" only because the
# default treats the plan as a constant; with `detach_plan=False` its gradient is exact. Either way the
# experts learn.


# %% [markdown]
# (nb04-coin)=
# ## The coin: one per layer per training forward
#
# Each SSR layer draws its own $\tau \sim U(0,1)$ in every training forward pass and takes the
# Sinkhorn branch when $\tau < p$. Over $N$ forwards the count of Sinkhorn calls of one layer is
# $\mathrm{Binomial}(N, p)$, and two layers toss independent coins. We run a two-layer model with
# SSR in both layers for many training-mode forwards (no backward pass is needed to toss coins)
# and read `Routing.extra_stats["used_sinkhorn"]` after each.

# %%
P_COIN, N_FWD = 0.05, 2000
torch.manual_seed(0)
corpus = load_char_corpus()
coin_model = TinyLM(corpus.vocab_size, d_model=16, n_layers=2, n_heads=2, block_size=16, n_experts=8,
                    d_hidden=16, router="ssr", router_options={"k": 2, "p": P_COIN}).train()
coin_x = corpus.batch("train", 2, 16, torch.Generator().manual_seed(0))[0]
used = np.zeros((N_FWD, 2))
with torch.no_grad():
    for i in range(N_FWD):
        coin_model(coin_x)
        used[i] = [m.last_routing.extra_stats["used_sinkhorn"] for m in coin_model.moe_layers()]
mean, sd = N_FWD * P_COIN, math.sqrt(N_FWD * P_COIN * (1 - P_COIN))
for layer, m in enumerate(coin_model.moe_layers()):
    count = int(used[:, layer].sum())
    assert count == m.router.sinkhorn_calls, "the router's counter matches the per-forward flags"
    print(f"layer {layer}: {count} Sinkhorn calls in {N_FWD} forwards; Binomial mean {mean:.0f}, sd {sd:.1f},"
          f" z = {(count - mean) / sd:+.2f}")
    assert abs(count - mean) <= 4 * sd
both = int((used[:, 0] * used[:, 1]).sum())
print(f"forwards where both layers used Sinkhorn: {both} (independent coins: N p^2 = {N_FWD * P_COIN**2:.1f}); "
      f"correlation of the two layers' flags {np.corrcoef(used.T)[0, 1]:+.3f}")
coin_model.eval()
with torch.no_grad():
    coin_model(coin_x)
assert all(m.last_routing.extra_stats["used_sinkhorn"] == 0.0 for m in coin_model.moe_layers()), "no coin at eval"

# %% [markdown]
# So the expected number of Sinkhorn calls in a run of $N$ steps through $L$ SSR layers is $pLN$
# (eq. {eq}`eq-ch3-calls`), with standard deviation $\sqrt{pLN(1-p)}$ and no call at all with
# probability $(1-p)^{LN}$. For the paper's settings and for the runs of
# {doc}`04b-ssr-training`:

# %%
assert round(1e-3 * 6 * 8000) == 48 and round(1e-3 * 6 * 80_000) == 480 and round(1e-5 * 6 * 80_000, 1) == 4.8
settings = [("paper, text", p, 6, 80_000) for p in (1e-5, 1e-4, 1e-3)] + [("paper, 8k steps", 1e-3, 6, 8000)]
settings += [("04b's runs", p, CONFIG["n_layers"], CONFIG["steps"]) for p in CONFIG["p_values"]]
print(f"{'setting':16s} {'p':>7s} {'L':>3s} {'N':>7s} {'E[calls]=pLN':>13s} {'sd':>6s} {'P(no call)':>11s}")
for name, p, L, N in settings:
    print(f"{name:16s} {p:7.0e} {L:3d} {N:7d} {p * L * N:13.1f} {math.sqrt(p * L * N * (1 - p)):6.1f}"
          f" {(1 - p) ** (L * N):11.2e}")

# %% [markdown]
# The toy is short: at the paper's $p \le 10^{-3}$ it would call Sinkhorn about once or never at CPU
# scale ($pLN = 0.3$ for 2 layers and 150 steps) and about 8 times at GPU scale (4 layers, 2000
# steps). {doc}`04b-ssr-training` therefore uses much larger values, $p \in \{0.05, 0.3\}$ (`CONFIG["p_values"]`), and keep
# that difference in mind: these runs say what Sinkhorn steps *can* do when they are frequent, not
# what they do at the paper's rates.

# %% [markdown]
# (nb04-noise)=
# ## The noise: on the cost, in training only
#
# SSR's eq. (6) adds $\gamma Z$, $Z_{te}\sim\mathcal N(0,1)$, to the cost; `minimoe` applies it in
# both branches in training and never at evaluation, chooses the experts with the noisy cost, and by
# default takes the softmax-branch weights from the clean logits. Three checks on one router
# (`noise_scale=1`, softmax branch only, $p = 0$): with $k = 1$, the share of the 4,000 copies of one
# token that go to each expert is the exact top-1 probability of {ref}`Proposition 3.3 <ch3-prop-noise>`
# (so the noise is exactly $\mathcal N(0, \gamma^2)$ on the cost); with $k = 2$ the weights are the clean
# softmax renormalised over the noisy choice; and at evaluation the routing is the clean top-$k$.

# %%
row_noise = torch.tensor([1.0, 0.5, 0.0, 0.0, -0.5, -1.0, 0.3, 0.2])
copies = row_noise.expand(1, 4000, 8)
noisy1 = SelectiveSinkhorn(1, 8, k=1, p=0.0, noise_scale=1.0, seed=0).train()
share = noisy1.route(copies).mask[0].double().mean(0)
exact_noise = gaussian_top1_probability(row_noise.double(), 1.0)
se_noise = (exact_noise * (1 - exact_noise) / 4000).sqrt()
print("share of copies per expert  ", np.round(share.numpy(), 3).tolist())
print("exact top-1 probability     ", np.round(exact_noise.numpy(), 3).tolist())
assert ((share - exact_noise).abs() <= 4 * se_noise + 1e-9).all(), "training noise is N(0, gamma^2) on the cost"

noisy2 = SelectiveSinkhorn(1, 8, k=2, p=0.0, noise_scale=1.0, seed=1).train()
r_noise = noisy2.route(copies[:, :50])
clean_weights = torch.softmax(copies[:, :50].masked_fill(~r_noise.mask, -float("inf")), -1)
assert torch.allclose(r_noise.combine, clean_weights, atol=1e-6), "weights: clean softmax over the noisy choice"
assert r_noise.mask.sum(-1).eq(2).all() and len({tuple(m.tolist()) for m in r_noise.mask[0]}) > 1
noisy2.eval()
clean_top2 = torch.zeros(8, dtype=torch.bool).scatter(0, row_noise.topk(2).indices, True)
assert all(torch.equal(noisy2.route(copies[:, :50]).mask[0, t], clean_top2) for t in range(50)), "no noise at eval"
print(f"k = 2 in training: {len({tuple(m.tolist()) for m in r_noise.mask[0]})} different expert pairs for 50 "
      f"copies of one token; at evaluation always {row_noise.topk(2).indices.tolist()}")

# %% [markdown]
# ## What we saw
#
# * **Proposition 3.1** holds by exhaustive search: the renormalised top-$k$ of a positive row is the
#   $k$-sparse distribution closest in $\mathrm{KL}(w\,\|\,q)$, with divergence $-\log\sum_{j\in K} q_j$.
# * **Proposition 3.3**: the exact top-1 probability (a one-dimensional integral) matches Monte Carlo
#   within four standard errors, and the paper's product is a lower bound that is not attained once
#   $E \ge 3$. With $E$ equal experts it gives $2^{-(E-1)}$ instead of $1/E$, a factor of $16$ too small
#   at $E = 8$.
# * **The coin** is tossed per layer and per training forward, and its counts behave like a binomial
#   with independent layers. A run makes about $pLN$ Sinkhorn calls: $48$ for $p = 10^{-3}$, $L = 6$,
#   $N = 8000$, and about $pLN$ in this notebook's runs as well (the `calls` and `pLN` columns).
#
# {doc}`04b-ssr-training` trains the toy LM with every router of the chapter's comparison.

# %%
print(f"notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s")
