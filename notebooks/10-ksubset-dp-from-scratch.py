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
# # The k-subset DP from scratch
#
# Companion to {doc}`../book/07-probabilistic-routing`. ProbMoE routes a token to a *set* of experts,
# drawn from the law $P(S)\propto\prod_{j\in S}e^{r_j}$ over subsets of a given size. We write the
# chain dynamic program for that law in a few lines and check it against brute-force enumeration of
# every subset and against `minimoe.ops`. Then we sample from the law (and show why the paper's
# sampler, read literally, does not), look at the marginals as heatmaps, and move to the range law of
# dynamic-$k$ routing.
#
# **You will learn to**
#
# 1. compute the normaliser and the marginals of the k-subset law with a prefix and a suffix table;
# 2. sample it exactly by walking backwards through the table, and test a sampler by chi-square;
# 3. read the marginals and the range law of dynamic-$k$ (its size distribution, its MAP subset);
# 4. write both ProbMoE routers from scratch and show them equal to `minimoe`'s.
#
# *Prerequisites:* chapter 7 up to "Sampling"; log-sum-exp and autograd. The numerical traps of a
# naive implementation, the paper's pseudocode read literally, and the speed of the DP follow in
# {doc}`10b-ksubset-numerics-and-pseudocode`.
#
# *Run time:* about 15 seconds at CPU scale on a 2-core laptop CPU, the default. `MINIMOE_SCALE=gpu` chooses
# the larger configuration, for a GPU: 400,000 Monte Carlo draws per sampling test instead of 40,000, 10 times
# the sampling; nothing else changes.

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

import matplotlib.pyplot as plt
import numpy as np
import torch
from scipy.stats import chi2

import minimoe
from minimoe.ops import (ksubset_log_partition, ksubset_marginals, ksubset_sample,
                         range_subset_covariance, range_subset_log_partition, range_subset_map,
                         range_subset_marginals, range_subset_sample, range_subset_size_probs)

SCALE = os.environ.get("MINIMOE_SCALE", "cpu")  # "gpu" runs the larger configuration: chosen, never automatic
DEVICE = "cuda" if SCALE == "gpu" else "cpu"
if SCALE == "cpu":
    torch.set_num_threads(1)  # the problems here are small; extra threads mostly wait on each other
DRAWS = 40_000 if SCALE == "cpu" else 400_000  # Monte Carlo draws per sampling test
F64 = torch.float64
torch.manual_seed(0)
print(f"SCALE={SCALE}, device={DEVICE}, minimoe {minimoe.__version__}, torch {torch.__version__}")

# %% [markdown]
# (nb10-enumeration)=
# ## The law, its normaliser and its marginals: enumeration, a chain DP, and minimoe
#
# For one token with router logits $r \in \mathbb R^E$, the k-subset law gives every set $S$ of
# exactly $k$ experts the probability $P(S) = \exp(\sum_{j\in S} r_j)/Z_k$. With $E \le 10$ we can
# simply list all $\binom{E}{k}$ subsets, so enumeration is our ground truth: the normaliser, the
# marginals $m_j = P(j \in S)$ and the covariance of the indicator vector $z$ of $S$ are sums over
# that list.

# %%
def subsets(E, sizes):
    """Every subset of range(E) whose size is in `sizes`, as a (n, E) float64 0/1 matrix."""
    rows = [[1.0 if j in S else 0.0 for j in range(E)]
            for c in sizes for S in itertools.combinations(range(E), c)]
    return torch.tensor(rows, dtype=F64)


def enumerate_law(r, sizes):
    """Brute force over the subsets: (subsets, P(S), log Z, marginals, covariance of z)."""
    Zs = subsets(r.shape[-1], sizes)
    log_w = Zs @ r
    log_Z = torch.logsumexp(log_w, 0)
    P = (log_w - log_Z).exp()
    m = P @ Zs
    cov = Zs.T @ (P[:, None] * Zs) - torch.outer(m, m)
    return Zs, P, log_Z, m, cov


# %% [markdown]
# The normaliser $Z_k = \sum_{|S|=k}\prod_{j\in S} e^{r_j}$ is the elementary symmetric polynomial
# $e_k$ of $x_j = e^{r_j}$. Walk through the experts one at a time: a set of $c$ experts among the
# first $i+1$ either leaves expert $i$ out ($c$ among the first $i$) or takes it ($c-1$ among the
# first $i$). So the table $\alpha[i, c] = \log e_c(x_0, \dots, x_{i-1})$ obeys
#
# $$\alpha[i+1, c] = \operatorname{logaddexp}\big(\alpha[i, c],\ r_i + \alpha[i, c-1]\big),
# \qquad \alpha[i, 0] = 0,\quad \alpha[0, c>0] = -\infty,$$
#
# $E \cdot k$ cells, $O(1)$ each. We keep it in log space so that large logits cannot overflow. The
# suffix table $\beta[i, c]$, the log weight of all ways to finish from "$c$ picked before expert
# $i$" at an allowed size, obeys the mirror recurrence. Expert $i$ is in $S$ on the paths that take
# it, so
#
# $$m_i = \exp\Big(r_i + \operatorname{logsumexp}_c\big(\alpha[i, c] + \beta[i+1, c+1]\big) - \log Z\Big).$$
#
# Both tables are written below for a set of allowed sizes, so the range law later reuses them.
# Each row of `r` is an independent token.

# %%
def prefix_table(r, K):
    """alpha[..., i, c] = log e_c(exp(r_0), ..., exp(r_{i-1})) for i = 0..E, c = 0..K."""
    *batch, E = r.shape
    alpha = r.new_full((*batch, E + 1, K + 1), -math.inf)
    alpha[..., 0] = 0.0                                         # e_0 = 1
    for i in range(E):                                          # skip expert i, or take it
        alpha[..., i + 1, 1:] = torch.logaddexp(alpha[..., i, 1:], alpha[..., i, :-1] + r[..., i, None])
    return alpha


