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
# # Gumbel-matching and the skip estimator
#
# Companion to {doc}`../book/05-balanced-assignments`. Chapter 5 proves that two samplers which
# respect expert capacity still give unbiased REINFORCE gradients: independent sampling followed by
# random skipping, and Gumbel-matching (an exact balanced assignment of Gumbel-perturbed scores)
# with the conditional importance weights of Kool, Maddison & Mnih. Every proof there is about
# problems of any size; here we check each step on problems small enough to **enumerate**, where
# the exact answer is a sum over a list. The plan:
#
# 1. the Gumbel-max trick from scratch (Proposition 5.3);
# 2. Gumbel-matching against a brute-force sampler, and cycle cancelling from scratch
#    (Proposition 5.5);
# 3. what Gumbel-matching is *not*: the Gibbs distribution, Sinkhorn's matrix, and the
#    maximum-entropy distribution (Propositions 5.4, 5.9, 5.10);
# 4. the conditionals that make the estimator computable (Propositions 5.6–5.7);
# 5. the central check: every estimator's Monte Carlo mean against the exact gradient
#    (Propositions 5.1, 5.2, 5.8);
# 6. the importance weights and the gradient variance: why GM-IW needs a high temperature.
#
# Every claim is an `assert` with a stated tolerance, so the notebook is also a test.
#
# *Notation:* this notebook keeps Kool et al.'s letters, $n$ tokens, $k$ experts and capacity $c$,
# which chapter 5 writes $T$, $E$ and $C$.
#
# *Run time:* about 10 seconds at CPU scale on a 2-core laptop CPU, the default. `MINIMOE_SCALE=gpu` chooses
# the larger configuration, for a GPU.

# %%
# Install minimoe when it is missing (e.g. on Colab), and scipy, which this notebook also uses.
import importlib.util
import subprocess
import sys

if importlib.util.find_spec("minimoe") is None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                           "minimoe[book] @ git+https://github.com/minimoe-book/minimoe", "scipy"])

# %%
import itertools
import math
import os
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from scipy import integrate
from scipy.optimize import linprog
from scipy.special import expit
from scipy.stats import chi2_contingency

import minimoe
from minimoe.ops import (balanced_assignments, count_balanced_assignments, estimator_coefficients,
                         expected_loss_gradient, floyd_warshall, gumbel_matching_conditionals,
                         gumbel_matching_sample, move_costs, reinforce_surrogate, sample_estimator, sample_gumbel,
                         sinkhorn_balance)

SCALE = os.environ.get("MINIMOE_SCALE", "cpu")  # "gpu" runs the larger configuration: chosen, never automatic
# The problems are tiny and the exact assignment solver runs on the host, so everything stays on the
# CPU; SCALE = "gpu" only buys more Monte Carlo draws (tighter error bars, larger z for the biased).
if SCALE == "cpu":
    torch.set_num_threads(1)  # the problems here are small; extra threads mostly wait on each other
DRAWS = 50_000 if SCALE == "cpu" else 500_000  # Monte Carlo draws per check
F64 = torch.float64
START = time.time()
torch.manual_seed(0)
print(f"SCALE={SCALE}, draws={DRAWS}, minimoe {minimoe.__version__}, torch {torch.__version__}")


def gen(seed):
    return torch.Generator().manual_seed(seed)


# %% [markdown]
# (nb06-scratch-skip)=
# ## The skip router from scratch
#
# The skip router (chapter 5, "The skip estimator") lets every token *sample* its expert from the
# router's softmax, then keeps a uniformly random $\min(n_e, C)$ of the $n_e$ tokens that sampled
# expert $e$. A kept token is combined with weight 1; its REINFORCE coefficient is the importance
# weight $n_{z}/\min(n_{z}, C)$, which makes the gradient unbiased (Proposition 5.2; the factor
# $p/q$ is 1 when the proposal is the softmax itself). The two random steps below use the same
# uniforms, in the same order, as the package's sampler.

# %% tags=["from-scratch"]
import torch


def skip_route(logits, capacity, generator):
    """Sampled experts z, which tokens are kept, and each token's REINFORCE coefficient."""
    T, E = logits.shape
    cdf = torch.softmax(logits.double(), -1).cumsum(-1)
    u = torch.rand(T, 1, generator=generator, dtype=torch.float64)
    z = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0].clamp_max(E - 1)   # inverse-CDF draws
    order = torch.argsort(z + torch.rand(T, generator=generator, dtype=torch.float64))  # by expert, shuffled
    n = torch.bincount(z, minlength=E)                                                  # tokens per expert
    rank = torch.empty(T, dtype=torch.long)
    rank[order] = torch.arange(T) - (n.cumsum(0) - n)[z[order]]                         # place in its queue
    keep = rank < capacity
    return z, keep, (keep * n[z]).double() / n[z].clamp_max(capacity)

# %%
from minimoe.routers import router_class

torch.manual_seed(0)
x_small = torch.randn(1, 24, 8, dtype=torch.float64)
router = router_class("kool_skip")(8, 4, generator=torch.Generator().manual_seed(5)).double().train()
routing = router(x_small)
z, keep, coefficient = skip_route(router.gate(x_small)[0].detach(), routing.capacity, torch.Generator().manual_seed(5))
assert torch.equal(z, routing.choice_expert[0, :, 0]) and torch.equal(keep.double(), routing.choice_weight[0, :, 0])
torch.testing.assert_close(coefficient, routing.reinforce_weight[0], rtol=1e-6, atol=0)
print(f"C = {routing.capacity}: the same draws, {int((~keep).sum())} tokens skipped; coefficients",
      sorted(set(coefficient[keep].tolist())))

# %% [markdown]
# (nb06-gumbel-max)=
# ## The Gumbel-max trick
#
# {ref}`Proposition 5.3 <ch5-prop-gumbel-max>`: if $g_1,\dots,g_k$ are i.i.d. standard Gumbel, then
# $\arg\max_j(\alpha_j + g_j)$ is distributed as $\mathrm{softmax}(\alpha)$. A standard Gumbel is
# $-\log(-\log U)$ with $U$ uniform on $(0, 1)$. A floating-point uniform can be exactly $0$ (and,
# after rounding, $1$), and both ends give an infinite Gumbel, so we clamp $U$ to
# $[\text{tiny}, 1-\text{eps}]$ of the dtype first.

# %%
def my_gumbel(shape, generator):
    """Standard Gumbel noise -log(-log U), with U kept inside [tiny, 1 - eps] of float64."""
    info = torch.finfo(F64)
    u = torch.rand(shape, generator=generator, dtype=F64).clamp(info.tiny, 1 - info.eps)
    return -torch.log(-torch.log(u))


ends = torch.tensor([0.0, 1.0], dtype=F64)
info = torch.finfo(F64)
print("U = 0 and U = 1 without clamping give", (-torch.log(-torch.log(ends))).tolist())
print("with clamping, the extreme Gumbels are", (-torch.log(-torch.log(ends.clamp(info.tiny, 1 - info.eps)))).tolist())
# minimoe's sampler is the same recipe: identical draws from the same generator state
assert torch.equal(my_gumbel((1000, 5), gen(1)), sample_gumbel((1000, 5), generator=gen(1)))

# %% [markdown]
# Now the trick itself: $5\cdot$`DRAWS` argmaxes of $\alpha + \mathbf g$ for five random
# logits. Each frequency is a binomial proportion, so its standard error is
# $\sqrt{p_j(1-p_j)/N}$. The bars in the figure are $\pm4.5$ standard errors: with five
# coordinates, a correct sampler falls outside them with probability below $10^{-4}$. Look for the
# dots sitting on the softmax bars.

# %%
alpha = torch.randn(5, generator=gen(2), dtype=F64) * 1.2
N1 = 5 * DRAWS
winners = (alpha + my_gumbel((N1, 5), gen(3))).argmax(-1)
freq = torch.bincount(winners, minlength=5).double() / N1
p_alpha = torch.softmax(alpha, 0)
se = torch.sqrt(p_alpha * (1 - p_alpha) / N1)
z_gumbel = ((freq - p_alpha) / se).abs()
print("softmax    ", np.round(p_alpha.numpy(), 4))
print("frequencies", np.round(freq.numpy(), 4), f" max |z| = {z_gumbel.max():.2f}")
assert (z_gumbel <= 4.5).all(), "argmax(alpha + Gumbel) is distributed as softmax(alpha)"

# temperature: argmax(a / tau + g) = argmax(a + tau g), draw by draw
g = my_gumbel((N1, 5), gen(4))
assert torch.equal((alpha / 0.3 + g).argmax(-1), (alpha + 0.3 * g).argmax(-1))

# %% [markdown]
# For $k = 2$ the trick says more: $L = g_2 - g_1$ is a standard logistic variable,
# $\Pr(L\le x) = \sigma(x)$, so expert 2 wins with probability $\sigma(\alpha_2 - \alpha_1)$. We
# compare the empirical distribution of $L$ with $\sigma$ by the Kolmogorov distance, against the
# Dvoretzky–Kiefer–Wolfowitz bound $\sqrt{\log(2/\delta)/(2N)}$ at $\delta = 10^{-4}$, and the
# win frequencies with $\sigma(\alpha_2 - \alpha_1)$ on a grid of logit differences. This is the
# fact behind the $k = 2$ closed forms of chapter 5 and behind Proposition 5.4 below.

# %%
pair = my_gumbel((N1, 2), gen(5))
L = (pair[:, 1] - pair[:, 0]).sort().values
ecdf = torch.arange(1, N1 + 1, dtype=F64) / N1
kolmogorov = float(torch.maximum((ecdf - torch.sigmoid(L)).abs(), (ecdf - 1 / N1 - torch.sigmoid(L)).abs()).max())
dkw = math.sqrt(math.log(2 / 1e-4) / (2 * N1))
print(f"sup |ECDF(g2 - g1) - sigmoid| = {kolmogorov:.4f}  (DKW bound at delta = 1e-4: {dkw:.4f})")
assert kolmogorov < dkw, "g2 - g1 is standard logistic"

differences = np.linspace(-4, 4, 9)
wins = np.array([float((L > -d).double().mean()) for d in differences])
win_se = np.sqrt(expit(differences) * (1 - expit(differences)) / N1)
assert (np.abs(wins - expit(differences)) <= 4.5 * win_se + 1e-12).all()

fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
ax = axes[0]
ax.bar(range(5), p_alpha.numpy(), color="lightgrey", label="softmax(alpha)")
ax.errorbar(range(5), freq.numpy(), yerr=4.5 * se.numpy(), fmt="o", color="tab:red", capsize=4,
            label=f"argmax frequency ± 4.5 s.e. (N={N1})")
