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
# # The k-subset DP in practice: numerical traps, the paper's pseudocode, and speed
#
# Companion to {doc}`../book/07-probabilistic-routing`. The chain DP of
# {doc}`10-ksubset-dp-from-scratch` is exact on paper; an implementation that trains has to survive
# autograd, second derivatives and extreme logits, and one that follows ProbMoE's appendix line by line
# meets four misprints. Here we reproduce each problem next to its fix, against enumeration, and time
# the DP at a realistic size.
#
# **You will learn to**
#
# 1. recognise the three numerical traps of a loop DP trained with double backward (a sentinel that
#    is not low enough, `logaddexp`'s second derivative, overflow in the linear domain);
# 2. read the paper's `PrUpToK`, `MarginalsBand`, `TopKIndices` and `CompileExactlyK` as printed and
#    see where each goes wrong (the errata);
# 3. compare the cost of the marginals and their backward with the loop DP that the paper uses.
#
# *Prerequisites:* the chain DP and the marginals of {doc}`10-ksubset-dp-from-scratch`; chapter 7's
# "Gradients" section.
#
# *Run time:* about 15 seconds at CPU scale on a 2-core laptop CPU, the default. `MINIMOE_SCALE=gpu` chooses
# the larger configuration, for a GPU: the speed comparison runs 16,384 tokens instead of 2,048, 8 times the
# tokens; nothing else changes.

# %%
# Install minimoe when it is missing (e.g. on Colab), and scipy, which this notebook also uses.
import importlib.util
import subprocess
import sys

if importlib.util.find_spec("minimoe") is None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                           "minimoe[book] @ git+https://github.com/minimoe-book/minimoe", "scipy"])

# %%
import inspect
import itertools
import math
import os
import time

import matplotlib.pyplot as plt
import torch

import minimoe
from minimoe.exercises.oracles import circuit_upward, compile_exactly_k, marginals_band, pr_up_to_k
from minimoe.ops import (ksubset_log_partition, ksubset_marginals, range_subset_covariance,
                         range_subset_marginals, range_subset_sample)

SCALE = os.environ.get("MINIMOE_SCALE", "cpu")  # "gpu" runs the larger configuration: chosen, never automatic
DEVICE = "cuda" if SCALE == "gpu" else "cpu"
if SCALE == "cpu":
    torch.set_num_threads(1)  # the problems here are small; extra threads mostly wait on each other
F64 = torch.float64
torch.manual_seed(0)
print(f"SCALE={SCALE}, device={DEVICE}, minimoe {minimoe.__version__}, torch {torch.__version__}")


def subsets(E, sizes):
    """Every subset of range(E) whose size is in `sizes`, as a (n, E) float64 0/1 matrix."""
    rows = [[1.0 if j in S else 0.0 for j in range(E)]
            for c in sizes for S in itertools.combinations(range(E), c)]
    return torch.tensor(rows, dtype=F64)


def enumerate_law(r, sizes):
    """Brute force over the subsets: (subsets, P(S), log Z, marginals, covariance of z)."""
    Zs = subsets(r.shape[-1], sizes)
    P = torch.softmax(Zs @ r, 0)
    m = P @ Zs
    return Zs, P, torch.logsumexp(Zs @ r, 0), m, Zs.T @ (P[:, None] * Zs) - torch.outer(m, m)


K6 = 3                                                           # the instance of the DP notebook
r6 = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=F64)
_, _, _, m6, cov6 = enumerate_law(r6, [K6])


# %% [markdown]
# (nb10-traps)=
# ## Three numerical traps
#
# Our DP above used $-\infty$ for impossible states and was never differentiated by autograd. The
# way ProbMoE trains is different: it computes $\log Z$ with a loop DP, takes the marginals as
# `torch.autograd.grad(..., create_graph=True)` and differentiates them again in the backward pass.
# Here is that loop, with the "impossible" marker `neg` and the log-add-exp as parameters, since
# both choices matter.

# %%
def loop_log_partition(r, k, neg=-1e30, lae=torch.logaddexp):
    """log e_k(exp(r)) for the rows of r (B, E), written so that autograd can go through it."""
    B = r.shape[0]
    impossible = r.new_full((B, 1), neg)
    alpha = torch.cat([r.new_zeros(B, 1), impossible.expand(B, k)], 1)    # alpha[0, :]
    for i in range(r.shape[1]):
        take = torch.cat([impossible, alpha[:, :-1]], 1) + r[:, i:i + 1]
        alpha = lae(alpha, take)
    return alpha[:, k]


