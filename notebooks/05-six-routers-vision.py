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
# # The six routers before training: tensors, drops, plans and Soft MoE
#
# Companion to {doc}`../book/04-six-routers`. Liu et al. compare six routers for Vision MoE models
# in one formulation: every router produces a dispatch tensor $\mathbf D$ and a combine tensor
# $\mathbf C$ of shape $T\times E\times C$. This notebook looks at the routers without any
# training.
#
# **You will learn to**
#
# 1. write the two new routers, sparsity-constrained expert choice and Soft MoE, from scratch and
#    show them equal to `minimoe`'s;
# 2. read the six tensors $\mathbf D$ and $\mathbf C$ on the same tokens;
# 3. count the tokens each router leaves unprocessed when some experts are more popular than others
#    (Propositions 4.1 and 4.2);
# 4. put the sparse plan of the sparsity-constrained router next to the entropic plan, and say when
#    it exists at all (Propositions 4.3 to 4.5);
# 5. measure how far the semi-dual solver gets (Proposition 4.6), and check the properties of
#    Soft MoE (Proposition 4.7).
#
# Every mathematical fact below is asserted, so the notebook fails if the code is wrong. The
# companion {doc}`05b-six-routers-trained` trains a tiny Vision Transformer with each router.
#
# *Prerequisites:* chapter 4 through "Soft MoE: the soft end"; Sinkhorn and its plans from
# {doc}`03-sinkhorn-from-scratch`.
#
# *Run time:* about 10 seconds at CPU scale on a 2-core laptop CPU, the default. `MINIMOE_SCALE=gpu` chooses
# the larger configuration, for a GPU: nothing changes at GPU scale in this notebook (its computations are
# small at either scale).

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

import matplotlib.pyplot as plt
import numpy as np
import torch

from minimoe import MoELayer
from minimoe.ops import (linear_assignment, sinkhorn, smallest_feasible_capacity, sparse_simplex_projection,
                         sparsity_constrained_plan, sparsity_constrained_semi_dual)
from minimoe.routers import build

SCALE = os.environ.get("MINIMOE_SCALE", "cpu")  # "gpu" runs the larger configuration: chosen, never automatic
# Every problem here is a small group solved exactly or in float64 on the CPU, so both scales run the
# same cells; the GPU configuration is the training study of 05b.
torch.set_num_threads(1)  # tiny matrices: one thread is faster than two, and robust to a busy machine
print(f"SCALE={SCALE}")

# The six routers, in the order of the chapter's table, with their registered names.
SIX = {
    "Softmax TC": "softmax_topk",
    "Sinkhorn TC": "sinkhorn_token_choice",
    "Softmax EC": "expert_choice",
    "Sinkhorn EC": "sinkhorn_expert_choice",
    "Sparse EC": "sparsity_constrained_ec",
    "Soft MoE": "soft_moe",
}
SPARSE = [label for label in SIX if label != "Soft MoE"]


# %% [markdown]
# (nb05-scratch)=
# ## The two new routers from scratch
#
# **Sparsity-constrained expert choice** (chapter 4, "The sparsity-constrained problem") replaces
# the entropic plan by a quadratic one whose columns have at most $C$ nonzeros. Its semi-dual has
# one price $\alpha_t$ per token; at given prices each expert's column is the projection of
# $(U_{:,e} - \alpha)/(\gamma T/E)$ onto the sparse simplex (keep the $C$ largest entries, then
# shift them down to sum 1), and the gradient in $\alpha$ is $1 - $ the plan's row sums. The authors
# take 20 Adam steps on it. Each expert then takes its tokens of positive plan entry; the weights are
# the softmax. **Soft MoE** (chapter 4, "Soft MoE: the soft end") has no choice at all: the
# normalised token-slot logits are turned into dispatch weights by a softmax over the tokens and
# into combine weights by a softmax over the slots.

# %% tags=["from-scratch"]
import torch
import torch.nn.functional as F


def sparse_projection(v, keep, total=1.0):
    """Each row onto {p >= 0, sum p = total, at most `keep` nonzeros}: the top entries, shifted."""
    top, index = v.topk(keep, dim=-1)
    excess = top.cumsum(-1) - total
    size = (top * torch.arange(1, keep + 1, dtype=v.dtype) > excess).sum(-1, keepdim=True)
    return torch.zeros_like(v).scatter(-1, index, (top - excess.gather(-1, size - 1) / size).clamp_min(0))


def sparse_expert_choice(logits, capacity, gamma=1.0, steps=20, lr=1e-2):
    """Adam on the semi-dual's token prices, then each expert's tokens of positive plan entry."""
    U, (T, E) = torch.softmax(logits, -1), logits.shape
    plan_at = lambda alpha: (T / E) * sparse_projection(((U - alpha[:, None]) / (gamma * T / E)).T, capacity).T
    alpha, m, s = (torch.zeros(T, dtype=U.dtype) for _ in range(3))
    plan = plan_at(alpha)
    for step in range(1, steps + 1):
        g = 1 - plan.sum(-1)                                 # the semi-dual's gradient
        m, s = 0.9 * m + 0.1 * g, 0.999 * s + 0.001 * g * g
        alpha = alpha - lr * (m / (1 - 0.9 ** step)) / ((s / (1 - 0.999 ** step)).sqrt() + 1e-8)
        plan = plan_at(alpha)
    best = plan.topk(capacity, dim=0)
    mask = torch.zeros(T, E, dtype=torch.bool).scatter(0, best.indices, best.values > 0)
    return U * mask, mask