ax.set_xlabel("option j")
ax.set_ylabel("probability")
ax.set_title("Gumbel-max: frequencies = softmax")
ax.legend(fontsize=8)
ax = axes[1]
grid = np.linspace(-8, 8, 400)
ax.hist(L.numpy(), bins=160, range=(-8, 8), density=True, color="lightgrey", label="g2 - g1 (histogram)")
ax.plot(grid, expit(grid) * (1 - expit(grid)), color="tab:blue", label="logistic density")
ax.set_xlabel("g2 - g1")
ax.set_ylabel("density")
ax.set_title("k = 2: the noise difference is logistic")
ax.legend(fontsize=8)
ax = axes[2]
ax.plot(grid / 2, expit(grid / 2), color="tab:blue", label="sigmoid(a2 - a1)")
ax.errorbar(differences, wins, yerr=4.5 * win_se, fmt="o", color="tab:red", capsize=3, label="win frequency ± 4.5 s.e.")
ax.set_xlabel("a2 - a1")
ax.set_ylabel("P(option 2 wins)")
ax.set_title("k = 2: option 2 wins with probability sigmoid")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# (nb06-gm-law)=
# ## Gumbel-matching on problems we can list
#
# Gumbel-matching ({ref}`eq. (4) <ch5-gm>`) perturbs every score, $s = a/\tau + \mathbf G$, and takes
# the best *balanced* assignment: $n$ tokens, $k$ experts, exactly $c = n/k$ tokens per expert. There
# are $n!/(c!)^k$ balanced assignments: 6 for $(n, k, c) = (4, 2, 2)$, 90 for $(6, 3, 2)$, 2520 for
# $(8, 4, 2)$. We list them ourselves (place the tokens one at a time into any expert that still has
# room) and check the list against `minimoe.ops.balanced_assignments`.

# %%
def enumerate_assignments(n, capacities):
    """Every z in [0, k)^n that puts exactly capacities[j] tokens on expert j (sum(capacities) = n),
    in lexicographic order."""
    if n == 0:
        return [()]
    out = []
    for j, room in enumerate(capacities):
        if room:
            rest = list(capacities)
            rest[j] -= 1
            out += [(j,) + tail for tail in enumerate_assignments(n - 1, rest)]
    return out


for n, k, c in [(4, 2, 2), (6, 3, 2), (8, 2, 4), (8, 4, 2), (4, 4, 1)]:
    mine = enumerate_assignments(n, [c] * k)
    assert len(mine) == math.factorial(n) // math.factorial(c) ** k == count_balanced_assignments(n, k, c)
    assert torch.equal(torch.tensor(mine), balanced_assignments(n, k, c))
    print(f"(n, k, c) = {(n, k, c)}: {len(mine)} balanced assignments")

# %% [markdown]
# The brute-force sampler is the definition: the total perturbed score of every assignment, and the
# argmax. It is exact and needs no algorithm, only patience ($n!/(c!)^k$ totals per draw). With the
# *same* noise it must return the same assignment as `gumbel_matching_sample`, draw by draw (ties
# have probability zero); that checks each of minimoe's exact solvers: the assignment solver, cycle
# cancelling, and the sort used for two experts.

# %%
def onehot_list(Z, k):
    return F.one_hot(torch.as_tensor(Z), k).to(F64)            # (M, n, k)


def brute_force_gm(logits, tau, capacity, gumbels, chunk=20_000):
    """Gumbel-matching by enumeration: argmax over all balanced z of sum_i s[i, z_i], s = logits/tau + G."""
    n, k = logits.shape[-2:]
    Z = torch.tensor(enumerate_assignments(n, [capacity] * k))
    onehot = onehot_list(Z, k)
    out = []
    for G in gumbels.split(chunk):
        totals = torch.einsum("bnk,mnk->bm", logits / tau + G, onehot)
        out.append(Z[totals.argmax(-1)])
    return torch.cat(out)


def assignment_codes(z, k):
    """The index of each assignment in the lexicographic list (base-k digits)."""
    n = z.shape[-1]
    return (z * k ** torch.arange(n - 1, -1, -1)).sum(-1)


law = {}
for n, k, c, tau, seed in [(4, 2, 2, 1.0, 10), (6, 3, 2, 1.5, 11)]:
    logits = torch.randn(n, k, generator=gen(seed), dtype=F64)
    G = sample_gumbel((DRAWS, n, k), generator=gen(seed + 100))
    brute = brute_force_gm(logits, tau, c, G)
    for method in ("assignment", "cycle", "top2")[:3 if k == 2 else 2]:
        same_noise = gumbel_matching_sample(logits.expand(DRAWS, n, k), c, tau=tau, gumbels=G, method=method)
        assert torch.equal(same_noise, brute), method
    # the law: minimoe with its own noise against the brute force with independent noise
    ours = gumbel_matching_sample(logits.expand(DRAWS, n, k), c, tau=tau, generator=gen(seed + 200))
    codes = assignment_codes(torch.tensor(enumerate_assignments(n, [c] * k)), k)
    counts = [torch.bincount(torch.searchsorted(codes, assignment_codes(z, k)), minlength=len(codes))
              for z in (ours, brute)]
    table = torch.stack(counts).numpy()
    rare = table.sum(0) < 10                                        # pool rare assignments into one cell
    table = np.concatenate([table[:, ~rare], table[:, rare].sum(1, keepdims=True)], 1) if rare.any() else table
    p_value = chi2_contingency(table)[1]
    # the Gibbs law at the same temperature, for the picture (section nb06-gibbs explains it)
    Z = torch.tensor(enumerate_assignments(n, [c] * k))
    gibbs = torch.softmax((onehot_list(Z, k) * logits).sum((1, 2)) / tau, 0)
    law[n, k, c] = (counts, gibbs, tau)
    print(f"(n, k, c) = {(n, k, c)}, tau = {tau}: same noise -> identical draws; independent noise -> "
          f"chi-square p = {p_value:.3f} over {table.shape[1]} assignments")
    assert p_value > 1e-3, "minimoe and the brute force sample the same law"


# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 3.8), gridspec_kw={"width_ratios": [1, 3]})
for ax, ((n, k, c), (counts, gibbs, tau)) in zip(axes, law.items()):
    order = torch.argsort(gibbs, descending=True)
    x = np.arange(len(order))
    ax.bar(x - 0.2, counts[0][order].numpy() / DRAWS, width=0.4, color="tab:blue", label="minimoe")
    ax.bar(x + 0.2, counts[1][order].numpy() / DRAWS, width=0.4, color="tab:orange", label="brute force")
    ax.plot(x, gibbs[order].numpy(), "k.", ms=4, label="Gibbs (for comparison)")
    ax.set_xlabel("balanced assignment (sorted by Gibbs probability)")
    ax.set_ylabel("probability")
    ax.set_title(f"GM law, (n, k, c) = {(n, k, c)}, tau = {tau}")
    ax.legend(fontsize=8)
axes[1].set_yscale("log")
plt.tight_layout()
plt.show()

# %% [markdown]
# The two samplers agree on every assignment (the right panel has a log scale, so the rare ones
# are visible too). The black dots are the Gibbs distribution at the same temperature: here the
# most likely assignments are *less* likely under Gumbel-matching. We come back to this in the next
# section.
#
# ### Cycle cancelling from scratch
#
# Enumeration does not scale. Kool et al. solve eq. (4) by cycle cancelling, and
# {ref}`Proposition 5.5 <ch5-prop-cycles>` is why it works: a balanced assignment is optimal if and
# only if the graph on the $k$ experts, with edge $j\to j'$ costing the cheapest single move
# $d_{jj'} = \min_{i:z_i=j}(s_{ij} - s_{ij'})$, has no negative cycle. The algorithm, in full:
#
# 1. start from any balanced assignment (we shuffle one; minimoe starts greedily);
# 2. compute $d$ with one scatter-min over the tokens, remembering which token realises each edge;
# 3. look for a negative cycle with Bellman–Ford from a virtual source: if something still
#    improves after $k$ sweeps, the predecessor pointers lead into a negative cycle;
# 4. if there is none, stop: Floyd–Warshall's diagonal certifies it. Otherwise move each edge's
#    token one step along the cycle (each expert still has $c$ tokens; the total rises by the
#    cycle's cost) and go back to 2.

# %%
def my_move_costs(scores, z):
    """d[j, j'] = min over tokens i in expert j of s[i, j] - s[i, j'] (scatter-min), and the argmin token."""
    n, k = scores.shape
    loss = scores.gather(1, z[:, None]) - scores                   # (n, k): what moving i to j' loses
    index = z[:, None].expand(n, k)
    cost = torch.full((k, k), math.inf, dtype=F64).scatter_reduce(0, index, loss, "amin")
    # the first token of expert j that attains the minimum
    hits = loss == cost[z]                                         # cost[z][i, j'] = d[z_i, j']
    token = torch.full((k, k), n, dtype=torch.long).scatter_reduce(
        0, index, torch.where(hits, torch.arange(n)[:, None], n), "amin")
    cost.fill_diagonal_(0.0)
    return cost, token


def my_floyd_warshall(cost):
    """All-pairs shortest paths: for each intermediate expert m, every pair at once."""
    D = cost.clone()
    for m in range(D.shape[0]):
        D = torch.minimum(D, D[:, m:m + 1] + D[m:m + 1, :])
    return D


def find_negative_cycle(cost, tol):
    """Bellman-Ford from a virtual source joined to every expert at cost 0. Returns the edges
    [(u, v), ...] of a negative cycle, or None when every cycle costs at least -k * tol."""
    k = cost.shape[0]
    dist = torch.zeros(k, dtype=F64)
    pred = torch.full((k,), -1, dtype=torch.long)
    for _ in range(k):
        best, via = (dist[:, None] + cost).min(0)                  # best way into each v
        improved = best < dist - tol
        if not improved.any():
            return None
        dist, pred = torch.where(improved, best, dist), torch.where(improved, via, pred)
    v = int(improved.nonzero()[0])
    for _ in range(k):                                              # k steps back land on the cycle
        v = int(pred[v])
    cycle, u = [], v
    while True:
        cycle.append((int(pred[u]), u))
        u = int(pred[u])
        if u == v:
            return cycle[::-1]


# %%
def objective(scores, z):
    return float(scores.gather(1, z[:, None]).sum())


def my_cycle_cancelling(scores, capacity, generator):
    n, k = scores.shape
    z = torch.arange(k).repeat_interleave(capacity)[torch.randperm(n, generator=generator)]
    tol = 1e-9 * (1 + float(scores.abs().max()))
    history = [objective(scores, z)]
    while True:
        cost, token = my_move_costs(scores, z)
        cycle = find_negative_cycle(cost, tol)
        if cycle is None:
            break
        assert sum(float(cost[u, v]) for u, v in cycle) < 0
        movers = [(int(token[u, v]), v) for u, v in cycle]          # distinct tokens: one per expert u
        for i, v in movers:
            z[i] = v
        history.append(objective(scores, z))
    assert (my_floyd_warshall(cost).diagonal() >= -k * tol).all(), "no negative cycle: optimal"
    return z, history