def softplus_lae(x, y):
    """log(e^x + e^y) = max + softplus(-|x - y|): derivatives stay finite at any finite gap."""
    return torch.maximum(x, y) + torch.nn.functional.softplus(-(x - y).abs())


# %% [markdown]
# **Trap 1: a sentinel that is not low enough.** The reference code marks impossible states with
# $-300$. A state that should have weight 0 then has weight $e^{-300}$, and it competes with the
# real subsets. At $\alpha[0, k]$ ("$k$ experts picked out of none") it survives to the end
# unchanged, so the answer is at least about $-300$ whatever the logits. Real subsets weigh
# $e^{\sum_S r_j}$, so the error appears once $k$ logits sum to less than about $-300$, for
# instance when all are below $-300/k$. Sixteen logits at $-100$ with $k = 4$: the answer is
# $-400 + \log\binom{16}{4} = -392.49$.

# %%
r_low = torch.full((1, 16), -100.0, dtype=F64)
truth = -400 + math.log(math.comb(16, 4))
v300 = loop_log_partition(r_low, 4, neg=-300.0).item()
v1e30 = loop_log_partition(r_low, 4, neg=-1e30).item()
vmm = ksubset_log_partition(r_low, 4).item()
print(f"exact {truth:.4f}; loop DP with -300: {v300:.4f}; loop DP with -1e30: {v1e30:.4f}; minimoe: {vmm:.4f}")
assert abs(v300 - (-300)) < 1e-3, "the -300 sentinel returns about -300"
assert abs(v1e30 - truth) < 1e-9 and abs(vmm - truth) < 1e-9

levels = torch.linspace(-20, -120, 101, dtype=F64)
rows = levels[:, None].expand(-1, 16).contiguous()
exact_levels = 4 * levels + math.log(math.comb(16, 4))
err300 = (loop_log_partition(rows, 4, neg=-300.0) - exact_levels).abs()
errmm = (ksubset_log_partition(rows, 4) - exact_levels).abs()
assert (err300[levels >= -65] < 1e-9).all() and (err300[levels <= -85] > 1).all()
assert errmm.max() < 1e-9

fig, ax = plt.subplots(figsize=(7, 3.6))
ax.semilogy(levels, err300.clamp(min=1e-17), label="loop DP, sentinel -300")
ax.semilogy(levels, errmm.clamp(min=1e-17), label="minimoe")
ax.axvline(-300 / 4, color="gray", ls="--", lw=1, label="-300 / k")
ax.set_xlabel("common logit value a (16 experts, k = 4)")
ax.set_ylabel("|log Z error| (floored at 1e-17)")
ax.set_title("A -300 sentinel breaks below a = -300/k")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# **Trap 2: the second derivative of `torch.logaddexp`.** The obvious fix, $-\infty$, breaks the
# *first* derivative: an impossible cell is $\operatorname{logaddexp}(-\infty, -\infty)$, whose
# gradient is $e^{-\infty - (-\infty)} = $ NaN, and NaN times a zero upstream gradient is still NaN.
# A huge finite sentinel such as $-10^{30}$ fixes the first derivative but not the second:
# `logaddexp`'s backward exponentiates the gap between its two arguments, and once $e^{\text{gap}}$
# overflows (a gap above about 709 in float64, 88.7 in float32) the derivative of that backward
# is $\infty/\infty$. ProbMoE needs exactly that second derivative, because the marginals are
# differentiated in the router's backward pass. So the $-300$ sentinel is safe from this in float64
# but not in float32. We compute the marginals with `create_graph=True`, then the full Hessian
# (which must equal the enumerated covariance), for each choice, in both dtypes, on the $E=6$,
# $k=3$ token.

# %%
def loop_derivatives(r, k, neg, lae):
    r = r.clone().requires_grad_(True)
    (m,) = torch.autograd.grad(loop_log_partition(r[None], k, neg, lae)[0], r, create_graph=True)
    H = torch.stack([torch.autograd.grad(m[i], r, retain_graph=True)[0] for i in range(len(r))])
    return m.detach(), H


