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
# # The balanced-assignment estimators in an MoE layer
#
# Companion to {doc}`../book/05-balanced-assignments`, section {ref}`ch5-routers`. The piecewise-linear
# toy of {doc}`07-piecewise-linear-toy` has two experts, where every estimator is a closed form. Here the
# same estimators run with any number of experts inside {py:class}`minimoe.MoELayer`, through the
# routers `kool_skip` and `kool_gumbel_matching`, on a task whose right routing is imbalanced.
#
# **You will learn to**
#
# 1. train a layer with the skip and Gumbel-matching routers, the REINFORCE term of
#    {py:func}`minimoe.losses.reinforce_loss` and a moving-average baseline;
# 2. judge a routing by its purity and by the share of its largest expert, not by the MSE alone;
# 3. check that the layer's gradient is the chapter's unbiased estimator, coordinate by coordinate,
#    against the exact gradient.
#
# *Prerequisites:* chapter 5 through "The routers"; the estimators of {doc}`06b-unbiased-estimators`.
#
# *Run time:* about 15 seconds at CPU scale on a 2-core laptop CPU, the default. `MINIMOE_SCALE=gpu` chooses
# the larger configuration, for a GPU: 8 experts instead of 4, expert width 32 instead of 16, 512 tokens per
# batch instead of 64, 1,500 training steps instead of 5, 2 seeds instead of 1 — about 10,000 to 20,000 times
# the arithmetic of the CPU scale (the lower figure if only the chosen experts are evaluated).

# %%
# Install minimoe when it is missing (e.g. on Colab), and scipy, which this notebook also uses.
import importlib.util
import subprocess
import sys

if importlib.util.find_spec("minimoe") is None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                           "minimoe[book] @ git+https://github.com/minimoe-book/minimoe", "scipy"])

# %%
import math
import os
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from minimoe import MoELayer
from minimoe.losses import reinforce_loss

SCALE = os.environ.get("MINIMOE_SCALE", "cpu")  # "gpu" runs the larger configuration: chosen, never automatic
if SCALE == "cpu":
    torch.set_num_threads(1)  # small tensors: one thread is as fast as two, and robust to a busy machine
    MOE = dict(n_experts=4, d_model=8, d_hidden=16, tokens=64, steps=5, seeds=(0,), lr=1e-2)
else:
    MOE = dict(n_experts=8, d_model=8, d_hidden=32, tokens=512, steps=1500, seeds=(0, 1), lr=1e-2)
# float64 throughout: importance weights reach 1e3 and more. MPS has no float64, so GPU means CUDA.
DEVICE = torch.device("cuda" if SCALE == "gpu" and torch.cuda.is_available() else "cpu")
DTYPE = torch.float64
print(f"SCALE={SCALE}, device={DEVICE}, MoE={MOE}")
NOTEBOOK_START = time.perf_counter()

# %% [markdown]
# (nb07-moe-layer)=
# ## The task
#
# The task has a known, imbalanced optimal routing. Tokens come from $E$ clusters whose sizes follow
# a Zipf law ($\propto 1/r$); the target is a different linear map in each cluster, plus noise of
# variance $0.01$. One expert per cluster is the right routing, and it puts about
# $1/H_E$ of the tokens on the first expert ($H_E = \sum_{r\le E}1/r$; 37% for $E = 8$), while
# capacity $c = n/E$ allows $1/E$. We train a single MoE layer (no residual) with an exponential-moving-average baseline,
# and evaluate with argmax routing and no capacity, as the routers do in `eval()` mode. Besides the
# MSE we report the **purity** of the routing: the fraction of tokens sent to the expert that most of
# their cluster goes to. The Switch router (top-1 softmax gate, capacity factor 1, balance loss 0.01,
# token dropping in training) is the differentiable-gating reference.
#
# What to look for: an unbiased estimator (Skip IW, GM IW) should learn the imbalanced routing, with
# purity near 1 and the largest expert near the largest cluster's share, while the biased ones are
# pulled towards the balanced samples they see. The MSE says less: an expert MLP can fit more than
# one cluster's linear map. Gumbel-matching is solved exactly by linear assignment on the host
# (`method="assignment"`): cycle cancelling from a greedy start needs more passes as the router grows
# confident and the right split moves away from balance. At CPU scale this is a smoke run of a few
# steps that only shows the API at work; its numbers mean nothing.

