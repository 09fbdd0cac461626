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
# # Sinkhorn from scratch
#
# Companion to chapter 2 (Routing as optimal transport). We write Sinkhorn's algorithm in ten
# lines, look at its plans, build the two Sinkhorn routers and BASE from scratch, and then check
# what the chapter proves about the plan itself: its KL geometry, the two limits of $\varepsilon$
# (the balanced assignment, with the experts' prices, and the uniform plan), the invariances, and the
# fact that a Sinkhorn router is top-$k$ routing with one bias per expert. How a solver gets there
# (convergence, over-relaxation, Newton, the log domain, gradients) is the subject of
# {doc}`03b-sinkhorn-numerics`.
#
# **You will learn to**
#
# 1. write log-domain Sinkhorn in ten lines and read its plans at four temperatures;
# 2. write the Sinkhorn token-choice, Sinkhorn expert-choice and BASE routers from scratch and show
#    them equal to `minimoe`'s;
# 3. check the KL-projection and Pythagorean identities on arbitrary feasible plans;
# 4. follow the plan to the balanced assignment as $\varepsilon \to 0$ (its LP gap, the experts'
#    prices, exact top-1 loads at a positive $\varepsilon$) and to the uniform plan as $\varepsilon$ grows;
# 5. show that a per-expert shift of the scores moves the potentials and not the plan, and so read a
#    Sinkhorn router as top-$k$ of the logits plus a bias.
#
# *Prerequisites:* chapter 2 through {ref}`ch2-closed-form`, then {ref}`ch2-limits`,
# {ref}`ch2-exact-assignment`, {ref}`ch2-invariances` and {ref}`ch2-routers` as the sections below
# reach them; {doc}`01-moe-layer-from-scratch` for slots and capacity.
#
# *Run time:* under 10 seconds at CPU scale on a 2-core laptop CPU, the default. Every problem here is
# small and runs on the CPU; `MINIMOE_SCALE=gpu` changes nothing in this notebook (the GPU-scale solver
# table is in {doc}`03b-sinkhorn-numerics`).

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
from scipy.optimize import linprog

import minimoe
from minimoe.ops import floyd_warshall, linear_assignment, move_costs, sinkhorn
from minimoe.routers import SinkhornTokenChoice

SCALE = os.environ.get("MINIMOE_SCALE", "cpu")  # "gpu" runs the larger configuration: chosen, never automatic
DEVICE = "cuda" if SCALE == "gpu" else "cpu"
if SCALE == "cpu":
    torch.set_num_threads(1)  # the problems here are small; extra threads mostly wait on each other
torch.manual_seed(0)
print(f"SCALE={SCALE}, device={DEVICE}, minimoe {minimoe.__version__}, torch {torch.__version__}")

# %% [markdown]
# (nb03-heatmaps)=
# ## Sinkhorn in ten lines, and what its plans look like
#
# The plan maximises $\langle P, S\rangle + \varepsilon H(P)$ over matrices whose rows sum to $1$
# and whose columns sum to $T/E$. Its closed form is
# $P_{ij} = \exp\big((S_{ij} + f_i + g_j)/\varepsilon\big)$, and Sinkhorn finds the potentials by
# alternating two exact updates (chapter 2, Proposition 2.5): make the rows right with a
# row log-sum-exp, then the columns with a column log-sum-exp. Below, `f` and `g` are kept divided
# by $\varepsilon$ inside the loop. After a column update the columns are exact, so the error we
# record is the relative row error.

# %%
def my_sinkhorn(S, eps, max_iter=5000, tol=1e-10):
    """Log-domain Sinkhorn for rows summing to 1 and columns to T/E. Returns (P, f, g, errors)."""
    T, E = S.shape
    L, log_b = S / eps, math.log(T / E)
    g = torch.zeros(E, dtype=S.dtype)
    errors = []
    for _ in range(max_iter):
        f = -torch.logsumexp(L + g, dim=1)                   # rows sum to 1
        g = log_b - torch.logsumexp(L + f[:, None], dim=0)   # columns sum to T/E
        errors.append((f + torch.logsumexp(L + g, dim=1)).expm1().abs().max().item())
        if errors[-1] <= tol:
            break
    return (L + f[:, None] + g).exp(), eps * f, eps * g, errors


# %% [markdown]
# A small skewed problem: 24 tokens, 4 experts, and logits in which expert 0 is popular (it gets
# $+1.5$ on top of standard normal noise). We solve it for four values of $\varepsilon$ with our
# loop and with `minimoe.ops.sinkhorn` in float64, and compare.

# %%
T0, E0 = 24, 4
S0 = torch.randn(T0, E0, dtype=torch.float64) + torch.tensor([1.5, 0.0, 0.0, 0.0], dtype=torch.float64)
S0 = S0[torch.argsort(S0[:, 0] - S0[:, 1:].mean(1), descending=True)]  # sort tokens by how much they like expert 0
EPS_HEAT = [10.0, 1.0, 0.3, 0.05]
plans = {}
for eps in EPS_HEAT:
    P_mine, f_mine, g_mine, errs = my_sinkhorn(S0, eps)
    res = sinkhorn(S0, eps, tol=1e-10, max_iter=10_000, return_potentials=True)
    diff = (P_mine - res.plan).abs().max().item()
    closed_form = (res.plan - ((S0 + res.f[:, None] + res.g[None, :]) / eps).exp()).abs().max().item()
    print(f"eps={eps:5}: {len(errs):5d} iterations, max|mine - minimoe| = {diff:.1e}, "
          f"max|P - exp((S+f+g)/eps)| = {closed_form:.1e}, column sums {P_mine.sum(0).numpy().round(6)}")
    assert diff < 1e-8, "our loop and minimoe agree to 1e-8"
    assert closed_form < 1e-12, "the returned potentials give the plan in closed form"
    assert (P_mine.sum(1) - 1).abs().max() < 1e-9 and (P_mine.sum(0) - T0 / E0).abs().max() < 1e-9
    assert (res.plan > 0).all(), "every entry is positive (Proposition 2.2)"
    plans[eps] = P_mine