choices = [("-inf, logaddexp", -math.inf, torch.logaddexp), ("-1e30, logaddexp", -1e30, torch.logaddexp),
           ("-300, logaddexp", -300.0, torch.logaddexp), ("-1e30, softplus form", -1e30, softplus_lae)]
trap2 = {}
print(f"{'sentinel, log-add-exp':24s} {'dtype':8s} {'NaN in m':>8s} {'NaN in Hessian':>14s} "
      f"{'max|m - enum|':>13s} {'max|H - Cov|':>12s}")
for name, neg, lae in choices:
    for dtype in (torch.float64, torch.float32):
        m, H = loop_derivatives(r6.to(dtype), K6, neg, lae)
        em, eH = (m.double() - m6).abs().max().item(), (H.double() - cov6).abs().max().item()
        trap2[name, dtype] = (m.isnan().sum().item(), H.isnan().sum().item(), em, eH)
        print(f"{name:24s} {str(dtype)[6:]:8s} {m.isnan().sum().item():8d} {H.isnan().sum().item():14d} "
              f"{em:13.1e} {eH:12.1e}")
for dtype in (torch.float64, torch.float32):
    x = r6.to(dtype)
    m = ksubset_marginals(x, K6)
    H = torch.autograd.functional.jacobian(lambda y: ksubset_marginals(y, K6), x)
    em, eH = (m.double() - m6).abs().max().item(), (H.double() - cov6).abs().max().item()
    trap2["minimoe", dtype] = (m.isnan().sum().item(), H.isnan().sum().item(), em, eH)
    print(f"{'minimoe (analytic)':24s} {str(dtype)[6:]:8s} {m.isnan().sum().item():8d} {H.isnan().sum().item():14d} "
          f"{em:13.1e} {eH:12.1e}")

assert trap2["-inf, logaddexp", torch.float64][0] > 0, "-inf: NaN already in the marginals"
for dtype in (torch.float64, torch.float32):
    assert trap2["-1e30, logaddexp", dtype][0] == 0 and trap2["-1e30, logaddexp", dtype][1] > 0
    for name in ("-1e30, softplus form", "minimoe"):
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        assert trap2[name, dtype][:2] == (0, 0) and trap2[name, dtype][3] < tol, "finite and equal to Cov"
assert trap2["-300, logaddexp", torch.float64][1] == 0 and trap2["-300, logaddexp", torch.float32][1] > 0

# %% [markdown]
# Two fixes work. The softplus form $\max(x, y) + \mathrm{softplus}(-|x-y|)$ never exponentiates
# a positive gap, so every derivative is finite with a finite sentinel (it still needs one: with
# $-\infty$, $x - y$ is NaN). `minimoe` avoids the question: its marginals come from a
# forward-backward pass and their backward is the covariance-vector product computed directly,
# so no autograd ever runs through a cell that holds $-\infty$.
#
# **Trap 3: logits of size $10^4$ in float32.** The linear-domain DP, $e_c \mathrel{+}= x_i
# e_{c-1}$ on $x_i = e^{r_i}$, is the fastest form, but $e^{10^4}$ overflows. Subtracting the
# largest logit first avoids the overflow and underflows instead: $e^{-2\cdot 10^4} = 0$. Take
# four logits near $+10^4$ and four near $-10^4$. With $k = 5$ the top four are surely in, and the
# fifth is one of the low four with softmax probabilities over their logits. The log-space loop
# survives the range but not the rounding: float32 numbers near $10^4$ are $10^{-3}$ apart.
# `minimoe` sends such rows to the log domain in float64 and returns float32. (With $k = 4$ the
# shifted linear DP survives, because only the top four logits matter.)

# %%
g_big = torch.Generator().manual_seed(8)
r_big = torch.cat([1e4 + torch.randn(4, generator=g_big), -1e4 + torch.randn(4, generator=g_big)]).float()


def linear_log_partition(r, k, shift):
    """log e_k(exp(r)) by the linear-domain DP, optionally after subtracting the largest logit."""
    s = r.max() if shift else r.new_zeros(())
    x = (r - s).exp()
    e = [r.new_ones(())] + [r.new_zeros(())] * k
    for xi in x:
        e = [e[0]] + [e[c] + xi * e[c - 1] for c in range(1, k + 1)]
    return e[k].log() + k * s