def soft_moe_weights(x, slot_features, scale):
    """Dispatch (softmax over tokens) and combine (softmax over slots) of the logits Z (T, E*S)."""
    Z = F.normalize(x, dim=-1) @ (F.normalize(slot_features, dim=0) * scale).flatten(1)
    return torch.softmax(Z, dim=0), torch.softmax(Z, dim=1)

# %%
from minimoe.routers import router_class

torch.manual_seed(0)
x_small = torch.randn(1, 24, 8, dtype=torch.float64)
router = router_class("sparsity_constrained_ec")(8, 4).double().eval()
routing = router(x_small)
weights, mask = sparse_expert_choice(router.gate(x_small)[0].detach(), routing.capacity)
assert torch.equal(mask, routing.position[0] >= 0)
torch.testing.assert_close(weights, routing.combine_tensor()[0].sum(-1).detach(), rtol=0, atol=1e-12)
soft = router_class("soft_moe")(8, 4, slots_per_expert=2).double()
routing = soft(x_small)
dispatch, combine = soft_moe_weights(x_small[0], soft.slot_embed.detach(), soft.scale.detach())
torch.testing.assert_close(dispatch, routing.slot_dispatch[0].flatten(1).detach(), rtol=0, atol=1e-12)
torch.testing.assert_close(combine, routing.slot_combine[0].flatten(1).detach(), rtol=0, atol=1e-12)
print(f"sparse EC: the same {int(mask.sum())} pairs and weights; Soft MoE: the same dispatch and combine weights")

# %% [markdown]
# (nb05-tensors)=
# ## The six routing tensors on the same tokens
#
# Eq. {eq}`eq-ch4-unified` writes every MoE layer with a dispatch tensor $\mathbf D[t, r, s]$ (token
# $t$ feeds slot $s$ of expert $r$) and a combine tensor $\mathbf C[t, r, s]$ (how much of that
# slot's output goes back to token $t$). We take one small group, $T = 16$ tokens of width 8 and
# $E = 4$ experts, at capacity factor $c = 1$, so $C = T/E = 4$ slots per expert. The five sparse
# routers share one gate $W$ and therefore the same logits $S = XW$; Soft MoE has no gate, and
# scores the same tokens against its own slot parameters $\Phi$ (4 slots per expert, the same
# expert work). Each panel is a tensor reshaped to $T\times(E\cdot C)$: a row is a token, a column
# a slot, and the white lines separate the experts.
#
# The structural facts of the chapter's second table, asserted below:
#
# * **sparse routers:** $\mathbf D$ is 0/1, each slot holds at most one token, a token uses each
#   expert at most once, and $\mathbf C = \mathbf D\cdot\Pi_{\rm softmax}$ exactly
#   (eq. {eq}`eq-ch4-combine`: the plan dispatches, the softmax combines);
# * **token choice:** a token has at most one expert ($k = 1$); **expert choice:** every expert
#   takes exactly $C$ tokens (the sparse router at most $C$: it leaves a slot empty where the plan
#   has no mass);
# * **Soft MoE:** every slot column of $\mathbf D$ and every token row of $\mathbf C$ is a
#   probability vector with positive entries ({ref}`Proposition 4.7 <ch4-prop-soft>`(a)).

# %%
T_DEMO, E_DEMO, D_DEMO = 16, 4, 8
gen = torch.Generator().manual_seed(0)
x_demo = torch.randn(T_DEMO, D_DEMO, generator=gen, dtype=torch.float64)
gate = torch.randn(D_DEMO, E_DEMO, generator=gen, dtype=torch.float64)
logits_demo = x_demo @ gate  # the logits every sparse router sees
probs_demo = torch.softmax(logits_demo, -1)

