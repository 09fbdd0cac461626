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
# # The MoE layer from scratch
#
# Companion to {doc}`../book/01-moe-layer`. We build the unified dispatch/combine tensors of
# Liu et al. for a small example, check that `minimoe`'s fast index path computes exactly eq. (2),
# and watch capacity turn into dropped tokens.
#
# *Run time:* under 10 seconds at CPU scale on a 2-core laptop CPU, the default. `MINIMOE_SCALE=gpu` chooses
# the larger configuration, for a GPU: the timing sweep of the two dispatch paths runs 1,024 to 16,384 tokens
# instead of 256 to 2,048, about 8 times the tokens in all (about 64 times the arithmetic of the einsum path,
# whose cost grows like $T^2$); nothing else changes.

# %%
# Install minimoe when it is missing (e.g. on Colab).
import importlib.util
import subprocess
import sys

if importlib.util.find_spec("minimoe") is None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                           "minimoe[book] @ git+https://github.com/minimoe-book/minimoe"])

# %%
import os
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import minimoe
from minimoe import MoELayer
from minimoe.ops import compute_capacity, token_choice_allocation

SCALE = os.environ.get("MINIMOE_SCALE", "cpu")  # "gpu" runs the larger configuration: chosen, never automatic
DEVICE = "cuda" if SCALE == "gpu" else "cpu"
torch.manual_seed(0)
print(f"SCALE={SCALE}, device={DEVICE}, minimoe {minimoe.__version__}, torch {torch.__version__}")

# %% [markdown]
# (nb01-scratch)=
# ## The whole layer from scratch
#
# Before using `minimoe`, we write the layer ourselves in plain PyTorch, step by step as chapter 1
# builds it: a gate and a softmax give each token a probability for each expert; each token picks
# its top $k$; the experts' $C$ slots are filled in token order, all first choices before any second
# choice, and a choice whose expert is full is dropped; the dispatch tensor $\mathbf D$ copies each
# kept token into its slot; each expert (a two-layer MLP) runs on its buffer; the combine tensor
# $\mathbf C = \mathbf D \cdot p$ brings the outputs back, weighted by the softmax.

# %% tags=["from-scratch"]
import torch
import torch.nn.functional as F


def moe_layer(x, gate_weight, w_in, b_in, w_out, b_out, k, capacity):
    """Top-k token choice with a capacity, then eq. (2): dispatch -> experts -> combine."""
    T, E = x.shape[0], gate_weight.shape[0]
    probs = torch.softmax(x @ gate_weight.T, dim=-1)                # (T, E) router probabilities
    choices = probs.topk(k, dim=-1).indices                         # (T, k) each token's experts
    slot = torch.full((T, E), -1)                                   # slot of token t at expert e
    filled = [0] * E
    for j in range(k):                                              # first choices before second ones
        for t in range(T):                                          # in token order
            e = int(choices[t, j])
            if filled[e] < capacity:                                # else: dropped
                slot[t, e], filled[e] = filled[e], filled[e] + 1
    D = torch.zeros(T, E, capacity, dtype=x.dtype)                  # dispatch tensor, 0 or 1
    t, e = (slot >= 0).nonzero(as_tuple=True)
    D[t, e, slot[t, e]] = 1.0
    C = D * probs[:, :, None]                                       # combine tensor: the gate weights
    buffers = torch.einsum("tec,td->ecd", D, x)                     # (E, C, d): each expert's input
    hidden = F.gelu(torch.einsum("ecd,edh->ech", buffers, w_in) + b_in[:, None])
    outputs = torch.einsum("ech,ehd->ecd", hidden, w_out) + b_out[:, None]
    return torch.einsum("tec,ecd->td", C, outputs), slot

# %% [markdown]
# The package's layer, with the same weights, computes the same thing. It never builds $\mathbf D$ or
# $\mathbf C$: it keeps each token's choices and copies rows into and out of the expert buffers
# (the index path, below).