def suffix_table(r, sizes):
    """beta[..., i, c] = log sum over ways to pick from experts i..E-1, c already picked, ending in `sizes`."""
    *batch, E = r.shape
    K = max(sizes)
    beta = r.new_full((*batch, E + 1, K + 2), -math.inf)       # column K+1 stays -inf: too many
    for c in sizes:
        beta[..., E, c] = 0.0
    for i in reversed(range(E)):
        beta[..., i, :-1] = torch.logaddexp(beta[..., i + 1, :-1], beta[..., i + 1, 1:] + r[..., i, None])
    return beta[..., :-1]


def dp_log_partition(r, sizes):
    return torch.logsumexp(prefix_table(r, max(sizes))[..., -1, list(sizes)], -1)


def dp_marginals(r, sizes):
    """Forward-backward: m_i = exp(r_i + logsumexp_c(alpha[i, c] + beta[i+1, c+1]) - log Z)."""
    alpha, beta = prefix_table(r, max(sizes)), suffix_table(r, sizes)
    through = torch.logsumexp(alpha[..., :-1, :-1] + beta[..., 1:, 1:], -1)   # (..., E)
    return (r + through - beta[..., 0, 0, None]).exp()


# %% [markdown]
# Now the comparison. For every $E$ from 1 to 8, every $k$ from 1 to $E$ and three logit scales
# (0.1, 1 and 3 times standard normal), we compute $\log Z_k$ and the marginals three ways:
# enumeration, our DP, and `minimoe.ops`, all in float64. We also check the two identities the
# chapter derives, without using autograd on our DP:
#
# * the marginals are the gradient of the log-partition: central finite differences of our
#   `dp_log_partition` give `dp_marginals`;
# * the Jacobian of the marginals is the covariance of $z$: central finite differences of
#   `dp_marginals` give the enumerated covariance, and so do `ksubset_covariance` and autograd
#   through `ksubset_marginals` (whose backward is that covariance, computed analytically).

# %%
gen = torch.Generator().manual_seed(1)
worst = dict(logZ=0.0, marg=0.0, sum_k=0.0, grad_fd=0.0, cov_fd=0.0)
h = 1e-5
n_cases = 0
for E in range(1, 9):
    for k in range(1, E + 1):
        for scale in (0.1, 1.0, 3.0):
            r = scale * torch.randn(E, generator=gen, dtype=F64)
            _, _, logZ_enum, m_enum, cov_enum = enumerate_law(r, [k])
            steps = h * torch.eye(E, dtype=F64)
            # log Z and marginals: ours, minimoe's, enumeration
            worst["logZ"] = max(worst["logZ"], abs(dp_log_partition(r, [k]) - logZ_enum).item(),
                                abs(ksubset_log_partition(r, k) - logZ_enum).item())
            m_dp, m_mm = dp_marginals(r, [k]), ksubset_marginals(r, k)
            worst["marg"] = max(worst["marg"], (m_dp - m_enum).abs().max().item(), (m_mm - m_enum).abs().max().item())
            worst["sum_k"] = max(worst["sum_k"], abs(m_dp.sum() - k).item(), abs(m_mm.sum() - k).item())
            # marginals = gradient of log Z, Jacobian of the marginals = covariance (finite differences of our DP)
            fd = (dp_log_partition(r + steps, [k]) - dp_log_partition(r - steps, [k])) / (2 * h)
            worst["grad_fd"] = max(worst["grad_fd"], (fd - m_enum).abs().max().item())
            jac_fd = (dp_marginals(r + steps, [k]) - dp_marginals(r - steps, [k])) / (2 * h)  # row i: d m / d r_i
            worst["cov_fd"] = max(worst["cov_fd"], (jac_fd - cov_enum).abs().max().item())
            n_cases += 1
print(f"{n_cases} cases (E = 1..8, k = 1..E, 3 scales); worst absolute differences:")
for name, v in worst.items():
    print(f"  {name:14s} {v:.1e}")
assert worst["logZ"] < 1e-13 and worst["marg"] < 1e-13 and worst["sum_k"] < 1e-13
assert worst["grad_fd"] < 1e-8 and worst["cov_fd"] < 1e-8, "finite differences agree to their own accuracy"

# %% [markdown]
# All three agree to rounding. The last line collects the covariance's shape: symmetric, rows
# summing to zero (because $\sum_j z_j = k$ is not random), off-diagonal entries $\le 0$ (raising one
# logit lowers every other marginal) and diagonal $m_i(1-m_i)$.
#
# Two more facts from the chapter, checked on one token with $E = 6$, $k = 3$. The last row of the
# prefix table holds $e_c$ for every $c$ at once, which are the coefficients of the polynomial
# $\prod_i (1 + x_i t)$. And the law is the same as "each expert independently with probability
# $\sigma(r_j)$, conditioned on $|S| = k$", ProbMoE's definition: the factor
# $\prod_i \sigma(-r_i)$ is common to every subset and cancels. Adding a constant to every logit
# multiplies every weight by $e^{kc}$, which also cancels.

# %%
E6, K6 = 6, 3
r6 = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=F64)
Z6, P6, logZ6, m6, cov6 = enumerate_law(r6, [K6])

poly = np.array([1.0])
for x in r6.exp().numpy():
    poly = np.convolve(poly, [1.0, x])                           # coefficients of prod (1 + x_i t), low first
coef_err = np.abs(prefix_table(r6, E6)[-1].exp().numpy() - poly).max()

Zall = subsets(E6, range(E6 + 1))                                # all 64 subsets
p = torch.sigmoid(r6)
bern = (Zall * p + (1 - Zall) * (1 - p)).prod(1)                 # independent Bernoulli(sigmoid(r))
cond = bern[Zall.sum(1) == K6] / bern[Zall.sum(1) == K6].sum()   # ... conditioned on |S| = 3
shift_err = (ksubset_marginals(r6 + 7.5, K6) - m6).abs().max().item()
print(f"max |e_c - polynomial coefficient| = {coef_err:.1e}")
print(f"max |P(S) - Bernoulli(sigmoid) conditioned on |S|=3| = {(cond - P6).abs().max():.1e}")
print(f"max |m(r + 7.5) - m(r)| = {shift_err:.1e}")
assert coef_err < 1e-12 and (cond - P6).abs().max() < 1e-14 and shift_err < 1e-12