# %%
MOE_ROUTERS = {
    "Sample (no capacity)": ("kool_skip", dict(capacity_factor=None, tau=1.0, estimator="skip_iw")),
    "Skip IW, τ=1": ("kool_skip", dict(capacity_factor=1.0, tau=1.0, estimator="skip_iw")),
    "Skip (biased), τ=1": ("kool_skip", dict(capacity_factor=1.0, tau=1.0, estimator="skip")),
    "GM IW, τ=3": ("kool_gumbel_matching", dict(capacity_factor=1.0, tau=3.0, estimator="gm_iw", method="assignment")),
    "GM (biased), τ=3": ("kool_gumbel_matching", dict(capacity_factor=1.0, tau=3.0, estimator="gm", method="assignment")),
    "Switch top-1 + LB": ("softmax_topk", dict(k=1, capacity_factor=1.0, balance_loss="switch")),
}


def make_cluster_task(n_experts, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sizes = 1 / torch.arange(1, n_experts + 1, dtype=DTYPE)
    task = SimpleNamespace(probs=sizes / sizes.sum(),
                           centres=4 * F.normalize(torch.randn(n_experts, d, generator=gen, dtype=DTYPE), dim=-1),
                           maps=torch.randn(n_experts, d, d, generator=gen, dtype=DTYPE) / math.sqrt(d))

    def sample(n, generator):
        cluster = torch.multinomial(task.probs, n, replacement=True, generator=generator)
        x = task.centres[cluster] + 0.5 * torch.randn(n, d, generator=generator, dtype=DTYPE)
        y = torch.einsum("nij,nj->ni", task.maps[cluster], x) + 0.1 * torch.randn(n, d, generator=generator, dtype=DTYPE)
        return x.to(DEVICE), y.to(DEVICE), cluster.to(DEVICE)

    task.sample = sample
    return task


def purity(expert, cluster, n_experts):
    counts = torch.zeros(n_experts, n_experts, device=expert.device).index_put_(
        (cluster, expert), torch.ones_like(expert, dtype=torch.float), accumulate=True)
    return float(counts.max(1).values.sum() / counts.sum())


# %%
task = make_cluster_task(MOE["n_experts"], MOE["d_model"])
x_eval, y_eval, cluster_eval = task.sample(4096, torch.Generator().manual_seed(99))
moe_results = {}
for label, (router, options) in MOE_ROUTERS.items():
    for seed in MOE["seeds"]:
        torch.manual_seed(seed)
        options = dict(options)
        if router.startswith("kool"):
            options["generator"] = torch.Generator(device=DEVICE).manual_seed(seed)
        layer = MoELayer(MOE["d_model"], MOE["d_hidden"], MOE["n_experts"], router,
                         router_options=options).to(DEVICE, DTYPE)
        optimizer = torch.optim.Adam(layer.parameters(), lr=MOE["lr"])
        data_gen = torch.Generator().manual_seed(1000 + seed)
        ema, start = None, time.perf_counter()
        for step in range(MOE["steps"]):
            x, y, _ = task.sample(MOE["tokens"], data_gen)
            per_token = ((layer(x) - y) ** 2).mean(-1)
            ema = per_token.mean().detach() if ema is None else ema
            loss = per_token.mean() + layer.aux_loss + reinforce_loss(layer, per_token, baseline=ema)
            ema = 0.99 * ema + 0.01 * per_token.mean().detach()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        layer.eval()
        if router == "softmax_topk":
            layer.router.capacity_factor = None  # evaluate every router by its argmax, without capacity
        with torch.no_grad():
            mse = float(((layer(x_eval) - y_eval) ** 2).mean())
            chosen = layer.last_routing.probs.reshape(-1, MOE["n_experts"]).argmax(-1)
        moe_results[(label, seed)] = dict(mse=mse, purity=purity(chosen, cluster_eval, MOE["n_experts"]),
                                          top_share=float(torch.bincount(chosen, minlength=MOE["n_experts"]).max()) / len(chosen),
                                          seconds=time.perf_counter() - start)
print(f"{MOE['n_experts']} experts, {MOE['tokens']} tokens per batch (capacity {MOE['tokens'] // MOE['n_experts']}), "
      f"{MOE['steps']} steps; the right routing gives the largest cluster {float(task.probs[0]):.0%} of the tokens")
print(f"{'router':24s} {'eval MSE':>10s} {'purity':>8s} {'largest expert':>15s} {'s/run':>7s}")
for label in MOE_ROUTERS:
    rows = [moe_results[(label, s)] for s in MOE["seeds"]]
    print(f"{label:24s} {np.mean([r['mse'] for r in rows]):10.4f} {np.mean([r['purity'] for r in rows]):8.3f}"
          f" {np.mean([r['top_share'] for r in rows]):15.0%} {np.mean([r['seconds'] for r in rows]):7.1f}")
    assert all(np.isfinite(r["mse"]) for r in rows), label

# %% [markdown]
# Before trusting any of these numbers: is the layer's gradient the chapter's estimator? For a
# separable loss (one MoE layer, no attention: {ref}`separability <ch5-separable>`) it must be unbiased. We feed
# 4,000 independent groups of the same 6 tokens through one batched forward ($E = 3$, $c = 2$,
# $\tau = 1$), average the gradients of the router's gate and of the experts' output biases, and
# compare with the exact gradient of $\mathbb E_p\frac1T\sum_t\lVert\mathrm{expert}_{z_t}(x_t) - y_t\rVert^2$
# (a sum over each token's experts). The per-group estimates come from the same hand formula that
# the tests check against autograd; every coordinate must be within 4.5 standard errors.

# %%
def layer_gradient_z(name, groups=4_000, T=6, E=3, d=3):
    torch.manual_seed(2)
    layer = MoELayer(d, 4, E, name, router_options={"tau": 1.0, "generator": torch.Generator().manual_seed(0)},
                     group_size=T).double()
    x1, y1 = torch.randn(1, T, d, dtype=DTYPE), torch.randn(1, T, d, dtype=DTYPE)
    out = layer(x1.expand(groups, T, d).contiguous())
    per_token = ((out - y1) ** 2).sum(-1)
    (per_token.mean() + reinforce_loss(layer, per_token)).backward()
    got = torch.cat([layer.router.gate.weight.grad.flatten(), layer.experts.b_out.grad.flatten()])
    routing = layer.last_routing
    w, mask = routing.reinforce_weight, routing.mask.double()
    with torch.no_grad():
        p = torch.softmax(layer.router.gate(x1), -1)[0]
        outs = torch.stack([layer.experts.forward_one(e, x1[0]) for e in range(E)], 1)
        table = ((outs - y1[0][:, None]) ** 2).sum(-1)
        f = (mask * table).sum(-1)
        z = mask.argmax(-1)
        gate = torch.einsum("gt,gte,td->ged", w * f, F.one_hot(z, E).double() - p, x1[0]) / T
        bias = torch.einsum("gt,gte,ted->ged", w, mask, 2 * (outs - y1[0][:, None])) / T
        per_group = torch.cat([gate.flatten(1), bias.flatten(1)], 1)
        assert torch.allclose(per_group.mean(0), got, atol=1e-10), "the layer's gradient is the hand formula"
        exact = torch.cat([torch.einsum("te,td->ed", p * (table - (p * table).sum(-1, keepdim=True)), x1[0]).flatten(),
                           torch.einsum("te,ted->ed", p, 2 * (outs - y1[0][:, None])).flatten()]) / T
    return float(((got - exact) / (per_group.std(0) / math.sqrt(groups))).abs().max())


for name in ("kool_skip", "kool_gumbel_matching"):
    worst = layer_gradient_z(name)
    print(f"{name}: layer gradient vs exact gradient, max |z| = {worst:.2f} over the gate and expert-bias coordinates")
    assert worst < 4.5

# %%
if MOE["steps"] >= 500:  # at GPU scale the runs are long enough to read the routing
    right = float(task.probs[0])
    for label in ("Skip IW, τ=1", "GM IW, τ=3", "Skip (biased), τ=1", "GM (biased), τ=3"):
        share = np.mean([moe_results[(label, s)]["top_share"] for s in MOE["seeds"]])
        pure = np.mean([moe_results[(label, s)]["purity"] for s in MOE["seeds"]])
        print(f"  MoE layer, {label}: largest expert {share:.0%} (right routing {right:.0%}), purity {pure:.3f}")
print(f"notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s")
