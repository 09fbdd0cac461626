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
# # ProbMoE's router gradient: DenseMixer from scratch and the gradient lab
#
# Companion to {doc}`../book/07-probabilistic-routing`. ProbMoE (Zhao, Shao, Van den Broeck & Zeng)
# treats a token's set of experts $S$ as a random variable. In training it draws $S$ exactly from the
# $k$-subset law $P_r(S) \propto \exp\big(\sum_{j\in S} r_j\big)$, $|S| = k$, runs only the sampled
# experts, and gives the router a gradient through the exact inclusion marginals
# $m_j = P(j \in S)$ with the straight-through weights $w = (z + m - \mathrm{sg}(m)) \odot
# \mathrm{softmax}(r)$. At evaluation it takes the most probable set: the top-$k$. Here we compare
# its router gradient with those of the paper's two baselines, conventional top-$k$ and DenseMixer,
# on a layer small enough to enumerate every subset (the paper's Appendix F, with a stated
# protocol). {doc}`11b-probmoe-training` trains the toy LM with each router.
#
# **You will learn to**
#
# 1. write DenseMixer's layer from scratch (the sparse value with the dense gradient) and show it
#    equal to `minimoe`'s;
# 2. compute the exact gradient of the expected loss by enumerating subsets, and measure each
#    estimator's bias, variance and single-draw error against it;
# 3. see that ProbMoE's straight-through estimate is biased even for a linear loss, where the
#    paper's eq. (8) is exact.
#
# *Prerequisites:* chapter 7 through "Gradients"; the $k$-subset marginals of
# {doc}`10-ksubset-dp-from-scratch`.
#
# *Run time:* about 15 seconds at CPU scale on a 2-core laptop CPU, the default. `MINIMOE_SCALE=gpu` chooses
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
import itertools
import math
import os
import time

import matplotlib.pyplot as plt
import numpy as np
import torch

from minimoe import MoELayer
from minimoe.ops import ksubset_covariance, ksubset_log_partition, ksubset_marginals, ksubset_sample
from minimoe.routers import build

SCALE = os.environ.get("MINIMOE_SCALE", "cpu")  # "gpu" runs the larger configuration: chosen, never automatic
# The lab enumerates every subset of a small layer in float64 on the CPU, so both scales run the same
# cells; the GPU configuration is the training study of 11b.
torch.set_num_threads(1)  # tiny matrices: one thread is faster than two, and robust to a busy machine
print(f"SCALE={SCALE}")
NOTEBOOK_START = time.perf_counter()

# %% [markdown]
# (nb11-scratch)=
# ## DenseMixer from scratch
#
# DenseMixer (chapter 7, "Baselines") routes like softmax top-$k$, but in training its router
# learns as if top-$k$ were not there: the layer runs *every* expert on every token, and returns
# the sparse output's value with the dense mixture's gradient. Each expert still learns only from
# the tokens routed to it, so its outputs elsewhere enter detached. This is a layer, not a router
# alone: the rule lives in the router's `adjust_output` (chapter 1, "A router carries its own rules").

# %% tags=["from-scratch"]
import torch


def densemixer_layer(x, gate_weight, expert, n_experts, k):
    """Top-k in the value, sum over all experts in the router's gradient."""
    probs = torch.softmax(x @ gate_weight.T, -1)
    mask = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, probs.topk(k, -1).indices, True)
    y = torch.stack([expert(e, x) for e in range(n_experts)])            # (E, T, d): every expert
    y = torch.where(mask.T[..., None], y, y.detach())                      # experts learn from their tokens
    sparse = torch.einsum("te,etd->td", probs * mask, y)                   # the value: plain top-k
    dense = torch.einsum("te,etd->td", probs, y)                           # the gradient: every expert
    return sparse.detach() + dense - dense.detach()

# %%
torch.manual_seed(0)
layer = MoELayer(8, 16, 4, "densemixer", router_options={"k": 2}).double().train()
x_small, probe = torch.randn(1, 24, 8, dtype=torch.float64), torch.randn(1, 24, 8, dtype=torch.float64)
weights = (layer.router.gate.weight, layer.experts.w_in, layer.experts.w_out)
theirs = torch.autograd.grad((layer(x_small) * probe).sum(), weights)
out = densemixer_layer(x_small[0], layer.router.gate.weight, layer.experts.forward_one, 4, 2)
ours = torch.autograd.grad((out * probe[0]).sum(), weights)
with torch.no_grad():
    torch.testing.assert_close(out, layer(x_small)[0], rtol=0, atol=1e-12)