def autograd_marginals(f, r):
    r = r.clone().requires_grad_(True)
    return torch.autograd.grad(f(r), r)[0]


print(f"logits (float32): {r_big.numpy()}")
for k in (4, 5):
    _, _, logZ_ref, m_ref, _ = enumerate_law(r_big.double(), [k])   # float64 enumeration of the same numbers
    methods = {
        "linear DP": lambda r: linear_log_partition(r, k, shift=False),
        "linear DP, shifted": lambda r: linear_log_partition(r, k, shift=True),
        "log-space loop DP": lambda r: loop_log_partition(r[None], k)[0],
    }
    print(f"k = {k}: float64 enumeration gives marginals {m_ref.numpy().round(5)}")
    for name, f in methods.items():
        m = autograd_marginals(f, r_big)
        print(f"  {name:20s} log Z = {f(r_big).item():12.3f}, max |m - m64| = {(m.double() - m_ref).abs().max():.1e}")
        if name == "linear DP":
            assert m.isnan().all(), "exp(1e4) overflows: NaN"
        if name == "linear DP, shifted" and k == 5:
            assert m.isnan().all(), "exp(-2e4) underflows: e_5 = 0 and NaN"
        if name == "log-space loop DP" and k == 5:
            assert (m.double() - m_ref).abs().max() > 1e-5, "float32 rounding of the sums costs ~1e-4"
    m = ksubset_marginals(r_big, k)
    err = (m.double() - m_ref).abs().max().item()
    print(f"  {'minimoe':20s} log Z = {ksubset_log_partition(r_big, k).item():12.3f}, max |m - m64| = {err:.1e}, "
          f"dtype {m.dtype}, sum {m.sum().item():.6f}")
    assert m.dtype == torch.float32 and err < 1e-7 and abs(m.sum().item() - k) < 1e-5
    assert abs(ksubset_log_partition(r_big, k).item() - logZ_ref.item()) < 1e-2, "log Z to float32 precision"

# %% [markdown]
# (nb10-pseudocode)=
# ## The paper's pseudocode, read literally
#
# The released code of ProbMoE is right where its printed pseudocode (Algorithms 1, 2 and 6 of the
# paper's Appendices G and H) is not. A reader who implements the appendix line by line meets four
# problems beyond the sampler's sigmoid: each is reproduced below as printed, next to the
# correction, and listed in {ref}`errata-probmoe`. The paper's tables are in $(\log p, \log q)$
# form, $p = \sigma(r)$, $q = 1 - p$, with $-10^{30}$ standing for $\log 0$ here (a finite
# stand-in, so that autograd through the table has no NaN).

# %% [markdown]
# (nb10-pruptok)=
# ### `PrUpToK` reads column $j - 1 = -1$
#
# `PrUpToK` loops $j = 0..k_{\max}$ and reads $a[i-1, j-1]$. At $j = 0$ that is $a[i-1, -1]$,
# which in NumPy and PyTorch is the *last* column, $a[i-1, k_{\max}]$, not $\log 0$. As soon as
# $i - 1 \ge k_{\max}$ that column holds real mass, and the table computes the probability that
# $|S| \equiv c \pmod{k_{\max}+1}$ instead of $|S| = c$. The fix: treat $j - 1 < 0$ as $\log 0$.

# %%
# pr_up_to_k as printed and corrected: one copy, in minimoe.exercises.oracles (the tests use it too)
print(inspect.getsource(pr_up_to_k))

r_pc = torch.tensor([0.8, -0.4, 1.2, 0.1, -1.5, 0.3], dtype=F64)
bits = torch.tensor(list(itertools.product([0.0, 1.0], repeat=6)), dtype=F64)   # all 64 subsets
weight = (bits @ torch.nn.functional.logsigmoid(r_pc) + (1 - bits) @ torch.nn.functional.logsigmoid(-r_pc)).exp()
size = bits.sum(1).long()
lp, lq = torch.nn.functional.logsigmoid(r_pc), torch.nn.functional.logsigmoid(-r_pc)
printed = pr_up_to_k(lp, lq, 2, literal=True)[-1].exp()
fixed = pr_up_to_k(lp, lq, 2, literal=False)[-1].exp()
exact = torch.stack([weight[size == c].sum() for c in range(3)])
modular = torch.stack([weight[size % 3 == c].sum() for c in range(3)])
print("P(|S| = c), c = 0, 1, 2, for E = 6, k_max = 2:")
print(f"  by enumeration            {exact.numpy().round(4)}")
print(f"  PrUpToK, j - 1 guarded    {fixed.numpy().round(4)}")
print(f"  PrUpToK as printed        {printed.numpy().round(4)}  = P(|S| = c mod 3) {modular.numpy().round(4)}")
assert torch.allclose(fixed, exact, atol=1e-14) and torch.allclose(printed, modular, atol=1e-14)
assert (printed - exact).abs().max() > 0.05