# %% [markdown]
# **It is not the Gumbel-top-$k$ law.** The cheapest way to draw $k$ distinct experts is
# Gumbel-top-$k$: add Gumbel noise to the logits and keep the $k$ largest. That draws experts one
# after another from the softmax, without replacement (Plackett–Luce), so its subset probabilities
# are a sum over the $k!$ orders in which $S$ can be drawn:
# $P_{\mathrm{PL}}(S) = \sum_{\text{orders}} \prod_{t} \pi_{s_t} / (1 - \sum_{u<t} \pi_{s_u})$. This
# is not proportional to $\prod_{j\in S}\pi_j$. We draw Gumbel-top-$k$ samples and run a chi-square
# test against both laws: it fits its own law and rejects the k-subset law.

# %%
def chi_square(counts, probs, min_expected=5.0):
    """Pearson chi-square of observed counts against probabilities; cells expected below
    `min_expected` are pooled into one. Returns (statistic, degrees of freedom, p-value)."""
    counts, expected = np.asarray(counts, float), np.asarray(probs, float) * np.sum(counts)
    small = expected < min_expected
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    stat = float(((counts - expected) ** 2 / expected).sum())
    return stat, len(counts) - 1, float(chi2.sf(stat, len(counts) - 1))


def subset_counts(masks, Zs):
    """How often each row of the subset list Zs occurs among the 0/1 masks (N, E)."""
    powers = 2 ** torch.arange(Zs.shape[1])
    codes = (masks.long() * powers).sum(1)
    index = {int(c): n for n, c in enumerate((Zs.long() * powers).sum(1))}
    found = torch.bincount(codes, minlength=2 ** Zs.shape[1])
    return np.array([int(found[c]) for c in index])


pi6 = torch.softmax(r6, 0)
P_pl = torch.zeros(len(Z6), dtype=F64)
for n, row in enumerate(Z6):
    for order in itertools.permutations(row.nonzero().flatten().tolist()):
        prob, used = 1.0, 0.0
        for j in order:
            prob, used = prob * pi6[j].item() / (1 - used), used + pi6[j].item()
        P_pl[n] += prob
assert abs(P_pl.sum().item() - 1) < 1e-12


# %%
g_gumbel = torch.Generator().manual_seed(2)
u = torch.rand(DRAWS, E6, generator=g_gumbel, dtype=F64)
top = (r6 - torch.log(-torch.log(u))).topk(K6, dim=1).indices
gumbel_masks = torch.zeros(DRAWS, E6).scatter_(1, top, 1.0)
counts_gumbel = subset_counts(gumbel_masks, Z6)
stat_pl, dof_pl, p_pl = chi_square(counts_gumbel, P_pl)
stat_k, dof_k, p_k = chi_square(counts_gumbel, P6)
print(f"{DRAWS} Gumbel-top-3 draws, E=6: chi2 vs Plackett-Luce = {stat_pl:.1f} (dof {dof_pl}, p = {p_pl:.3f}); "
      f"vs k-subset law = {stat_k:.0f} (dof {dof_k}, p = {p_k:.1e})")
print(f"largest |P_PL(S) - P(S)| = {(P_pl - P6).abs().max():.3f}, "
      f"marginals: PL {(P_pl @ Z6).numpy().round(3)}, k-subset {m6.numpy().round(3)}")
assert p_pl > 1e-3, "Gumbel-top-k samples fit the Plackett-Luce subset law"
assert p_k < 1e-6, "and not the k-subset law"
top_subset = P6.argmax()
assert P_pl[top_subset] > P6[top_subset] and (P_pl @ Z6)[0] > m6[0], "PL favours the top subset and top expert"

# %%
order6 = torch.argsort(P6, descending=True)
labels6 = ["{" + ",".join(str(j) for j in row.nonzero().flatten().tolist()) + "}" for row in Z6[order6]]
fig, ax = plt.subplots(figsize=(11, 3.8))
xs = np.arange(len(Z6))
ax.bar(xs - 0.2, P6[order6], width=0.4, label="k-subset law $\\propto \\prod_{j\\in S} e^{r_j}$")
ax.bar(xs + 0.2, P_pl[order6], width=0.4, label="Gumbel-top-k (Plackett–Luce) law")
ax.plot(xs + 0.2, counts_gumbel[order6.numpy()] / DRAWS, "k.", label=f"Gumbel-top-k frequency, {DRAWS} draws")
ax.set_xticks(xs)
ax.set_xticklabels(labels6, rotation=60, fontsize=8)
ax.set_xlabel("subset S (E = 6, k = 3, logits [2, 1, 0.5, 0, -1, -3])")
ax.set_ylabel("probability")
ax.set_title("Two laws over 3-subsets: the k-subset law and Gumbel-top-k")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# Gumbel-top-$k$ puts more mass on the very top subset and on sets that contain the top expert;
# the k-subset law spreads more. The two agree only for $k = 1$ (both are the softmax) and $k = E$.

# %% [markdown]
# (nb10-tree)=
# ### The same normaliser by a balanced tree (the paper's Appendix H)
#
# $e_c(x)$ is the coefficient of $t^c$ in $\prod_j(1 + x_jt)$, and the factors can be multiplied in any
# order. Pairing them in a balanced binary tree, every node multiplies two polynomials truncated at
# degree $k$ (a log-space convolution of at most $k+1$ coefficients), and the nodes of one level are
# independent: $\log_2 E$ levels instead of $E$ sequential steps. We pad $E$ to a power of two with
# experts of logit $-\infty$ (never chosen) and compare the root with the chain DP.

# %%
def tree_log_esp(r, k):
    """log e_c(exp(r)) for c = 0..k by a balanced tree of truncated polynomial products."""
    E = r.shape[-1]
    size = 1 << max(0, (E - 1).bit_length())
    padded = torch.cat([r, torch.full((size - E,), -math.inf, dtype=r.dtype)])
    blocks = torch.stack([torch.zeros_like(padded), padded], -1)  # each leaf: log(1 + x_j t), degrees 0 and 1
    while blocks.shape[0] > 1:
        left, right = blocks[0::2], blocks[1::2]
        degree = min(k, left.shape[-1] - 1 + right.shape[-1] - 1)
        out = torch.full((left.shape[0], degree + 1), -math.inf, dtype=r.dtype)
        for c in range(degree + 1):  # out[c] = logsumexp_{a + b = c} left[a] + right[b]
            terms = [left[:, a] + right[:, c - a] for a in range(left.shape[-1]) if 0 <= c - a < right.shape[-1]]
            out[:, c] = torch.logsumexp(torch.stack(terms, -1), -1)
        blocks = out
    return blocks[0]


