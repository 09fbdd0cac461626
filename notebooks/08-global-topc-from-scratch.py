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
# # Global top-c from scratch
#
# Companion to {doc}`../book/06-linear-programming`. We solve the token-choice, expert-choice and
# global selection problems as linear programs with `scipy.optimize.linprog` and compare them with
# `minimoe.ops.global_topc`; draw the thresholds that the duals are; count how many experts each
# token gets under each rule; measure token drops against the exact formula; probe the causality of
# the two ways of grouping tokens; count what noise does to token choice and to a global
# selection; run the counterexamples to two of the paper's lemmas; and count what the routing step
# costs. Everything here is small and runs in seconds; at `SCALE == "gpu"` the Monte Carlo
# sections use more samples.
#
# *Run time:* under 10 seconds at CPU scale on a 2-core laptop CPU, the default. `MINIMOE_SCALE=gpu` chooses
# the larger configuration, for a GPU: 4,000 Monte Carlo groups instead of 400 in the drop-rate section and
# 2,000 trials instead of 200 in the last one, 10 times the sampling; nothing else changes.

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

import minimoe
from minimoe.ops import (exchangeable_drop_probability, global_topc, selection_budget, solve_selection_lp,
                         topc_threshold, unified_score)
from minimoe.ops.allocation import expert_choice_allocation
from minimoe.routers import USMoE, build

SCALE = os.environ.get("MINIMOE_SCALE", "cpu")  # "gpu" runs the larger configuration: chosen, never automatic
DEVICE = "cuda" if SCALE == "gpu" else "cpu"
TRIALS = 400 if SCALE == "cpu" else 4000  # Monte Carlo groups in the drop-rate section
print(f"SCALE={SCALE}, device={DEVICE}, minimoe {minimoe.__version__}, torch {torch.__version__}")

# %% [markdown]
# (nb08-lp)=
# ## Three selection problems, solved as linear programs
#
# Six tokens, four experts, positive scores, $k = 2$ experts per token, so the budget is $c = 12$
# pairs and expert choice takes $C = 12/4 = 3$ tokens per expert. `solve_selection_lp` builds each
# problem's LP relaxation ($0\le X\le 1$) and solves it with HiGHS. Proposition 6.1 says every vertex
# is a 0/1 matrix, so the solver returns a selection, and Proposition 6.2 that the global one is the
# 12 largest entries.

# %%
torch.manual_seed(0)
T, E, k = 6, 4, 2
c = k * T
S = torch.rand(T, E, dtype=torch.float64)
Snp = S.numpy()