# %% [markdown]
# (nb10-marginalsband)=
# ### `MarginalsBand` differentiates through $\log q$
#
# `MarginalsBand` sets $\log q \leftarrow \log(1 - \exp(\log p))$ and returns
# $\mu = \nabla_{\log p} L$, $L = \operatorname{logsumexp}_c a[n, c]$. Unlike Algorithm 5 (and
# eq. 6, and the proof of Prop. B.2), it does not say that $\log q$ is held fixed, and as written
# $\log q$ is a function of $\log p$ with $\partial\log q_j/\partial\log p_j = -p_j/(1-p_j)$. The
# chain rule then adds the derivative through the factors $q_j$ of the subsets that leave $j$ out:
#
# $$\mu_j = m_j - (1 - m_j)\frac{p_j}{1 - p_j},$$
#
# which is not a probability (it can be negative, and the $\mu_j$ do not sum to $\mathbb E|S|$).
# Holding $\log q$ fixed, or differentiating the normaliser in the logits, gives $m$.

# %%
# marginals_band as printed and corrected: one copy, in minimoe.exercises.oracles (the tests use it too)
print(inspect.getsource(marginals_band))

r_mb = torch.tensor([2.0, 0.0, -1.0, -0.5], dtype=F64)
m_mb = enumerate_law(r_mb, [2])[3]
mu_printed = marginals_band(r_mb, 2, 2, stop_gradient=False)
mu_fixed = marginals_band(r_mb, 2, 2, stop_gradient=True)
p_mb = torch.sigmoid(r_mb)
print(f"logits {r_mb.tolist()}, k = 2")
print(f"  marginals m (enumeration)       {m_mb.numpy().round(4)}, sum {m_mb.sum():.4f}")
print(f"  MarginalsBand, log q held fixed {mu_fixed.numpy().round(4)}")
print(f"  MarginalsBand as printed        {mu_printed.numpy().round(4)}, sum {mu_printed.sum():.4f}")
assert torch.allclose(mu_fixed, m_mb, atol=1e-12)
assert torch.allclose(mu_printed, m_mb - (1 - m_mb) * p_mb / (1 - p_mb), atol=1e-12)
assert (mu_printed < 0).any() and abs(mu_printed.sum() - 2) > 1

# %% [markdown]
# (nb10-topkindices)=
# ### `TopKIndices` fills the free slots with experts that were not drawn
#
# Algorithm 1 (dynamic-$k$) draws $z$ with $|S| \le k_{\max}$ ones, then takes
# $I = \mathrm{TopKIndices}(z, k_{\max})$ and $w = w^{\text{full}}|_I$. When $|S| < k_{\max}$, the top
# $k_{\max}$ of a 0/1 vector includes $k_{\max} - |S|$ zeros: experts that were not drawn, chosen by
# the tie-breaking of `topk`. They run, with forward weight $z_j\pi_j = 0$, but their straight-through
# weight $m_j\pi_j$ has the gradient $\pi_j\,\partial m_j/\partial r$, so each padded expert adds
# $\delta_j\pi_j\mathrm{Cov}(\cdot, z_j)$ to the router gradient. The released code multiplies the
# gathered weights by the gathered mask, which removes exactly that term; `minimoe`'s
# `ProbMoEDynamic` never dispatches padded slots. Below, with a loss linear in the weights
# ($\partial L/\partial w_j = \delta_j$, random), one draw for 16 tokens.