tensors = {}
for label, name in SIX.items():
    if name == "soft_moe":
        router = build(name, D_DEMO, E_DEMO, slots_per_expert=T_DEMO // E_DEMO).double().eval()
        routing = router(x_demo)
    else:
        router = build(name, D_DEMO, E_DEMO, capacity_factor=1.0).eval()
        routing = router.route(logits_demo)
    tensors[label] = (routing.dispatch_tensor().detach(), routing.combine_tensor().detach())

for label, (D, C) in tensors.items():
    assert D.shape == C.shape == (T_DEMO, E_DEMO, T_DEMO // E_DEMO), (label, D.shape)
    if label == "Soft MoE":
        assert (D > 0).all() and (C > 0).all(), "Soft MoE: every entry is positive"
        assert torch.allclose(D.sum(0), torch.ones(E_DEMO, T_DEMO // E_DEMO, dtype=D.dtype)), "slot columns sum to 1"
        assert torch.allclose(C.sum((1, 2)), torch.ones(T_DEMO, dtype=C.dtype)), "token rows sum to 1"
        continue
    assert ((D == 0) | (D == 1)).all(), f"{label}: D is 0/1"
    assert (D.sum(0) <= 1).all(), f"{label}: a slot holds at most one token"
    assert (D.sum(2) <= 1).all(), f"{label}: a token uses an expert at most once"
    assert torch.equal(C, D * probs_demo[:, :, None]), f"{label}: C = D * softmax, exactly"
    if label.endswith("TC"):
        assert (D.sum((1, 2)) <= 1).all(), f"{label}: k = 1 expert per token at most"
    elif label == "Sparse EC":
        assert (D.sum((0, 2)) <= T_DEMO // E_DEMO).all(), f"{label}: at most C tokens per expert"
    else:
        assert (D.sum((0, 2)) == T_DEMO // E_DEMO).all(), f"{label}: exactly C tokens per expert"
    dropped = int((D.sum((1, 2)) == 0).sum())
    print(f"{label:12s} tokens without an expert: {dropped:2d} of {T_DEMO};  slots used: "
          f"{int(D.sum())} of {D.shape[1] * D.shape[2]};  most experts for one token: {int(D.sum((1, 2)).max())}")
print("Soft MoE     every token feeds every slot, every slot feeds every token")


# %%
fig, axes = plt.subplots(len(SIX), 2, figsize=(7.5, 2.6 * len(SIX)))
for row, (label, (D, C)) in enumerate(tensors.items()):
    for col, (tensor, what) in enumerate(((D, "dispatch D"), (C, "combine C"))):
        ax = axes[row, col]
        flat = tensor.reshape(T_DEMO, -1).numpy()
        im = ax.imshow(flat, cmap="viridis", vmin=0, vmax=max(flat.max(), 1e-12), aspect="auto",
                       interpolation="nearest")
        for boundary in range(1, E_DEMO):
            ax.axvline(boundary * tensor.shape[2] - 0.5, color="white", lw=1.5)
        ax.set_title(f"{label}: {what}", fontsize=10)
        ax.set_xlabel("slot (expert r, slot s), experts separated by lines")
        ax.set_ylabel("token t")
        fig.colorbar(im, ax=ax, fraction=0.046)
fig.suptitle("Routing tensors of the six routers on the same 16 tokens (E = 4, c = 1)", y=1.0)
fig.tight_layout()
plt.show()

# %% [markdown]
# The sparse panels differ only in *which* cells are lit. Token choice fills slots in token order,
# so its slots are used from the left, and a token whose expert is full gets nothing. Expert choice
# fills every slot, and some tokens are picked twice while others are left out. Soft MoE lights
# every cell: each slot reads a weighted average of all tokens, and each token reads a weighted
# average of all slots.

# %% [markdown]
# **No gradient through the solvers.** The three OT routers compute their plans without gradient:
# the logits reach the combine weights only through the softmax at the dispatched pairs
# (eq. {eq}`eq-ch4-combine`). We check it with autograd: for a random weighting of the combine
# tensor, the gradient with respect to the logits equals that of $\mathbf D\odot\Pi_{\rm softmax}$
# with the dispatch held fixed.

# %%
weights_demo = torch.randn(T_DEMO, E_DEMO, generator=gen, dtype=torch.float64)
for label in ("Sinkhorn TC", "Sinkhorn EC", "Sparse EC"):
    leaf = logits_demo.clone().requires_grad_(True)
    routing = build(SIX[label], D_DEMO, E_DEMO, capacity_factor=1.0).eval().route(leaf)
    (grad_router,) = torch.autograd.grad((routing.combine * weights_demo).sum(), leaf)
    mask = routing.mask.detach().double()
    (grad_softmax,) = torch.autograd.grad((mask * torch.softmax(leaf, -1) * weights_demo).sum(), leaf)
    assert torch.allclose(grad_router, grad_softmax, atol=1e-12), label
    print(f"{label:12s} d(combine)/d(logits) = that of D * softmax(logits): the plan passes no gradient")

# %% [markdown]
# (nb05-anatomy)=
# ## Router anatomy: drops under expert popularity
#
# No training yet. We draw router logits for a group of $T = 256$ tokens and $E = 8$ experts,
# $S_{tr}\sim\mathcal N(0, 1)$, and add a per-expert *popularity* offset $b_r\sim\mathcal N(0, s^2)$
# to every token, for a skew $s\in\{0, 1, 2\}$ and capacity factors $c\in\{1, 2\}$, over 20 draws.
# For each router we count the **unprocessed** tokens (no expert takes them; the residual connection
# alone carries them) and the **slot utilisation** (dispatched pairs over the $E\cdot C$ slots).
# Soft MoE is not in the sweep: its dispatch is a softmax over tokens, so it drops nothing whatever
# the logits ({ref}`Proposition 4.7 <ch4-prop-soft>`(a)); we check that on random tokens.
#
# The sparsity-constrained router runs with its default solver, the authors' 20 Adam steps, and also
# with the `annealed` solver of {py:func}`minimoe.ops.sparsity_constrained_plan`, which gets closer to
# the plan of eq. {eq}`eq-ch4-sparse` ({ref}`nb05-solver`).

# %%
A_T, A_E, A_DRAWS, SKEWS, A_FACTORS = 256, 8, 20, (0, 1, 2), (1, 2)
gen = torch.Generator().manual_seed(1)
base_logits = torch.randn(A_DRAWS, A_T, A_E, generator=gen, dtype=torch.float64)
popularity = torch.randn(A_DRAWS, 1, A_E, generator=gen, dtype=torch.float64)  # one profile b per draw
ANATOMY_ROUTERS = {label: (SIX[label], {}) for label in SPARSE}
ANATOMY_ROUTERS["Sparse EC (annealed)"] = ("sparsity_constrained_ec", {"ot_method": "annealed"})

anatomy, positions = {}, {}
for c in A_FACTORS:
    for s in SKEWS:
        logits = base_logits + s * popularity
        for label, (name, options) in ANATOMY_ROUTERS.items():
            routing = build(name, 1, A_E, capacity_factor=float(c), **options).eval().route(logits)
            mask = routing.mask
            unprocessed = (~mask.any(-1)).double().mean(-1)  # per draw
            utilisation = mask.sum((-2, -1)).double() / (A_E * routing.capacity)
            anatomy[(label, c, s)] = (unprocessed.mean().item(), unprocessed.std().item(), utilisation.mean().item())
            positions[(label, c, s)] = routing.position
    x_tokens = torch.randn(A_T, 16, generator=gen)
    soft = build("soft_moe", 16, A_E, slots_per_expert=round(c * A_T / A_E)).eval()(x_tokens)
    assert soft.stats["drop_rate"] == 0 and (soft.slot_dispatch > 0).all(), "Soft MoE drops nothing"

print(f"unprocessed-token fraction (mean over {A_DRAWS} draws) and slot utilisation, T={A_T}, E={A_E}")
print(f"{'router':22s}" + "".join(f"{f'c={c} s={s}':>16s}" for c in A_FACTORS for s in SKEWS))
for label in ANATOMY_ROUTERS:
    print(f"{label:22s}" + "".join(f"{anatomy[(label, c, s)][0]:8.3f} ({anatomy[(label, c, s)][2]:.2f})"
                                   for c in A_FACTORS for s in SKEWS))
print(f"{'Soft MoE':22s}" + "".join(f"{0:8.3f} (1.00)" for c in A_FACTORS for s in SKEWS))
print("(slot utilisation in brackets)")
for label in ("Softmax EC", "Sinkhorn EC"):
    assert all(anatomy[(label, c, s)][2] == 1 for c in A_FACTORS for s in SKEWS), "expert choice fills every slot"

# %%
fig, axes = plt.subplots(1, len(A_FACTORS), figsize=(12, 4.2), sharey=True)
for ax, c in zip(axes, A_FACTORS):
    for label in ANATOMY_ROUTERS:
        means = [anatomy[(label, c, s)][0] for s in SKEWS]
        sds = [anatomy[(label, c, s)][1] for s in SKEWS]
        ax.errorbar(SKEWS, means, yerr=sds, marker="o", capsize=3, label=label,
                    ls="--" if "annealed" in label else "-")
    ax.plot(SKEWS, [0] * len(SKEWS), marker="x", color="black", label="Soft MoE")
    ax.set_xticks(SKEWS)
    ax.set_xlabel("popularity skew s (std of the per-expert offset b)")
    ax.set_title(f"capacity factor c = {c}")
axes[0].set_ylabel(f"unprocessed tokens (fraction; mean ± sd over {A_DRAWS} draws)")
axes[-1].legend(fontsize=8)
fig.suptitle(f"Tokens no expert processes, T = {A_T}, E = {A_E}")
fig.tight_layout()
plt.show()

# %% [markdown]
# **Proposition 4.1** ({ref}`Proposition 4.1 <ch4-prop-one-row>`). One Sinkhorn iteration on the kernel $e^S$,
# started from $v = \mathbf 1$, is a row normalisation (the softmax) followed by a column scaling.
# Two checks: (i) after one iteration, the plan divided by the softmax is constant down every
# column (so the plan is the softmax with each column rescaled); (ii) therefore Sinkhorn expert
# choice stopped after that one column update picks *exactly* the tokens that softmax expert choice
# picks, for every draw, skew and capacity, because expert choice only reads the order within each
# column. (The routers by default end on a row update, as V-MoE does, and do not stop while the plan is
# unbalanced; {ref}`ch2-routers` says why. Here we ask for the bare iteration:
# `sinkhorn_iters=1, last_update="columns", balance_tol=None`.) Token choice reads the order within
# rows, which the column scaling does change; we print how often.
#
# **Proposition 4.2** ({ref}`Proposition 4.2 <ch4-prop-popularity>`). A per-expert offset $b$ leaves the Sinkhorn plan
# unchanged, so the dispatch of both Sinkhorn routers must be *identical* for $s = 0, 1, 2$, while
# the dispatch of both softmax routers changes (and the combine weights of all four, which are
# softmax values, change too).

# %%
one_step = sinkhorn(base_logits, max_iter=1, tol=0, method="log")
ratio = one_step / torch.softmax(base_logits, -1)
column_spread = ((ratio.amax(-2) - ratio.amin(-2)) / ratio.mean(-2)).max().item()
assert column_spread < 1e-12, column_spread
print(f"(i) one Sinkhorn iteration / softmax: largest relative spread down a column {column_spread:.1e}")

tc_changed = []
for c in A_FACTORS:
    for s in SKEWS:
        logits = base_logits + s * popularity
        bare = dict(sinkhorn_iters=1, last_update="columns", balance_tol=None)  # one iteration, nothing added
        one_iteration_ec = build("sinkhorn_expert_choice", 1, A_E, capacity_factor=float(c), **bare).eval()
        assert torch.equal(one_iteration_ec.route(logits).position, positions[("Softmax EC", c, s)]), (c, s)
        one_iteration_tc = build("sinkhorn_token_choice", 1, A_E, capacity_factor=float(c), **bare).eval()
        routed = one_iteration_tc.route(logits).mask
        tc_changed.append((routed != positions[("Softmax TC", c, s)].ge(0)).any(-1).double().mean().item())
print("(ii) Sinkhorn EC with sinkhorn_iters=1 == softmax EC: identical dispatch for every draw, s and c")
print(f"     token choice after one iteration differs from softmax TC on {min(tc_changed):.0%}-{max(tc_changed):.0%} "
      "of the tokens")

for c in A_FACTORS:
    for s in SKEWS[1:]:
        for label in ("Sinkhorn TC", "Sinkhorn EC"):
            assert torch.equal(positions[(label, c, s)], positions[(label, c, 0)]), (label, c, s)
        for label in ("Softmax TC", "Softmax EC"):
            assert not torch.equal(positions[(label, c, s)], positions[(label, c, 0)]), (label, c, s)
moved = {label: np.mean([(positions[(label, c, 2)] != positions[(label, c, 0)]).any(-1).double().mean().item()
                         for c in A_FACTORS]) for label in ("Softmax TC", "Softmax EC")}
print("Proposition 4.2: Sinkhorn TC and EC dispatch identical under the offset for s = 1, 2 and c = 1, 2;")
print("                 tokens whose experts change at s = 2: " + ", ".join(f"{k} {v:.0%}" for k, v in moved.items()))
ratio_ec = anatomy[("Softmax EC", 1, 2)][0] / anatomy[("Sinkhorn EC", 1, 2)][0]
print(f"at s = 2, c = 1: softmax EC leaves {ratio_ec:.1f}x as many tokens unprocessed as Sinkhorn EC; "
      f"softmax TC drops {anatomy[('Softmax TC', 1, 2)][0]:.0%}")

# %% [markdown]
# **Liu et al.'s eq. (7) and Proposition 4.1(b)-(c).** The softmax is the maximiser of
# $\langle\Pi, S\rangle - \langle\Pi,\log\Pi\rangle$ over row-stochastic $\Pi$ (eq. (7) of the paper;
# {ref}`Proposition 2.1 <ch2-prop-forms>`(c)): no row-stochastic matrix near it does better, and the
# value is $\sum_t\mathrm{LSE}(S_{t,:})$. The converged Sinkhorn plan ranks column $r$ by
# $S_{tr} - \mathrm{LSE}_j(S_{tj} + g_j)$ and row $t$ by $S_{t,:} + g$, with $g$ its expert potential;
# the softmax is the case $g = 0$.

# %%
S41 = base_logits[0] + 2 * popularity[0]  # one draw at skew 2
soft41 = torch.softmax(S41, -1)
value_soft = ((soft41 * S41).sum() - (soft41 * soft41.log()).sum()).item()
assert abs(value_soft - torch.logsumexp(S41, -1).sum().item()) < 1e-9
rivals = torch.distributions.Dirichlet(torch.ones(A_E, dtype=torch.float64)).sample((200, A_T))
rivals = 0.99 * soft41 + 0.01 * rivals  # row-stochastic, close to the softmax
rival_values = (rivals * S41).sum((-2, -1)) - (rivals * rivals.log()).sum((-2, -1))
assert (rival_values < value_soft).all(), "eq. (7): the softmax is the maximiser"
out41 = sinkhorn(S41, 1.0, tol=1e-12, max_iter=20000, return_potentials=True)
column_key = S41 - torch.logsumexp(S41 + out41.g, -1, keepdim=True)
assert torch.equal(out41.plan.argsort(0), column_key.argsort(0)), "(b) column ranking"
assert torch.equal(out41.plan.argsort(1), (S41 + out41.g).argsort(1)), "(c) row ranking"
assert not torch.equal(out41.plan.argsort(0), soft41.argsort(0)), "g changes the columns' order"
print(f"eq. (7): softmax objective {value_soft:.2f} = sum of LSE; best of 200 row-stochastic plans near it "
      f"{rival_values.max().item():.2f}")
print(f"Prop. 4.1(b)-(c): the plan's column and row orders are those of S - LSE(S + g) and S + g; "
      f"expert potentials g = {np.round(out41.g.numpy(), 2).tolist()}")

# %% [markdown]
# What to take from the sweep. The Sinkhorn routers' curves are flat in $s$: the plan removes the
# offset before anything is ranked. Softmax token choice sends most tokens to the few popular
# experts, which overflow. Softmax expert choice still fills every slot, but with the wrong tokens:
# in every column, a token that prefers a popular expert is ranked low, so those tokens go
# unchosen. At $c = 2$ every router except softmax token choice leaves at most a few percent behind. The
# sparse router's drops depend on its solver: the plan it uses is only approximately balanced over
# tokens, and a token with no mass in any column is dropped. Its curve rises with $s$ because its
# utility is the softmax, which the offset does change.

# %% [markdown]
# (nb05-plans)=
# ## The sparse plan next to the entropic plan
#
# The Sinkhorn routers decide with the entropic plan $\Pi_{\rm ent}$, which is dense; the
# sparsity-constrained router with $\Pi_{\rm sparse}$ of eq. {eq}`eq-ch4-sparse`, which has at most
# $C$ nonzeros per expert column. Both have exact column sums $T/E$ (the entropic one up to the
# Sinkhorn tolerance). Below, one group of $T = 32$ tokens and $E = 4$ experts: the entropic plan
# of the logits, and the sparse plan of their softmax at $c = 1$ ($C = 8 = T/E$: the feasible
# plans are then 0/1 assignments, {ref}`ch4-feasibility`) and at $c = 2$ ($C = 16$). Zeros are
# white.

# %%
P_T, P_E = 32, 4
gen = torch.Generator().manual_seed(2)
logits_plan = 1.5 * torch.randn(P_T, P_E, generator=gen, dtype=torch.float64)
utility = torch.softmax(logits_plan, -1)
plans = {"entropic plan (Sinkhorn)": sinkhorn(logits_plan, tol=1e-10)}
for c in (1, 2):
    plans[f"sparse plan, c = {c} (C = {c * P_T // P_E})"] = sparsity_constrained_plan(utility, c * P_T // P_E)

fig, axes = plt.subplots(1, 3, figsize=(11, 5.5), sharey=True)
for ax, (title, plan) in zip(axes, plans.items()):
    shown = np.ma.masked_equal(plan.numpy(), 0.0)
    im = ax.imshow(shown, cmap="magma_r", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    nonzeros = (plan > 0).sum(0).tolist()
    ax.set_title(f"{title}\nnonzeros per column {nonzeros}", fontsize=9)
    ax.set_xlabel("expert r")
    ax.set_xticks(range(P_E))
axes[0].set_ylabel("token t")
fig.colorbar(im, ax=axes, fraction=0.03, label="plan entry (white: exactly 0)")
fig.suptitle(f"Entropic vs sparsity-constrained plan, T = {P_T}, E = {P_E}")
plt.show()
for title, plan in plans.items():
    print(f"{title:30s} column sums {[round(v, 12) for v in plan.sum(0).tolist()]}, "
          f"mean |row sum - 1| {(plan.sum(1) - 1).abs().mean():.1e}")

# %% [markdown]
# Over many groups: $T = 64$, $E = 8$, 200 random groups, both solvers. The columns are exact after
# any number of solver steps ({ref}`Proposition 4.6 <ch4-prop-semidual>`(d)), so the assertions are
# about the columns; the rows are only reported. A token whose row is all zero is dropped by the
# router whatever else happens.

# %%
gen = torch.Generator().manual_seed(3)
utilities = torch.softmax(torch.randn(200, 64, 8, generator=gen, dtype=torch.float64), -1)
print(f"{'solver':14s} {'c':>2s} {'C':>3s} {'cols with C nonzeros':>21s} {'max col error':>14s} "
      f"{'mean |row-1|':>13s} {'tokens without mass':>20s}")
for method in ("adam", "annealed"):
    for c in (1, 2):
        C = c * 64 // 8
        plan = sparsity_constrained_plan(utilities, C, method=method)
        nonzeros = (plan > 0).sum(-2)
        assert (nonzeros <= C).all() and (plan >= 0).all()
        column_error = (plan.sum(-2) - 64 / 8).abs().max().item()
        assert column_error < 1e-12, column_error
        print(f"{method:14s} {c:2d} {C:3d} {(nonzeros == C).double().mean().item():21.1%} {column_error:14.1e} "
              f"{(plan.sum(-1) - 1).abs().mean().item():13.3f} {(plan.sum(-1) == 0).double().mean().item():20.2%}")

# %% [markdown]
# **Proposition 4.3** ({ref}`Proposition 4.3 <ch4-prop-quadratic>`) and **4.6(e)** ({ref}`Proposition 4.6 <ch4-prop-semidual>`). With
# $C\ge T$ there is no sparsity constraint, and the problem is quadratically regularised OT: a
# strictly concave quadratic program. The form of its solution: on its support,
# $U_{tr} - \gamma\Pi_{tr} = \alpha_t + \mu_r$ splits into a token part and an expert part, and off
# the support $U_{tr}\le\alpha_t + \mu_r$. We take $\alpha$ from the solver and read $\mu_r$ off each
# column; for a concave QP these conditions with feasible marginals certify the optimum
# (`tests/test_sparse_ot.py::test_full_capacity_is_quadratic_ot_of_pot` also compares the plan with
# POT's independent solver).
#
# **Proposition 4.5** ({ref}`Proposition 4.5 <ch4-prop-projection>`). The projection onto the sparse simplex keeps the
# $C$ largest entries and shifts them down to sum 1. (A search over every support of size at most $C$
# agrees: `tests/test_sparse_ot.py::test_projection_equals_brute_force_over_supports`.)

# %%
gen = torch.Generator().manual_seed(4)
T_small, E_small = 8, 4
U_small = torch.softmax(2 * torch.randn(T_small, E_small, generator=gen, dtype=torch.float64), -1)
info = sparsity_constrained_plan(U_small, T_small, method="annealed", max_iter=300, return_info=True)
marginal_error = max((info.plan.sum(1) - 1).abs().max().item(), (info.plan.sum(0) - T_small / E_small).abs().max().item())
support = info.plan > 0
residual = U_small - info.plan - info.alpha[:, None]  # gamma = 1: equals mu_r on the support
mu = torch.where(support, residual, torch.nan).nanmean(0)
spread_on_support = torch.where(support, (residual - mu).abs(), torch.zeros_like(residual)).max().item()
off_support = torch.where(~support, U_small - info.alpha[:, None] - mu, -torch.ones_like(residual)).max().item()
assert marginal_error < 1e-6 and spread_on_support < 1e-6 and off_support < 1e-6
print(f"Prop. 4.3/4.6(e), C >= T: marginals within {marginal_error:.1e}; {int((~support).sum())} exact zeros; "
      f"U - Pi - alpha constant down each column on the support (spread {spread_on_support:.1e}); "
      f"off the support U - alpha - mu <= {off_support:.1e}")

y = torch.tensor([0.9, -0.3, 0.5, 1.2, 0.1, 0.45, -1.0], dtype=torch.float64)
p = sparse_simplex_projection(y, 3)
assert set(p.nonzero().flatten().tolist()) <= set(y.topk(3).indices.tolist()) and abs(p.sum().item() - 1) < 1e-12
print(f"Prop. 4.5: y = {y.tolist()}\n  projection with C = 3: {[round(v, 3) for v in p.tolist()]} "
      f"(the 3 largest entries, each shifted down by {(y - p)[p > 0][0].item():.3f})")

# %% [markdown]
# **Proposition 4.4** ({ref}`Proposition 4.4 <ch4-prop-feasible>`): when does eq. {eq}`eq-ch4-sparse` have a feasible
# plan at all? A column with at most $C$ entries of size $\le 1$ holds at most $C$, so $C\ge T/E$
# is necessary; the exact condition is $EC\ge T + E - \gcd(T, E)$. The table compares
# {py:func}`minimoe.ops.smallest_feasible_capacity` with $\lceil T/E\rceil$ and with the capacity
# the paper's rounding gives at $c = 1$. (An independent check, a mixed-integer program that finds a
# feasible plan at the smallest capacity and none one below it, is
# `tests/test_sparse_ot.py::test_feasibility_condition_matches_a_mixed_integer_oracle`.)

# %%
print(f"{'T':>4s} {'E':>3s} {'gcd':>4s} {'ceil(T/E)':>9s} {'round(T/E)':>10s} {'smallest feasible C':>20s}")
for T, E in [(5, 3), (8, 3), (6, 4), (10, 4), (12, 8), (49, 32), (196, 32), (200, 32), (256, 8)]:
    smallest = smallest_feasible_capacity(T, E)
    assert smallest >= math.ceil(T / E)
    print(f"{T:4d} {E:3d} {math.gcd(T, E):4d} {math.ceil(T / E):9d} {math.floor(T / E + 0.5):10d} {smallest:20d}")

u_b16 = torch.softmax(torch.randn(196, 32, generator=gen), -1)
try:
    sparsity_constrained_plan(u_b16, 6)
    raise AssertionError("C = 6 < 196/32 must be refused")
except ValueError as err:
    assert "7" in str(err)
    print(f"\nT=196, E=32, C=round(196/32)=6 (the paper's ViT-B/16 setting):\n  ValueError: {err}")

# %% [markdown]
# (nb05-solver)=
# ## How far the semi-dual solver gets
#
# The plan is read off token prices $\alpha$ that minimise the semi-dual $h$ of eq.
# {eq}`eq-ch4-semidual`. {ref}`Proposition 4.6 <ch4-prop-semidual>` gives three things to check:
#
# * the **mean row error** $\frac1T\sum_t|(\Pi\mathbf 1)_t - 1|$ is what the solver drives down;
#   $0$ would certify an optimal plan (part d);
# * $h$ is what it minimises, so $h(\alpha)$ after some steps should be below $h(0)$;
# * **weak duality** (part b): $h(\alpha)$ is at least the value of *every* feasible plan. At
#   $C = T/E$ the feasible plans are the balanced 0/1 assignments and the best one is computed
#   exactly by {py:func}`minimoe.ops.linear_assignment` (exercise 4.3), so
#   $h(\alpha) - \mathrm{value}(\text{best assignment})\ge 0$ is an upper bound on how far the
#   solver's $h$ is from the optimum.
#
# Two solvers: `method="adam"` is the authors' schedule (Adam, learning rate $10^{-2}$, 20 steps;
# the dotted line), continued here to see where it goes; `method="annealed"` decays the step like
# $1/t$ and returns the iterate with the smallest row error. Each point solves from scratch with
# that many steps, for 8 groups of $T = 64$, $E = 8$, $C = 8$ and of $T = 128$, $E = 8$, $C = 16$
# (both $c = 1$), with the softmax of standard normal logits as the utility.

# %%
ITERS = [0, 1, 2, 3, 5, 7, 10, 15, 20, 30, 50, 70, 100, 150, 200, 300]
SOLVER_CASES = [(64, 8, 8), (128, 8, 16)]
gen = torch.Generator().manual_seed(6)
solver = {}
for T, E, C in SOLVER_CASES:
    U = torch.softmax(torch.randn(8, T, E, generator=gen, dtype=torch.float64), -1)
    best = linear_assignment(U, C)  # the optimum of eq. (9) at C = T/E (a 0/1 plan)
    optimum = U.gather(-1, best[..., None]).squeeze(-1).sum(-1) - T / 2  # <P, U> - ||P||^2 / 2
    h_zero = sparsity_constrained_semi_dual(U, torch.zeros(8, T, dtype=U.dtype), C)
    for method in ("adam", "annealed"):
        rows = []
        for n_steps in ITERS:
            info = sparsity_constrained_plan(U, C, method=method, max_iter=n_steps, return_info=True)
            value = sparsity_constrained_semi_dual(U, info.alpha, C)
            assert torch.allclose(value, info.value)
            assert (value >= optimum - 1e-9).all(), "weak duality: h(alpha) >= every feasible plan's value"
            rows.append(dict(steps=n_steps, row_error=info.row_error, gap=(value - optimum).mean().item(),
                             no_mass=(info.plan.sum(-1) == 0).double().mean().item()))
        solver[(T, E, C, method)] = rows
        final = sparsity_constrained_plan(U, C, method=method, return_info=True)
        assert (final.value < h_zero).all(), "the solver lowers the semi-dual"
    print(f"T={T:3d} E={E} C={C:2d}: h(0) - optimum = {(h_zero - optimum).mean():.3f};  "
          + ";  ".join(f"{m} at its default steps: row error {solver[(T, E, C, m)][ITERS.index(d)]['row_error']:.3f}, "
                       f"h - optimum {solver[(T, E, C, m)][ITERS.index(d)]['gap']:.3f}, "
                       f"tokens without mass {solver[(T, E, C, m)][ITERS.index(d)]['no_mass']:.1%}"
                       for m, d in (("adam", 20), ("annealed", 100))))


# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
for (T, E, C), ls in zip(SOLVER_CASES, ("-", "--")):
    for method, color in (("adam", "tab:blue"), ("annealed", "tab:orange")):
        rows = solver[(T, E, C, method)]
        steps = [max(r["steps"], 0.5) for r in rows]  # step 0 drawn at 0.5 on the log axis
        axes[0].plot(steps, [r["row_error"] for r in rows], ls=ls, color=color, marker=".",
                     label=f"{method}, T={T}, C={C}")
        axes[1].plot(steps, [r["gap"] for r in rows], ls=ls, color=color, marker=".", label=f"{method}, T={T}, C={C}")
for ax in axes:
    ax.axvline(20, color="gray", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("solver steps (step 0 drawn at 0.5; dotted: the authors' 20)")
    ax.legend(fontsize=8)
axes[0].set_ylabel("mean |row sum - 1| of the plan")
axes[0].set_title("Row error (columns are exact at every step)")
axes[1].set_yscale("log")
axes[1].set_ylabel("h(alpha) - value of the best assignment (>= 0)")
axes[1].set_title("Semi-dual value above the optimum (weak duality)")
fig.tight_layout()
plt.show()

# %% [markdown]
# With the constant step, Adam's row error falls and then stalls, and its $h$ stops falling (the
# last iterate circles the kink where the minimum of $h$ sits); the decaying step keeps going. At
# the authors' 20 steps both solvers are far from the optimum, with row errors over 0.1 and a few
# percent of the tokens without any mass: the plan the router uses is *not* the solution of
# eq. {eq}`eq-ch4-sparse` ({ref}`errata-liu-sparse-solver`). It has the right columns and sparsity,
# and only approximately one unit per token. The printout gives the numbers at each solver's
# default number of steps (20 and 100).

# %% [markdown]
# (nb05-soft)=
# ## Soft MoE: four properties
#
# {ref}`Proposition 4.7 <ch4-prop-soft>` on a `MoELayer` with the `soft_moe` router: three images of
# $T = 8$ tokens of width 16, $E = 4$ experts with 2 slots each, each image its own group.
#
# * **(c) batch independence:** replace the other two images; the output for image 0 does not move;
# * **(b) permutation equivariance:** permute the tokens of every image; the outputs are permuted
#   the same way;
# * **(d) small logits:** with the learned scale set to 0, $Z = 0$: every token of an image gets the
#   same output, $\frac1E\sum_r\mathrm{MLP}_r(\bar x)$ with $\bar x$ the image's mean token;
# * **(e) large logits:** with the scale at $10^4$, every slot's dispatch column is (nearly) one-hot,
#   and a token's output is the output of the token its best slot picked: often *another* token.
#   (The normalised logits are cosines times the scale; the scale must be large against the smallest
#   gap between the two best cosines of a slot, which the cell prints.)

# %%
torch.manual_seed(7)
soft_layer = MoELayer(16, 32, 4, "soft_moe", router_options=dict(slots_per_expert=2)).double().eval()
images = torch.randn(3, 8, 16, dtype=torch.float64)
with torch.no_grad():
    out = soft_layer(images, group_size=8)

    others = images.clone()
    others[1:] = torch.randn(2, 8, 16, dtype=torch.float64)
    moved_by_others = (soft_layer(others, group_size=8)[0] - out[0]).abs().max().item()
    assert moved_by_others < 1e-12

    perm = torch.randperm(8)
    equivariance = (soft_layer(images[:, perm], group_size=8) - out[:, perm]).abs().max().item()
    assert equivariance < 1e-12

    router = soft_layer.router
    router.scale.fill_(0.0)
    flat = soft_layer(images, group_size=8)
    mean_token = images.mean(1)  # (3, 16)
    expected = torch.stack([soft_layer.experts.forward_one(r, mean_token) for r in range(4)]).mean(0)
    zero_scale_error = (flat - expected[:, None, :]).abs().max().item()
    assert zero_scale_error < 1e-12

    router.scale.fill_(1e4)
    sharp = soft_layer(images, group_size=8)
    routing = soft_layer.last_routing
    assert (routing.slot_dispatch.amax(1) > 0.99).all(), "every slot takes one token"
    Z = router.slot_logits(images)  # (3, 8, 4, 2)
    top_two = (Z / router.scale).topk(2, dim=1).values
    smallest_gap = (top_two[:, 0] - top_two[:, 1]).min().item()
    best_slot = Z.flatten(-2).argmax(-1)  # (3, 8): the slot each token reads
    slot_token = Z.argmax(1).flatten(-2)  # (3, 8 slots): the token each slot takes
    source = slot_token.gather(-1, best_slot)  # whose output token t receives
    y_slots = torch.stack([soft_layer.experts.forward_one(r, images[g, slot_token[g].view(4, 2)[r]])
                           for g in range(3) for r in range(4)]).view(3, 4 * 2, 16)
    limit_error = (sharp - y_slots.gather(1, best_slot[..., None].expand(-1, -1, 16))).abs().max().item()
    assert limit_error < 1e-3
    router.scale.fill_(1.0)

# %%
print(f"(c) image 0's output after replacing the other images: changed by {moved_by_others:.1e}")
print(f"(b) permuted tokens: outputs permuted, up to {equivariance:.1e}")
print(f"(d) scale 0: every output = mean over experts of MLP_r(mean token), up to {zero_scale_error:.1e}")
print(f"(e) scale 1e4 (smallest gap between a slot's two best cosines {smallest_gap:.1e}): "
      f"largest dispatch weight per slot >= {routing.slot_dispatch.amax(1).min():.4f}; "
      f"output = the picked token's expert output up to {limit_error:.1e}; "
      f"{(source != torch.arange(8)).double().mean():.0%} of the tokens receive another token's output")

# %% [markdown]
# Part (e) is why Soft MoE at large scale is not expert choice: a token reads the slot it likes
# best, but that slot took whichever token *it* liked best. The learned scale sits between the two
# limits, and the normalisation of eq. (10) keeps it from drifting with the token norms
# ({ref}`errata-liu-soft-normalisation`).

# %% [markdown]
# The routers' structure is now checked without any training. {doc}`05b-six-routers-trained` trains a
# tiny Vision MoE with each of them at equal compute and asks which of the paper's orderings survive.