worst = 0.0
for E_t, k_t in [(7, 3), (8, 8), (13, 5), (60, 4), (64, 8)]:
    r_t = 2 * torch.randn(E_t, dtype=torch.float64)
    tree = tree_log_esp(r_t, k_t)
    chain = torch.stack([ksubset_log_partition(r_t, c) for c in range(1, k_t + 1)])
    worst = max(worst, (tree[1:k_t + 1] - chain).abs().max().item())
print(f"tree vs chain, E up to 64, k up to 8: max |difference of log e_c| = {worst:.1e}")
assert worst < 1e-10, "the tree and the chain compute the same polynomial"

# %% [markdown]
# The paper's circuit also returns the marginals (`CircuitDownward`, Algorithm 5): a top-down pass
# that is the backward pass of the upward one. Autograd through the tree does the same job; the
# gradient of the root's $\log e_k$ must be the marginals.

# %%
r_tree = torch.tensor([1.5, -0.2, 0.7, 0.0, -1.1, 2.2, 0.3, -0.6], dtype=F64, requires_grad=True)
m_tree = torch.autograd.grad(tree_log_esp(r_tree, 3)[3], r_tree)[0]
m_enum = enumerate_law(r_tree.detach(), [3])[3]
print(f"E = 8, k = 3: max |grad of the tree's root - marginals by enumeration| = {(m_tree - m_enum).abs().max():.1e}")
assert torch.allclose(m_tree, m_enum, atol=1e-12) and torch.allclose(ksubset_marginals(r_tree.detach(), 3), m_enum, atol=1e-12)

# %% [markdown]
# (nb10-sampling)=
# ## Exact sampling, backwards through the table
#
# To draw $S$ exactly, decide the experts from the last to the first. With $c$ experts still to
# pick among experts $0..i$, the weight of the ways that take expert $i$ is
# $x_i\, e_{c-1}(x_0..x_{i-1})$ out of $e_c(x_0..x_i)$, so we take it with probability
#
# $$p = \exp\big(r_i + \alpha[i, c-1] - \alpha[i+1, c]\big).$$
#
# Multiplying these step probabilities along a path telescopes to $\exp(\sum_S r_j)/Z_k$: the
# sampler is exact. Two boundary cases come for free: $c = 0$ gives probability 0, and $c = i + 1$
# (every remaining expert is needed) gives $\alpha[i, c] = -\infty$ in the skip term, so
# $\alpha[i+1,c] = r_i + \alpha[i, c-1]$ exactly and $p = 1$.

# %%
def sample_backward(r, k, u, literal_paper=False):
    """Draws of the k-subset law for one token r (E,), one per row of the uniforms u (N, E).
    With literal_paper=True, expert i is taken with probability sigmoid(log p) instead of p."""
    alpha = prefix_table(r, k)
    N, E = u.shape
    left = torch.full((N,), k)
    mask = torch.zeros(N, E)
    for i in reversed(range(E)):
        log_p = r[i] + alpha[i, (left - 1).clamp(min=0)] - alpha[i + 1, left]
        p = torch.sigmoid(log_p) if literal_paper else log_p.exp()
        take = (u[:, i] < p) & (left > 0)
        mask[:, i] = take.double()
        left = left - take.long()
    return mask


# The telescoping argument, checked exactly: follow the walk along each subset and multiply the
# probabilities of its decisions.
def path_probability(r, k, S):
    alpha, left, prob = prefix_table(r, k), k, 1.0
    for i in reversed(range(len(r))):
        p = (r[i] + alpha[i, left - 1] - alpha[i + 1, left]).exp().item() if left > 0 else 0.0
        prob, left = (prob * p, left - 1) if S[i] else (prob * (1 - p), left)
    return prob


walk = torch.tensor([path_probability(r6, K6, S.bool().tolist()) for S in Z6], dtype=F64)
print(f"max |P(walk produces S) - P(S)| over the 20 subsets = {(walk - P6).abs().max():.1e}")
assert (walk - P6).abs().max() < 1e-14


# %% [markdown]
# Now draws: our sampler and `minimoe.ops.ksubset_sample`, each with its own seed, against the
# exact probabilities. The chi-square test pools subsets expected fewer than 5 times; we also
# compare each expert's inclusion frequency with its marginal.

# %%
g_mine = torch.Generator().manual_seed(3)
mine = sample_backward(r6, K6, torch.rand(DRAWS, E6, generator=g_mine, dtype=F64))
g_mm = torch.Generator(device=DEVICE).manual_seed(4)
theirs = ksubset_sample(r6.to(DEVICE).expand(DRAWS, E6), K6, generator=g_mm).cpu()
for name, masks in [("ours", mine), ("minimoe", theirs)]:
    counts = subset_counts(masks, Z6)
    stat, dof, pval = chi_square(counts, P6)
    freq = masks.double().mean(0)
    z_scores = (freq - m6) / (m6 * (1 - m6) / DRAWS).sqrt()
    print(f"{name:8s}: {DRAWS} draws, sizes {sorted(set(masks.sum(1).long().tolist()))}, chi2 = {stat:.1f} "
          f"(dof {dof}, p = {pval:.2f}), inclusion frequency z-scores {z_scores.numpy().round(2)}")
    assert (masks.sum(1) == K6).all(), "every draw has exactly k experts"
    assert pval > 1e-3, "the frequencies fit the exact probabilities"
    assert z_scores.abs().max() < 4.5, "each expert's inclusion frequency is within 4.5 sigma of m_j"
counts_mine, counts_mm = subset_counts(mine, Z6), subset_counts(theirs, Z6)