# %%
T_pad, E_pad = 16, 6
g_pad = torch.Generator().manual_seed(11)
r_pad = torch.randn(T_pad, E_pad, generator=g_pad, dtype=F64).requires_grad_(True)
delta_pad = torch.randn(T_pad, E_pad, generator=g_pad, dtype=F64)
z_pad = range_subset_sample(r_pad.detach(), 1, 3, generator=g_pad).to(F64)


def alg1_router_gradient(mask_slots):
    mu = range_subset_marginals(r_pad, 1, 3)
    w_full = ((z_pad - mu).detach() + mu) * torch.softmax(r_pad, -1)
    I = torch.topk(z_pad, 3, -1).indices                       # TopKIndices(z, k_max)
    w = w_full.gather(-1, I) * (z_pad.gather(-1, I) if mask_slots else 1.0)
    return torch.autograd.grad((w * delta_pad.gather(-1, I)).sum(), r_pad)[0], I


g_printed, I_pad = alg1_router_gradient(False)
g_masked, _ = alg1_router_gradient(True)
padded = torch.zeros_like(z_pad).scatter(-1, I_pad, (z_pad.gather(-1, I_pad) == 0).to(F64))
with torch.no_grad():
    extra = torch.einsum("tj,tij->ti", padded * delta_pad * torch.softmax(r_pad, -1),
                         range_subset_covariance(r_pad, 1, 3))
print(f"{int(padded.sum())} of {3 * T_pad} slots hold an expert that was not drawn; "
      f"max |router-gradient change| = {(g_printed - g_masked).abs().max():.3f}")
assert padded.sum() == (3 - z_pad.sum(-1)).sum() > 0
assert torch.allclose(g_printed - g_masked, extra, atol=1e-12) and extra.abs().max() > 1e-2

# %% [markdown]
# (nb10-alg6)=
# ### `CompileExactlyK` pairs counts its blocks cannot hold
#
# Algorithm 6 builds the circuit bottom-up. At each level, node $(i, j)$ is the OR over the
# elements $(\mathrm{dp}_{\text{prev}}[2i, j'], \mathrm{dp}_{\text{prev}}[2i+1, j-j'])$ for *every*
# $0 \le j' \le j$, with $j$ up to $\min(k, n/m)$, the size of the merged block. But a child block
# of $n/(2m)$ experts has entries only for counts up to $\min(k, n/(2m))$: at the first level the
# leaves have counts 0 and 1, and $j = 2$ asks for $\mathrm{dp}_{\text{prev}}[\cdot, 2]$. As printed
# the loop indexes past its table whenever $k \ge 2$. The fix restricts $j'$ to
# $\max(0, j - c_R) \le j' \le \min(j, c_L)$, with $c_L, c_R$ the children's largest counts (what the
# released code does by dropping invalid pairs). The corrected circuit computes $\log Z_k$ and its
# models are exactly the $k$-subsets.

# %%
# compile_exactly_k as printed and corrected: one copy, in minimoe.exercises.oracles (the tests use it too)
print(inspect.getsource(compile_exactly_k))

try:
    compile_exactly_k(8, 3, corrected=False)
    raised = None
except IndexError as error:
    raised = error
print(f"Algorithm 6 as printed, n = 8, k = 3: IndexError ({raised})")
assert isinstance(raised, IndexError)
r_c = torch.tensor([0.8, -0.4, 1.2, 0.1, -1.5, 0.3, 2.0, -0.7], dtype=F64)
root, unique = compile_exactly_k(8, 3, corrected=True)
n_nodes = len(unique)
log_z_circuit = circuit_upward(root, torch.nn.functional.logsigmoid(r_c), torch.nn.functional.logsigmoid(-r_c))
log_z_chain = ksubset_log_partition(r_c, 3) + torch.nn.functional.logsigmoid(-r_c).sum()
models = [bits8 for bits8 in itertools.product([0.0, 1.0], repeat=8)
          if circuit_upward(root, torch.tensor(bits8).log(), (1 - torch.tensor(bits8)).log()).exp() > 0.5]
print(f"corrected: {n_nodes} decision nodes; log Z_3 = {log_z_circuit:.6f} (chain DP {log_z_chain:.6f}); "
      f"{len(models)} models, all of size 3: {all(sum(b) == 3 for b in models)}")
assert abs(log_z_circuit - log_z_chain) < 1e-12
assert len(models) == math.comb(8, 3) and all(sum(b) == 3 for b in models)