# %%
torch.manual_seed(0)
layer = MoELayer(8, 16, 4, "softmax_topk", router_options={"k": 2, "capacity_factor": 1.0}).double()
x_small = torch.randn(12, 8, dtype=torch.float64)
capacity = compute_capacity(12, 4, 1.0, k=2)                        # round(1.0 * k * T / E) = 6
ex = layer.experts
with torch.no_grad():
    ours, our_slots = moe_layer(x_small, layer.router.gate.weight, ex.w_in, ex.b_in, ex.w_out, ex.b_out,
                                k=2, capacity=capacity)
    theirs = layer(x_small)
assert torch.equal(our_slots, layer.last_routing.position[0])
torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
print(f"12 tokens, 4 experts, k = 2, C = {capacity}: the same slots, outputs equal to {(ours - theirs).abs().max():.1e}")

# %% [markdown]
# (nb01-dispatch-combine)=
# ## Dispatch and combine tensors for eight tokens
#
# Eight tokens, three experts, top-1 token choice with capacity factor 1: each expert has
# $C = \mathrm{round}(8/3) = 3$ slots. The router returns a slot table (`position[t, e]` is the slot
# of token $t$ in expert $e$'s buffer, or $-1$); `dispatch_tensor()` and `combine_tensor()` rebuild
# the $T \times E \times C$ tensors $\mathbf D$ and $\mathbf C$ of eq. (2).

# %%
T, E, d = 8, 3, 4
layer = MoELayer(d, 8, E, "softmax_topk", router_options={"k": 1, "capacity_factor": 1.0}).double()
x = torch.randn(T, d, dtype=torch.float64)
with torch.no_grad():
    layer.router.gate.weight.mul_(3)  # sharper preferences, so some expert overflows
    out = layer(x)
routing = layer.last_routing
D, Cmb = routing.dispatch_tensor(), routing.combine_tensor()
print("capacity C =", routing.capacity, " D shape", tuple(D.shape))
print("first choice of each token:", routing.probs.argmax(-1).tolist())
print("slot table (rows: tokens, columns: experts; -1 = not dispatched):")
print(routing.position[0])

# %%
fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
for ax, tensor, title in [(axes[0], D[0], "dispatch $\\mathbf{D}$ (0/1)"),
                          (axes[1], Cmb[0], "combine $\\mathbf{C}$ (softmax weight)")]:
    im = ax.imshow(tensor.reshape(T, E * routing.capacity).detach(), cmap="Blues", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(E * routing.capacity))
    ax.set_xticklabels([f"e{e}\nc{c}" for e in range(E) for c in range(routing.capacity)], fontsize=7)
    for e in range(1, E):
        ax.axvline(e * routing.capacity - 0.5, color="k", lw=1)
    ax.set_xlabel("expert slot (expert e, slot c)")
    ax.set_ylabel("token t")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, fraction=0.05)
fig.suptitle("Top-1 token choice, 8 tokens, 3 experts, capacity 3")
fig.tight_layout()
plt.show()

# %% [markdown]
# Each column (a slot) holds at most one token, each row (a token) at most $k=1$ nonzero, and the
# combine tensor is the dispatch tensor times the token's softmax probability. A row with no
# entry is a **dropped** token: its preferred expert was full when its turn came.

# %%
dropped = (~routing.mask.any(-1))[0]
print("dropped tokens:", dropped.nonzero().flatten().tolist())
print("their MoE output is exactly zero:", bool((out[dropped] == 0).all()))
assert (D.sum(1) <= 1).all() and (D.sum((1, 3)) <= routing.capacity).all()
assert torch.equal(Cmb, D * routing.probs.unsqueeze(-1))