for a, b in zip(ours, theirs):
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
print("the same output, and the same gradients for the gate and both expert weight tensors")

# %% [markdown]
# (nb11-gradients)=
# ## The gradient lab
#
# The objective ProbMoE differentiates is the expected loss over the subset law (the paper's Eq. 3),
#
# $$J(r) = \sum_t \mathbb{E}_{S_t \sim P_{r_t}}\big[L_t(y_{S_t})\big], \qquad
# y_S = \sum_{j \in S} \pi_j f_j(x_t), \quad \pi = \mathrm{softmax}(r_t).$$
#
# For a few tokens and a few experts we can compute its gradient with respect to the router logits
# exactly, by enumerating all $\binom{E}{k}$ subsets with their exact probabilities. The layer is a
# {py:class}`minimoe.MoELayer` with fixed random expert MLPs (width 8, hidden width 16), random
# token inputs, and the loss $L_t = \tfrac12\lVert y_t - \text{target}_t\rVert^2$ to a fixed random
# target. The gate weight is drawn so that the logits have standard deviation $\sigma$ ("logit
# scale"). The paper's Appendix F does not give its loss, its expert outputs, what its "true
# gradient" is, nor its definitions of bias and variance. **Our protocol** (our choice, since the paper gives none): the
# target is $g^* = \nabla_r J$ by enumeration. For estimates $\hat g_s$ from $N$ draws with mean
# $\bar g$, all flattened over the $T \times E$ logits,
#
# * bias $= 1 - \cos(\bar g, g^*)$,
# * variance $= \mathrm{mean}_s\big(1 - \cos(\hat g_s, \bar g)\big)$,
# * error $= \mathrm{mean}_s\big(1 - \cos(\hat g_s, g^*)\big)$, the quality of a single draw.
#
# Since a deterministic estimator's bias can be computed exactly, and a stochastic one's expectation
# $\mathbb{E}[\hat g] = \sum_S P(S)\,\hat g(S)$ can be enumerated too, we also print the **exact
# bias** $1 - \cos(\mathbb{E}[\hat g], g^*)$, free of Monte Carlo noise.
#
# | estimator | subset in the forward pass | router gradient |
# |---|---|---|
# | top-$k$ (conventional) | top-$k$ | through $\pi_j$ of the chosen experts only |
# | DenseMixer | top-$k$ | $\sum_{j=1}^{E} \delta_j\, \partial\pi_j/\partial r$: every expert's output, as if top-$k$ were the identity |
# | ProbMoE | a draw of the $k$-subset law | through $\pi_j$ and through the marginals: $\sum_{j \in S} \delta_j (\partial\pi_j/\partial r + \pi_j \mathrm{Cov}(z, z_j))$ |
# | REINFORCE | a draw of the $k$-subset law | pathwise term plus $(z - m)(L_t - b_t)$, the score function with a baseline $b_t$ = the loss of the top-$k$ set (fixed, so unbiased) |
# | top-$k$ + marginal | top-$k$ | ProbMoE's straight-through with the deterministic top-$k$ mask (paper's Fig. 2 hybrid) |
# | sample + dense STE | a draw | DenseMixer's backward on a sampled set (paper's Fig. 2 hybrid) |
#
# Here $\delta_j = \langle \partial L/\partial y, f_j(x)\rangle$. REINFORCE is not in the paper; it
# is here as the unbiased reference. The first cell writes each estimator as a few lines of
# autograd and checks them against what the package's {py:class}`~minimoe.MoELayer` computes with
# the routers `softmax_topk`, `densemixer` and `probmoe_exact`.

# %%
DT = torch.float64
LAB_D, LAB_H = 8, 16            # token width and expert hidden width of the small layer
LAB_INSTANCES, LAB_DRAWS = 10, 10_000  # the paper: 10 seeds, 10,000 samples
LAB_SETTINGS = {                 # name: (E, k, T tokens, logit scale sigma)
    "E=8 k=2, σ=1": (8, 2, 8, 1.0),
    "E=8 k=2, σ=3": (8, 2, 8, 3.0),
    "E=10 k=5, σ=1 (paper's size)": (10, 5, 10, 1.0),
}
ESTIMATORS = {                   # name: (forward subset, backward)
    "top-k": ("top", "pathwise"),
    "DenseMixer": ("top", "dense"),
    "ProbMoE": ("sample", "marginal"),
    "REINFORCE": ("sample", "score"),
    "top-k + marginal": ("top", "marginal"),
    "sample + dense STE": ("sample", "dense"),
}