# %% [markdown]
# We run it on 200 random instances ($k\le5$, $c\le6$, random temperatures) and compare with
# `gumbel_matching_sample(method="assignment")` (scipy's exact assignment solver on the
# column-replicated matrix) and, when $n \le 8$, with the brute force. We also check our move costs
# and Floyd–Warshall against `minimoe.ops.move_costs` and `minimoe.ops.floyd_warshall`, and the
# other direction of Proposition 5.5: breaking an optimum by swapping two tokens always creates a
# negative cycle, and cancelling it strictly helps.

# %%
rng = np.random.default_rng(0)
passes, brute_checked = [], 0
for trial in range(200):
    k, c = int(rng.integers(2, 6)), int(rng.integers(1, 7))
    n, tau = k * c, float(rng.uniform(0.3, 3))
    logits = torch.randn(n, k, generator=gen(1000 + trial), dtype=F64) * 2
    G = sample_gumbel((n, k), generator=gen(2000 + trial))
    scores = logits / tau + G
    z_mine, history = my_cycle_cancelling(scores, c, gen(trial))
    z_lsa = gumbel_matching_sample(logits, c, tau=tau, gumbels=G, method="assignment")
    assert abs(objective(scores, z_mine) - objective(scores, z_lsa)) < 1e-9 and torch.equal(z_mine, z_lsa)
    assert all(b > a for a, b in zip(history, history[1:])), "every cancelled cycle raises the total"
    passes.append(len(history) - 1)
    cost_mine, _ = my_move_costs(scores, z_mine)
    cost_pkg, _ = move_costs(scores, z_mine)
    assert torch.allclose(cost_mine, cost_pkg, atol=1e-12)
    assert torch.allclose(my_floyd_warshall(cost_mine), floyd_warshall(cost_pkg), atol=1e-12)
    if n <= 8:
        assert torch.equal(z_mine, brute_force_gm(logits, tau, c, G[None])[0])
        brute_checked += 1
    # break the optimum: swap one token of expert 0 with one of expert 1
    broken = z_mine.clone()
    i0, i1 = int((z_mine == 0).nonzero()[0]), int((z_mine == 1).nonzero()[0])
    broken[i0], broken[i1] = 1, 0
    before = objective(scores, broken)
    cost_b, token_b = my_move_costs(scores, broken)
    cycle = find_negative_cycle(cost_b, 1e-9 * (1 + float(scores.abs().max())))
    assert cycle is not None, "a suboptimal assignment has a negative cycle"
    for i, v in [(int(token_b[u, v]), v) for u, v in cycle]:
        broken[i] = v
    assert objective(scores, broken) > before, "cancelling it strictly improves the total"
print(f"200/200 instances: cycle cancelling = assignment solver ({brute_checked} also = brute force); "
      f"passes from a random start: median {int(np.median(passes))}, max {max(passes)}")

# %% [markdown]
# How fast does the total climb? On larger instances (a few hundred tokens) we record the gap to
# the optimum after each cancelled cycle (an exact zero is drawn at $10^{-16}$). The gap falls to
# zero: at the end there is no negative cycle, and that is a proof of optimality, not a heuristic
# stop.

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.8))
for k, c, seed in [(2, 100, 0), (4, 60, 1), (8, 30, 2)]:
    n = k * c
    logits = torch.randn(n, k, generator=gen(3000 + seed), dtype=F64)
    G = sample_gumbel((n, k), generator=gen(4000 + seed))
    z_mine, history = my_cycle_cancelling(logits + G, c, gen(seed))
    best = objective(logits + G, gumbel_matching_sample(logits, c, gumbels=G, method="assignment"))
    assert abs(history[-1] - best) < 1e-9
    gaps = np.maximum(best - np.array(history), 1e-16)
    ax.semilogy(gaps, marker=".", ms=3, label=f"n={n}, k={k}: {len(history) - 1} passes")
ax.set_xlabel("cancelled cycles")
ax.set_ylabel("optimal total - current total")
ax.set_title("Cycle cancelling from a random balanced start")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# (nb06-gibbs)=
# ## What Gumbel-matching is not: Gibbs, Sinkhorn, maximum entropy
#
# Giving every *assignment* its own Gumbel and taking the argmax would sample the Gibbs distribution
# $p(\mathbf z)\propto\exp(\frac1\tau\sum_iz_{ij}a_{ij})$ over $\mathcal Z$ (Proposition 5.3 on a
# list of $n!/(c!)^k$ options). Gumbel-matching adds one Gumbel per *entry* instead, so assignments
# that share entries share noise. On problems we can list, the Gibbs marginals
# $\Pr(z_i = j)$ are exact sums; the Gumbel-matching marginals have no formula, so we estimate them
# from $2\cdot$`DRAWS` draws; and Sinkhorn's matrix $\tilde P$ is the balancing of
# $\mathrm{softmax}(a/\tau)$ ({py:func}`minimoe.ops.sinkhorn_balance`). Four shapes, one random
# instance each ($a\sim\mathcal N(0,1)$, $\tau = 1$); the table gives the largest gap between each
# pair of marginal matrices.

# %%
N3 = 2 * DRAWS
rows, scatter = [], {}
for n, k, c in [(4, 2, 2), (6, 3, 2), (8, 2, 4), (8, 4, 2)]:
    a = torch.randn(n, k, generator=gen(30 + n + k), dtype=F64)
    onehot = onehot_list(enumerate_assignments(n, [c] * k), k)
    gibbs_law = torch.softmax((onehot * a).sum((1, 2)), 0)
    gibbs = (gibbs_law[:, None, None] * onehot).sum(0)
    draws = gumbel_matching_sample(a.expand(N3, n, k), c, generator=gen(40 + n + k))
    gm = F.one_hot(draws, k).double().mean(0)
    gm_se = torch.sqrt(gm * (1 - gm) / N3).clamp_min(1e-12)
    sh = sinkhorn_balance(a)
    gm_gibbs, sh_gibbs, sh_gm = [float((x - y).abs().max()) for x, y in ((gm, gibbs), (sh, gibbs), (sh, gm))]
    z_not_gibbs = float(((gm - gibbs) / gm_se).abs().max())
    rows.append(((n, k, c), gm_gibbs, sh_gibbs, sh_gm, float(gm_se.max()), z_not_gibbs))
    scatter[n, k, c] = (gibbs, gm, sh)
    assert z_not_gibbs > 6, "Gumbel-matching is not Gibbs"
    assert sh_gm < sh_gibbs and sh_gm < gm_gibbs, "Sinkhorn tracks the Gumbel-matching marginals best"
print(f"{'(n,k,c)':>10} {'max|GM-Gibbs|':>14} {'max|SH-Gibbs|':>14} {'max|SH-GM|':>11} {'GM s.e.':>8} {'GM vs Gibbs z':>14}")
for shape, *vals, z in rows:
    print(f"{str(shape):>10} {vals[0]:14.3f} {vals[1]:14.3f} {vals[2]:11.3f} {vals[3]:8.4f} {z:14.1f}")

fig, axes = plt.subplots(1, 4, figsize=(14, 3.6), sharex=True, sharey=True)
for ax, ((n, k, c), (gibbs, gm, sh)) in zip(axes, scatter.items()):
    gm_se = torch.sqrt(gm * (1 - gm) / N3)
    ax.axhline(0, color="lightgrey")
    ax.axvline(1 / k, color="grey", ls=":", lw=1)
    ax.errorbar(gibbs.flatten(), (gm - gibbs).flatten(), yerr=1.96 * gm_se.flatten(), fmt="o", ms=4, capsize=2,
                color="tab:blue", label="Gumbel-matching (MC ± 1.96 s.e.)")
    ax.plot(gibbs.flatten(), (sh - gibbs).flatten(), "x", ms=6, color="tab:red", label="Sinkhorn")
    ax.set_title(f"(n, k, c) = {(n, k, c)}")
    ax.set_xlabel("Gibbs marginal P(z_i = j)")
axes[0].set_ylabel("marginal - Gibbs marginal")
axes[0].legend(fontsize=8)
fig.suptitle("Gumbel-matching and Sinkhorn marginals minus the Gibbs marginals (dotted: 1/k)")
plt.tight_layout()
plt.show()

# %% [markdown]
# The differences run downhill: where Gibbs is confident (large marginals), Gumbel-matching is less
# so, and where Gibbs gives little, Gumbel-matching gives more. On these instances its marginals are
# pulled towards $1/k$: Gumbel-matching looks "hotter" than Gibbs at the same $\tau$. That is an
# observation here, not a theorem; Proposition 5.4 proves it for $n = k = 2$ only, below.
# Sinkhorn's marginals (red) sit on top of the Gumbel-matching ones (blue), much closer to them than
# to Gibbs. At $n = 8$ the Sinkhorn–GM gap
# is close to the Monte Carlo error itself.

# %% [markdown]
# (nb06-gm-vs-gibbs)=
# ### The whole law, beyond $n = k = 2$
#
# Marginals hide much of a law on $\mathcal Z$. On the smallest problems beyond $2\times2$ we can
# compare the two laws on *every* balanced assignment: six instances ($a\sim\mathcal N(0,1)$,
# $\tau = 1$) of shapes $(3,3,1)$, $(4,2,2)$ and $(4,4,1)$, with 200,000 Gumbel-matching draws each,
# solved by brute force over the list (the argmax of $\langle\mathbf z, s\rangle$ over $\mathcal Z$,
# cross-checked against {py:func}`minimoe.ops.gumbel_matching_sample` on the first 2,000). The chapter
# claims: the laws differ (chi-square), but their total variation distance is only about 0.06–0.11,
# and Gumbel-matching is hotter: higher entropy, marginals closer to $1/k$.

# %%
NG = 200_000
print(f"{'(n,k,c)':>10} {'seed':>4} {'|Z|':>4} {'TV(GM, Gibbs)':>14} {'H(GM)':>7} {'H(Gibbs)':>9} {'chi2 p':>8}")
for (n, k, c), seed in [((3, 3, 1), 0), ((3, 3, 1), 1), ((4, 2, 2), 0), ((4, 2, 2), 1), ((4, 4, 1), 1), ((4, 4, 1), 2)]:
    Z = balanced_assignments(n, k, c)
    onehot = F.one_hot(Z, k).double()
    a = torch.randn(n, k, generator=gen(seed), dtype=F64)
    gibbs_law = torch.softmax((onehot * a).sum((1, 2)), 0)
    scores = a + sample_gumbel((NG, n, k), generator=gen(100 + seed))
    index = torch.einsum("bnk,mnk->bm", scores, onehot).argmax(-1)
    assert torch.equal(Z[index[:2000]], gumbel_matching_sample(a.expand(2000, n, k), c, gumbels=scores[:2000] - a))
    counts = torch.bincount(index, minlength=len(Z)).double()
    gm_law = counts / NG
    tv = 0.5 * float((gm_law - gibbs_law).abs().sum())
    entropy_gm = float(-(gm_law * gm_law.clamp_min(1e-300).log()).sum())
    entropy_gibbs = float(-(gibbs_law * gibbs_law.log()).sum())
    p_value = chi2_contingency(np.stack([counts.numpy(), (gibbs_law * NG).numpy()]))[1]
    print(f"{str((n, k, c)):>10} {seed:4} {len(Z):4} {tv:14.3f} {entropy_gm:7.3f} {entropy_gibbs:9.3f} {p_value:8.1e}")
    assert p_value < 1e-9, "the laws differ"
    assert 0.04 < tv < 0.2, "... but not by much"
    assert entropy_gm > entropy_gibbs + 0.05, "Gumbel-matching is hotter"
    gm_m, gibbs_m = (gm_law[:, None, None] * onehot).sum(0), (gibbs_law[:, None, None] * onehot).sum(0)
    assert (gm_m - 1 / k).abs().sum() < (gibbs_m - 1 / k).abs().sum(), "... its marginals are closer to 1/k"