# %% [markdown]
# **The paper's sampler as printed.** ProbMoE's Algorithm 2 computes the same log-probability
# $\pi_i = a[i-1, j-1] + \log p_i - a[i, j]$ (in its $(\log p, \log q)$ tables, the factors
# $\prod q$ cancel and it is exactly our `log_p`) and then draws $z_i \sim
# \mathrm{Bernoulli}(\sigma(\pi_i))$. A sigmoid of a log-probability is not that probability: it is
# at most $\sigma(0) = 1/2$, so even a forced inclusion happens only half the time, and the draws
# come out with fewer than $k$ experts. The reference code gets it right by feeding the sigmoid the
# log-*odds* $r_i + \alpha[i, c-1] - \alpha[i, c]$ (take against skip), whose sigmoid is $p$; we
# check that identity on every cell of the table.

# %%
g_lit = torch.Generator().manual_seed(5)
literal = sample_backward(r6, K6, torch.rand(DRAWS, E6, generator=g_lit, dtype=F64), literal_paper=True)
sizes_lit = torch.bincount(literal.sum(1).long(), minlength=K6 + 1)
print(f"literal sampler, {DRAWS} draws: subset sizes 0..3 occur {sizes_lit.tolist()} times "
      f"({sizes_lit[K6].item() / DRAWS:.1%} have size k = 3)")
assert sizes_lit[K6] < 0.5 * DRAWS and sizes_lit[:K6].sum() > 0.5 * DRAWS, "most draws have fewer than k experts"

alpha6 = prefix_table(r6, K6)
gaps = []
for i in range(E6):
    for c in range(1, min(i + 1, K6) + 1):
        log_prob = r6[i] + alpha6[i, c - 1] - alpha6[i + 1, c]
        log_odds = r6[i] + alpha6[i, c - 1] - alpha6[i, c]   # alpha[i, c] = -inf when c = i + 1: odds infinite
        gaps.append(abs(torch.sigmoid(log_odds) - log_prob.exp()).item())
print(f"max |sigmoid(log-odds) - exp(log-prob)| over the table = {max(gaps):.1e}")
assert max(gaps) < 1e-15

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 3.8), gridspec_kw=dict(width_ratios=[3, 1]))
ax = axes[0]
ax.bar(xs, P6[order6], color="lightgray", label="exact P(S)")
ax.plot(xs - 0.15, counts_mine[order6.numpy()] / DRAWS, "o", ms=4, label="our backward sampler")
ax.plot(xs + 0.15, counts_mm[order6.numpy()] / DRAWS, "x", ms=5, label="minimoe.ops.ksubset_sample")
ax.set_xticks(xs)
ax.set_xticklabels(labels6, rotation=60, fontsize=8)
ax.set_xlabel("subset S (E = 6, k = 3)")
ax.set_ylabel("probability / frequency")
ax.set_title(f"Sampling frequencies against the exact law ({DRAWS} draws each)")
ax.legend(fontsize=8)
ax = axes[1]
ax.bar(range(K6 + 1), sizes_lit / DRAWS, label="paper, literal: Bernoulli(sigmoid(log p))")
ax.bar([K6], [1.0], fill=False, edgecolor="k", ls="--", label="exact sampler")
ax.set_xlabel("subset size |S|")
ax.set_ylabel("share of draws")
ax.set_title("Subset sizes (k = 3)")
ax.legend(fontsize=7, loc="upper left")
fig.tight_layout()
plt.show()

# %% [markdown]
# (nb10-heatmaps)=
# ## What the marginals look like
#
# Sixteen experts with logits evenly spaced from $2.5$ down to $-2.5$. For each $k$ from 1 to 16
# we compute the marginals and stack them into a heatmap (left). Row $k = 1$ is the softmax, row
# $k = 16$ is all ones, every row sums to $k$, and each expert's marginal grows with $k$. Within a
# row the order of the logits is kept: $m_i - m_j = (x_i - x_j)\,e_{k-1}(x_{-i,-j})/Z_k$.
#
# The right panel compares, at $k = 4$, the marginals with the obvious guess $k \cdot
# \mathrm{softmax}(r)$. Both sum to $k$, but $k\pi$ exceeds 1 for the top expert, which no
# probability can, while the k-subset marginals saturate towards 1 and push the extra mass down
# to the experts below.

# %%
E16 = 16
r16 = torch.linspace(2.5, -2.5, E16, dtype=F64)
M16 = torch.stack([ksubset_marginals(r16, k) for k in range(1, E16 + 1)])   # row k-1
pi16 = torch.softmax(r16, 0)
ks = torch.arange(1, E16 + 1, dtype=F64)
assert (M16.sum(1) - ks).abs().max() < 1e-12, "row k sums to k"
assert (M16[0] - pi16).abs().max() < 1e-15 and (M16[-1] == 1).all(), "k = 1 is the softmax, k = E all ones"
assert (M16.diff(dim=0) > 0).all(), "each marginal increases with k (below k = E)"
assert (M16[:-1].diff(dim=1) < 0).all(), "a larger logit has a larger marginal"
m4 = M16[3]
print(f"k=4: top expert 4*softmax = {4 * pi16[0]:.3f}, marginal = {m4[0]:.3f}; "
      f"expert 8: 4*softmax = {4 * pi16[8]:.3f}, marginal = {m4[8]:.3f}")
assert 4 * pi16[0] > 1 and m4.max() < 1
assert (m4[8:] > 4 * pi16[8:]).all(), "the low experts get more than k * softmax"

fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
im = axes[0].imshow(M16, cmap="viridis", vmin=0, vmax=1, aspect="auto",
                    extent=(-0.5, E16 - 0.5, E16 + 0.5, 0.5))