def all_subsets(E, k):
    """Every k-subset of E experts as a bool mask, (C(E, k), E)."""
    masks = torch.zeros(math.comb(E, k), E, dtype=torch.bool)
    for i, subset in enumerate(itertools.combinations(range(E), k)):
        masks[i, list(subset)] = True
    return masks


def make_instance(seed, E, k, T, sigma):
    """A MoE layer with fixed random experts, T random tokens and targets, gate logits of scale sigma."""
    torch.manual_seed(seed)
    layer = MoELayer(LAB_D, LAB_H, E, "softmax_topk", router_options={"k": k, "capacity_factor": None}).to(DT)
    with torch.no_grad():
        layer.router.gate.weight.normal_(0, sigma / math.sqrt(LAB_D))
        x = torch.randn(T, LAB_D, dtype=DT)
        target = torch.randn(T, LAB_D, dtype=DT)
        outputs = layer.experts(x.expand(E, T, LAB_D)).transpose(0, 1).contiguous()  # f_j(x_t): (T, E, d)
        r = layer.router.gate(x)
    top = torch.zeros_like(r, dtype=torch.bool).scatter(-1, r.topk(k, -1).indices, True)
    inst = dict(layer=layer, x=x, target=target, outputs=outputs, r=r, k=k, top=top)
    inst["baseline"] = token_losses(top[None] * torch.softmax(r, -1), inst)[0]  # REINFORCE's b_t
    return inst


def token_losses(weights, inst):
    """L_t for combine weights (N, T, E): (N, T)."""
    y = torch.einsum("nte,ted->ntd", weights, inst["outputs"])
    return 0.5 * ((y - inst["target"]) ** 2).sum(-1)


# %%
def estimates(inst, masks, backward):
    """One router-gradient estimate per row of masks (N, T, E): (N, T, E)."""
    N = masks.shape[0]
    r = inst["r"].expand(N, -1, -1).clone().requires_grad_(True)  # one copy per draw: per-draw gradients
    probs = torch.softmax(r, -1)
    z = masks.to(DT)
    if backward in ("pathwise", "score"):
        losses = token_losses(z * probs, inst)
    elif backward == "marginal":  # ProbMoE eq. 7 with the package's exact marginals (custom backward);
        m = ksubset_marginals(r, inst["k"])  # only the experts in S run, so only their weights are used
        losses = token_losses(z * (z + m - m.detach()) * probs, inst)
    elif backward == "dense":  # the value of the sparse output, the gradient of sum_e pi_e f_e
        sparse = torch.einsum("nte,ted->ntd", z * probs, inst["outputs"])
        dense = torch.einsum("nte,ted->ntd", probs, inst["outputs"])
        y = sparse.detach() + dense - dense.detach()
        losses = 0.5 * ((y - inst["target"]) ** 2).sum(-1)
    g = torch.autograd.grad(losses.sum(), r)[0]
    if backward == "score":  # grad log P(S) = z - m for the k-subset law
        with torch.no_grad():
            g = g + (z - ksubset_marginals(inst["r"], inst["k"])) * (losses - inst["baseline"])[..., None]
    return g


def exact_gradient(inst):
    """g* = grad of sum_t E_S[L_t] by enumeration, and the exact law P (T, C) over the subsets."""
    E, k = inst["r"].shape[-1], inst["k"]
    subsets = all_subsets(E, k)
    r = inst["r"].clone().requires_grad_(True)
    log_p = r @ subsets.to(DT).T - ksubset_log_partition(r, k)[:, None]  # (T, C)
    losses = token_losses(subsets[:, None, :] * torch.softmax(r, -1), inst)  # (C, T)
    J = (log_p.exp() * losses.T).sum()
    return torch.autograd.grad(J, r)[0], log_p.detach().exp(), subsets


def exact_expectation(inst, backward, law, subsets):
    """E[g_hat] = sum_S P(S) g_hat(S), token by token (every token uses subset c in 'draw' c)."""
    masks = subsets[:, None, :].expand(-1, inst["r"].shape[0], -1)
    return (law.T[..., None] * estimates(inst, masks, backward)).sum(0)