# %% [markdown]
# The slot table is not what the router handed the layer. A token-choice router makes only $k$
# choices per token, so it returns them as three $(T, k)$ tables: `choice_expert` (the expert of
# each choice), `choice_slot` (its slot, $-1$ when the choice was dropped) and `choice_weight` (its
# gate, $0$ when dropped). The $(T, E)$ tables `position` and `combine` were built from them when the
# cell above first read them; the layer's fast paths never build them.

# %%
print("token  expert  slot  weight   (slot -1, weight 0: the choice was dropped)")
for t in range(T):
    expert, slot = int(routing.choice_expert[0, t, 0]), int(routing.choice_slot[0, t, 0])
    print(f"{t:5d}  {expert:6d}  {slot:4d}  {float(routing.choice_weight[0, t, 0]):6.3f}")
rebuilt = torch.full((T, E), -1, dtype=torch.long).scatter(-1, routing.choice_expert[0], routing.choice_slot[0])
assert torch.equal(rebuilt, routing.position[0])
tokens, experts, k = 4096, 64, 1  # one training group of the router benchmark
print(f"at T = {tokens}, E = {experts}, k = {k}: choices {tokens * k * 3 * 8 / 2**10:.0f} KiB "
      f"(int64, int64, float64) against tables {tokens * experts * 2 * 8 / 2**20:.0f} MiB (int64, float64)")

# %% [markdown]
# (nb01-index-path)=
# ## The index path computes eq. (2)
#
# Eq. (2) as written contracts a $T\times E\times C$ tensor with the tokens: memory and time
# $O(TECd)$. `MoELayer(path="slots")` instead copies each dispatched token into its slot of a
# per-expert buffer, runs all experts with one batched matmul and scatter-adds the weighted outputs
# back. `path="grouped"` sorts the routed (token, expert) pairs by expert and runs each expert on its
# own contiguous segment, so no empty slot is computed. The default, `path="index"`, picks the faster
# of the two for the routing at hand (chapter 1, "Why capacity exists"). Below: the index path and
# the two layouts it picks from, against einsum (eq. 2) and a Python loop over experts, on random
# routers in float64, outputs *and* gradients.

# %%
def run(layer, x, path):
    layer.zero_grad()
    x = x.clone().requires_grad_(True)
    torch.manual_seed(1)
    out = layer.apply_routing(x, layer.router(x), path)
    (out * torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out)).sum().backward()
    return out.detach(), torch.cat([x.grad.flatten()] + [p.grad.flatten() for p in layer.parameters()])

rows = []
for name, options in [("softmax_topk", {"k": 1}), ("softmax_topk", {"k": 2, "capacity_factor": 0.5}),
                      ("softmax_topk", {"k": 2, "batch_priority": True}), ("expert_choice", {"capacity_factor": 2.0})]:
    layer = MoELayer(16, 32, 8, name, router_options=options).double()
    xg = torch.randn(4, 64, 16, dtype=torch.float64)
    out_e, g_e = run(layer, xg, "einsum")
    for path in ("index", "slots", "grouped", "loop"):
        out_p, g_p = run(layer, xg, path)
        rows.append((name, str(options), path, (out_p - out_e).abs().max().item(), (g_p - g_e).abs().max().item()))
print(f"{'router':14s} {'options':32s} {'path':8s} {'max|out-eq2|':>13s} {'max|grad-eq2|':>14s}")
for r in rows:
    print(f"{r[0]:14s} {r[1]:32s} {r[2]:8s} {r[3]:13.1e} {r[4]:14.1e}")
assert max(max(r[3], r[4]) for r in rows) < 1e-12

# %% [markdown]
# With capacity $C \ge T$ nothing is dropped and the layer is eq. (1) of Liu et al. evaluated token
# by token, $\sum_r \mathrm{Gate}_r(x)\,\mathrm{MLP}_r(x)$ with the top-$k$ softmax gates:

# %%
layer = MoELayer(16, 32, 8, "softmax_topk", router_options={"k": 2, "capacity_factor": 100.0}).double()
xt = torch.randn(40, 16, dtype=torch.float64)
with torch.no_grad():
    probs = torch.softmax(layer.router.gate(xt), -1)
    top = probs.topk(2, -1)
    eq1 = sum(top.values[:, j, None] * torch.stack([layer.experts.forward_one(int(e), xt[t:t + 1])[0]
                                                    for t, e in enumerate(top.indices[:, j])]) for j in range(2))
    print("max |layer - eq.(1)| =", (layer(xt) - eq1).abs().max().item())

# %% [markdown]
# The point of the index path is cost. The einsum path materialises two $T \times E \times C$
# tensors, so its memory grows like $T^2$ at a fixed capacity factor; the index path's buffer is
# $E \cdot C \approx kT$ rows. (`benchmarks/` measures this properly; here, a quick look.)

# %%
sizes = [256, 512, 1024, 2048] if SCALE == "cpu" else [1024, 2048, 4096, 8192, 16384]
E_t, d_t, h_t = 16, 64, 128
timings = {"index": [], "grouped": [], "einsum": [], "loop": []}
for n in sizes:
    layer = MoELayer(d_t, h_t, E_t, "softmax_topk", router_options={"k": 2}).to(DEVICE)
    xs = torch.randn(1, n, d_t, device=DEVICE, requires_grad=True)
    with torch.no_grad():  # time dispatch + experts + combine, not the router
        routing = layer.router(xs)
    for path in timings:
        best = float("inf")
        for _ in range(3):
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            layer.apply_routing(xs, routing, path).sum().backward()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        timings[path].append(best * 1e3)
fig, ax = plt.subplots(figsize=(5.5, 3.6))
for path, ms in timings.items():
    ax.plot(sizes, ms, marker="o", label=path)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("tokens per group T")
ax.set_ylabel("forward + backward time (ms, best of 3)")
ax.set_title(f"MoE layer paths, E={E_t}, d={d_t}, k=2, capacity factor 1")
ax.legend()
plt.show()

# %% [markdown]
# (nb01-grouped-path)=
# ### Dropless routing without padding
#
# Without a capacity (`capacity_factor=None`) every choice is kept, and slot buffers (`path="slots"`)
# must be as long as the *busiest* expert's queue: with unequal loads most of the $E \cdot C$ rows
# they multiply are empty. The grouped path multiplies exactly the $kT$ routed pairs, and the default
# `path="index"` switches to it when the padding would be large. Below, a dropless top-2 router whose
# logits favour the first experts: the rows each layout sends through the experts.

# %%
layer = MoELayer(16, 32, 8, "softmax_topk", router_options={"k": 2, "capacity_factor": None})
xd = torch.randn(1, 512, 16)
with torch.no_grad():
    skewed = layer.router.route(layer.router.gate(xd) + torch.linspace(2.0, 0.0, 8))
loads = skewed.tokens_per_expert()[0]
padded_rows = 8 * skewed.num_slots
print("tokens per expert:", loads.tolist())
print(f"slot buffers: 8 experts x {skewed.num_slots} slots = {padded_rows} rows; grouped path: "
      f"{int(loads.sum())} rows (k T = {2 * 512}); {padded_rows / int(loads.sum()):.1f}x fewer")
with torch.no_grad():
    torch.testing.assert_close(layer.apply_routing(xd, skewed, "grouped"), layer.apply_routing(xd, skewed, "slots"))
assert int(loads.sum()) == 2 * 512 < padded_rows

# %% [markdown]
# (nb01-capacity-dropping)=
# ## Capacity and dropping
#
# Now 512 tokens and 8 experts whose router logits carry a per-expert "popularity" offset (a few
# experts most tokens prefer). We sweep the capacity factor and count dropped tokens for top-1 and
# top-2 token choice and for expert choice. Expert choice fills every slot by construction; what
# it drops are the tokens *no* expert picked.