# %% [markdown]
# (nb06-prop54)=
# ### The smallest counterexample (Proposition 5.4)
#
# With $n = k = 2$, $c = 1$ there are two assignments, the diagonal and the swap. With
# $\ell = (a_{11} + a_{22} - a_{12} - a_{21})/\tau$, Gibbs puts $\sigma(\ell)$ on the diagonal.
# Gumbel-matching picks the diagonal when $\ell + L_1 + L_2 > 0$ for two independent logistics,
# so its probability is $\mathbb E\,\sigma(\ell + L)$, a one-dimensional integral that we do by
# quadrature. We also sample both: Gumbel-matching with minimoe, and Gibbs by the exact
# Gumbel-max over the two assignments (one Gumbel per assignment).

# %%
def gm_diagonal_probability(ell):
    """E sigma(ell + L), L standard logistic, by quadrature."""
    value, _ = integrate.quad(lambda x: expit(ell + x) * expit(x) * expit(-x), -60, 60, epsabs=1e-13, points=[0.0])
    return value


quadrature = {ell: gm_diagonal_probability(ell) for ell in (0.5, 1.0, 2.0, 4.0)}
print(" ell   Gibbs sigma(ell)   Gumbel-matching E sigma(ell + L)")
for ell, value in quadrature.items():
    print(f"{ell:4}   {expit(ell):.4f}             {value:.4f}")
reference = {0.5: 0.5826, 1.0: 0.6613, 2.0: 0.7945, 4.0: 0.9426}  # an independent quadrature, 4 decimals
assert all(abs(quadrature[ell] - reference[ell]) < 1e-4 for ell in reference)
assert expit(1.0) - quadrature[1.0] > 0.03, "GM is not Gibbs: 0.661 against 0.731 at ell = 1"
for ell in np.linspace(0.1, 6, 30):
    assert 0.5 < gm_diagonal_probability(ell) < expit(ell), "strictly between 1/2 and sigma(ell) (proof of 5.4)"

N22 = max(50_000, DRAWS)
ells = np.linspace(-4, 4, 9)
mc_gm, mc_gibbs = [], []
for idx, ell in enumerate(ells):
    logits = torch.tensor([[ell, 0.0], [0.0, 0.0]], dtype=F64)
    z = gumbel_matching_sample(logits.expand(N22, 2, 2), 1, generator=gen(50 + idx))
    mc_gm.append(float((z[:, 0] == 0).double().mean()))       # token 0 on expert 0 means the diagonal
    totals = torch.tensor([ell, 0.0], dtype=F64) + my_gumbel((N22, 2), gen(70 + idx))  # one Gumbel per assignment
    mc_gibbs.append(float((totals.argmax(-1) == 0).double().mean()))
mc_gm, mc_gibbs = np.array(mc_gm), np.array(mc_gibbs)
exact_gm = np.array([gm_diagonal_probability(ell) for ell in ells])
for mc, exact in ((mc_gm, exact_gm), (mc_gibbs, expit(ells))):
    assert (np.abs(mc - exact) <= 4.5 * np.sqrt(exact * (1 - exact) / N22)).all()
print(f"Monte Carlo (N = {N22} per point) matches the quadrature and sigma within 4.5 s.e. at all {len(ells)} points")

fig, ax = plt.subplots(figsize=(6.5, 3.8))
fine = np.linspace(-5, 5, 201)
ax.plot(fine, expit(fine), color="black", label="Gibbs: sigma(l)")
ax.plot(fine, [gm_diagonal_probability(x) for x in fine], color="tab:blue", label="Gumbel-matching: E sigma(l + L)")
ax.plot(ells, mc_gibbs, "s", mfc="none", color="black", label="Gibbs, one Gumbel per assignment (MC)")
ax.plot(ells, mc_gm, "o", color="tab:blue", label="minimoe Gumbel-matching (MC)")
ax.set_xlabel("l = (a11 + a22 - a12 - a21) / tau")
ax.set_ylabel("P(diagonal assignment)")
ax.set_title("n = k = 2: Gumbel-matching is hotter than Gibbs")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# (nb06-invariance)=
# ### Row and column shifts change nothing (Proposition 5.9)
#
# On a balanced assignment, adding $\rho_i + \kappa_j$ to every score adds the same constant
# $\sum_i\rho_i + c\sum_j\kappa_j$ to every feasible total, so the argmax cannot move, and the
# conditionals of section {ref}`nb06-conditionals` cannot either. In particular, sampling from
# Sinkhorn's $\log\tilde P$ (which is $a/\tau$ plus row and column potentials) is the same as
# sampling from $a/\tau$. We check it on 200 problems at once, with the same noise: the assignments
# must be identical, and the conditionals equal to rounding.

# %%
B, n, k, c, tau = 200, 6, 3, 2, 0.7
a = torch.randn(B, n, k, generator=gen(80), dtype=F64) * 2
G = sample_gumbel((B, n, k), generator=gen(81))
shifted = a + tau * (3 * torch.randn(B, n, 1, generator=gen(82), dtype=F64)
                     + 3 * torch.randn(B, 1, k, generator=gen(83), dtype=F64))
balanced = sinkhorn_balance(a, tau=tau, log=True)            # log P~, used at temperature 1
z_plain = gumbel_matching_sample(a, c, tau=tau, gumbels=G)
q_plain = gumbel_matching_conditionals(a, G, z_plain, tau=tau)
for name, logits, t in (("row + column shifts", shifted, tau), ("Sinkhorn's log P~", balanced, 1.0)):
    z = gumbel_matching_sample(logits, c, tau=t, gumbels=G)
    q = gumbel_matching_conditionals(logits, G, z, tau=t)
    deviation = float((q - q_plain).abs().max())
    print(f"{name}: identical assignments {torch.equal(z, z_plain)}, max conditional change {deviation:.1e}")
    assert torch.equal(z, z_plain) and deviation < 1e-10
# independent sampling, by contrast, does feel a column shift: softmax(a + kappa) != softmax(a)
assert (torch.softmax(shifted / tau, -1) - torch.softmax(a / tau, -1)).abs().max() > 0.1

# With slack (n = 5 tokens, k = 3, c = 2: one free slot) the proposition is false for column shifts:
# the value of z changes by sum_j kappa_j n_j(z), which depends on the loads. Row shifts still do nothing.
n5 = 5
a5 = torch.randn(B, n5, k, generator=gen(84), dtype=F64) * 2
G5 = sample_gumbel((B, n5, k), generator=gen(85))
z5 = gumbel_matching_sample(a5, c, gumbels=G5)
rows5 = gumbel_matching_sample(a5 + 3 * torch.randn(B, n5, 1, generator=gen(86), dtype=F64), c, gumbels=G5)
cols5 = gumbel_matching_sample(a5 + 3 * torch.randn(B, 1, k, generator=gen(87), dtype=F64), c, gumbels=G5)
moved = float((cols5 != z5).any(-1).double().mean())
print(f"with slack: row shifts identical {torch.equal(rows5, z5)}; a column shift moves a token in {moved:.0%} of draws")
assert torch.equal(rows5, z5) and moved > 0.1
# the smallest counterexample: one token, two experts, c = 1 is independent sampling, softmax(a + kappa)
one, kappa1 = torch.tensor([[0.3, -0.2]], dtype=F64), torch.tensor([[0.0, 1.5]], dtype=F64)
for shift in (torch.zeros_like(kappa1), kappa1):
    exact1 = float(torch.softmax(one + shift, -1)[0, 1])
    freq1 = float(gumbel_matching_sample((one + shift).expand(DRAWS, 1, 2), 1, generator=gen(88)).double().mean())
    print(f"one token, shift {shift.tolist()}: P(expert 2) = {freq1:.4f} by Monte Carlo, {exact1:.4f} exactly")
    assert abs(freq1 - exact1) < 4.5 * math.sqrt(exact1 * (1 - exact1) / DRAWS)

# %% [markdown]
# (nb06-maxent)=
# ### The maximum-entropy distribution with given marginals (Proposition 5.10)
#
# Sinkhorn's $\tilde P$ is balanced, so it is a mixture of balanced assignments, in many ways. Among
# all distributions $\alpha$ on $\mathcal Z$ with marginals $\tilde P$, the one of largest entropy is
# a Gibbs distribution $\alpha_{\mathbf z}\propto\prod_iu_{iz_i}$. Its potentials $\lambda = \log u$
# minimise the convex dual
#
# $$F(\lambda) = \log\mathrm{Perm}(e^\lambda) - \langle\lambda,\tilde P\rangle,\qquad
# \mathrm{Perm}(U) = \sum_{\mathbf z\in\mathcal Z}\prod_iu_{iz_i},$$
#
# whose gradient is $\mu(\lambda) - \tilde P$ (the Gibbs marginals minus the targets) and whose
# Hessian is the covariance of $\mathbf z$ under $\alpha$. By enumeration both are sums over
# $\mathcal Z$, so Newton's method is a few lines. The Hessian is singular along the gauge
# directions $\lambda_{ij}\to\lambda_{ij}+\rho_i+\kappa_j$, which change nothing on $\mathcal Z$; a
# pseudo-inverse simply ignores them.

# %%
def fit_maxent(P, onehot):
    """Newton on F(lambda) = logsumexp_z <z, lambda> - <lambda, P> over the list of assignments."""
    Zf = onehot.reshape(len(onehot), -1)
    target = P.reshape(-1)
    lam = torch.zeros_like(target)

    def value(lam):
        return float(torch.logsumexp(Zf @ lam, 0) - lam @ target)

    for iteration in range(100):
        w = torch.softmax(Zf @ lam, 0)
        mu = w @ Zf
        grad = mu - target
        if grad.abs().max() < 1e-12:
            break
        hessian = Zf.T @ (w[:, None] * Zf) - torch.outer(mu, mu)
        step = torch.linalg.pinv(hessian, hermitian=True, rtol=1e-10) @ grad
        t = 1.0
        while value(lam - t * step) > value(lam) - 0.25 * t * float(grad @ step) and t > 1e-8:
            t /= 2                                                  # backtracking (rarely needed)
        lam = lam - t * step
    return lam.reshape(P.shape), float(grad.abs().max()), iteration


def double_centre(x):
    return x - x.mean(1, keepdim=True) - x.mean(0, keepdim=True) + x.mean()