fig.colorbar(im, ax=axes[0], label="$m_j = P(j \\in S)$")
axes[0].set_xlabel("expert j (logits 2.5 down to -2.5)")
axes[0].set_ylabel("subset size k")
axes[0].set_title("k-subset marginals for every k")
axes[1].plot(range(E16), pi16, "s-", ms=3, label="softmax $\\pi$ (= marginals at k = 1)")
axes[1].plot(range(E16), 4 * pi16, "^-", ms=3, label="$4\\pi$")
axes[1].plot(range(E16), m4, "o-", ms=3, label="k-subset marginals, k = 4")
axes[1].axhline(1, color="gray", lw=0.8, ls="--")
axes[1].set_xlabel("expert j")
axes[1].set_ylabel("value")
axes[1].set_title("Softmax against k-subset marginals (both sum to 4)")
axes[1].legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# **Temperature.** Dividing the logits by $\tau$ sharpens the law as $\tau \to 0$ (all the mass
# goes to the top-$k$ set, and the marginals become its 0/1 indicator) and flattens it as
# $\tau \to \infty$ (every subset equally likely, every marginal $k/E$). In between, the top
# expert's marginal falls steadily.

# %%
taus = torch.logspace(-1.5, 1.5, 31, dtype=F64)
Mtau = torch.stack([ksubset_marginals(r16 / t, 4) for t in taus])
topk_indicator = (torch.arange(E16) < 4).double()
print(f"tau = {taus[0]:.3f}: max |m - top-4 indicator| = {(Mtau[0] - topk_indicator).abs().max():.1e}; "
      f"tau = {taus[-1]:.1f}: max |m - 4/16| = {(Mtau[-1] - 0.25).abs().max():.3f}")
assert (Mtau[0] - topk_indicator).abs().max() < 1e-4
assert (Mtau[-1] - 0.25).abs().max() < 0.05
assert (Mtau[:, 0].diff() < 0).all(), "the top expert's marginal falls as tau grows"
assert (Mtau.sum(1) - 4).abs().max() < 1e-12

fig, ax = plt.subplots(figsize=(7, 4.4))
im = ax.pcolormesh(np.arange(E16), np.log10(taus.numpy()), Mtau.numpy(), cmap="viridis", vmin=0, vmax=1,
                   shading="nearest")
fig.colorbar(im, ax=ax, label="$m_j$ at k = 4")
ax.set_xlabel("expert j (logits 2.5 down to -2.5)")
ax.set_ylabel("$\\log_{10} \\tau$ (logits divided by $\\tau$)")
ax.set_title("Marginals sharpen to top-4 as $\\tau \\to 0$ and flatten to 4/16 as $\\tau$ grows")
fig.tight_layout()
plt.show()

# %% [markdown]
# (nb10-range)=
# ## The range law of dynamic-$k$
#
# Dynamic-$k$ routing keeps the same weights $\exp(\sum_{j\in S} r_j)$ but allows every size from
# $k_{\min}$ to $k_{\max}$. One prefix table of width $k_{\max}+1$ serves every size at once:
# $Z^* = \sum_{c=k_{\min}}^{k_{\max}} e_c$, the size law is $\rho_c = e_c / Z^*$, and the marginals
# come from the same forward-backward formula with every size in the range accepted at the end of
# the suffix table. They are a mixture of the exact-$k$ marginals, $m^* = \sum_c \rho_c\, m^{(c)}$,
# and sum to $E|S|$ instead of a fixed $k$. We check all of it by enumeration for $E = 6$ and the
# range $[2, 4]$.

# %%
KMIN, KMAX = 2, 4
SIZES = range(KMIN, KMAX + 1)
rr = torch.tensor([1.2, 0.6, 0.1, -0.3, -0.8, -1.5], dtype=F64)
Zr, Pr, logZr, mr, covr = enumerate_law(rr, SIZES)
size_r = Zr.sum(1)
rho_enum = torch.stack([Pr[size_r == c].sum() for c in SIZES])
rho_dp = torch.softmax(prefix_table(rr, KMAX)[-1, KMIN:], 0)
rho_mm = range_subset_size_probs(rr, KMIN, KMAX)
ES = (Pr * size_r).sum()
mixture = sum(rho_enum[n] * ksubset_marginals(rr, c) for n, c in enumerate(SIZES))
cov_size = Zr.T @ (Pr * size_r) - mr * ES                      # Cov(z_i, |S|), straight from the list
errors = {
    "log Z*: DP, minimoe": max(abs(dp_log_partition(rr, SIZES) - logZr).item(),
                               abs(range_subset_log_partition(rr, KMIN, KMAX) - logZr).item()),
    "size law: DP, minimoe": max((rho_dp - rho_enum).abs().max().item(), (rho_mm - rho_enum).abs().max().item()),
    "marginals: DP, minimoe": max((dp_marginals(rr, SIZES) - mr).abs().max().item(),
                                  (range_subset_marginals(rr, KMIN, KMAX) - mr).abs().max().item()),
    "sum of marginals - E|S|": abs(range_subset_marginals(rr, KMIN, KMAX).sum() - ES).item(),
    "mixture of exact-k": (mixture - mr).abs().max().item(),
    "covariance: minimoe": (range_subset_covariance(rr, KMIN, KMAX) - covr).abs().max().item(),
    "cov row sums - Cov(z,|S|)": (covr.sum(1) - cov_size).abs().max().item(),
}
print(f"E=6, range [{KMIN},{KMAX}]: size law {rho_enum.numpy().round(4)}, E|S| = {ES:.4f}, "
      f"Cov(z_i, |S|) = {cov_size.numpy().round(3)}")
for name, v in errors.items():
    print(f"  {name:26s} {v:.1e}")
assert max(errors.values()) < 1e-12
assert cov_size.abs().min() > 0.01, "the covariance rows do not sum to 0 here: |S| is random"

# %% [markdown]
# **The absolute level of the logits matters.** For exact-$k$ a common shift $c$ multiplies every
# weight by the same $e^{kc}$ and changes nothing. Here it multiplies the weight of a set by
# $e^{c|S|}$, which favours larger sets when $c > 0$. In fact $\log Z^*(r + c)$ is the cumulant
# generating function of $|S|$, so its first derivative in $c$ is $E|S|$ and its second is
# $\mathrm{Var}|S| \ge 0$: the expected size climbs with the shift, fastest where the size is
# most uncertain. We check $\frac{d}{dc}E|S| = \mathrm{Var}|S|$ by central differences, and
# $\frac{d}{dc}\log Z^* = E|S|$ with autograd. A softmax over the experts cannot see $c$ at all,
# which is why the sigmoid and softmax readings of the router differ for dynamic-$k$.