# %% [markdown]
# (nb10-speed)=
# ## How fast
#
# Finally the cost at a realistic size: $T = 2048$ tokens, $E = 64$ experts, $k = 8$, float32
# (with `SCALE == "gpu"`, 16,384 tokens on the GPU). The loop DP with autograd is how the paper
# computes the marginals. We time two things: the marginals alone, and the marginals plus their
# backward (a vector-Jacobian product, what a training step needs; for the loop this takes
# `create_graph=True` and, by trap 2, the softplus form). Times are the best of five runs and vary
# from machine to machine; the full benchmark, with sampling throughput and larger sizes, is
# `python -m benchmarks`.

# %%
T_SPEED = 2048 if SCALE == "cpu" else 16384
g_speed = torch.Generator().manual_seed(9)
r_speed = torch.randn(T_SPEED, 64, generator=g_speed).to(DEVICE)
v_speed = torch.randn(T_SPEED, 64, generator=g_speed).to(DEVICE)


def timed(fn, repeats=5):
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return out, best * 1e3


def loop_marginals(lae=torch.logaddexp, create_graph=False):
    r = r_speed.clone().requires_grad_(True)
    (m,) = torch.autograd.grad(loop_log_partition(r, 8, -1e30, lae).sum(), r, create_graph=create_graph)
    return m, r


def loop_with_backward():
    m, r = loop_marginals(softplus_lae, create_graph=True)
    return m.detach(), torch.autograd.grad(m, r, v_speed)[0]


def minimoe_with_backward():
    r = r_speed.clone().requires_grad_(True)
    m = ksubset_marginals(r, 8)
    return m.detach(), torch.autograd.grad(m, r, v_speed)[0]


m_mm, t_mm = timed(lambda: ksubset_marginals(r_speed, 8))
(m_loop, _), t_loop = timed(loop_marginals)
(m_mm2, vjp_mm), t_mm2 = timed(minimoe_with_backward)
(m_loop2, vjp_loop), t_loop2 = timed(loop_with_backward)
m_64 = ksubset_marginals(r_speed.double(), 8)
print(f"T={T_SPEED}, E=64, k=8, float32 on {DEVICE}")
print(f"marginals:            minimoe {t_mm:7.1f} ms, loop DP + autograd {t_loop:7.1f} ms ({t_loop / t_mm:.1f}x); "
      f"max|diff| = {(m_mm - m_loop).abs().max():.1e}, minimoe vs float64 {(m_mm.double() - m_64).abs().max():.1e}")
print(f"marginals + backward: minimoe {t_mm2:7.1f} ms, loop DP + autograd {t_loop2:7.1f} ms ({t_loop2 / t_mm2:.1f}x); "
      f"max|VJP diff| = {(vjp_mm - vjp_loop).abs().max():.1e} (VJP entries up to {vjp_mm.abs().max():.2f})")
assert (m_mm - m_loop).abs().max() < 1e-5 and (m_mm.double() - m_64).abs().max() < 1e-5
assert (vjp_mm - vjp_loop).abs().max() < 1e-5

# %% [markdown]
# Both compute the same numbers to float32 rounding. `minimoe` is faster because each of its
# steps is one fused multiply-add over all tokens in the linear domain (it uses the log domain
# only for rows whose logits are spread too far for that, as in trap 3), and because autograd
# through the loop records and replays a graph of several operations per expert.

# %% [markdown]
# ## What we saw
#
# * A $-300$ sentinel returns about $-300$ once the logits fall below $-300/k$; `logaddexp`
#   gives NaN in the first derivative with $-\infty$ and in the second with any sentinel more than
#   about 709 (float64) or 88.7 (float32) below the real values; the linear domain
#   overflows or underflows at $\pm 10^4$. `minimoe` is exact in all three cases.
# * Read literally, the paper's `PrUpToK` computes sizes modulo $k_{\max}+1$, `MarginalsBand`
#   returns numbers that are not probabilities, `TopKIndices` lets experts that were not drawn change
#   the router gradient, and `CompileExactlyK` indexes past its table; each correction matches
#   enumeration.
# * At $T = 2048$, $E = 64$, $k = 8$ `minimoe`'s marginals equal the autograd loop's and cost less.