def permanent_check(P, lam, n, k, c):
    """max |u_ij Perm(U_-ij) / Perm(U) - P~_ij|, with U_-ij = row i removed and one slot fewer at j."""
    u = lam.exp()
    assignments = enumerate_assignments(n, [c] * k)
    perm = sum(math.prod(float(u[i, zi]) for i, zi in enumerate(z)) for z in assignments)
    formula = torch.zeros(n, k, dtype=F64)
    for i, j in itertools.product(range(n), range(k)):
        others = [t for t in range(n) if t != i]
        rooms = [c - (e == j) for e in range(k)]
        minor = sum(math.prod(float(u[t, e]) for t, e in zip(others, z)) for z in enumerate_assignments(n - 1, rooms))
        formula[i, j] = u[i, j] * minor / perm
    return float((formula - P).abs().max())


# %%
INSTANCES = 20 if SCALE == "cpu" else 100
fits = {}
print(f"max-ent fits on {INSTANCES} random P~ per shape (Sinkhorn of softmax(N(0, 1) logits)):")
for n, k, c in [(4, 4, 1), (6, 3, 2), (8, 2, 4), (8, 4, 2)]:
    onehot = onehot_list(enumerate_assignments(n, [c] * k), k)
    r2s, slopes, residuals = [], [], []
    for instance in range(INSTANCES):
        P = sinkhorn_balance(torch.randn(n, k, generator=gen(9000 + instance), dtype=F64), tol=1e-13)
        lam, residual, iterations = fit_maxent(P, onehot)
        residuals.append(residual)
        # regression of lambda on log P~ with row and column effects = regression of the double-centred tables
        y, x = double_centre(lam), double_centre(P.log())
        slope = float((x * y).sum() / (x * x).sum())
        r2s.append(1 - float(((y - slope * x) ** 2).sum() / (y ** 2).sum()))
        slopes.append(slope)
        if instance == 0:
            minor_error = permanent_check(P, lam, n, k, c)
            fits[n, k, c] = (x, y, slope, r2s[0])
            # it is the maximiser: positive, and -log(alpha) - 1 lies in the span of the constraints
            # (the KKT condition of a strictly concave problem); a sparse feasible mixture has less entropy
            Zf = onehot.reshape(len(onehot), -1)
            alpha = torch.softmax(Zf @ lam.reshape(-1), 0).numpy()
            A = np.vstack([Zf.numpy().T, np.ones((1, len(Zf)))])
            b = np.concatenate([P.reshape(-1).numpy(), [1.0]])
            coeffs = np.linalg.lstsq(A.T, -np.log(alpha) - 1, rcond=None)[0]
            kkt = float(np.abs(A.T @ coeffs + np.log(alpha) + 1).max())
            vertex = linprog(np.random.default_rng(0).random(len(Zf)), A_eq=A, b_eq=b, bounds=(0, None), method="highs").x
            entropy_vertex = float(-(vertex[vertex > 0] * np.log(vertex[vertex > 0])).sum())
            assert alpha.min() > 0 and kkt < 1e-7 and float(-(alpha * np.log(alpha)).sum()) > entropy_vertex
    r2s, slopes = np.array(r2s), np.array(slopes)
    print(f"  (n, k, c) = {(n, k, c)}: max|mu - P~| <= {max(residuals):.0e}; marginal formula error {minor_error:.0e}; "
          f"R^2 median {np.median(r2s):.4f} (min {r2s.min():.4f}); slope median {np.median(slopes):.3f} "
          f"(range {slopes.min():.3f}-{slopes.max():.3f})")
    assert max(residuals) < 1e-9 and minor_error < 1e-9
    assert np.median(r2s) > 0.98 and r2s.min() > 0.95, "the max-entropy potentials are close to log P~ / tau"
    assert 0.6 < slopes.min() and slopes.max() < 1.0, "... for a tau a little above 1"


# %%
fig, axes = plt.subplots(1, 4, figsize=(14, 3.5))
for ax, ((n, k, c), (x, y, slope, r2)) in zip(axes, fits.items()):
    ax.plot(x.flatten(), y.flatten(), "o", ms=4)
    grid = torch.linspace(float(x.min()), float(x.max()), 2)
    ax.plot(grid, slope * grid, color="tab:red", label=f"slope {slope:.2f}, R^2 {r2:.3f}")
    ax.plot(grid, grid, color="lightgrey", ls="--", label="slope 1")
    ax.set_title(f"(n, k, c) = {(n, k, c)}")
    ax.set_xlabel("log P~ (row and column effects removed)")
    ax.legend(fontsize=8)
axes[0].set_ylabel("max-ent lambda (same)")
fig.suptitle("Maximum-entropy potentials against log P~ (first instance of each shape): slope 1/tau < 1")
plt.tight_layout()
plt.show()

# %% [markdown]
# Modulo the gauge the fitted potentials are almost exactly $\log\tilde P/\tau$ with a slope
# $1/\tau$ between about 0.7 and 0.9 ($\tau\approx1.1$–$1.5$; the tiny $n = k = 4$ case is the
# loosest), which is the paper's observation "$u\approx\tilde p^{1/\tau}$ for some
# $\tau$" made precise. The chain "max-entropy $\Rightarrow$ Gibbs $\Rightarrow$ approximated by
# Gumbel-matching, with Sinkhorn close to the marginals of both" holds link by link, and no link is
# exact. The marginal formula uses the permanent of $U$ with row $i$ removed and *one slot* of
# column $j$ removed, not "rows $i$ and $j$" as the paper says ({ref}`errata-kool-minor`).

# %% [markdown]
# (nb06-conditionals)=
# ## The conditionals (Propositions 5.6–5.7)
#
# The GM-IW weight divides by $q(z_i\mid\mathbf x,\mathbf G_{-i})$, the law of token $i$'s expert
# when every other token's noise is held fixed. It rests on two results.
#
# **Eq. (7)**: with $\mathbf z$ optimal, value $v^\star$, and $d^\star$ the shortest-path costs of the
# move graph, the best value with token $i$ forced into expert $j$ is
# $v^\star - s_{iz_i} + s_{ij} - d^\star_{jz_i}$. We check it against brute force: list every
# balanced assignment with $z_i = j$ and take the best, for every $(i, j)$ of 60 random problems.

# %%
def forced_values_brute(scores, capacity):
    """v*_{|z_i = j} for all (i, j) by enumeration."""
    n, k = scores.shape
    Z = torch.tensor(enumerate_assignments(n, [capacity] * k))
    totals = (onehot_list(Z, k) * scores).sum((1, 2))
    out = torch.empty(n, k, dtype=F64)
    for i, j in itertools.product(range(n), range(k)):
        out[i, j] = totals[Z[:, i] == j].max()
    return out


worst = 0.0
for trial in range(60):
    n, k, c = [(4, 2, 2), (6, 3, 2), (6, 2, 3), (8, 4, 2)][trial % 4]
    tau = [0.5, 1.0, 2.0][trial % 3]
    logits = torch.randn(n, k, generator=gen(500 + trial), dtype=F64)
    G = sample_gumbel((n, k), generator=gen(600 + trial))
    s = logits / tau + G
    z = gumbel_matching_sample(logits, c, tau=tau, gumbels=G)
    d_star = my_floyd_warshall(my_move_costs(s, z)[0])
    v_star = objective(s, z)
    own = s.gather(1, z[:, None])                                   # s_{i z_i}
    eq7 = v_star - own + s - d_star[:, z].T                         # [i, j] uses d*[j, z_i]
    worst = max(worst, float((eq7 - forced_values_brute(s, c)).abs().max()))
print(f"eq. (7) against brute-force re-solving, 60 problems, every (i, j): max error {worst:.1e}")
assert worst < 1e-9

# %% [markdown]
# **Eq. (9)**: with token $i$ removed, the other tokens fill the remaining slots (one fewer at $j$)
# with best value $v^\star_{-ij}$, which does not involve $\mathbf g_i$. So token $i$ goes to
# $\arg\max_j(v^\star_{-ij} + a_{ij}/\tau + g_{ij})$, and by the Gumbel-max trick
# $q(z_i=j\mid\mathbf G_{-i}) = \mathrm{softmax}_j(v^\star_{-ij} + a_{ij}/\tau)$. We compute the
# $v^\star_{-ij}$ by listing the sub-problems' assignments and compare with
# `gumbel_matching_conditionals`, which uses the closed form
# $\mathrm{softmax}_j(a_{ij}/\tau - d^\star_{jz_i})$ (one Floyd–Warshall, no re-solving).

# %%
def conditionals_brute(logits, gumbels, tau, capacity):
    """softmax_j(v*_{-ij} + a_ij / tau), with v*_{-ij} the best value of the other tokens when expert j has
    one slot fewer (by enumeration)."""
    n, k = logits.shape
    s = logits / tau + gumbels
    q = torch.empty(n, k, dtype=F64)
    for i in range(n):
        others = [t for t in range(n) if t != i]
        v_minus = torch.empty(k, dtype=F64)
        for j in range(k):
            Z = torch.tensor(enumerate_assignments(n - 1, [capacity - (e == j) for e in range(k)]))
            v_minus[j] = (onehot_list(Z, k) * s[others]).sum((1, 2)).max()
        q[i] = torch.softmax(v_minus + logits[i] / tau, 0)
    return q


worst = 0.0
for trial in range(40):
    n, k, c = [(4, 2, 2), (6, 3, 2), (6, 2, 3), (8, 4, 2)][trial % 4]
    tau = [0.5, 1.0, 2.0][trial % 3]
    logits = torch.randn(n, k, generator=gen(700 + trial), dtype=F64)
    G = sample_gumbel((n, k), generator=gen(800 + trial))
    z = gumbel_matching_sample(logits, c, tau=tau, gumbels=G)
    q = gumbel_matching_conditionals(logits, G, z, tau=tau)
    worst = max(worst, float((q - conditionals_brute(logits, G, tau, c)).abs().max()))
print(f"gumbel_matching_conditionals against eq. (9) by enumeration, 40 problems: max error {worst:.1e}")
assert worst < 1e-9

# %% [markdown]
# The formula uses the realised $z_i$ and $d^\star$, which both depend on $\mathbf g_i$, yet the
# result must not. Fix one problem and $\mathbf G_{-i}$, redraw token $i$'s own noise 20 times and
# recompute: row $i$ of the conditionals stays put, even when $z_i$ moves (the other rows do change,
# since their conditioning set $\mathbf G_{-t}$ contains $\mathbf g_i$).

# %%
n, k, c, tau = 6, 3, 2, 0.7
logits = torch.randn(n, k, generator=gen(900), dtype=F64)
G = sample_gumbel((n, k), generator=gen(901))
z0 = gumbel_matching_sample(logits, c, tau=tau, gumbels=G)
q0 = gumbel_matching_conditionals(logits, G, z0, tau=tau)
for i in range(n):
    redraw = G.expand(20, n, k).clone()
    redraw[:, i] = sample_gumbel((20, k), generator=gen(910 + i))
    z = gumbel_matching_sample(logits.expand(20, n, k), c, tau=tau, gumbels=redraw)
    q = gumbel_matching_conditionals(logits.expand(20, n, k), redraw, z, tau=tau)
    row_change = float((q[:, i] - q0[i]).abs().max())
    other_change = float((q - q0).abs().max())
    print(f"token {i}: z_i took {len(set(z[:, i].tolist()))} values over 20 redraws; "
          f"row i changed by {row_change:.1e}, other rows by up to {other_change:.2f}")
    assert row_change < 1e-12