def cos(a, b):
    a, b = a.flatten(-2), b.flatten(-2)
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


def draw_masks(inst, n, seed):
    gen = torch.Generator().manual_seed(seed)
    return ksubset_sample(inst["r"].expand(n, -1, -1), inst["k"], generator=gen)


# %%
# The estimators are what the package computes: gradient of the gate weight from a real MoELayer
# forward/backward with each router, against x^T (our logit gradient) for the same subset.
inst = make_instance(0, 8, 2, 8, 1.0)
W = inst["layer"].router.gate.weight.detach().clone()
for router, options, backward in [("softmax_topk", {"capacity_factor": None}, "pathwise"),
                                  ("densemixer", {}, "dense"), ("probmoe_exact", {}, "marginal")]:
    layer = inst["layer"]
    layer.router = build(router, LAB_D, 8, k=2, **options).to(DT).train()
    with torch.no_grad():
        layer.router.gate.weight.copy_(W)
    loss = 0.5 * ((layer(inst["x"]) - inst["target"]) ** 2).sum()
    layer.zero_grad()
    loss.backward()
    mask = layer.last_routing.mask.reshape(inst["r"].shape)  # the subset the layer used (a draw for probmoe_exact)
    ours = estimates(inst, mask[None], backward)[0]
    assert torch.allclose(layer.router.gate.weight.grad, ours.T @ inst["x"], atol=1e-10), router
    assert router == "probmoe_exact" or torch.equal(mask, inst["top"])
print("the lab's top-k, DenseMixer and ProbMoE gradients equal MoELayer's gate gradients with the package's routers")

# %% [markdown]
# Now every setting, with `LAB_INSTANCES` random instances each (new experts, tokens, targets and
# gate) and `LAB_DRAWS` draws for the stochastic estimators. Each cell of the table is the mean over
# instances ± the standard deviation over instances, as in the paper's Table 7.

# %%
FOCUS = "E=8 k=2, σ=1"  # the setting of the convergence test and of the error-vs-draws plot
lab_start = time.perf_counter()
lab = {}  # (setting, estimator) -> list of per-instance dicts
lab_instances = {}
for setting, (E, k, T, sigma) in LAB_SETTINGS.items():
    for i in range(LAB_INSTANCES):
        inst = make_instance(1000 + i, E, k, T, sigma)
        g_star, law, subsets = exact_gradient(inst)
        sampled = draw_masks(inst, LAB_DRAWS, seed=i)
        inst.update(g_star=g_star, law=law, subsets=subsets)
        lab_instances[(setting, i)] = inst
        for name, (forward, backward) in ESTIMATORS.items():
            g = estimates(inst, sampled if forward == "sample" else inst["top"][None], backward)
            g_bar = g.mean(0)
            g_exp = g_bar if forward == "top" else exact_expectation(inst, backward, law, subsets)
            row = dict(bias=float(1 - cos(g_bar, g_star)), var=float((1 - cos(g, g_bar)).mean()),
                       err=float((1 - cos(g, g_star)).mean()), exact_bias=float(1 - cos(g_exp, g_star)))
            row = {key: max(value, 0.0) for key, value in row.items()}  # 1 - cos >= 0 up to rounding
            if name == "REINFORCE":  # unbiased: its exact expectation is the exact gradient
                assert torch.allclose(g_exp, g_star, atol=1e-12 * float(g_star.abs().max())), "REINFORCE is unbiased"
            if forward == "top":
                assert row["var"] < 1e-12, "deterministic given the logits"
            if name == "ProbMoE" and setting == FOCUS:
                row["draws"] = g  # kept for the error-vs-draws plot below
            # every estimator's rows sum to 0: blind to a common shift of a token's logits, like g*
            assert g.sum(-1).abs().max() < 1e-9 * float(g.abs().max()) + 1e-12, name
            lab.setdefault((setting, name), []).append(row)
        assert g_star.sum(-1).abs().max() < 1e-12


def lab_stat(setting, name, key):
    values = np.array([row[key] for row in lab[(setting, name)]])
    return values.mean(), values.std(), values