# %%
cs = torch.linspace(-4, 4, 81, dtype=F64)
sizes_t = torch.arange(KMIN, KMAX + 1, dtype=F64)


def size_moments(c):
    rho = range_subset_size_probs(rr + c[:, None], KMIN, KMAX)
    mean = rho @ sizes_t
    return mean, rho @ sizes_t ** 2 - mean ** 2


mean_c, var_c = size_moments(cs)
hc = 1e-5
slope = (size_moments(cs + hc)[0] - size_moments(cs - hc)[0]) / (2 * hc)
cc = cs.clone().requires_grad_(True)
(dlogZ,) = torch.autograd.grad(range_subset_log_partition(rr + cc[:, None], KMIN, KMAX).sum(), cc)
at = {c: mean_c[(cs - c).abs().argmin()].item() for c in (-2.0, 0.0, 2.0)}
print("E|S| at shifts -2 / 0 / +2: " + " / ".join(f"{v:.3f}" for v in at.values()))
print(f"max |dE|S|/dc - Var|S|| = {(slope - var_c).abs().max():.1e}, "
      f"max |dlogZ*/dc - E|S|| = {(dlogZ - mean_c).abs().max():.1e}")
assert (mean_c.diff() > 0).all(), "E|S| increases strictly with the shift"
assert (slope - var_c).abs().max() < 1e-6 and (dlogZ - mean_c).abs().max() < 1e-12
assert (ksubset_marginals(rr + 3.0, 3) - ksubset_marginals(rr, 3)).abs().max() < 1e-12, "exact-k ignores the shift"

fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
axes[0].plot(cs, mean_c, label="E|S|")
axes[0].plot(cs, var_c, label="Var|S|")
axes[0].plot(cs[::4], slope[::4], "k.", ms=4, label="dE|S|/dc (finite differences)")
axes[0].set_xlabel("common shift c added to every logit")
axes[0].set_ylabel("size moments")
axes[0].set_title(f"Range [{KMIN},{KMAX}], E = 6: the shift sets the budget")
axes[0].legend(fontsize=8)
bottom = np.zeros(3)
rho_at = range_subset_size_probs(rr + torch.tensor([-2.0, 0.0, 2.0], dtype=F64)[:, None], KMIN, KMAX)
for n, c in enumerate(SIZES):
    axes[1].bar(["c = -2", "c = 0", "c = +2"], rho_at[:, n], bottom=bottom, label=f"|S| = {c}")
    bottom += rho_at[:, n].numpy()
axes[1].set_xlabel("shift")
axes[1].set_ylabel("P(|S| = c)")
axes[1].set_title("Size law at three shifts")
axes[1].legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# `range_subset_sample` draws the size first, from $\rho$, then a subset of that size with the
# backward walk above; the two stages multiply to $e^{\sum_S r_j}/Z^*$. A chi-square test over all
# 50 subsets of sizes 2 to 4:

# %%
g_range = torch.Generator(device=DEVICE).manual_seed(6)
draws_r = range_subset_sample(rr.to(DEVICE).expand(DRAWS, 6), KMIN, KMAX, generator=g_range).cpu()
stat, dof, pval = chi_square(subset_counts(draws_r, Zr), Pr)
print(f"{DRAWS} draws of the range law: sizes in {sorted(set(draws_r.sum(1).long().tolist()))}, "
      f"chi2 = {stat:.1f} (dof {dof}, p = {pval:.2f}), mean size {draws_r.sum(1).double().mean():.4f} vs {ES:.4f}")
assert pval > 1e-3 and ((draws_r.sum(1) >= KMIN) & (draws_r.sum(1) <= KMAX)).all()

# %% [markdown]
# **The MAP subset.** $\log P(S) = \sum_{j\in S} r_j - \log Z^*$, so for each size the best set is
# the top-$c$ logits, and the best size maximises $F(c)$, the sum of the $c$ largest logits. Its
# increments are the sorted logits, which decrease, so $F$ is concave and peaks where the logits
# turn negative: keep every expert with $r_j > 0$, at least $k_{\min}$ and at most $k_{\max}$.
# The paper's Algorithm 3 instead takes prefix sums of the sorted *softmax probabilities*; those
# only grow, so its argmax is always $k_{\max}$. We compare brute force over the 238 allowed
# subsets of $E = 8$, range $[2, 6]$, with `range_subset_map`, Algorithm 3 as printed, and
# Algorithm 3 with prefix sums of logits, on 2,000 random tokens whose logit level varies.

# %%
E8, LO, HI, N_MAP = 8, 2, 6, 2000
g_map = torch.Generator().manual_seed(7)
R = 1.5 * torch.randn(N_MAP, E8, generator=g_map, dtype=F64) + 4 * torch.rand(N_MAP, 1, generator=g_map, dtype=F64) - 2
Zm = subsets(E8, range(LO, HI + 1))
brute = Zm[(R @ Zm.T).argmax(1)].bool()
ours = range_subset_map(R, LO, HI)


def alg3(logits, lo, hi, sum_softmax):
    """Algorithm 3: sort, take prefix sums, k* = the argmax over k in [lo, hi]; keep the top-k*
    experts. As printed the prefix sums are over softmax probabilities (sum_softmax=True)."""
    scores = torch.softmax(logits, 1) if sum_softmax else logits
    C = scores.sort(dim=1, descending=True).values.cumsum(1)
    kstar = lo + C[:, lo - 1:hi].argmax(1)
    rank = logits.argsort(1, descending=True).argsort(1)
    return rank < kstar[:, None], kstar


printed, k_printed = alg3(R, LO, HI, sum_softmax=True)
fixed, _ = alg3(R, LO, HI, sum_softmax=False)
size_brute = brute.sum(1)
print(f"range_subset_map = brute force on {(ours == brute).all(1).sum()} / {N_MAP} tokens; "
      f"Alg. 3 with logits: {(fixed == brute).all(1).sum()} / {N_MAP}; Alg. 3 as printed: "
      f"{(printed == brute).all(1).sum()} / {N_MAP} (it picks k_max = {HI} on {(k_printed == HI).sum()} tokens, "
      f"the MAP size is {HI} on {(size_brute == HI).sum()})")