# %% [markdown]
# Finally, the conditional is a *law*, so sampling must reproduce it. For each token $i$ we hold
# $\mathbf G_{-i}$ fixed, draw $\mathbf g_i$ `DRAWS` times, re-solve each time and count where token
# $i$ lands. The grey bars are the conditionals; the red dots the frequencies with $\pm4.5$
# standard errors; the open circles the tempered router $\mathrm{softmax}(a_i/\tau)$, which is what
# token $i$ would do without capacity. The gap between circles and bars is the balancing.

# %%
freqs, ses = torch.empty(n, k, dtype=F64), torch.empty(n, k, dtype=F64)
for i in range(n):
    batch = G.expand(DRAWS, n, k).clone()
    batch[:, i] = sample_gumbel((DRAWS, k), generator=gen(920 + i))
    z = gumbel_matching_sample(logits.expand(DRAWS, n, k), c, tau=tau, gumbels=batch)
    freqs[i] = torch.bincount(z[:, i], minlength=k).double() / DRAWS
    ses[i] = torch.sqrt(q0[i] * (1 - q0[i]) / DRAWS)
z_cond = ((freqs - q0) / ses).abs()
print(f"conditional frequencies with G_-i fixed, {DRAWS} redraws per token: max |z| = {z_cond.max():.2f}")
assert (z_cond <= 4.5).all()

fig, ax = plt.subplots(figsize=(9, 3.6))
router = torch.softmax(logits / tau, -1)
colors = ["tab:blue", "tab:orange", "tab:green"]
for j in range(k):
    x = np.arange(n) + (j - 1) * 0.27
    ax.bar(x, q0[:, j].numpy(), width=0.25, color=colors[j], alpha=0.35, label=f"q(z_i = {j} | G_-i)")
    ax.errorbar(x, freqs[:, j].numpy(), yerr=4.5 * ses[:, j].numpy(), fmt="o", ms=3, color="tab:red", capsize=2)
    ax.plot(x, router[:, j].numpy(), "o", mfc="none", color=colors[j], ms=7)
ax.plot([], [], "o", color="tab:red", ms=3, label="frequency ± 4.5 s.e.")
ax.plot([], [], "o", mfc="none", color="grey", label="softmax(a_i / tau)")
ax.set_xlabel("token i (experts side by side)")
ax.set_ylabel("probability")
ax.set_title(f"Conditionals given the other tokens' noise, (n, k, c) = {(n, k, c)}, tau = {tau}")
ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.18))
plt.tight_layout()
plt.show()

# %% [markdown]
# (nb06-scratch-gm)=
# ## The Gumbel-matching router from scratch
#
# With six tokens and three experts of two slots there are only 90 balanced assignments, so we can
# write the router by listing them. Gumbel-matching perturbs every logit by standard Gumbel noise
# and takes the balanced assignment of largest perturbed score. Its GM-IW coefficient is
# $p_\theta(z_i\mid x_i)\,/\,q(z_i\mid\mathbf G_{-i})$, where the conditional $q$ is a Gumbel-max over
# the experts $j$ of $s_{ij}$ plus the best score the *other* tokens can reach with token $i$ at $j$
# (Proposition 5.7).

# %% tags=["from-scratch"]
import itertools

import torch


def gumbel_matching_route(logits, generator, tau=1.0):
    """The Gumbel-matching assignment of T tokens (E divides T) and each token's GM-IW coefficient."""
    T, E = logits.shape
    slots = [e for e in range(E) for _ in range(T // E)]
    Z = torch.tensor(sorted(set(itertools.permutations(slots))))       # every balanced assignment
    u = torch.rand(T, E, generator=generator, dtype=torch.float64)
    s = logits / tau - torch.log(-torch.log(u))                         # Gumbel-perturbed scores
    total = s.gather(1, Z.T).sum(0)                                     # each assignment's score
    z = Z[total.argmax()]
    q = torch.empty(T, E, dtype=torch.float64)
    for i in range(T):                                                  # q(z_i = j | G_-i)
        others = total - s[i, Z[:, i]]
        q[i] = torch.softmax(logits[i] / tau + torch.stack([others[Z[:, i] == j].max() for j in range(E)]), -1)
    p = torch.softmax(logits, -1)
    return z, p[range(T), z] / q[range(T), z]

# %%
from minimoe.routers import router_class

torch.manual_seed(0)
x_small = torch.randn(1, 6, 8, dtype=torch.float64)
router = router_class("kool_gumbel_matching")(8, 3, generator=torch.Generator().manual_seed(7)).double().train()
routing = router(x_small)
z, coefficient = gumbel_matching_route(router.gate(x_small)[0].detach(), torch.Generator().manual_seed(7))
assert torch.equal(z, routing.choice_expert[0, :, 0])
torch.testing.assert_close(coefficient, routing.reinforce_weight[0], rtol=1e-9, atol=0)
print("the same assignment", z.tolist(), "and GM-IW coefficients", [round(c, 3) for c in coefficient.tolist()])

# %% [markdown]
# (nb06-unbiased)=
# ## The central check: every estimator against the exact gradient
#
# The objective is separable, $L(\theta) = \frac1n\sum_i\sum_jp_{ij}f_{ij}$ with
# $p = \mathrm{softmax}(\theta)$ and a fixed loss table $f$, so its gradient is exact for any $n$:
# $\partial L/\partial\theta_{il} = \frac1n p_{il}(f_{il} - \sum_jp_{ij}f_{ij})$
# ({py:func}`minimoe.ops.expected_loss_gradient`). Each estimator gives, per draw,
# $\hat\nabla_{il} = \frac1n w_i\,(f_{iz_i} - b)\,(\mathbb 1[z_i = l] - p_{il})$ (the gradient of the
# surrogate {eq}`eq-ch5-surrogate` with respect to $\theta$), with its own sampler and weights $w_i$:
#
# | estimator | sampler | $w_i$ | chapter 5 |
# |---|---|---|---|
# | `sample` | independent from $q_\tau = \mathrm{softmax}(a/\tau)$, no capacity | $p/q_\tau$ | unbiased (Prop. 5.1) |
# | `skip_iw` | independent, then a uniform $\min(n_j, c)$ of each expert kept | $\delta_i\frac{n_{z_i}}{\min(n_{z_i},c)}\,p/q_\tau$ | unbiased (Prop. 5.2) |
# | `skip` | the same | $\delta_i\,p/q_\tau\cdot n/\sum\delta$ | biased |
# | `gm_iw` | Gumbel-matching at $\tau$ | $p/q(z_i\mid\mathbf G_{-i})$ | unbiased (Prop. 5.8) |
# | `gm_sh` | Gumbel-matching at $\tau$ | $p/\tilde P$ | biased |
# | `gm` | Gumbel-matching at $\tau$ | $p/q_\tau$ | biased |
#
# First the oracle three ways (closed form, `expected_loss_gradient`, autograd), and one draw of the
# per-draw formula against autograd of {py:func}`minimoe.ops.reinforce_surrogate`.

# %%
n, k, c = 6, 3, 2
theta = torch.randn(n, k, generator=gen(2), dtype=F64)
f = torch.randn(n, k, generator=gen(2 + 10_000), dtype=F64)
p = torch.softmax(theta, -1)
exact = p * (f - (p * f).sum(-1, keepdim=True)) / n
x = theta.clone().requires_grad_(True)
(torch.softmax(x, -1) * f).sum(-1).mean().backward()
assert torch.allclose(exact, expected_loss_gradient(theta, f), atol=1e-15)
assert torch.allclose(exact, x.grad, atol=1e-15)


def per_draw_gradients(drawn, baseline=0.0):
    """(N, n, k): 1/n w_i (f_{i z_i} - b) (onehot(z_i) - p_i) for every draw."""
    fz = f.expand(*drawn.assignment.shape, k).gather(-1, drawn.assignment[..., None])[..., 0]
    return (drawn.coef * (fz - baseline))[..., None] * (F.one_hot(drawn.assignment, k).double() - p) / n


one = sample_estimator(theta, "gm_iw", c, tau=0.7, generator=gen(3))
x = theta.clone().requires_grad_(True)
log_p = torch.log_softmax(x, -1).gather(-1, one.assignment[:, None])[:, 0]
fz = f.gather(-1, one.assignment[:, None])[:, 0]
surrogate_grad, = torch.autograd.grad(reinforce_surrogate(log_p, fz, one.coef, baseline=0.3), x)
assert torch.allclose(surrogate_grad, per_draw_gradients(one, 0.3), atol=1e-14)
print("oracle: closed form = expected_loss_gradient = autograd; per-draw formula = autograd of the surrogate")

# %% [markdown]
# Now `DRAWS` draws of every estimator at two temperatures, batched: `sample_estimator` takes the
# logits expanded to `(DRAWS, n, k)` and treats every leading index as an independent problem. For
# each of the $n\cdot k = 18$ coordinates we report the Monte Carlo mean with its standard error and
# the z-score $(\text{mean} - \text{exact})/\text{s.e.}$. With 18 coordinates, an unbiased estimator
# exceeds $|z| = 4.5$ somewhere with probability about $10^{-4}$; we assert the unbiased ones stay
# below it, and that the biased ones exceed 6 where their bias is large enough to see at this
# sample size. (The instance has moderate logits: with very confident ones, a weight of $10^4$ on
# an event of probability $10^{-6}$ is never drawn, and the standard error itself is then wrong.)

# %%
ESTIMATORS6 = ("sample", "skip_iw", "gm_iw", "skip", "gm_sh", "gm")
UNBIASED6 = ("sample", "skip_iw", "gm_iw")
TAUS = (0.5, 1.0)
results = {}
for ti, tau in enumerate(TAUS):
    for ei, name in enumerate(ESTIMATORS6):
        drawn = sample_estimator(theta.expand(DRAWS, n, k), name, c, tau=tau, generator=gen(100 * ti + ei))
        terms = per_draw_gradients(drawn)
        mean, se = terms.mean(0), terms.std(0) / math.sqrt(DRAWS)
        results[tau, name] = (mean, se, (mean - exact) / se, float(drawn.coef.max()))
    for name in ("skip_iw", "gm_iw"):                               # a constant baseline changes nothing
        drawn = sample_estimator(theta.expand(DRAWS, n, k), name, c, tau=tau, generator=gen(50 + 100 * ti))
        terms = per_draw_gradients(drawn, baseline=0.7)
        mean, se = terms.mean(0), terms.std(0) / math.sqrt(DRAWS)
        results[tau, name + " (b=0.7)"] = (mean, se, (mean - exact) / se, float(drawn.coef.max()))

print(f"max |z| over the 18 coordinates, N = {DRAWS} draws each (max weight in brackets)")
names = list(ESTIMATORS6) + ["skip_iw (b=0.7)", "gm_iw (b=0.7)"]
print(f"{'':>16}" + "".join(f"{'tau = ' + str(t):>18}" for t in TAUS))
for name in names:
    print(f"{name:>16}" + "".join(f"{float(results[t, name][2].abs().max()):11.1f} ({results[t, name][3]:5.0f})"
                                  for t in TAUS))
for tau in TAUS:
    for name in names:
        zmax = float(results[tau, name][2].abs().max())
        if name.split()[0] in UNBIASED6:
            assert zmax < 4.5, (tau, name)
        elif name in ("skip", "gm") or tau == 0.5 or DRAWS >= 200_000:  # GM-SH at tau = 1 needs many draws
            assert zmax > 6, (tau, name)

# %% [markdown]
# The picture for each temperature: one panel per estimator, and for each of the 18 coordinates
# the error of the Monte Carlo mean (mean minus exact gradient) with a 95% interval
# ($\pm1.96$ s.e.). For the unbiased estimators the intervals straddle zero (about one in twenty
# may miss it by a little); for the biased ones some coordinates miss by many interval widths. Mind
# the scales: each panel has its own. A last plot puts every coordinate's $|z|$ on one axis.

# %%
for tau in TAUS:
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), sharex=True)
    coordinate = np.arange(n * k)
    for ax, name in zip(axes.flatten(), ESTIMATORS6):
        mean, se, zs, _ = results[tau, name]
        ax.axhline(0, color="grey", lw=1)
        ax.errorbar(coordinate, (mean - exact).flatten(), yerr=1.96 * se.flatten(), fmt="o", ms=3, capsize=2,
                    color="tab:blue" if name in UNBIASED6 else "tab:red")
        ax.set_title(f"{name}: max |z| = {float(zs.abs().max()):.1f}"
                     + (" (unbiased)" if name in UNBIASED6 else " (biased)"), fontsize=10)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    for ax in axes[1]:
        ax.set_xlabel("coordinate (token i, expert l) = 3 i + l")
    for ax in axes[:, 0]:
        ax.set_ylabel("MC mean - exact, ± 1.96 s.e.")
    fig.suptitle(f"(n, k, c) = {(n, k, c)}, tau = {tau}, N = {DRAWS}: error of the Monte Carlo mean, per coordinate "
                 "(each panel has its own scale)")
    plt.tight_layout()
    plt.show()