# %%
PAPER_TABLE7 = {"ProbMoE": (0.0702, 0.0426, 0.0076, 0.0110, 0.0967, 0.0659),
                "DenseMixer": (0.1052, 0.0839, 0.0201, 0.0427, 0.1349, 0.0995)}
for setting in LAB_SETTINGS:
    print(f"\n{setting}: {LAB_INSTANCES} instances, {LAB_DRAWS} draws")
    print(f"  {'estimator':20s} {'bias':>17s} {'exact bias':>17s} {'variance':>17s} {'error':>17s}")
    for name in ESTIMATORS:
        cells = [lab_stat(setting, name, key)[:2] for key in ("bias", "exact_bias", "var", "err")]
        print(f"  {name:20s} " + " ".join(f"{m:8.4f} ±{s:7.4f}" for m, s in cells))
    if "paper" in setting:
        for name, (bm, bs, vm, vs, em, es) in PAPER_TABLE7.items():
            print(f"  {'paper: ' + name:20s} {bm:8.4f} ±{bs:7.4f} {'':>17s} {vm:8.4f} ±{vs:7.4f} {em:8.4f} ±{es:7.4f}")
print(f"\nlab: {time.perf_counter() - lab_start:.1f} s")

# %%
# Computed comparisons: which single estimate is closer to the exact gradient?
LAB_VERDICT = {}
for setting in LAB_SETTINGS:
    pm, dm = lab_stat(setting, "ProbMoE", "err")[2], lab_stat(setting, "DenseMixer", "err")[2]
    tk, rf = lab_stat(setting, "top-k", "err")[2], lab_stat(setting, "REINFORCE", "err")[2]
    pb = lab_stat(setting, "ProbMoE", "exact_bias")[2]
    LAB_VERDICT[setting] = dict(dense_wins=int((dm < pm).sum()), probmoe_beats_topk=int((pm < tk).sum()),
                                probmoe_beats_reinforce=int((pm < rf).sum()),
                                bias_share=float(np.mean(pb / pm)))
    v = LAB_VERDICT[setting]
    print(f"{setting:30s}: DenseMixer's error below one ProbMoE draw's on {v['dense_wins']}/{LAB_INSTANCES} "
          f"instances; ProbMoE below top-k on {v['probmoe_beats_topk']}/{LAB_INSTANCES}, below REINFORCE on "
          f"{v['probmoe_beats_reinforce']}/{LAB_INSTANCES}; ProbMoE's exact bias is {v['bias_share']:.1%} of its error")
assert all((lab_stat(s, "ProbMoE", "exact_bias")[2] > 1e-7).all() for s in LAB_SETTINGS), "ProbMoE is biased"
assert all(v["bias_share"] < 0.2 for v in LAB_VERDICT.values()), "one draw's error is mostly variance"
assert all(lab_stat(s, "DenseMixer", "err")[0] < lab_stat(s, "ProbMoE", "err")[0] for s in LAB_SETTINGS), \
    "under this protocol DenseMixer's deterministic error is below one ProbMoE draw's, on average"

# %% [markdown]
# What the table says, and what it does not:
#
# * **ProbMoE's estimator is biased, but only slightly.** Its exact bias is positive on every
#   instance (asserted), and REINFORCE's is zero to rounding (asserted). Chapter 7 ({ref}`ch7-st`)
#   shows why: the estimator counts an expert's credit $\delta_j$ only when that expert is sampled, so
#   it is biased even for a loss linear in the layer's output, and the quadratic loss here is no
#   exception. The bias is a small fraction of a single draw's error (printed, and asserted below
#   20%): one draw's error is almost all variance.
# * **DenseMixer has no variance at all**: it is a deterministic function of the logits. Whether its
#   bias is smaller than the error of *one* ProbMoE draw is what matters for a training step that
#   draws once. Under our protocol DenseMixer's error is the smaller one on average in every setting
#   (asserted); the verdict lines count it instance by instance. The paper's Table 7 reports
#   the opposite ordering, with a nonzero variance for DenseMixer, so its protocol must differ from
#   ours in ways the paper does not state (perhaps a random element we do not have, or a different
#   target gradient). We do not reproduce Table 7, and we do not claim that it is wrong.
# * **REINFORCE** is unbiased, and per draw it is usually noisier than ProbMoE even with a baseline
#   (the verdict lines count how often): the usual trade. The conventional top-$k$ gradient ignores every unchosen expert and is deterministic.
#
# The next cell makes the bias visible by brute force. It takes the instance where ProbMoE's exact
# bias is largest and averages many more draws: the mean of the REINFORCE estimates must converge to
# $g^*$, the mean of the ProbMoE estimates to its own expectation $\mathbb{E}[\hat g] \ne g^*$. The
# test is the largest per-component $z$-score, $\max_i |\bar g_i - g_i| / \mathrm{se}_i$ over the
# $T \times E$ components.