# %%
T2, E2 = 512, 8
gen = torch.Generator().manual_seed(0)
popularity = torch.tensor([2.0, 1.0, 0.5, 0.0, 0.0, -0.5, -1.0, -2.0])
logits = torch.randn(64, T2, E2, generator=gen) + popularity  # 64 random groups
probs = torch.softmax(logits, -1)
factors = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0]
curves = {"token choice, k=1": [], "token choice, k=2": [], "expert choice": []}
for f in factors:
    for label, k in [("token choice, k=1", 1), ("token choice, k=2", 2)]:
        pos = token_choice_allocation(probs, k, compute_capacity(T2, E2, f, k=k))
        curves[label].append(minimoe.metrics.drop_rate(pos >= 0).item())
    pos = minimoe.ops.expert_choice_allocation(probs, compute_capacity(T2, E2, f))
    curves["expert choice"].append(minimoe.metrics.drop_rate(pos >= 0).item())

fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
for label, ys in curves.items():
    axes[0].plot(factors, ys, marker="o", label=label)
axes[0].set_xlabel("capacity factor c  (C = round(c k T / E))")
axes[0].set_ylabel("fraction of tokens dropped")
axes[0].set_title("Dropped tokens vs capacity (skewed router)")
axes[0].legend()

wanted = torch.bincount(probs[0].argmax(-1), minlength=E2)
C1 = compute_capacity(T2, E2, 1.0)
kept = (token_choice_allocation(probs[0], 1, C1) >= 0).sum(0)
axes[1].bar(range(E2), wanted, color="lightgray", label="tokens whose first choice it is")
axes[1].bar(range(E2), kept, color="tab:blue", label="tokens kept (top-1, c = 1)")
axes[1].axhline(C1, color="tab:red", ls="--", label=f"capacity C = {C1}")
axes[1].set_xlabel("expert")
axes[1].set_ylabel("tokens")
axes[1].set_title("One group: overflow at popular experts")
axes[1].legend(fontsize=8)
fig.tight_layout()
plt.show()
print({k: [round(v, 3) for v in vs] for k, vs in curves.items()})

# %% [markdown]
# The same 64 groups check three results of the chapter exactly. Lemma 1.3: with $k = 1$, a token's
# slot is the number of earlier tokens whose choice is the same expert, and the token is dropped
# when that rank reaches $C$. Proposition 1.4: expert choice fills all $C$ slots of every expert.
# Lemma 1.3(d): top-1 drops exactly $\sum_e \max(0, n_e - C)$ tokens, $n_e$ the tokens that
# want expert $e$.

# %%
first = F.one_hot(probs.argmax(-1), E2)                    # (groups, T, E): each token's choice
rank = first.cumsum(-2) - first                           # earlier tokens with the same choice
queue_slot = torch.where((first == 1) & (rank < C1), rank, torch.full_like(rank, -1))
assert torch.equal(token_choice_allocation(probs, 1, C1), queue_slot)                       # Lemma 1.3
ec_slots = minimoe.ops.expert_choice_allocation(probs, C1)
assert ((ec_slots >= 0).sum(-2) == C1).all()                                                 # Prop. 1.4
dropped = (token_choice_allocation(probs, 1, C1) < 0).all(-1).sum(-1)
assert torch.equal(dropped, (first.sum(-2) - C1).clamp_min(0).sum(-1))                     # Prop. 1.5
print(f"64 groups: slots = queue ranks, expert choice fills all {E2} x {C1} slots, "
      f"top-1 drops {dropped.float().mean():.1f} tokens per group = the overflow")

# %% [markdown]
# Popular experts overflow and their extra tokens are dropped while unpopular experts sit partly
# empty: with top-1 token choice at $c=1$ a large share of the tokens is lost. That waste is what
# the auxiliary losses of chapter 1 (and the balanced routers of later chapters) fight. Expert
# choice never leaves a slot empty, but a token that no expert ranks among its top $C$ is dropped.