fig, ax = plt.subplots(figsize=(10, 3.8))
for ti, tau in enumerate(TAUS):
    for ei, name in enumerate(ESTIMATORS6):
        zs = results[tau, name][2].abs().flatten().numpy()
        ax.plot(np.full(zs.shape, ei + (ti - 0.5) * 0.3), zs, "o", ms=3, alpha=0.7,
                color=["tab:blue", "tab:purple"][ti], label=f"tau = {tau}" if ei == 0 else None)
ax.axhline(4.5, color="tab:green", ls="--", label="4.5 (unbiased must stay below)")
ax.axhline(6, color="tab:red", ls=":", label="6")
ax.set_yscale("log")
ax.set_xticks(range(len(ESTIMATORS6)), ESTIMATORS6)
ax.set_ylabel("|z| per coordinate")
ax.set_title("Bias in units of the Monte Carlo standard error")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# A z-score measures bias in units of the Monte Carlo error, so it grows like $\sqrt N$ for a
# biased estimator and stays of order one for an unbiased one. At $\tau = 1$ GM-SH's bias is a few
# times smaller than at $\tau = 0.5$: with 50,000 draws it shows up at roughly 7–8 standard errors
# (5–6 with 20,000), so at the CPU scale we print it but assert it only at $\tau = 0.5$; the GPU
# scale's 500,000 draws put it above 20. Sinkhorn's matrix is a good stand-in for the
# Gumbel-matching marginals (section {ref}`nb06-gibbs`), and the better it is, the smaller the
# bias: at $n = 100$ it hides under the noise entirely. The uncorrected `gm` and the
# survivor-averaging `skip` are off by tens to hundreds of standard errors: the first treats
# balanced draws as independent, the second ignores that tokens of over-full experts are dropped
# more often. Biased estimators still train, but towards the wrong place (notebook
# {doc}`07-piecewise-linear-toy`).
#
# ### Skip-IW is unbiased exactly, not just statistically
#
# Proposition 5.2 is an identity, and on a tiny problem we can check it as one: list all $k^n$
# assignments with their probabilities $\prod_iq_{iz_i}$, and for each one every way of keeping a
# uniform $\min(n_j, c)$ of each expert's tokens (each kept set equally likely). The expectation of
# the skip-IW gradient is then a finite sum, and it must equal the exact gradient to rounding, with
# or without a baseline. Its biased sibling `skip` must not.

# %%
def skip_expectation(theta, f, capacity, tau, estimator, baseline):
    n, k = theta.shape
    p = torch.softmax(theta, -1)
    log_q = torch.log_softmax(theta / tau, -1)
    rows, keeps, probs = [], [], []
    for z in itertools.product(range(k), repeat=n):
        prob_z = math.exp(sum(float(log_q[i, z[i]]) for i in range(n)))
        groups = [[i for i in range(n) if z[i] == j] for j in range(k)]
        kept_sets = list(itertools.product(*[itertools.combinations(g, min(len(g), capacity)) for g in groups]))
        for kept in kept_sets:
            keep = torch.zeros(n, dtype=torch.bool)
            keep[[i for part in kept for i in part]] = True
            rows.append(z)
            keeps.append(keep)
            probs.append(prob_z / len(kept_sets))
    z = torch.tensor(rows)
    coef = estimator_coefficients(estimator, theta.expand(len(z), n, k), z, proposal_log_probs=log_q.expand(len(z), n, k),
                                  keep=torch.stack(keeps), capacity=capacity)
    fz = f.expand(len(z), n, k).gather(-1, z[..., None])[..., 0]
    terms = (coef * (fz - baseline))[..., None] * (F.one_hot(z, k).double() - p) / n
    return (torch.tensor(probs, dtype=F64)[:, None, None] * terms).sum(0), sum(probs), len(z)


for n_, k_, c_ in [(4, 2, 2), (6, 3, 2)]:
    th = torch.randn(n_, k_, generator=gen(n_ + k_), dtype=F64)
    ff = torch.randn(n_, k_, generator=gen(n_ + k_ + 1), dtype=F64)
    truth = expected_loss_gradient(th, ff)
    for b in (0.0, 0.7):
        mean_iw, mass, count = skip_expectation(th, ff, c_, 1.7, "skip_iw", b)
        mean_skip, _, _ = skip_expectation(th, ff, c_, 1.7, "skip", b)
        err_iw, err_skip = float((mean_iw - truth).abs().max()), float((mean_skip - truth).abs().max())
        print(f"(n, k, c) = {(n_, k_, c_)}, tau = 1.7, b = {b}: {count} (z, kept set) pairs, total probability "
              f"{mass:.15f}; skip_iw error {err_iw:.1e}, skip error {err_skip:.1e}")
        assert abs(mass - 1) < 1e-12 and err_iw < 1e-12 and err_skip > 1e-3

# %% [markdown]
# (nb06-coupled)=
# ### When one token's loss depends on another token's expert
#
# Every "unbiased" above assumes a separable loss: token $i$'s loss depends on its own expert only
# ({ref}`separability <ch5-separable>`). After an MoE layer in a Transformer, attention mixes tokens and the
# assumption fails. The smallest illustration: $n = 4$, $k = 2$, $c = 2$, and
# $f_i(\mathbf z) = F_{iz_i} + \gamma\,C_{iz_{i+1}}$ (indices mod 4). The true gradient of
# $\mathbb E_{\mathbf z\sim\prod p}\frac1n\sum_if_i(\mathbf z)$ is a sum over the 16 assignments (autograd);
# the estimators' exact expectations are sums over every assignment and every kept subset
# (`skip_expectation`'s enumeration, with the coupled losses); GM-IW's mean is estimated from
# `DRAWS` draws. With $\gamma = 0$ all three are exact; with $\gamma = 1$ all three are biased.

# %%
n_c, k_c, c_c, tau_c = 4, 2, 2, 1.0
g_c = gen(5)
theta_c, F_c, C_c = (torch.randn(n_c, k_c, generator=g_c, dtype=F64) for _ in range(3))
p_c = torch.softmax(theta_c, -1)
Z_all = torch.tensor(list(itertools.product(range(k_c), repeat=n_c)))


def coupled(z, gamma):
    rows_ = torch.arange(n_c)
    return F_c[rows_, z] + gamma * C_c[rows_, z.roll(-1, -1)]


def coupled_truth(gamma):
    x_ = theta_c.clone().requires_grad_(True)
    log_joint = torch.log_softmax(x_, -1)[torch.arange(n_c), Z_all].sum(-1)
    return torch.autograd.grad((log_joint.exp() * coupled(Z_all, gamma).mean(-1)).sum(), x_)[0]


# %%
# every (z, kept set) pair of independent sampling + uniform skipping, with its probability
log_q_c = torch.log_softmax(theta_c / tau_c, -1)
pairs, keeps_c, probs_c = [], [], []
for z in itertools.product(range(k_c), repeat=n_c):
    prob_z = math.exp(sum(float(log_q_c[i, z[i]]) for i in range(n_c)))
    groups = [[i for i in range(n_c) if z[i] == j] for j in range(k_c)]
    kept_sets = list(itertools.product(*[itertools.combinations(g_, min(len(g_), c_c)) for g_ in groups]))
    for kept in kept_sets:
        keep = torch.zeros(n_c, dtype=torch.bool)
        keep[[i for part in kept for i in part]] = True
        pairs.append(z)
        keeps_c.append(keep)
        probs_c.append(prob_z / len(kept_sets))
z_pairs, keep_pairs, prob_pairs = torch.tensor(pairs), torch.stack(keeps_c), torch.tensor(probs_c, dtype=F64)
print(f"{'':>8} {'max|truth|':>11} {'sample error':>13} {'skip_iw error':>14} {'gm_iw max |z|':>14}")
for gamma in (0.0, 1.0):
    truth = coupled_truth(gamma)
    errors = []
    for name in ("sample", "skip_iw"):
        coef = estimator_coefficients(name, theta_c.expand(len(z_pairs), n_c, k_c), z_pairs,
                                      proposal_log_probs=log_q_c.expand(len(z_pairs), n_c, k_c), keep=keep_pairs,
                                      capacity=c_c)
        terms = (coef * coupled(z_pairs, gamma))[..., None] * (F.one_hot(z_pairs, k_c).double() - p_c) / n_c
        errors.append(float(((prob_pairs[:, None, None] * terms).sum(0) - truth).abs().max()))
    drawn = sample_estimator(theta_c.expand(DRAWS, n_c, k_c), "gm_iw", c_c, tau=tau_c, generator=gen(1), method="top2")
    terms = (drawn.coef * coupled(drawn.assignment, gamma))[..., None] * (F.one_hot(drawn.assignment, k_c).double() - p_c) / n_c
    z_gm = float(((terms.mean(0) - truth) / (terms.std(0) / math.sqrt(DRAWS))).abs().max())
    print(f"gamma={gamma:3}: {float(truth.abs().max()):11.3f} {errors[0]:13.1e} {errors[1]:14.1e} {z_gm:14.1f}")
    if gamma == 0:
        assert max(errors) < 1e-12 and z_gm < 4.5, "separable: exact"
    else:
        assert min(errors) > 0.02 and z_gm > 10, "coupled: every estimator is biased"