# %% [markdown]
# The first half-step of Sinkhorn, run by `minimoe` itself. One iteration (`max_iter=1, tol=0`) is a
# row update from $g = 0$ followed by a column update, so the plan it returns has exact *columns*.
# The row potential it returns is the one of the row update, so $\exp((S + f)/\varepsilon)$ is the plan
# after the first half-step, which Propositions 2.1(c) and 2.5(d) say is the row softmax. The plan
# itself is that softmax with every column rescaled to $T/E$.

# %%
one = sinkhorn(S0, 0.3, max_iter=1, tol=0, return_potentials=True)
half_step = ((S0 + one.f[:, None]) / 0.3).exp()
softmax03 = torch.softmax(S0 / 0.3, dim=1)
print(f"one iteration: max|exp((S + f)/eps) - softmax(S/eps)| = {(half_step - softmax03).abs().max():.1e}")
assert torch.allclose(half_step, softmax03, atol=1e-13), "the first row update is the row softmax"
assert torch.allclose(one.plan, softmax03 * (T0 / E0) / softmax03.sum(0), atol=1e-13), "then columns rescaled"

# %%
softmax0 = torch.softmax(S0, dim=1)
panels = [("row softmax of S\n(no column constraint)", softmax0)] + [
    (f"Sinkhorn plan, $\\varepsilon$ = {eps:g}", plans[eps]) for eps in EPS_HEAT]
fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.6))
for ax, (title, P) in zip(axes, panels):
    im = ax.imshow(P, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(E0))
    ax.set_xticklabels([f"e{e}\n{s:.1f}" for e, s in enumerate(P.sum(0).tolist())])
    ax.set_xlabel("expert (column sum below)")
    ax.set_ylabel("token (sorted by preference for e0)")
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.08, label="mass")
fig.suptitle(f"T={T0} tokens, E={E0} experts, expert 0 popular: every plan has column sums T/E = {T0 // E0}")
fig.tight_layout()
plt.show()

# %% [markdown]
# The softmax gives expert 0 far more than its share of 6 units. Every Sinkhorn plan gives each
# expert exactly 6. At $\varepsilon = 10$ the plan is nearly uniform ($1/E = 0.25$ everywhere).
# As $\varepsilon$ shrinks it sharpens, and at $\varepsilon = 0.05$ it is close to a hard
# assignment (a row's largest entry is above 0.9 on average). Expert 0 takes its 6 units from
# tokens near the top of the list, the ones that prefer it most, and the rest are shared out among
# experts 1 to 3.