# %%
BIG_DRAWS, CHUNK = 200_000, 50_000
focus = max(range(LAB_INSTANCES), key=lambda i: lab[(FOCUS, "ProbMoE")][i]["exact_bias"])
inst = lab_instances[(FOCUS, focus)]
sums = {name: [0.0, 0.0] for name in ("ProbMoE", "REINFORCE")}
for c in range(BIG_DRAWS // CHUNK):
    masks = draw_masks(inst, CHUNK, seed=10_000 + c)
    for name in sums:
        g = estimates(inst, masks, ESTIMATORS[name][1])
        sums[name][0] += g.sum(0)
        sums[name][1] += (g ** 2).sum(0)
big = {}
for name, (s1, s2) in sums.items():
    mean = s1 / BIG_DRAWS
    se = ((s2 / BIG_DRAWS - mean ** 2) * BIG_DRAWS / (BIG_DRAWS - 1) / BIG_DRAWS).sqrt()
    big[name] = dict(mean=mean, se=se, z_exact=((mean - inst["g_star"]) / se).abs().max().item())
g_exp_st = exact_expectation(inst, "marginal", inst["law"], inst["subsets"])
big["ProbMoE"]["z_own"] = ((big["ProbMoE"]["mean"] - g_exp_st) / big["ProbMoE"]["se"]).abs().max().item()
Z_TOL = 5.0
print(f"instance {focus} of '{FOCUS}', {BIG_DRAWS:,} draws, {inst['r'].numel()} components:")
print(f"  REINFORCE mean vs exact gradient g*:       max |z| = {big['REINFORCE']['z_exact']:6.2f}")
print(f"  ProbMoE mean vs its own expectation E[g]:  max |z| = {big['ProbMoE']['z_own']:6.2f}")
print(f"  ProbMoE mean vs exact gradient g*:         max |z| = {big['ProbMoE']['z_exact']:6.2f}")
print(f"  exact: 1 - cos(E[g_ProbMoE], g*) = {float(1 - cos(g_exp_st, inst['g_star'])):.2e}, "
      f"|E[g] - g*| / |g*| = {float((g_exp_st - inst['g_star']).norm() / inst['g_star'].norm()):.3f}, "
      f"|E[g]| / |g*| = {float(g_exp_st.norm() / inst['g_star'].norm()):.3f}")
assert big["REINFORCE"]["z_exact"] < Z_TOL, "REINFORCE converges to the exact gradient"
assert big["ProbMoE"]["z_own"] < Z_TOL, "ProbMoE converges to its own expectation"
assert big["ProbMoE"]["z_exact"] > Z_TOL, "... which is not the exact gradient"

# %%
# Error of the average of n draws, against n: the stochastic estimators approach their exact bias.
n_axis = 2 ** np.arange(0, 11)
err_n = {}
for name in ("ProbMoE", "REINFORCE", "sample + dense STE"):
    curve = np.zeros(len(n_axis))
    for i in range(LAB_INSTANCES):
        inst = lab_instances[(FOCUS, i)]
        g = lab[(FOCUS, name)][i]["draws"] if name == "ProbMoE" else \
            estimates(inst, draw_masks(inst, LAB_DRAWS, seed=i), ESTIMATORS[name][1])
        for j, n in enumerate(n_axis):
            blocks = min(LAB_DRAWS // n, 200)
            block_means = g[:blocks * n].view(blocks, n, *g.shape[1:]).mean(1)
            curve[j] += float((1 - cos(block_means, inst["g_star"])).mean()) / LAB_INSTANCES
    err_n[name] = curve
dense_err = lab_stat(FOCUS, "DenseMixer", "err")[0]
cross = [n for n, e in zip(n_axis, err_n["ProbMoE"]) if e < dense_err]
print(f"'{FOCUS}': DenseMixer's error {dense_err:.4f}; ProbMoE averaged over n draws reaches it at "
      f"n = {cross[0] if cross else f'more than {n_axis[-1]}'}")


# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
ax = axes[0]
setting = "E=10 k=5, σ=1 (paper's size)"
names = list(ESTIMATORS)
xs = np.arange(len(names))
for j, (key, label) in enumerate([("exact_bias", "exact bias"), ("var", "variance"), ("err", "error (one draw)")]):
    means = [lab_stat(setting, n, key)[0] for n in names]
    sds = [lab_stat(setting, n, key)[1] for n in names]
    ax.bar(xs + (j - 1) * 0.27, means, width=0.27, yerr=sds, capsize=2, label=label)
ax.set_xticks(xs)
ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
ax.set_yscale("symlog", linthresh=1e-3)
ax.set_ylabel("1 − cosine (mean ± sd over instances)")
ax.set_title(f"Router-gradient estimators, {setting}")
ax.legend(fontsize=8)
ax = axes[1]
for name, curve in err_n.items():
    ax.plot(n_axis, curve, "o-", label=f"{name}: mean of n draws")
    exact_b = lab_stat(FOCUS, name, "exact_bias")[0]
    if exact_b > 1e-10:
        ax.axhline(exact_b, ls=":", lw=1, color=ax.lines[-1].get_color(), label=f"{name}: exact bias")
for name, ls in (("DenseMixer", "--"), ("top-k", "-.")):
    ax.axhline(lab_stat(FOCUS, name, "err")[0], color="black", ls=ls, lw=1, label=f"{name} (deterministic)")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("draws averaged, n")
ax.set_ylabel("1 − cos(mean of n estimates, exact gradient)")
ax.set_title(f"Averaging draws, {FOCUS}")
ax.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# A training step draws once per token, so the left end of the right-hand plot is what a step
# sees. The curves of the stochastic estimators fall like $1/n$ until they meet their bias:
# REINFORCE keeps falling, ProbMoE flattens at its (small) exact bias, and the sample + dense STE
# hybrid flattens higher. Where DenseMixer's deterministic line crosses the ProbMoE curve tells how
# many draws ProbMoE would need to match it on this layer. In a model, the gradient of the gate
# weight sums over the tokens of a batch, each with its own draw, which averages part of this
# noise away; how much depends on how alike the tokens are. The lab says nothing about which
# gradient *trains* better: a
# biased, low-noise direction can be a good descent direction. The training runs of
# {doc}`11b-probmoe-training` ask that question directly.

# %% [markdown]
# (nb11-linear)=
# ### A linear loss: the paper's eq. (8) is exact, the sampled estimator is not
#
# The bias above is not an effect of the quadratic loss. Take a loss linear in the layer's output,
# $L_t = \langle c_t, y_t\rangle$, so that $\delta_j = \langle c_t, f_j(x_t)\rangle$ does not depend on
# the subset. Then $J = \sum_t\sum_j \delta_j m_j\pi_j$ and its gradient is exactly the paper's eq. (8),
# $\sum_j\delta_j(m_j\,\partial\pi_j + \pi_j\,\partial m_j)$. The estimator ProbMoE computes,
# $\sum_{j\in S}\delta_j(\partial\pi_j + \pi_j\,\mathrm{Cov}(\cdot, z_j))$ (Proposition 7.4 in
# {ref}`ch7-st`), has the mean $\sum_j m_j\delta_j(\partial\pi_j + \pi_j\,\mathrm{Cov}(\cdot, z_j))$:
# it falls short by $\sum_j\delta_j\pi_j(1 - m_j)\mathrm{Cov}(\cdot, z_j)$, because an expert's
# credit reaches the marginals only when that expert is drawn. Below, $E = 5$, $k = 2$, four tokens,
# everything by enumeration of the ten subsets.

# %%
inst_lin = make_instance(7, 5, 2, 4, 1.0)
c_lin = torch.randn(4, LAB_D, dtype=DT, generator=torch.Generator().manual_seed(7))
r_lin, f_lin, Z_lin = inst_lin["r"], inst_lin["outputs"], all_subsets(5, 2).to(DT)
r_var = r_lin.clone().requires_grad_(True)
law_var = torch.exp(r_var @ Z_lin.T - ksubset_log_partition(r_var, 2)[:, None])        # (T, C)
y_all = torch.einsum("ce,te,ted->ctd", Z_lin, torch.softmax(r_var, -1), f_lin)
g_lin = torch.autograd.grad((law_var.T * (y_all * c_lin).sum(-1)).sum(), r_var)[0]    # exact grad of J
with torch.no_grad():
    delta_lin = torch.einsum("ted,td->te", f_lin, c_lin)
    pi_lin, m_lin = torch.softmax(r_lin, -1), ksubset_marginals(r_lin, 2)
    cov_lin = ksubset_covariance(r_lin, 2)                                               # = dm_j/dr_i, symmetric
    jac_lin = torch.diag_embed(pi_lin) - pi_lin[:, :, None] * pi_lin[:, None, :]        # [t, j, i]
    eq8 = torch.einsum("tj,tji->ti", delta_lin * m_lin, jac_lin) + torch.einsum("tj,tji->ti", delta_lin * pi_lin, cov_lin)
    gap = torch.einsum("tj,tji->ti", delta_lin * pi_lin * (1 - m_lin), cov_lin)
r_c = r_lin.expand(len(Z_lin), -1, -1).clone().requires_grad_(True)                  # one copy per subset
masks_lin = Z_lin[:, None, :].expand(-1, 4, -1)
m_c = ksubset_marginals(r_c, 2)
w_c = masks_lin * (masks_lin + m_c - m_c.detach()) * torch.softmax(r_c, -1)
g_c = torch.autograd.grad((torch.einsum("cte,ted->ctd", w_c, f_lin) * c_lin).sum(), r_c)[0]
mean_st = (law_var.detach().T[..., None] * g_c).sum(0)                                # E[estimate]
print(f"linear loss, E = 5, k = 2: max |eq. (8) - exact gradient| = {(eq8 - g_lin).abs().max():.1e}")
print(f"  max |mean of ProbMoE's estimate - exact gradient| = {(mean_st - g_lin).abs().max():.4f} "
      f"(exact gradient entries up to {g_lin.abs().max():.3f}); "
      f"1 - cos = {float(1 - cos(mean_st[None], g_lin[None])):.1e}")
assert torch.allclose(eq8, g_lin, atol=1e-12), "eq. (8) is the exact gradient for a linear loss"
assert torch.allclose(g_lin - mean_st, gap, atol=1e-12), "the shortfall is the formula above"
assert (mean_st - g_lin).abs().max() > 5e-3, "the sampled estimator is biased even for a linear loss"

# %% [markdown]
# ## What we saw
#
# * **The estimators are what the package computes.** The lab's straight-through, DenseMixer and
#   top-$k$ gradients equal the gate gradients of a real `MoELayer` with the package's routers.
# * **ProbMoE's gradient is a biased surrogate; REINFORCE's is not.** Enumerating the subset law
#   gives each estimator's exact expectation: REINFORCE's equals the exact gradient to rounding,
#   ProbMoE's does not, and with 200,000 draws the Monte Carlo means land where the enumeration says
#   (within 5 standard errors in every component), which is measurably away from the exact gradient
#   for ProbMoE. The bias does not come from the quadratic loss: with a linear loss the paper's
#   eq. (8) is the exact gradient and ProbMoE's estimate is still biased ({ref}`nb11-linear`).
# * **The bias is small; the variance is not.** A single ProbMoE draw's error is almost all
#   variance. DenseMixer is deterministic. Under our protocol the paper's Table 7 ordering (ProbMoE
#   ahead of DenseMixer in bias, variance and error) does not come out: on average DenseMixer's
#   error is the smaller one in every setting, and the verdict lines count the instances. The claim
#   is tested below at the paper's size; whether the biased, low-noise gradient trains better is the
#   question of {doc}`11b-probmoe-training`.

# %%
paper_setting = "E=10 k=5, σ=1 (paper's size)"
pm_err, dm_err = lab_stat(paper_setting, "ProbMoE", "err")[0], lab_stat(paper_setting, "DenseMixer", "err")[0]
print("the paper's claim, tested on this layer:")
print(f"  [{'held' if pm_err < dm_err else 'did not hold here'}] ProbMoE's router gradient has a lower error "
      f"than DenseMixer's (App. F, Table 7)\n      paper's size, one draw: ProbMoE {pm_err:.4f}, DenseMixer "
      f"{dm_err:.4f}; DenseMixer lower on {LAB_VERDICT[paper_setting]['dense_wins']}/{LAB_INSTANCES} instances")
print(f"\nnotebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s")