# %% [markdown]
# Independent sampling and skip-IW miss by the same vector: both estimate the gradient with the cross
# terms $\frac1n\mathbb E[\nabla\log p(z_{i+1})\,C_{iz_{i+1}}]$ left out. GM-IW misses by something else
# again, because its balanced draws correlate $z_{i+1}$ with $z_i$. The chapter's conclusion: in a
# Transformer, `kool_skip` and `kool_gumbel_matching` give biased router gradients.

# %% [markdown]
# (nb06-weights)=
# ## The weights, and why GM-IW loses to skip
#
# All three unbiased estimators have the right mean; what separates them is the variance, and the
# variance comes from the weights $w_i$. The chapter's argument
# ({ref}`ch5-variance`): when the router is confident and the right split is imbalanced, a token can
# have a large $p_\theta(z\mid x)$ for an over-subscribed expert while balance makes
# $q(z\mid\mathbf G_{-i})$ tiny; when it lands there anyway, $p/q$ is huge. A higher temperature
# flattens $q$ and caps the weights.
#
# We use the data of the paper's toy (notebook {doc}`07-piecewise-linear-toy`): 100 points, two
# ideal linear experts, capacity 50, and three quarters of the points belonging to expert 0. The
# router is fixed at $p(z = 1\mid x) = \sigma(s\,(x - 0.5))$: soft at $s = 3$, confident (and close
# to the right, imbalanced routing) at $s = 10$. Per draw we form the router gradient with respect
# to its two parameters (slope and offset), with the exact expected loss as baseline, and measure
# the trace of its covariance over the draws.

# %%
D6 = 4_000 if SCALE == "cpu" else 40_000
n6, c6 = 100, 50
data = gen(0)
x6 = torch.rand(n6, generator=data, dtype=F64) * 2 - 1
y6 = torch.where(x6 < 0.5, 0.8 * x6 - 0.2, -2 * x6 + 2) + 0.1 * torch.randn(n6, generator=data, dtype=F64)
f6 = (y6[:, None] - torch.stack([0.8 * x6 - 0.2, -2 * x6 + 2], -1)) ** 2   # loss of each ideal expert
REGIMES = [(3, 1.0), (10, 1.0), (10, 3.0)]
VAR_ESTIMATORS = ("sample", "skip_iw", "gm_iw", "gm_sh")
variance, weights = {}, {}
for ri, (s, tau) in enumerate(REGIMES):
    logits6 = torch.stack([torch.zeros_like(x6), s * (x6 - 0.5)], -1)
    p6 = torch.softmax(logits6, -1)
    baseline = float((p6 * f6).sum(-1).mean())
    # expert 1's logit is l_i = u x_i + v with (u, v) = (s, -s/2); exact gradient w.r.t. (u, v) by the chain
    # rule from dL/dl_i = p_i1 (f_i1 - <p_i, f_i>) / n
    dl = p6[:, 1] * (f6[:, 1] - (p6 * f6).sum(-1)) / n6
    exact6 = torch.stack([(dl * x6).sum(), dl.sum()])
    for ei, name in enumerate(VAR_ESTIMATORS):
        drawn = sample_estimator(logits6.expand(D6, n6, 2), name, c6, tau=tau, generator=gen(200 + 10 * ri + ei))
        fz = f6.expand(D6, n6, 2).gather(-1, drawn.assignment[..., None])[..., 0]
        per_token = drawn.coef * (fz - baseline) * ((drawn.assignment == 1).double() - p6[:, 1]) / n6
        grads = torch.stack([(per_token * x6).sum(-1), per_token.sum(-1)], -1)   # (D6, 2)
        z_bias = float(((grads.mean(0) - exact6) / (grads.std(0) / math.sqrt(D6))).abs().max())
        kept = drawn.coef[drawn.keep]
        variance[s, tau, name] = (float(torch.cov(grads.T).trace()), float(drawn.coef.max()), z_bias)
        weights[s, tau, name] = kept.flatten().numpy()

print(f"trace of the router-gradient covariance over {D6} draws [max weight, |z| of the mean vs exact]")
print(f"{'s':>3} {'tau':>4}" + "".join(f"{name:>26}" for name in VAR_ESTIMATORS))
for s, tau in REGIMES:
    print(f"{s:3} {tau:4}" + "".join(f"{variance[s, tau, m][0]:10.2e} [{variance[s, tau, m][1]:5.0f}, {variance[s, tau, m][2]:4.1f}]"
                                     for m in VAR_ESTIMATORS))

# the variance story, asserted where it is robust at this sample size (checked over several seeds)
assert variance[10, 1.0, "gm_iw"][0] > 2 * variance[10, 1.0, "skip_iw"][0], "confident router, tau=1: GM-IW is noisier"
assert variance[10, 1.0, "gm_iw"][1] > 100, "... because of weights in the hundreds"
assert variance[10, 3.0, "gm_iw"][0] < variance[10, 3.0, "skip_iw"][0], "tau=3: the order reverses"
assert variance[10, 3.0, "gm_iw"][1] < 20, "... the weights are capped"
assert variance[3, 1.0, "gm_iw"][0] < variance[3, 1.0, "sample"][0], "soft router: balanced draws stratify"

# %% [markdown]
# The histograms show where the variance comes from: the weights of the kept tokens (skip-IW's
# skipped tokens have weight 0 and are left out), on a log scale, for the confident router at the
# two temperatures. Skip-IW's weight is $\frac{n_j}{c}\cdot p/q_\tau$: at $\tau = 1$ that is
# $n_j/c\le n/c = 2$, and for $\tau\ge1$ the factor
# $p_j/q_{\tau,j} = p_j^{1-1/\tau}\sum_lp_l^{1/\tau}$ is at most $k^{1-1/\tau}$ (1.59 for two
# experts at $\tau = 3$): skip never divides by a small probability. GM-IW's weights have a tail
# reaching into the hundreds at $\tau = 1$ and are capped near 10 at $\tau = 3$.

# %%
fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
for ax, (s, tau) in zip(axes[:2], [(10, 1.0), (10, 3.0)]):
    bins = np.logspace(-4, 3.5, 76)
    for name, color in (("skip_iw", "tab:blue"), ("gm_iw", "tab:red"), ("gm_sh", "tab:green")):
        ax.hist(np.clip(weights[s, tau, name], 1e-4, None), bins=bins, histtype="step", lw=1.5, color=color,
                label=f"{name} (max {variance[s, tau, name][1]:.0f})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("weight w_i of a kept token (below 1e-4: first bin)")
    ax.set_ylabel(f"count over {D6} x {n6} tokens")
    ax.set_title(f"confident router s = {s}, tau = {tau}")
    ax.legend(fontsize=8)
ax = axes[2]
width = 0.2
for ei, name in enumerate(VAR_ESTIMATORS):
    ax.bar(np.arange(len(REGIMES)) + (ei - 1.5) * width, [variance[s, t, name][0] for s, t in REGIMES],
           width=width, label=name)
ax.set_yscale("log")
ax.set_xticks(range(len(REGIMES)), [f"s={s}, tau={t}" for s, t in REGIMES])
ax.set_ylabel("trace of gradient covariance")
ax.set_title("Gradient variance by regime")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Three regimes, three stories, as in the chapter:
#
# * **soft router** ($s = 3$, $\tau = 1$): Gumbel-matching's balanced draws act like stratified
#   sampling, and GM-IW has *lower* variance than independent sampling or skip;
# * **confident router, imbalanced target** ($s = 10$, $\tau = 1$): some tokens meet a tiny
#   conditional $q(z\mid\mathbf G_{-i})$ for the expert they prefer; their weights reach the
#   hundreds and GM-IW becomes several times noisier than skip-IW, which never divides by a small
#   probability (its weights are at most $\frac nc\cdot\frac p{q_\tau}$);
# * **same router, $\tau = 3$**: the flatter proposal caps the weights and GM-IW is ahead again,
#   which is why it trains only at high temperatures in the toy experiment.
#
# GM-SH is biased, and its weights $p/\tilde P$ have the same kind of tail; a low variance does not
# make up for aiming at the wrong gradient.
#
# What is exact about skip-IW's variance: given $\mathbf z$, its mean over the kept subsets is the
# `sample` estimator of the same $\mathbf z$, so
# $\operatorname{Var}(\text{skip-IW}) = \operatorname{Var}(\text{sample}) + \mathbb E\operatorname{Var}(\text{skip-IW}\mid\mathbf z)$:
# independent sampling plus the noise of skipping. We check the identity by enumeration on the
# coupled example's instance with the separable loss ($\gamma = 0$): every term is a finite sum.

# %%
args_c = dict(proposal_log_probs=log_q_c.expand(len(z_pairs), n_c, k_c), keep=keep_pairs, capacity=c_c)
f_pairs = coupled(z_pairs, 0.0)
est = {name: ((estimator_coefficients(name, theta_c.expand(len(z_pairs), n_c, k_c), z_pairs, **args_c) * f_pairs)[..., None]
              * (F.one_hot(z_pairs, k_c).double() - p_c) / n_c).reshape(len(z_pairs), -1) for name in ("sample", "skip_iw")}
_, group = torch.unique((z_pairs * (k_c ** torch.arange(n_c))).sum(-1), return_inverse=True)
mass = torch.zeros(int(group.max()) + 1, dtype=F64).index_add_(0, group, prob_pairs)
given_z = torch.zeros(len(mass), n_c * k_c, dtype=F64).index_add_(0, group, prob_pairs[:, None] * est["skip_iw"]) / mass[:, None]
mean_c = (prob_pairs[:, None] * est["skip_iw"]).sum(0)
var = {name: float((prob_pairs[:, None] * (v - mean_c) ** 2).sum()) for name, v in est.items()}
skip_noise = float((prob_pairs[:, None] * (est["skip_iw"] - given_z[group]) ** 2).sum())
print(f"trace Var(skip_iw) = {var['skip_iw']:.6e}; trace Var(sample) + E trace Var(skip_iw | z) = "
      f"{var['sample']:.6e} + {skip_noise:.6e}")
assert (given_z[group] - est["sample"]).abs().max() < 1e-12, "E[skip_iw | z] = sample(z)"
assert abs(var["skip_iw"] - var["sample"] - skip_noise) < 1e-12 and skip_noise > 0

# %%
print(f"notebook 06 ran in {time.time() - START:.1f} s at SCALE={SCALE}")