# %%
print("softmax column sums:", softmax0.sum(0).numpy().round(2))
assert softmax0[:, 0].sum() > 1.5 * T0 / E0, "the softmax overloads the popular expert by more than 50%"
assert (plans[10.0] - 1 / E0).abs().max() < 0.1, "eps = 10: within 0.1 of uniform"
sharpness = [plans[eps].max(1).values.mean().item() for eps in EPS_HEAT]
print("mean of each row's largest entry:", dict(zip(EPS_HEAT, np.round(sharpness, 3))))
assert sharpness == sorted(sharpness) and sharpness[-1] > 0.9, "plans sharpen as eps shrinks"
assert plans[0.05][: T0 // 2, 0].sum() > 0.99 * T0 / E0, "expert 0 fills up from the top half of the list"

# %% [markdown]
# (nb03-scratch-routers)=
# ## The two Sinkhorn routers from scratch
#
# A Sinkhorn router replaces the softmax by the plan when it *selects*, and keeps the softmax when it
# *weights* (Liu et al.; chapter 2, "Sinkhorn routers are top-k with per-expert biases"). Like V-MoE
# it runs a fixed 20 iterations at $\varepsilon = 1$ and ends on a row update, so every token's row of
# the plan sums to one. Token choice then fills each expert's $C$ slots in token order from the
# plan's top-$k$; expert choice lets each expert take the $C$ tokens with the largest plan entries.

# %% tags=["from-scratch"]
import torch


def sinkhorn_plan(logits, eps=1.0, iterations=20):
    """Rows sum to 1, columns to T/E: scale the kernel's rows and columns in turn, rows last."""
    T, E = logits.shape
    K = torch.exp((logits - logits.max()) / eps)             # a constant shift changes no plan
    v = torch.ones(E, dtype=logits.dtype)
    for _ in range(iterations):
        u = 1.0 / (K @ v)
        v = (T / E) / (K.T @ u)
    u = 1.0 / (K @ v)
    return u[:, None] * K * v


def sinkhorn_token_choice(logits, capacity):
    """Top-1 of the plan, slots in token order; softmax weights."""
    first = sinkhorn_plan(logits).argmax(-1)
    slot, filled = torch.full(logits.shape, -1), [0] * logits.shape[1]
    for t, e in enumerate(first.tolist()):
        if filled[e] < capacity:
            slot[t, e], filled[e] = filled[e], filled[e] + 1
    return torch.softmax(logits, -1) * (slot >= 0), slot


def sinkhorn_expert_choice(logits, capacity):
    """Each expert takes its `capacity` tokens of largest plan entry; softmax weights."""
    best = sinkhorn_plan(logits).topk(capacity, dim=0).indices
    slot = torch.full(logits.shape, -1).scatter(0, best, torch.arange(capacity)[:, None].expand_as(best))
    return torch.softmax(logits, -1) * (slot >= 0), slot

# %%
from minimoe.routers import router_class

torch.manual_seed(0)
x_small = torch.randn(1, 16, 8)
for name, ours in (("sinkhorn_token_choice", sinkhorn_token_choice), ("sinkhorn_expert_choice", sinkhorn_expert_choice)):
    router = router_class(name)(8, 4, capacity_factor=1.0).eval()
    routing = router(x_small)
    weights, slots = ours(router.gate(x_small)[0], routing.capacity)
    assert torch.equal(slots, routing.position[0])
    torch.testing.assert_close(weights, routing.combine_tensor()[0].sum(-1), rtol=0, atol=1e-6)
    print(f"{name}: the same slots and weights; tokens dropped: {int((slots < 0).all(-1).sum())} of 16")

# %% [markdown]
# (nb03-kl-geometry)=
# ## The KL geometry: projection and Pythagoras
#
# Two identities of chapter 2 hold for *every* feasible plan $Q$, not only the optimum, so we test them
# on plans that have nothing to do with the problem: the uniform plan, the balanced hard assignments of
# random scores (entries 0 and 1), and the Sinkhorn plans of random scores. Proposition 2.1(b):
# $\varepsilon\,\mathrm{KL}(Q\,\|\,K) = -F(Q) + \varepsilon(\sum K - m)$ with $K = e^{S/\varepsilon}$, so the
# optimum is the feasible plan closest to $K$ in KL. Proposition 2.3(b):
# $F(Q) = F(P^\star) - \varepsilon\,\mathrm{KL}(Q\,\|\,P^\star)$, and $F(P^\star) = -\langle a, f\rangle - \langle b, g\rangle$.

# %%
def gen_kl(P, Q):
    """Generalised KL divergence sum P log(P/Q) - P + Q, with 0 log 0 = 0."""
    return (torch.special.xlogy(P, P) - torch.special.xlogy(P, Q) - P + Q).sum().item()


def F(P, S, eps):
    return ((P * S).sum() - eps * torch.special.xlogy(P, P).sum()).item()


eps_kl = 0.3
K0 = (S0 / eps_kl).exp()
star = sinkhorn(S0, eps_kl, tol=1e-13, max_iter=10_000, return_potentials=True)
others = [torch.full((T0, E0), 1 / E0, dtype=torch.float64)]
others += [torch.nn.functional.one_hot(linear_assignment(torch.randn(T0, E0, dtype=torch.float64), T0 // E0), E0).double()
           for _ in range(3)]
others += [sinkhorn(2 * torch.randn(T0, E0, dtype=torch.float64), e, tol=1e-13, max_iter=10_000) for e in (0.2, 1.0)]
kl_gaps, pythagoras_gaps = [], []
for Q in others:
    kl_gaps.append(abs(eps_kl * gen_kl(Q, K0) - (-F(Q, S0, eps_kl) + eps_kl * (K0.sum().item() - T0))))
    pythagoras_gaps.append(abs(F(Q, S0, eps_kl) - (F(star.plan, S0, eps_kl) - eps_kl * gen_kl(Q, star.plan))))
    assert gen_kl(Q, K0) >= gen_kl(star.plan, K0), "P* is the KL projection of K"
value_gap = abs(F(star.plan, S0, eps_kl) + star.f.sum().item() + (T0 / E0) * star.g.sum().item())
print(f"{len(others)} feasible plans: largest error of Prop. 2.1(b) {max(kl_gaps):.1e}, of Prop. 2.3(b) "
      f"{max(pythagoras_gaps):.1e}; |F(P*) + <a,f> + <b,g>| = {value_gap:.1e}")
assert max(kl_gaps) < 1e-9 and max(pythagoras_gaps) < 1e-9 and value_gap < 1e-9

# %% [markdown]
# (nb03-eps-zero)=
# ## Small ε: the balanced assignment
#
# Chapter 2, Proposition 2.9: as $\varepsilon \to 0$ the plan's score $\langle P_\varepsilon, S\rangle$
# rises to the optimum $\mathrm{LP}^\star$ of the linear program over the same polytope, with
# $0 \le \mathrm{LP}^\star - \langle P_\varepsilon, S\rangle \le \varepsilon H(P_\varepsilon) \le \varepsilon T\log E$,
# and when $E$ divides $T$ the plan tends to the balanced hard assignment that
# `minimoe.ops.linear_assignment(S, capacity=T/E)` computes. First we check that solver against a
# generic LP solver, `scipy.optimize.linprog`, on the transportation problem itself.

# %%
torch.manual_seed(5)
T5, E5 = 64, 8
C5 = T5 // E5
S5 = torch.randn(T5, E5, dtype=torch.float64)
z5 = linear_assignment(S5, capacity=C5)
lp_star = S5.gather(1, z5[:, None]).sum().item()

# max <P, S>  s.t.  P 1 = 1 (T rows),  P^T 1 = T/E (E columns),  P >= 0;  P flattened row-major
A_rows = np.kron(np.eye(T5), np.ones((1, E5)))
A_cols = np.kron(np.ones((1, T5)), np.eye(E5))
lp = linprog(-S5.numpy().ravel(), A_eq=np.vstack([A_rows, A_cols]),
             b_eq=np.concatenate([np.ones(T5), np.full(E5, C5)]), bounds=(0, None), method="highs")
x = lp.x.reshape(T5, E5)
print(f"linear_assignment total score {lp_star:.10f}, linprog optimum {-lp.fun:.10f}")
print(f"linprog solution: max distance to an integer {np.abs(x - x.round()).max():.1e}; "
      f"loads {np.bincount(z5.numpy(), minlength=E5)}")
assert lp.status == 0 and abs(-lp.fun - lp_star) < 1e-8 * (1 + abs(lp_star)), "same optimum"
assert np.abs(x - x.round()).max() < 1e-9, "the LP vertex is a 0/1 matrix (Proposition 2.9(c))"
assert (x.argmax(1) == z5.numpy()).all(), "and it is the same assignment"
assert (torch.bincount(z5, minlength=E5) == C5).all()

# the solver's own proof of optimality: expert prices p and token utilities u with u_t + p_e >= S_te
# everywhere and = on the assignment (then no assignment can score more: chapter 2, "Solving it exactly")
cert = linear_assignment(S5, capacity=C5, return_duals=True)
slack = cert.utilities[:, None] + cert.prices[None, :] - S5
on_assignment = slack.gather(1, cert.assignment[:, None])
print(f"dual certificate: smallest slack {slack.min().item():.1e} (>= 0), largest on the assignment "
      f"{on_assignment.abs().max().item():.1e} (= 0); dual value {(cert.utilities.sum() + C5 * cert.prices.sum()).item():.10f}")
assert slack.min() >= -1e-12 and on_assignment.abs().max() <= 1e-12
assert abs((cert.utilities.sum() + C5 * cert.prices.sum()).item() - lp_star) < 1e-9, "strong duality"

# %%
EPS_ZERO = np.logspace(1, -2.5, 15)
gaps, entropy_bounds, agreements, potentials = [], [], [], []
g = None
for eps in EPS_ZERO:  # from large to small eps, each solve warm-started from the last g
    res = sinkhorn(S5, float(eps), tol=1e-10, max_iter=20_000, init=g, return_potentials=True)
    P, g = res.plan, res.g
    potentials.append(g)
    score = (P * S5).sum().item()
    H = -torch.special.xlogy(P, P).sum().item()
    gaps.append(lp_star - score)
    entropy_bounds.append(eps * H)
    agreements.append((P.argmax(1) == z5).float().mean().item())
    assert -1e-7 <= gaps[-1] <= eps * H + 1e-7 and eps * H <= eps * T5 * math.log(E5) + 1e-9, "eq. (LP gap)"
top1_counts = torch.bincount(P.argmax(1), minlength=E5)
print(f"eps={EPS_ZERO[-1]:g}: gap {gaps[-1]:.2e}, top-1 agreement {agreements[-1]:.0%}, "
      f"top-1 counts per expert {top1_counts.tolist()}")
assert agreements[-1] == 1.0 and (top1_counts == C5).all(), "top-1 of the plan is the balanced assignment"

fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
axes[0].loglog(EPS_ZERO, np.maximum(gaps, 1e-16), "o-", label=r"$\mathrm{LP}^\star - \langle P_\varepsilon, S\rangle$")
axes[0].loglog(EPS_ZERO, entropy_bounds, "--", label=r"$\varepsilon H(P_\varepsilon)$")
axes[0].loglog(EPS_ZERO, EPS_ZERO * T5 * math.log(E5), ":", label=r"$\varepsilon T \log E$")
axes[0].set_xlabel(r"$\varepsilon$")
axes[0].set_ylabel("score below the LP optimum")
axes[0].set_title(f"Gap to the assignment LP, T={T5}, E={E5}")
axes[0].legend(fontsize=8)
axes[1].semilogx(EPS_ZERO, agreements, "o-")
axes[1].set_xlabel(r"$\varepsilon$")
axes[1].set_ylabel("fraction of tokens")
axes[1].set_title("top-1 of the plan = linear_assignment")
axes[1].set_ylim(0, 1.05)
fig.tight_layout()
plt.show()

# %% [markdown]
# The sweep goes from large to small $\varepsilon$ and passes each column potential to the next
# solve as `init`, which saves iterations. It stops at $\varepsilon \approx 3\times10^{-3}$:
# around $\varepsilon = 10^{-3}$, where $S/\varepsilon$ is in the thousands, the solver no longer
# reaches a $10^{-10}$ tolerance, for the reason that {doc}`03b-sinkhorn-numerics` shows at
# $|S|/\varepsilon \approx 10^4$ ({ref}`nb03-overflow`).
#
# The gap stays under both bounds. At large $\varepsilon$ it is a sizeable fraction of
# $\varepsilon T\log E$; at small $\varepsilon$ the plan is nearly a 0/1 matrix, its entropy
# goes to 0, and the gap falls faster than $\varepsilon$. Once
# $\varepsilon$ is small enough, every token's largest plan entry is its expert in the balanced
# assignment, and each expert is the top-1 of exactly $T/E = 8$ tokens.

# %% [markdown]
# (nb03-scratch-base)=
# ## The BASE router from scratch
#
# The $\varepsilon\to0$ limit is the balanced assignment itself, which BASE layers solve for every
# training group: each token to one expert, exactly $T/E$ per expert, with the largest total score.
# An assignment is optimal when no *cycle* of moves between experts gains anything (chapter 5,
# Proposition 5.5): move one token from expert $a$ to $b$, one from $b$ to $c$, ..., one back into
# $a$, and the loads do not change. So start from any balanced assignment and cancel improving
# cycles until none is left; Bellman-Ford on the $E$ experts finds one. BASE then weights each token
# by the sigmoid of its logit at its expert.

# %% tags=["from-scratch"]
import torch


def improving_cycle(gain):
    """Experts [a, b, ...] such that moving one token along each edge a -> b gains > 0, or None."""
    E = gain.shape[0]
    dist, pred = torch.zeros(E, dtype=gain.dtype), torch.full((E,), -1)
    for _ in range(E):                                       # Bellman-Ford on the costs -gain
        relaxed, via = (dist[:, None] - gain).min(0)
        better = relaxed < dist - 1e-9
        if not better.any():
            return None                                      # no negative cycle: z is optimal
        dist, pred = torch.where(better, relaxed, dist), torch.where(better, via, pred)
    cycle = [int(better.nonzero()[0])]
    for _ in range(E):                                       # E steps back: now on the cycle
        cycle = [int(pred[cycle[0]])]
    while int(pred[cycle[-1]]) != cycle[0]:
        cycle.append(int(pred[cycle[-1]]))
    return cycle[::-1]


def base_router(logits):
    """The balanced assignment of the logits (E divides T), weighted by the sigmoid of the logit."""
    T, E = logits.shape
    z = torch.arange(T) % E                                  # a balanced start
    while True:
        gain = logits - logits.gather(1, z[:, None])         # (T, E): what moving token t to e gains
        best = torch.stack([gain[z == a].max(0).values for a in range(E)]).fill_diagonal_(-torch.inf)
        if (cycle := improving_cycle(best)) is None:
            return torch.sigmoid(logits) * torch.nn.functional.one_hot(z, E), z
        moves = [(int(torch.where(z == a, gain[:, b], -torch.inf).argmax()), b)
                 for a, b in zip(cycle, cycle[1:] + cycle[:1])]    # one token along each edge
        for t, b in moves:
            z[t] = b

# %%
from minimoe.routers import router_class

torch.manual_seed(0)
router = router_class("base")(8, 4).double().train()       # BASE solves the assignment in training
x_small = torch.randn(1, 24, 8, dtype=torch.float64)
routing = router(x_small)
weights, z = base_router(router.gate(x_small)[0].detach())
assert torch.equal(z, routing.position[0].argmax(-1)) and (routing.position[0] >= 0).sum(-1).eq(1).all()
torch.testing.assert_close(weights, routing.combine_tensor()[0].sum(-1).detach(), rtol=0, atol=1e-12)
print("24 tokens, 4 experts, 6 each: the same assignment as minimoe's solver; loads", torch.bincount(z).tolist())

# %% [markdown]
# (nb03-prices)=
# ## The column potentials become the experts' prices
#
# Chapter 2, Proposition 2.10: with $q_\varepsilon = -g_\varepsilon$, the total amount by which tokens
# would rather be elsewhere than at their expert in the balanced assignment $z$,
# $V(q) = \sum_t [\max_e (S_{te} - q_e) - (S_{tz_t} - q_{z_t})]$, is at most $\varepsilon T\log E$, and it
# equals the dual gap $\Phi(q) - \min\Phi$ exactly. The prices that make $V = 0$ are the optimal prices. They
# form a polytope: $p_b - p_a \ge -d_{ab}$ for every pair of experts, with $d$ the shortest paths of the
# cheapest moves between experts (`minimoe.ops.move_costs`, `minimoe.ops.floyd_warshall`). Each
# difference $p_e - p_0$ then lies in $[-d_{0e}, d_{e0}]$, but these intervals are only the polytope's
# shadows: a vector inside all of them can still break a constraint between two other experts. We
# check all three on the sweep above, and put the exact solver's prices (`return_duals=True`) beside
# Sinkhorn's at the smallest $\varepsilon$.

# %%
def price_violation(q):
    """V(q): how much the tokens would gain by leaving their expert in z5, at prices q."""
    net = S5 - q
    return (net.max(1).values - net.gather(1, z5[:, None])[:, 0]).sum().item()


def dual_value(q):
    """Phi(q) = sum_t max_e (S_te - q_e) + sum_e C_e q_e, the assignment dual without utilities."""
    return ((S5 - q).max(1).values.sum() + C5 * q.sum()).item()


violations = []
for eps, g_eps in zip(EPS_ZERO, potentials):
    q = -g_eps
    violations.append(price_violation(q))
    assert violations[-1] <= eps * T5 * math.log(E5) + 1e-9, "eq. (price gap)"
    assert abs(violations[-1] - (dual_value(q) - lp_star)) <= 1e-8 * (1 + abs(lp_star)), "V = dual gap"

distance = floyd_warshall(move_costs(S5, z5)[0])  # d[a, b], shortest moves
low, high = -distance[0, :], distance[:, 0]  # p_e - p_0 lies in [low_e, high_e] for every optimal p


def polytope_gap(p):
    """The largest violation of p_b - p_a >= -d[a, b] over all pairs (0 inside the optimal polytope)."""
    return (-distance - (p[None, :] - p[:, None])).clamp(min=0).max().item()


ours = cert.prices - cert.prices[0]
theirs = -(potentials[-1] - potentials[-1][0])
exact = [eps for eps, v in zip(EPS_ZERO, violations) if v == 0.0]
print("eps     " + " ".join(f"{eps:8.1e}" for eps in EPS_ZERO))
print("V(-g)   " + " ".join(f"{v:8.1e}" for v in violations))
print(f"V = 0 (so -g_eps is an optimal price vector) for every eps <= {max(exact):.1e}" if exact else "V > 0 throughout")
print("expert   optimal p_e - p_0 in        linear_assignment   -(g_e - g_0), eps=%.1e" % EPS_ZERO[-1])
for e in range(E5):
    print(f"{e:6d}   [{low[e].item():8.4f}, {high[e].item():8.4f}]   {ours[e].item():17.4f}   {theirs[e].item():18.4f}")
assert price_violation(cert.prices) <= 1e-12, "the solver's prices are optimal"
assert polytope_gap(ours) <= 1e-12, "the solver's prices lie in the optimal polytope"
assert polytope_gap(theirs) <= violations[-1] + 1e-9, "so do Sinkhorn's, up to V"

fig, ax = plt.subplots(figsize=(6, 3.8))
positive = np.array(violations) > 0  # V = 0 exactly at the smallest eps: not on a log axis
ax.loglog(EPS_ZERO[positive], np.array(violations)[positive], "o-", label=r"$V(-g_\varepsilon)$ (where $> 0$)")
ax.loglog(EPS_ZERO, EPS_ZERO * T5 * math.log(E5), ":", label=r"$\varepsilon T \log E$")
ax.set_xlabel(r"$\varepsilon$")
ax.set_ylabel("total (CS1) violation")
ax.set_title(f"Column potentials as prices, T={T5}, E={E5}")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# At large $\varepsilon$ the potentials are nearly equal, and $V$ is what the tokens would gain at equal
# prices. Once $\varepsilon$ is below the spread of the scores, $V$ falls fast, far below the bound
# (which pays $\log E$ for every token, even for tokens nearly certain of their expert). It reaches exactly 0 at a positive
# $\varepsilon$: the polytope of optimal prices has an interior, the potentials approach a point
# inside it, and from then on $-g_\varepsilon$ is itself an optimal price vector. The exact solver's
# prices are inside too, at another point (often on the boundary, since its paths raise prices only
# as far as they must): the polytope has room, and each method picks its own point of it.

# %% [markdown]
# (nb03-top1-exact)=
# ## Exactly balanced top-1 at a positive ε
#
# The plan only converges to the balanced assignment, but its *top-1* is that assignment, with exactly
# $T/E$ tokens per expert, for every $\varepsilon$ below $\varepsilon_0 = \delta/(2T\log E)$, where
# $\delta$ is the score gap to the second-best balanced assignment (the corollary to Proposition 2.9).
# On a problem small enough to list all $6!/(2!\,2!\,2!) = 90$ balanced assignments we compute $\delta$
# by brute force and check the corollary's inequality
# $P_{t z_t} \ge 1 - \varepsilon H(P_\varepsilon)/\delta > \frac12$ below $\varepsilon_0$, and also how far
# above $\varepsilon_0$ the top-1 loads stay exact here.

# %%
torch.manual_seed(51)
Tc, Ec = 6, 3
Sc = torch.randn(Tc, Ec, dtype=torch.float64)
vertices = torch.tensor([z for z in itertools.product(range(Ec), repeat=Tc)
                         if all(z.count(e) == Tc // Ec for e in range(Ec))])
vertex_scores = Sc.gather(1, vertices.T).sum(0)
order = vertex_scores.argsort(descending=True)
zc, delta = vertices[order[0]], (vertex_scores[order[0]] - vertex_scores[order[1]]).item()
eps0 = delta / (2 * Tc * math.log(Ec))
assert len(vertices) == 90 and torch.equal(zc, linear_assignment(Sc, Tc // Ec))
exact_up_to, all_exact = 0.0, True
for eps in eps0 * np.logspace(-1, 2, 13):  # increasing
    P = sinkhorn(Sc, float(eps), tol=1e-12, max_iter=100_000)
    exact = torch.equal(P.argmax(1), zc)
    if eps < eps0:
        lower = 1 - eps * (-torch.special.xlogy(P, P).sum().item()) / delta
        assert (P.gather(1, zc[:, None]) >= lower - 1e-10).all() and lower > 0.5, "the corollary's inequality"
        assert exact and (torch.bincount(P.argmax(1), minlength=Ec) == Tc // Ec).all(), "exact top-1 loads"
    all_exact = all_exact and exact
    if all_exact:
        exact_up_to = eps
print(f"delta = {delta:.4f}, eps0 = {eps0:.2e}; top-1 = balanced assignment for every eps tried up to "
      f"{exact_up_to:.2e} ({exact_up_to / eps0:.0f} x eps0)")

# %% [markdown]
# $\varepsilon_0$ is a worst case: the loads are exact well above it. When the LP has several optimal
# solutions (ties), no single assignment is the limit. The cited theorem of Cominetti and San Martín says
# the plan then tends to the optimal solution of largest entropy. We build scores with ties (integers in
# $\{0,1,2\}$), find the optimal face with `linprog` (its support: the entries that some optimal solution
# makes positive), compute the face's largest-entropy point by scaling its 0/1 support pattern to the
# marginals, and compare it with the plan at small $\varepsilon$.

# %%
rng = np.random.default_rng(52)
A_eq6 = np.vstack([np.kron(np.eye(6), np.ones((1, 3))), np.kron(np.ones((1, 6)), np.eye(3))])
b_eq6 = np.concatenate([np.ones(6), np.full(3, 2.0)])
while True:
    St = rng.integers(0, 3, size=(6, 3)).astype(float)
    lp_t = linprog(-St.ravel(), A_eq=A_eq6, b_eq=b_eq6, bounds=(0, None), method="highs")
    face_A, face_b = np.vstack([A_eq6, St.ravel()[None]]), np.concatenate([b_eq6, [-lp_t.fun]])
    largest = [-linprog(-np.eye(18)[k], A_eq=face_A, b_eq=face_b, bounds=(0, None), method="highs").fun
               for k in range(18)]
    support = (np.array(largest) > 1e-9).reshape(6, 3)
    if support.sum() > 6:  # ties: the optimal face is more than one vertex
        break
u_t, v_t = np.ones(6), np.ones(3)
for _ in range(5000):
    u_t = 1 / (support @ v_t)
    v_t = 2.0 / (support.T @ u_t)
maxent = u_t[:, None] * support * v_t[None, :]
P_t = sinkhorn(torch.tensor(St), 0.02, tol=1e-13, max_iter=100_000).numpy()
print("scores with ties:\n", St.astype(int), "\nlargest-entropy optimal solution:\n", maxent.round(3))
print(f"max|P_eps - largest-entropy solution| at eps = 0.02: {np.abs(P_t - maxent).max():.1e}; "
      f"the vertex linprog returns is {np.abs(lp_t.x.reshape(6, 3) - maxent).max():.2f} away")
assert np.abs(maxent.sum(1) - 1).max() < 1e-12 and abs((St * maxent).sum() + lp_t.fun) < 1e-9, "optimal"
assert np.abs(P_t - maxent).max() < 1e-6, "the plan tends to the largest-entropy LP solution"

# %% [markdown]
# (nb03-eps-infinity)=
# ## Large ε: the uniform plan
#
# At the other end (Proposition 2.8) the entropy wins and the plan tends to $1/E$ everywhere, with
# $\lVert P_\varepsilon - Q\rVert_1 \le \min\big(T\,\mathrm{osc}(S)/\varepsilon,\ T\sqrt{2\,\mathrm{osc}(S)/\varepsilon}\big)$.
# The square-root bound is the smaller one for small $\varepsilon$, the $1/\varepsilon$ bound for large
# $\varepsilon$, and the latter has the right order: the distance itself shrinks like $1/\varepsilon$.
# We assert both bounds at every $\varepsilon$, and check the order: $\varepsilon\,(P_\varepsilon - 1/E)$
# tends to the first-order term $(S_{tj} - \bar S_{t\cdot} - \bar S_{\cdot j} + \bar S)/E$ of the chapter.

# %%
EPS_INF = np.logspace(0, 4, 9)
max_dev, l1_dev, l1_bound, linear_bound = [], [], [], []
osc = (S5.max() - S5.min()).item()
for eps in EPS_INF:
    P = sinkhorn(S5, float(eps), tol=1e-12, max_iter=10_000)
    max_dev.append((P - 1 / E5).abs().max().item())
    l1_dev.append((P - 1 / E5).abs().sum().item())
    l1_bound.append(T5 * math.sqrt(2 * osc / eps))
    linear_bound.append(T5 * osc / eps)
    assert l1_dev[-1] <= min(l1_bound[-1], linear_bound[-1]), "Proposition 2.8 bound"
print("eps * max|P - 1/E| for eps >= 100:", [f"{e * d:.4f}" for e, d in zip(EPS_INF, max_dev) if e >= 100])
print("distance / (T osc / eps) for eps >= 100:", [f"{d / b:.4f}" for e, d, b in zip(EPS_INF, l1_dev, linear_bound) if e >= 100])
assert max_dev[-1] < 1e-3, "uniform to 1e-3 at eps = 1e4"
assert linear_bound[-1] < l1_bound[-1], "at large eps the 1/eps bound is the tighter one"
scaled = [e * d for e, d in zip(EPS_INF, max_dev) if e >= 100]
assert max(scaled) / min(scaled) < 1.1, "the deviation decays like 1/eps (to 10%)"
first_order = (S5 - S5.mean(1, keepdim=True) - S5.mean(0, keepdim=True) + S5.mean()) / E5
assert (EPS_INF[-1] * (P - 1 / E5) - first_order).abs().max() < 1e-2 * first_order.abs().max(), "first-order term"

fig, ax = plt.subplots(figsize=(6, 3.8))
ax.loglog(EPS_INF, max_dev, "o-", label=r"$\max_{ij} |P_{ij} - 1/E|$")
ax.loglog(EPS_INF, l1_dev, "s-", label=r"$\|P_\varepsilon - Q\|_1$")
ax.loglog(EPS_INF, l1_bound, "--", label=r"bound $T\sqrt{2\,\mathrm{osc}(S)/\varepsilon}$")
ax.loglog(EPS_INF, linear_bound, ":", label=r"bound $T\,\mathrm{osc}(S)/\varepsilon$")
ax.set_xlabel(r"$\varepsilon$")
ax.set_ylabel("distance to the uniform plan")
ax.set_title(f"Large $\\varepsilon$, T={T5}, E={E5}")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# (nb03-invariances)=
# ## Invariances
#
# Proposition 2.11: adding a constant per token ($\phi_t$) or per expert ($\psi_e$) to the scores
# leaves the plan unchanged and shifts the potentials to $(f - \phi, g - \psi)$, up to the gauge
# $(f + c, g - c)$; the plan depends on $S/\varepsilon$ only; and (Proposition 2.8) with a single
# token the plan is the uniform row whatever the scores.

# %%
torch.manual_seed(6)
S6 = torch.randn(32, 6, dtype=torch.float64)
phi, psi = 3 * torch.randn(32, dtype=torch.float64), 5 * torch.randn(6, dtype=torch.float64)
base = sinkhorn(S6, 0.5, tol=1e-12, return_potentials=True)
shifted = sinkhorn(S6 + phi[:, None] + psi[None, :], 0.5, tol=1e-12, return_potentials=True)
c_rows = shifted.f + phi - base.f  # should be a constant c ...
c_cols = shifted.g + psi - base.g  # ... and this -c
print(f"shift:  max|P' - P| = {(shifted.plan - base.plan).abs().max():.1e}, "
      f"f'+phi-f in [{c_rows.min():.6f}, {c_rows.max():.6f}], g'+psi-g in [{c_cols.min():.6f}, {c_cols.max():.6f}]")
assert (shifted.plan - base.plan).abs().max() < 1e-10
assert (c_rows.max() - c_rows.min()) < 1e-8 and (c_cols.max() - c_cols.min()) < 1e-8
assert abs(c_rows.mean() + c_cols.mean()) < 1e-8, "the two constants cancel (the gauge)"

# softmax, by contrast, moves with a per-expert shift
softmax_shift = (torch.softmax(S6 + psi, 1) - torch.softmax(S6, 1)).abs().max().item()
print(f"        the row softmax moves by up to {softmax_shift:.2f} under the same per-expert shift")
assert softmax_shift > 0.1

eps = 0.25
scaled_plan = sinkhorn(S6 / eps, 1.0, tol=1e-12, return_potentials=True)
plain = sinkhorn(S6, eps, tol=1e-12, return_potentials=True)
print(f"scale:  max|P(S, {eps}) - P(S/{eps}, 1)| = {(plain.plan - scaled_plan.plan).abs().max():.1e}")
assert (plain.plan - scaled_plan.plan).abs().max() < 1e-10
gauge = plain.f - eps * scaled_plan.f
assert (gauge.max() - gauge.min()) < 1e-8, "potentials scale with eps (up to the gauge)"

i, j, k, l = 0, 1, 2, 3  # cross-ratios are those of the kernel (Proposition 2.11(c))
P = plain.plan
cross = (P[i, k] * P[j, l] / (P[j, k] * P[i, l])).log().item()
assert abs(cross - (S6[i, k] + S6[j, l] - S6[j, k] - S6[i, l]).item() / eps) < 1e-9

for eps in [0.01, 1.0, 100.0]:
    single = sinkhorn(10 * torch.randn(1, 6, dtype=torch.float64), eps)
    assert (single - 1 / 6).abs().max() < 1e-12, "one token: the uniform row"
print("single token: plan = 1/E for eps in 0.01, 1, 100")

# %% [markdown]
# The per-expert shift is the interesting one for routing: a bias that makes one expert popular is
# absorbed entirely into its potential $g_e$, while the softmax follows it.

# %% [markdown]
# (nb03-bias)=
# ## A Sinkhorn router is top-k with a per-expert bias
#
# Each row of the plan is $\mathrm{softmax}\big((S_{t,:} + g)/\varepsilon\big)$ (Proposition
# 2.12), so ranking a row of the plan is ranking the logits plus the column potential $g$. We
# check this on `minimoe.routers.SinkhornTokenChoice` in eval mode (no noise), dropless
# (`capacity_factor=None`, so its dispatch is exactly the top-$k$ of the plan), with enough
# iterations for the plan to converge: its dispatch is the top-$k$ of `logits + g`, with `g` from
# `sinkhorn(..., return_potentials=True)`. Four routing groups of 64 tokens, 8 experts, expert $e$
# made popular by an offset added to its logits.

# %%
torch.manual_seed(9)
G9, T9, E9 = 4, 64, 8
popularity = torch.tensor([2.0, 1.0, 0.5, 0.0, 0.0, -0.5, -1.0, -2.0], dtype=torch.float64)  # expert 0 most popular
logits = torch.randn(G9, T9, E9, dtype=torch.float64) + popularity
ref = sinkhorn(logits, 1.0, tol=1e-12, max_iter=10_000, return_potentials=True)
for k in (1, 2):
    router = SinkhornTokenChoice(16, E9, k=k, capacity_factor=None, eps=1.0,
                                 sinkhorn_iters=10_000, sinkhorn_tol=1e-10).eval()
    routing = router.route(logits)
    biased = logits + ref.g[:, None, :]
    top = biased.topk(k + 1, dim=-1).values
    margin = (top[..., k - 1] - top[..., k]).min().item()  # no near-ties, so the comparison is meaningful
    expected = torch.zeros_like(routing.mask).scatter_(-1, biased.topk(k, dim=-1).indices, True)
    print(f"k={k}: dispatch == top-k(logits + g) for all {G9 * T9} tokens: "
          f"{bool(torch.equal(routing.mask, expected))} (smallest top-k margin {margin:.1e})")
    assert margin > 1e-6 and torch.equal(routing.mask, expected)

# the bias is the popularity, undone: g(S + popularity) = g(S) - popularity, up to the gauge
g_noise = sinkhorn(logits - popularity, 1.0, tol=1e-12, max_iter=10_000, return_potentials=True).g
undone = ref.g + popularity - g_noise
assert (undone.amax(-1) - undone.amin(-1)).max() < 1e-8

softmax_load = torch.bincount(logits.argmax(-1).flatten(), minlength=E9)
sinkhorn_load = torch.bincount(ref.plan.argmax(-1).flatten(), minlength=E9)
print("top-1 load per expert, softmax :", softmax_load.tolist())
print("top-1 load per expert, Sinkhorn:", sinkhorn_load.tolist(), f"(balanced: {G9 * T9 // E9})")
assert sinkhorn_load.max() < softmax_load.max() and sinkhorn_load.min() > softmax_load.min()


# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
width = 0.4
axes[0].bar(np.arange(E9) - width / 2, softmax_load, width, label="softmax top-1")
axes[0].bar(np.arange(E9) + width / 2, sinkhorn_load, width, label="Sinkhorn top-1")
axes[0].axhline(G9 * T9 / E9, color="k", ls="--", lw=1, label=f"balanced: {G9} x T/E = {G9 * T9 // E9}")
axes[0].set_xlabel("expert")
axes[0].set_ylabel("tokens (4 groups of 64)")
axes[0].set_title("Top-1 load on skewed logits")
axes[0].legend(fontsize=8)
centred = ref.g - ref.g.mean(-1, keepdim=True)  # fix the gauge: mean zero per group
for grp in range(G9):
    axes[1].plot(popularity, centred[grp], "o", alpha=0.7, label=f"group {grp}")
axes[1].plot(popularity, -popularity, "k--", lw=1, label="$-$popularity")
axes[1].set_xlabel("expert popularity offset in the logits")
axes[1].set_ylabel("column potential g (mean 0)")
axes[1].set_title(r"The bias g cancels the popularity ($\varepsilon$ = 1)")
axes[1].legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# Softmax top-1 sends most tokens to the popular experts. The Sinkhorn router sees the same logits
# plus a bias $g$ that is close to minus the popularity (exactly minus it, plus what the noise
# alone would need), so its top-1 loads are close to balanced. They are not exactly $T/E$: only
# the column sums of the plan are exact, and a top-1 choice is not a plan (chapter 2, "Balance in
# expectation").


# %% [markdown]
# ## What we saw
#
# * Ten lines of log-domain Sinkhorn match `minimoe.ops.sinkhorn` to $10^{-8}$; the returned
#   potentials give the plan in closed form.
# * One iteration of `minimoe`'s Sinkhorn starts with the row softmax. Every feasible plan obeys the
#   KL-projection identity and the Pythagorean identity of the optimum.
# * The Sinkhorn token-choice and expert-choice routers and BASE fit in a few lines of plain
#   PyTorch each, and equal `minimoe`'s routers slot for slot.
# * Small $\varepsilon$: the score gap to the assignment LP is below $\varepsilon H(P) \le \varepsilon T\log E$,
#   and the top-1 of the plan becomes the balanced assignment of `linear_assignment`, which agrees
#   with `linprog`, with exactly $T/E$ tokens per expert below an explicit $\varepsilon_0$; with ties
#   the plan tends to the optimal solution of largest entropy. The column potentials become optimal
#   prices for the experts. Large $\varepsilon$: the plan tends to $1/E$ like $1/\varepsilon$, within
#   both bounds of Proposition 2.8.
# * Per-token and per-expert shifts do not change the plan; only $S/\varepsilon$ matters; one
#   token always gets the uniform row.
# * Sinkhorn token choice is top-$k$ of the logits plus a per-expert bias $g$ that undoes the
#   experts' popularity.
#
# Next, {doc}`03b-sinkhorn-numerics`: how fast the iterations converge, over-relaxation and Newton,
# why float32 needs the log domain, and the gradients of the value and of the plan.