assert (ours == brute).all() and (fixed == brute).all()
assert (size_brute == (R > 0).sum(1).clamp(LO, HI)).all(), "MAP size = clip(#{r > 0}, k_min, k_max)"
assert (k_printed == HI).all(), "Alg. 3 as printed always picks k_max"
assert (printed == brute).all(1).sum() == (size_brute == HI).sum(), "and is right only where k_max is the MAP size"

fig, ax = plt.subplots(figsize=(6.5, 3.6))
bins = np.arange(LO - 0.5, HI + 1.5)
ax.hist([size_brute.numpy(), k_printed.numpy()], bins=bins, label=["MAP size (brute force = minimoe)",
                                                                  "Alg. 3 as printed"])
ax.set_xlabel("number of experts kept")
ax.set_ylabel(f"tokens (of {N_MAP})")
ax.set_title(f"MAP subset size, E = {E8}, range [{LO},{HI}]")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# (nb10-scratch)=
# ## The two ProbMoE routers from scratch
#
# Everything above fits in one router. In training a ProbMoE layer draws each token's subset from
# the law (exactly $k$ experts, or between $k_{\min}$ and $k_{\max}$ for dynamic-$k$), and uses the
# *straight-through* gates $(\text{mask} + m - \mathrm{sg}(m))\cdot\mathrm{softmax}$: the value is the
# sampled mask times the softmax, the gradient flows through the marginals $m$, which autograd gets
# as the gradient of $\log Z$ (Proposition 7.2). The sample walks the experts from the last to the
# first through the table, after drawing the size from $P(|S| = c)\propto e_c$.

# %% tags=["from-scratch"]
import torch
import torch.nn.functional as F


def weight_table(r, K):
    """alpha[i][:, c] = e_c(w_0, ..., w_{i-1}), w = exp(r): the chain DP, in the linear domain (fine
    for moderate logits) and out of place, so that autograd can differentiate it twice."""
    alpha, w = [F.one_hot(torch.zeros(r.shape[0], dtype=torch.long), K + 1).to(r.dtype)], r.exp()
    for i in range(r.shape[1]):
        alpha.append(torch.cat([alpha[-1][:, :1], alpha[-1][:, 1:] + w[:, i:i + 1] * alpha[-1][:, :-1]], 1))
    return alpha


def subset_route(logits, k_min, k_max, u):
    """Sampled subsets (T, E) from the uniforms u (T, E + 1), and the straight-through gates."""
    T, E = logits.shape
    r = logits if logits.requires_grad else logits.detach().requires_grad_(True)
    alpha = weight_table(r, k_max)
    m = torch.autograd.grad(alpha[E][:, k_min:].sum(-1).log().sum(), r, create_graph=True)[0]  # P(j in S)
    a, w = [t.detach() for t in alpha], r.detach().exp()
    cdf = a[E][:, k_min:].cumsum(-1)                                      # first the size ...
    left = k_min + torch.searchsorted(cdf, u[:, :1] * cdf[:, -1:], right=True)[:, 0].clamp_max(k_max - k_min)
    mask = torch.zeros(T, E, dtype=torch.bool)
    for i in reversed(range(E)):                                          # ... then the experts, last first
        take_p = w[:, i] * a[i].gather(1, (left - 1).clamp(min=0)[:, None])[:, 0] / a[i + 1].gather(1, left[:, None])[:, 0]
        mask[:, i] = ((u[:, 1 + i] < take_p) & (left > 0)) | (left == i + 1)   # the rest all needed
        left = left - mask[:, i].long()
    return mask, (mask + m - m.detach()) * torch.softmax(logits, -1)

# %%
from minimoe.routers import router_class

torch.manual_seed(0)
x_small = torch.randn(1, 24, 8, dtype=torch.float64)
for name, options, (k_min, k_max) in (("probmoe_exact", {"k": 2}, (2, 2)),
                                       ("probmoe_dynamic", {"k_min": 1, "k_max": 3}, (1, 3))):
    router = router_class(name)(8, 6, generator=torch.Generator().manual_seed(3), **options).double().train()
    routing = router(x_small)
    u = torch.rand(24, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64)   # the router's draws
    logits = router.gate(x_small)[0]
    mask, gates = subset_route(logits, k_min, k_max, u)
    assert torch.equal(mask, routing.position[0] >= 0)
    torch.testing.assert_close(gates, routing.combine[0], rtol=0, atol=1e-12)
    probe = torch.randn(24, 6, dtype=torch.float64)                                    # gradients agree too
    ours, theirs = (torch.autograd.grad((g * probe).sum(), router.gate.weight)[0] for g in (gates, routing.combine[0]))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)
    print(f"{name}: the same subsets (sizes {sorted(set(mask.sum(-1).tolist()))}), gates and router gradient")

# %% [markdown]
# ## What we saw
#
# * A ten-line log-space chain DP gives $\log Z_k$ and, with its mirror suffix table, the
#   marginals; both match enumeration and `minimoe` to about $10^{-14}$ for every $E \le 8$ and $k$.
#   Finite differences confirm that the marginals are the gradient of $\log Z_k$ and that their
#   Jacobian is the covariance of $z$.
# * The k-subset law is the Bernoulli-sigmoid law conditioned on $|S| = k$, and it is not the
#   Gumbel-top-$k$ law: a chi-square test with 40,000 draws rejects it with $p \approx 0$.
# * Walking backwards through the prefix table samples exactly (chi-square over all 20 subsets
#   passes, for our sampler and for `ksubset_sample`). The paper's sampler, read literally, feeds a
#   log-probability to a sigmoid and returns subsets with fewer than $k$ experts most of the time.
# * Marginals grow with $k$ from the softmax ($k=1$) to all ones, never exceed 1 (unlike
#   $k\cdot$softmax), and go from the top-$k$ indicator to $k/E$ as the temperature rises.
# * The range law sums to $E|S|$ and mixes the exact-$k$ marginals; unlike exact-$k$ it depends on
#   the logits' level, with $\frac{d}{dc}E|S| = \mathrm{Var}|S|$. Its MAP keeps the positive
#   logits, clipped to the range; Algorithm 3 as printed always keeps $k_{\max}$.