solutions = {
    "token choice (rows = 2)": solve_selection_lp(Snp, per_token=k),
    "expert choice (columns = 3)": solve_selection_lp(Snp, per_expert=c // E),
    "global (sum = 12)": solve_selection_lp(Snp, budget=c, budget_equality=True),
}
fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
for ax, (name, sol) in zip(axes, solutions.items()):
    assert np.abs(sol.x - np.round(sol.x)).max() < 1e-7, "the LP optimum is integral (Proposition 6.1)"
    ax.imshow(Snp, cmap="Greys", vmin=0, vmax=1)
    rows, cols = np.nonzero(np.round(sol.x))
    ax.scatter(cols, rows, marker="s", s=320, facecolors="none", edgecolors="tab:red", linewidths=2)
    ax.set_title(f"{name}\nobjective {sol.objective:.3f}", fontsize=9)
    ax.set_xlabel("expert")
    ax.set_ylabel("token")
fig.suptitle("The selected pairs (red squares) on the scores (grey: darker is higher)")
plt.tight_layout()
plt.show()

mask = global_topc(S, c)
topc_value = float((S * mask).sum())
print(f"global_topc objective {topc_value:.6f}, LP objective {solutions['global (sum = 12)'].objective:.6f}")
assert abs(topc_value - solutions["global (sum = 12)"].objective) < 1e-9
assert np.array_equal(mask.numpy(), np.round(solutions["global (sum = 12)"].x).astype(bool))
ordered = np.sort(Snp.ravel())[::-1]
for name in list(solutions)[:2]:
    assert solutions[name].objective <= topc_value + 1e-12, "TC and EC never beat the global selection"
    picked = np.sort(Snp[np.round(solutions[name].x).astype(bool)])[::-1]
    assert (picked <= ordered[: len(picked)] + 1e-15).all(), "Proposition 6.2(c), (d): sorted dominance"


# %%
# Proposition 6.2(b) and (d) need non-negative scores under "at most c" or with fewer than c pairs
neg = np.array([[0.5, -0.2], [-0.1, -0.3]])
at_most = solve_selection_lp(neg, budget=2).objective
exactly = solve_selection_lp(neg, budget=2, budget_equality=True).objective
print(f"S = {neg.tolist()}, c = 2: best with at most 2 pairs {at_most:.2f}, the top 2 {exactly:.2f}")
assert abs(at_most - 0.5) < 1e-9 and abs(exactly - 0.4) < 1e-9
neg = np.array([[-1.0, -1.0], [-1.0, -1.0], [-10.0, -10.0]])
ec_value = solve_selection_lp(neg, per_expert=1).objective
top3 = solve_selection_lp(neg, budget=3, budget_equality=True).objective
print(f"S = {neg.tolist()}, c = 3: expert choice (C = 1) {ec_value:.1f} beats the top 3 {top3:.1f}")
assert abs(ec_value + 2) < 1e-9 and abs(top3 + 3) < 1e-9, "Lemma A.2 fails without its condition"

# %% [markdown]
# The duals are thresholds (Proposition 6.3). The global LP has one, $\lambda$, between the 12th and
# 13th largest score; token choice has one per token, between that token's 2nd and 3rd score; expert
# choice one per expert. Below, every score is a dot, the selected ones filled, and each rule's
# thresholds are the lines that separate them.

# %%
tc, ec, gl = solutions["token choice (rows = 2)"], solutions["expert choice (columns = 3)"], solutions["global (sum = 12)"]
lam = topc_threshold(S, c).item()
print(f"global threshold: HiGHS dual {gl.budget_dual:.4f}, c-th largest score {lam:.4f}, "
      f"(c+1)-th {np.sort(Snp.ravel())[::-1][c]:.4f}")
fig, axes = plt.subplots(1, 3, figsize=(12, 3.4), sharey=True)
panels = [("global: one threshold", gl, lambda t, e: gl.budget_dual),
          ("token choice: one per token", tc, lambda t, e: tc.token_duals[t]),
          ("expert choice: one per expert", ec, lambda t, e: ec.expert_duals[e])]
for ax, (title, sol, threshold) in zip(axes, panels):
    chosen = np.round(sol.x).astype(bool)
    for t in range(T):
        for e in range(E):
            x = t + (e - 1.5) * 0.12
            ax.scatter(x, Snp[t, e], color="tab:blue" if chosen[t, e] else "white", edgecolors="tab:blue", zorder=3)
            ax.plot([x - 0.05, x + 0.05], [threshold(t, e)] * 2, color="tab:red", lw=1.5)
            if chosen[t, e]:
                assert Snp[t, e] >= threshold(t, e) - 1e-9
            else:
                assert Snp[t, e] <= threshold(t, e) + 1e-9
    ax.set_title(title)
    ax.set_xlabel("token (experts side by side)")
axes[0].set_ylabel("score")
fig.suptitle("Selected pairs (filled) lie above their rule's threshold (red); the others below")
plt.tight_layout()
plt.show()

# %% [markdown]
# When is the global selection strictly better than token choice? Proposition 6.4: exactly when some
# token's 3rd score beats another token's 2nd. We look for one instance of each kind among random
# ones and check the criterion on a few hundred.

# %%
found = {}
agree = agree_ec = 0
for seed in range(300):
    g = torch.Generator().manual_seed(seed)
    Sx = torch.rand(T, E, generator=g, dtype=torch.float64)
    rows = Sx.sort(-1, descending=True).values
    gap = float((Sx * global_topc(Sx, c)).sum() - rows[:, :k].sum())
    predicted = bool(rows[:, k - 1].min() < rows[:, k].max())
    agree += (gap > 1e-12) == predicted
    found.setdefault(predicted, (seed, gap))
    # the column version for expert choice, C = c / E = 3 per expert
    cols = Sx.sort(-2, descending=True).values
    gap_ec = float((Sx * global_topc(Sx, c)).sum() - cols[: c // E].sum())
    agree_ec += (gap_ec > 1e-12) == bool(cols[c // E - 1].min() < cols[c // E].max())
print(f"criterion of Proposition 6.4 agrees with the objective gap on {agree}/300 instances "
      f"(token choice) and {agree_ec}/300 (expert choice)")
print(f"equal: seed {found[False][0]} (gap {found[False][1]:.1e}); strictly better: seed {found[True][0]} "
      f"(gap {found[True][1]:.3f})")
assert agree == 300 and agree_ec == 300

# %% [markdown]
# (nb08-scratch)=
# ## USMoE from scratch
#
# USMoE (chapter 6, "The unified score") mixes a token-choice score, the row softmax, with an
# expert-choice score, here $\frac2E\sigma(\text{logit})$ as in the authors' code, and keeps the
# $c = \lfloor kT\rfloor$ largest entries of the mixed score over the whole group: a global top-$c$.
# The kept entries' scores are the combine weights. (Below a group is one sequence,
# `grouping="sequence"`; the package's default groups the tokens at one position across sequences,
# so that no token competes with its own sequence's future.)

# %% tags=["from-scratch"]
import math

import torch


def usmoe_route(logits, k=2.0, alpha=0.5):
    """Global top-c of the unified score U = (1 - alpha) softmax + alpha (2/E) sigmoid."""
    T, E = logits.shape
    U = (1 - alpha) * torch.softmax(logits, -1) + alpha * (2.0 / E) * torch.sigmoid(logits)
    chosen = torch.zeros(T * E, dtype=torch.bool)
    chosen[U.flatten().topk(math.floor(k * T)).indices] = True        # the c best pairs anywhere
    mask = chosen.view(T, E)
    return U * mask, mask

# %%
from minimoe.routers import router_class

torch.manual_seed(0)
x_small = torch.randn(1, 24, 8, dtype=torch.float64)
router = router_class("usmoe")(8, 4, grouping="sequence").double().train()
routing = router(x_small)
weights, mask = usmoe_route(router.gate(x_small)[0].detach())
assert torch.equal(mask, routing.position[0] >= 0)
torch.testing.assert_close(weights, routing.combine_tensor()[0].sum(-1).detach(), rtol=0, atol=1e-12)
print("the same 48 pairs and weights; experts per token:", mask.sum(-1).tolist())

# %% [markdown]
# (nb08-histograms)=
# ## How many experts does each token get?
#
# Token choice gives every token $k$ experts. Expert choice gives each expert $C$ tokens, and a token
# whatever number of experts picked it. The global selection gives each token the number of its scores
# above the shared threshold. With the sigmoid unified score, those are always the top of the token's
# own row (Proposition 6.5), so USMoE is token choice with a variable $k_t$. Random logits with a
# per-token offset (some tokens are "confident", some are not), 16 experts, 64 tokens per group, $k = 2$.

# %%
torch.manual_seed(1)
G, L, E2, k2 = 200, 64, 16, 2
logits = torch.randn(G, L, E2) + 1.5 * torch.randn(G, L, 1)
n_keep = selection_budget(k2, L, E2)
counts = {"token choice": torch.full((G, L), k2)}
position = expert_choice_allocation(torch.softmax(logits, -1), n_keep // E2)
counts["expert choice (softmax)"] = (position >= 0).sum(-1)
for alpha in (0.0, 0.5, 1.0):
    U = unified_score(logits, alpha)
    m = global_topc(U, n_keep)
    counts[f"USMoE, alpha = {alpha}"] = m.sum(-1)
    # the row-prefix property: the selected experts are the top-k_t of the token's own logits
    ranks = logits.argsort(-1, descending=True).argsort(-1)  # rank of each expert within its row
    assert torch.equal(m, ranks < m.sum(-1, keepdim=True)), "selected = top-k_t of the row"

fig, axes = plt.subplots(1, len(counts), figsize=(14, 3), sharey=True)
for ax, (name, cnt) in zip(axes, counts.items()):
    values = cnt.flatten().numpy()
    ax.hist(values, bins=np.arange(-0.5, 9.5), density=True, color="tab:blue")
    ax.set_title(f"{name}\nmean {values.mean():.2f}, dropped {np.mean(values == 0):.1%}", fontsize=9)
    ax.set_xlabel("experts per token")
axes[0].set_ylabel("fraction of tokens")
fig.suptitle("Experts per token at the same budget (2 per token on average)")
plt.tight_layout()
plt.show()
for name, cnt in counts.items():
    if name.startswith("USMoE") or name == "token choice":
        assert abs(cnt.float().mean().item() - k2) < 1e-6, "the same total compute"

# %% [markdown]
# The budget is the same for every rule; how it is spread differs. At $\alpha = 1$ (sigmoid of the
# logits) the confident tokens take many experts and the unconfident ones are dropped. The row softmax
# ($\alpha = 0$) gives every token a row that sums to one, which evens the counts out; $\alpha = 0.5$
# sits between.

# %% [markdown]
# (nb08-drops)=
# ## Token drops: Monte Carlo against the exact formula
#
# With exchangeable scores the selected set is a uniformly random subset of pairs, and a token is
# dropped with probability $\binom{LE-E}{n}/\binom{LE}{n}$ (Proposition 6.7), below the paper's
# independence approximation $(1-k/E)^E$ and its bound $e^{-k}$. I.i.d. standard normal logits with
# $\alpha = 1$ (a global top-c of the sigmoid, hence of the logits) are exchangeable; $\alpha < 1$
# mixes in the row softmax and breaks the symmetry.

# %%
torch.manual_seed(2)
L3, E3 = 64, 16
ks = [0.5, 1, 1.5, 2, 3, 4]
measured = {a: [] for a in (1.0, 0.5, 0.0)}
exact, approx, bound = [], [], []
for kk in ks:
    n = selection_budget(kk, L3, E3)
    lg = torch.randn(TRIALS, L3, E3)
    for a in measured:
        drops = (global_topc(unified_score(lg, a), n).sum(-1) == 0).double().mean().item()
        measured[a].append(drops)
    exact.append(exchangeable_drop_probability(L3, E3, n))
    approx.append((1 - kk / E3) ** E3)
    bound.append(math.exp(-kk))
se = [math.sqrt(p * (1 - p) / (TRIALS * L3)) for p in exact]  # binomial s.e., ignoring within-group dependence
for kk, m1, ex, s in zip(ks, measured[1.0], exact, se):
    print(f"k={kk:3}: measured {m1:.4f}  exact {ex:.4f}  (1-k/E)^E {(1 - kk / E3) ** E3:.4f}  e^-k {math.exp(-kk):.4f}")
    assert abs(m1 - ex) < 0.01 + 6 * s, "alpha = 1 on i.i.d. logits matches the hypergeometric formula"

fig, ax = plt.subplots(figsize=(6.5, 4))
ax.plot(ks, bound, "k:", label="$e^{-k}$ (paper's bound)")
ax.plot(ks, approx, "k--", label="$(1-k/E)^E$ (independence)")
ax.plot(ks, exact, "k-", label="exact, exchangeable scores")
for a, style in zip(measured, ["o", "s", "^"]):
    ax.plot(ks, measured[a], style, label=f"Monte Carlo, alpha = {a}")
ax.set_yscale("log")
ax.set_xlabel("average experts per token k")
ax.set_ylabel("fraction of tokens dropped")
ax.set_title(f"Token drops of a global top-c (L={L3}, E={E3}, {TRIALS} groups)")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# The measured rate at $\alpha = 1$ sits on the exact curve, a little below the independence
# approximation. The row softmax lowers drops a lot: each token's scores sum to one, so few tokens
# have all their entries below the threshold. Real router logits are not exchangeable either way, so
# the `usmoe` router reports the drop rate it actually had ({doc}`09-usmoe-toy-lm`).

# %% [markdown]
# (nb08-causality)=
# ## Which tokens compete: the causality probe
#
# Route a batch of 8 sequences of 32 tokens, then change the logits of the *last* token of every
# sequence and route again. With `grouping="sequence"` the threshold of a sequence depends on all its
# tokens, so earlier tokens can change their experts; with `grouping="position"` the tokens that
# compete sit at the same position of different sequences, and nothing earlier can move.

# %%
torch.manual_seed(3)
base = torch.randn(8, 32, 16)
changes = {"sequence": [], "position": []}
for trial in range(50):
    changed = base.clone()
    changed[:, -1] = 3 * torch.randn(8, 16)
    for grouping in changes:
        router = USMoE(8, 16, k=2, grouping=grouping)
        before, after = router.route(base).mask, router.route(changed).mask
        moved = (before[:, :-1] != after[:, :-1]).any(-1).float().mean().item()
        changes[grouping].append(moved)
for grouping, moved in changes.items():
    print(f"grouping={grouping!r:11}: earlier tokens whose experts changed: {np.mean(moved):.2%} on average, "
          f"in {np.mean(np.array(moved) > 0):.0%} of the 50 trials")
assert max(changes["position"]) == 0.0, "per-position selection is causal"
assert np.mean(changes["sequence"]) > 0, "per-sequence selection lets the last token move earlier routes"

# %% [markdown]
# Per-sequence selection, as the paper describes USMoE, leaks the future into a decoder's routing;
# per-position selection, what the authors' language-model code does, does not, but couples the
# sequences of a batch instead. With one sequence, per-position selection is token choice.

# %% [markdown]
# (nb08-noisy)=
# ## Noisy tokens: fewer misroutes, some of them turned into drops
#
# Lemma 3.5 of the paper, corrected in Proposition 6.6, says that a global selection misroutes a noisy
# token only if top-1 token choice misroutes it too. We build tokens around 8 expert embeddings, so
# each token has a clean best expert; corrupt 15% of them with Gaussian noise; and route with top-1
# token choice and with a global top-c ($c = T$, one expert per token on average) on the logits. A
# token is *misrouted* if it receives experts but not its clean best one, and *dropped* if it receives
# none.

# %%
torch.manual_seed(4)
d, E4, T4, trials = 16, 8, 64, 200 if SCALE == "cpu" else 2000
W = torch.randn(E4, d)
stats = {"TC misroute": [], "global misroute": [], "global drop (noisy)": [], "global drop (clean)": [],
         "TC misroute -> global drop": []}
violations = 0
for _ in range(trials):
    z = torch.randint(0, E4, (T4,))
    x = W[z] + 0.5 * torch.randn(T4, d)
    noisy = torch.rand(T4) < 0.15
    x_obs = x + noisy[:, None] * 1.5 * torch.randn(T4, d)
    clean_best = (x @ W.T).argmax(-1)
    S4 = x_obs @ W.T
    tc_mis = S4.argmax(-1) != clean_best
    sel = global_topc(S4, T4)
    got = sel.any(-1)
    gl_mis = got & ~sel.gather(1, clean_best[:, None])[:, 0]
    violations += int((gl_mis & ~tc_mis).sum())
    if noisy.any():
        stats["TC misroute"].append(tc_mis[noisy].float().mean().item())
        stats["global misroute"].append(gl_mis[noisy].float().mean().item())
        stats["global drop (noisy)"].append((~got[noisy]).float().mean().item())
        stats["TC misroute -> global drop"].append((tc_mis & ~got)[noisy].float().mean().item())
    stats["global drop (clean)"].append((~got[~noisy]).float().mean().item())
print(f"{trials} groups of {T4} tokens, 15% noisy; rates among noisy tokens unless marked clean:")
for name, values in stats.items():
    print(f"  {name:28s} {np.mean(values):.3f}")
print(f"tokens misrouted by the global rule but not by top-1 token choice: {violations}")
assert violations == 0, "Proposition 6.6(d)"
assert np.mean(stats["global misroute"]) <= np.mean(stats["TC misroute"])

fig, ax = plt.subplots(figsize=(6.5, 3.5))
names = list(stats)
ax.barh(names, [np.mean(stats[n]) for n in names], color=["tab:orange", "tab:blue", "tab:blue", "tab:gray", "tab:red"])
ax.set_xlabel("fraction of tokens")
ax.set_title("Noisy tokens under top-1 token choice and a global top-c (c = T)")
plt.tight_layout()
plt.show()

# %% [markdown]
# The global rule misroutes fewer noisy tokens, as the paper says, and never one that token choice
# routes correctly. The last bar shows what the lemma leaves out: a good part of the token-choice
# misroutes are not corrected but *dropped*, and noisy tokens are dropped more often than clean ones
# (compare the two drop bars). Whether
# a dropped token is better than a misrouted one depends on the model; the residual connection carries
# a dropped token unchanged.

# %% [markdown]
# (nb08-noise-margin)=
# ## Lemma 3.5 needs its factor 2
#
# Proposition 6.6(c) asks for a margin $\gamma > 2\delta$; the paper's proof asks only for
# $\gamma > \delta$, using the false step $\tau_c^\star\le\tau_c$. Two tokens, both noisy, budget
# $c = 2$, clean scores $S^\star = \begin{pmatrix}1.0 & 0.7\\ 0.8 & 0.0\end{pmatrix}$ and noise of size
# $\delta = 0.06$: token 1's wrong pair is raised by $\delta$, token 2's right pair lowered by $\delta$.
# Both tokens' best expert is the first, and $\gamma = 0.8 - 0.7 = 0.1$, between $\delta$ and $2\delta$.
# We also check part (a): a token-choice misroute needs $\Delta_{\min} < 2\delta$, and the worst noise
# of size $\delta$ (a corner of the box) then does misroute it.

# %%
clean = torch.tensor([[1.0, 0.7], [0.8, 0.0]], dtype=torch.float64)
delta, c2 = 0.06, 2
best = clean.argmax(-1)
gamma = (topc_threshold(clean, c2) - clean[:, 1].max()).item()  # the wrong pairs are column 2
noise = torch.tensor([[0.0, delta], [-delta, 0.0]], dtype=torch.float64)
picked = global_topc(clean + noise, c2)
print(f"delta = {delta}, gamma = {gamma:.2f}, noisy scores {(clean + noise).tolist()}")
print(f"global top-2, clean: {global_topc(clean, c2).int().tolist()}, noisy: {picked.int().tolist()}")
assert best.tolist() == [0, 0] and delta < gamma <= 2 * delta
assert torch.equal(global_topc(clean, c2), torch.tensor([[True, False], [True, False]]))
assert picked[0, 1] and not picked[1].any(), "a wrong pair of a noisy token is in, and token 2 is dropped"
assert torch.equal((clean + noise).argmax(-1), best), "top-1 token choice routes both tokens correctly"

# the family S* = [[1, 0.8 - g], [0.8, 0]]: the wrong pair enters exactly when g < 2 delta
gammas = np.linspace(0.01, 3 * delta, 35)
wrong_in = []
for g in gammas:
    S_g = torch.tensor([[1.0, 0.8 - g], [0.8, 0.0]], dtype=torch.float64) + noise
    wrong_in.append(bool(global_topc(S_g, c2)[0, 1]))
    if abs(g - 2 * delta) > 1e-9:
        assert wrong_in[-1] == (g < 2 * delta)

# part (a): over random rows, some noise of size delta misroutes top-1 token choice iff the margin < 2 delta
gen = np.random.default_rng(5)
for _ in range(300):
    row = gen.random(4)
    margin = np.min(np.delete(row.max() - row, row.argmax()))
    corners = np.array(list(itertools.product((-delta, delta), repeat=4)))
    assert ((row + corners).argmax(-1) != row.argmax()).any() == (margin < 2 * delta)

fig, ax = plt.subplots(figsize=(6.5, 3.2))
ax.plot(gammas, 0.8 - gammas + delta, label="token 1, wrong pair: $0.8-\\gamma+\\delta$")
ax.plot(gammas, np.full_like(gammas, 0.8 - delta), label="token 2, right pair: $0.8-\\delta$")
for x, name in ((delta, "$\\delta$"), (2 * delta, "$2\\delta$")):
    ax.axvline(x, color="gray", ls=":")
    ax.text(x + 0.002, 0.83, name, ha="left", va="center")
ax.set_xlabel("margin $\\gamma$ of the clean scores")
ax.set_ylabel("noisy score")
ax.set_title("The second place of the top-2: the wrong pair wins for every $\\gamma < 2\\delta$")
ax.legend(fontsize=8, loc="upper right")
plt.tight_layout()
plt.show()

# %% [markdown]
# Between $\delta$ and $2\delta$ the paper's condition holds and its conclusion fails: the noisy
# token's wrong pair takes the second place, and the other token, which top-1 token choice would have
# routed correctly, gets no expert at all.

# %% [markdown]
# (nb08-collapse)=
# ## Lemma 3.7: mixing two scores can lower the rank
#
# Proposition 6.8. First the counterexample to the paper's eq. (28): two router embeddings (the
# standard basis of $\mathbb R^2$), token-choice coefficients $c_1 = (1, 0)$, $c_2 = (1, 1)$ and
# expert-choice ones $d_1 = d_2 = (-1, 1)$, none collinear with its partner, mixed at
# $\alpha = \tfrac12$. The effective rank is $\exp$ of the entropy of the normalised singular values.
# Then part (a) on real gating Jacobians, computed by autograd for the unified score.

# %%
def effective_rank(A, tol=1e-12):
    s = np.linalg.svd(np.asarray(A, dtype=float), compute_uv=False)
    p = s[s > tol] / s[s > tol].sum()
    return float(np.exp(-(p * np.log(p)).sum()))


coef_t = [np.array([1.0, 0.0]), np.array([1.0, 1.0])]
coef_e = [np.array([-1.0, 1.0]), np.array([-1.0, 1.0])]
J_t = sum(np.outer(cj, wj) for cj, wj in zip(coef_t, np.eye(2)))
J_e = sum(np.outer(dj, wj) for dj, wj in zip(coef_e, np.eye(2)))
J_u = 0.5 * J_t + 0.5 * J_e
for name, J in (("token choice", J_t), ("expert choice", J_e), ("unified, alpha = 0.5", J_u)):
    print(f"{name:22s} rank {np.linalg.matrix_rank(J)}, effective rank {effective_rank(J):.2f}")
assert all(abs(cj[0] * dj[1] - cj[1] * dj[0]) > 0 for cj, dj in zip(coef_t, coef_e)), "not collinear"
assert [np.linalg.matrix_rank(J) for J in (J_t, J_e, J_u)] == [2, 1, 1]
assert np.allclose([effective_rank(J) for J in (J_t, J_e, J_u)], [1.80, 1.00, 1.00], atol=0.005)
assert effective_rank(J_u) < max(effective_rank(J_t), effective_rank(J_e)), "eq. (28) fails"

alphas = np.linspace(0, 1, 41)
mixed = [effective_rank((1 - a) * J_t + a * J_e) for a in alphas]

# part (a): the gating Jacobian sum_{i in K} E_i grad U_i^T of a random token has rank <= |K|
g5 = torch.Generator().manual_seed(6)
W5 = torch.randn(6, 12, generator=g5, dtype=torch.float64)  # 6 experts, width 12
x5 = torch.randn(12, generator=g5, dtype=torch.float64)
outs = torch.randn(6, 10, generator=g5, dtype=torch.float64)  # the selected experts' outputs, held fixed
for a in (0.0, 0.5, 1.0):
    found_ranks = []
    for size in (1, 2, 3):
        K = (W5 @ x5).topk(size).indices
        J = torch.autograd.functional.jacobian(
            lambda z: (unified_score((W5 @ z)[None], a)[0, K, None] * outs[K]).sum(0), x5)
        found_ranks.append(int(torch.linalg.matrix_rank(J, rtol=1e-9)))
        assert found_ranks[-1] <= size
    print(f"alpha = {a}: rank of the gating Jacobian for |K| = 1, 2, 3: {found_ranks}")


# %%
fig, ax = plt.subplots(figsize=(6, 3.2))
ax.plot(alphas, mixed, label="$(1-\\alpha)J_t + \\alpha J_e$")
ax.axhline(effective_rank(J_t), color="tab:orange", ls="--", label="$J_t$ alone")
ax.axhline(effective_rank(J_e), color="tab:green", ls=":", label="$J_e$ alone")
ax.set_xlabel("mixing weight $\\alpha$")
ax.set_ylabel("effective rank")
ax.set_title("Mixing two gating Jacobians: the rank drops at $\\alpha = 1/2$")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# (nb08-cost)=
# ## What the routing step costs
#
# Proposition 6.9, counted rather than timed (timings on a shared machine say little). For groups of
# $T$ tokens of width $d = 256$, $E = 16$ experts and $k = 2$: the gate's floating-point operations
# (torch's FLOP counter) for USMoE and token choice; the comparisons of a heap selection of the
# $n = 2T$ largest of the $16T$ scores, against the bound $2n + (m-n)(1+2\lfloor\log_2 n\rfloor)$ and
# against token choice's $T$ heap top-2s; and the operators that `global_topc` itself runs. Its
# selection of the $n$-th largest score is one call: on a CPU numpy's introselect `np.partition`
# (which torch's operator log does not see, so we count its calls), on an accelerator `torch.topk`.

# %%
from unittest import mock

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from minimoe.exercises.oracles import heap_top  # a binary min-heap that counts its comparisons


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


# %%
E6, k6, d6 = 16, 2, 256
Ts = [16, 32, 64, 128, 256]
rows = []
op_lists = []
for T6 in Ts:
    x6 = torch.randn(1, T6, d6)
    flops = {}
    for name, opts in (("usmoe", {"k": k6, "grouping": "sequence"}), ("softmax_topk", {"k": k6})):
        with FlopCounterMode(display=False) as counter:
            build(name, d6, E6, **opts)(x6)
        flops[name] = counter.get_total_flops()
    assert flops["usmoe"] == flops["softmax_topk"] == 2 * T6 * d6 * E6, "Proposition 6.9(a)"
    scores6 = torch.randn(T6, E6, dtype=torch.float64)
    n6, m6 = selection_budget(k6, T6, E6), T6 * E6
    chosen, global_count = heap_top(scores6.flatten().tolist(), n6)
    assert chosen == set(global_topc(scores6, n6).flatten().nonzero().flatten().tolist())
    bound = 2 * n6 + (m6 - n6) * (1 + 2 * int(math.log2(n6)))
    assert global_count <= bound, "Proposition 6.9(b)"
    tc_count = sum(heap_top(row, k6)[1] for row in scores6.tolist())
    assert tc_count <= T6 * (2 * k6 + (E6 - k6) * (1 + 2 * int(math.log2(k6))))
    with OpLog() as log, mock.patch.object(np, "partition", wraps=np.partition) as partition:
        global_topc(scores6[None], n6)
    op_lists.append([str(op) for op in log.ops])
    selections = partition.call_count + sum("topk" in op for op in op_lists[-1])
    assert selections == 1, "one selection per call, over all T*E entries"
    masks = [USMoE(d6, E6, k=kk, grouping="sequence").route(torch.randn(3, T6, E6)).mask for kk in (1.5, 2)]
    assert [int(m.sum()) for m in masks] == [3 * selection_budget(1.5, T6, E6), 3 * 2 * T6], "Proposition 6.9(c)"
    rows.append((T6, flops["usmoe"], global_count, bound, tc_count))
assert all(ops == op_lists[0] for ops in op_lists), "the same operators for every T: no loop over tokens"

print(f"{'T':>5} {'gate flops':>11} {'global cmp':>11} {'bound':>9} {'TC cmp':>8} {'global/gate':>12}")
for T6, fl, gc, bd, tc in rows:
    print(f"{T6:5d} {fl:11d} {gc:11d} {bd:9d} {tc:8d} {gc / fl:12.4f}")
assert all(gc < fl / 20 for _, fl, gc, _, _ in rows), "the selection is a lower-order term at d = 256"


# %%
fig, ax = plt.subplots(figsize=(6.5, 4))
arr = np.array(rows, dtype=float)
ax.loglog(arr[:, 0], arr[:, 1], "k-o", label="gate: $2TDE$ flops (both routers)")
ax.loglog(arr[:, 0], arr[:, 3], "k--", label="heap bound, global top-$n$")
ax.loglog(arr[:, 0], arr[:, 2], "s-", color="tab:blue", label="comparisons, global top-$n$ (USMoE)")
ax.loglog(arr[:, 0], arr[:, 4], "^-", color="tab:orange", label="comparisons, $T$ top-$k$ (token choice)")
ax.set_xlabel("tokens per selection group $T$")
ax.set_ylabel("operations")
ax.set_title(f"Routing cost per group (E = {E6}, k = {k6}, d = {d6})")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# The gate's cost is identical for the two routers and grows like $T$; the global selection's
# comparisons grow like $T\log T$, a few times token choice's, and stay more than an order of
# magnitude below the gate at this width. `global_topc` runs the same handful of tensor operators for
# every $T$, and a single selection over the whole group.

# %% [markdown]
# ## What we saw
#
# * The three selection LPs have integral optima; the global one equals `global_topc`, and its dual is
#   one threshold between the $c$-th and $(c+1)$-th score. Token choice has one threshold per token,
#   expert choice one per expert (Propositions 6.1–6.3).
# * Token choice is globally optimal exactly when no token's $(k+1)$-th score beats another's $k$-th
#   (Proposition 6.4), checked on 300 instances.
# * At equal budget, the global rule spreads experts unevenly over tokens; the row softmax evens this
#   out. With the sigmoid score, each token's experts are the top of its own row (Proposition 6.5).
# * The drop rate of exchangeable scores matches the hypergeometric formula, below the paper's
#   independence approximation; real scores need measuring (Proposition 6.7).
# * Per-sequence selection leaks later tokens into earlier routes; per-position selection does not.
# * Global selection turns noisy tokens' misroutes partly into drops (Proposition 6.6), and the
#   paper's margin $\gamma > \delta$ is not enough to keep wrong pairs out: it takes $2\delta$.
# * Mixing the token-choice and expert-choice gating Jacobians can lower their rank, and never lifts
#   it above the number of selected experts (Proposition 6.8).
# * The gate costs the same for USMoE and token choice; the global selection adds $O(TE\log T)$
#   comparisons, a lower-order term (Proposition 6.9).
