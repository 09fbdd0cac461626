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
# # Expert parallelism on a laptop
#
# Companion to {doc}`../book/08-expert-parallelism`. We shard the experts of a MoE layer over
# several processes with `torch.distributed` and exchange the tokens with all-to-all collectives.
# On a laptop the processes talk through gloo over the loopback interface; on a GPU node the same
# code runs on NCCL. Three questions:
#
# * Is the sharded layer the same function as the single-device layer, forward and backward?
# * How full are the communication buffers under each router, and how many tokens are dropped?
# * Where does the time go: computing, moving tokens, or waiting for the busiest rank?
#
# The last section checks the chapter's two formulas: the expected drops and padding of a fixed
# capacity, and the bound on the busiest rank's load.
#
# *Run time:* about 20 seconds at CPU scale on a 2-core laptop CPU, the default. `MINIMOE_SCALE=gpu` chooses
# the larger configuration, for a GPU: with two or more GPUs visible, one NCCL rank per GPU, 8,192 tokens
# instead of 1,024, width 1,024 instead of 128, expert width 4,096 instead of 512 and 10 repeats instead of 5
# — about 1,000 times the expert arithmetic of the CPU scale; with fewer than two GPUs it runs the CPU sizes
# on gloo.

# %%
# Install minimoe when it is missing (e.g. on Colab).
import importlib.util
import subprocess
import sys

if importlib.util.find_spec("minimoe") is None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                           "minimoe[book] @ git+https://github.com/minimoe-book/minimoe"])

# %%
import json
import math
import os
import tempfile
import time

import matplotlib.pyplot as plt
import numpy as np
import torch

from minimoe.parallel import expected_overflow, idle_fraction, max_load_bound

SCALE = os.environ.get("MINIMOE_SCALE", "cpu")  # "gpu" runs the larger configuration: chosen, never automatic
N_GPUS = torch.cuda.device_count()
if SCALE == "gpu" and N_GPUS >= 2:
    BACKEND, WORLD = "nccl", N_GPUS  # one rank per GPU
    CONFIG = dict(experts=WORLD * max(1, 8 // WORLD), tokens=8192, group_size=1024, d_model=1024,
                  d_hidden=4096, repeats=10, skew=0.5, check_tokens=256)
else:
    if SCALE == "gpu":
        print(f"SCALE='gpu' but {N_GPUS} GPU is visible: NCCL needs one GPU per rank, so this run uses "
              "gloo on the CPU, at the CPU sizes")
    BACKEND, WORLD = "gloo", 4
    CONFIG = dict(experts=8, tokens=1024, group_size=256, d_model=128, d_hidden=512, repeats=5, skew=0.5,
                  check_tokens=64)
print(f"SCALE={SCALE}, backend={BACKEND}, ranks={WORLD}, config={CONFIG}")
NOTEBOOK_START = time.perf_counter()

# %% [markdown]
# (nb12-launch)=
# ## Launching the ranks from the notebook
#
# A distributed program is $W$ copies of one script, one per *rank*. Each copy joins a process
# group and then calls the same collectives in the same order. `torchrun` starts the copies and
# tells each one its rank. Here the script is the module `minimoe.parallel.demo`, which ships with
# the package:
#
# 1. Every rank builds the same single-device layers, from the same seeds. It keeps
#    $E/W$ experts ({py:meth}`~minimoe.parallel.ExpertParallelMoELayer.from_single_device`) and
#    its $1/W$ share of the tokens. Its tokens are $N$ per rank, drawn from
#    $\mathcal N(0.5\,\mu, I)$ for one fixed random vector $\mu$: the shared offset makes some
#    experts more attractive to every token.
# 2. `--check` compares the sharded layer with the single-device layer in float64, on small sizes.
# 3. Each router of the suite then runs a few timed forward + backward steps with both exchanges
#    (`capacity` and `variable`). The per-rank {py:class}`~minimoe.parallel.ExchangeStats` are
#    gathered on rank 0, which writes them to a JSON file.
#
# The cell below is the command you would type in a terminal. Tokens per rank $N$ = `tokens`,
# routing groups of $T$ = `group_size` tokens, $E$ = `experts` experts.

# %%
OUT = os.path.join(tempfile.mkdtemp(), "expert_parallel.json")
options = [f"--{key.replace('_', '-')}={value}" for key, value in CONFIG.items()]
command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
           "-m", "minimoe.parallel.demo", "--out", OUT, f"--backend={BACKEND}", "--check", *options]
print("torchrun " + " ".join(command[3:]))
start = time.perf_counter()
run = subprocess.run(command, capture_output=True, text=True, timeout=900)
if run.returncode != 0:
    print(run.stdout[-4000:], run.stderr[-4000:])
    raise RuntimeError(f"the distributed run failed with exit code {run.returncode}")
with open(OUT) as f:
    R = json.load(f)
RUNS, LABELS = R["runs"], list(R["runs"])
print(f"{R['world_size']} ranks on {R['backend']} ({R['device']}): {time.perf_counter() - start:.1f} s "
      f"with the start-up, {R['seconds']:.1f} s inside the ranks")

# %% [markdown]
# (nb12-equality)=
# ## The sharded layer is the single-device layer
#
# The reference is {py:class}`minimoe.MoELayer` on the tokens of *all* ranks, routing each rank's
# tokens as its own groups. It has the same weights. After the backward pass the router gradients
# are summed over the ranks with {py:func}`~minimoe.parallel.allreduce_replicated_grads`. The table
# lists the largest absolute difference over all ranks, in float64. The last column says whether
# any rank routed differently; since every rank drops exactly the tokens the single-device layer
# drops, it must read 0.

# %%
KEYS = ("forward", "grad_x", "grad_experts", "grad_router", "routing_differs")
print(f"{'router':28s} {'exchange':9s} " + " ".join(f"{k:>15s}" for k in KEYS))
worst = 0.0
for label, by_exchange in R["equality"].items():
    for exchange, diffs in by_exchange.items():
        print(f"{label:28s} {exchange:9s} " + " ".join(f"{diffs[k]:15.1e}" for k in KEYS))
        worst = max(worst, *(diffs[k] for k in KEYS))
print(f"largest difference anywhere: {worst:.1e}")
assert worst < 1e-12, worst

# %% [markdown]
# The differences are float64 rounding: the two layers add the same numbers in different orders.
# The capacity exchange computes on exactly the buffer rows of the single-device index path, and
# its forward usually matches bit for bit.
#
# (nb12-load)=
# ## Per-rank load, buffer fill and drops
#
# For each router, the next figure shows the (token, expert) pairs each rank's experts receive in
# the capacity exchange, against the rows the fixed buffer has for them, $W\cdot\frac EW\cdot G\cdot C$
# per rank (dashed). Fill is received pairs over slots. "Dropped" is the share of tokens that no
# expert took. The counts do not depend on the exchange; the buffer size does.

# %%
def per_rank(label, exchange, key):
    return np.array([r[key] for r in RUNS[label][exchange]], dtype=float)


fig, axes = plt.subplots(1, len(LABELS), figsize=(2.3 * len(LABELS), 3.6), sharey=True)
for ax, label in zip(axes, LABELS):
    received, slots = per_rank(label, "capacity", "tokens_received"), per_rank(label, "capacity", "slots")
    ax.bar(np.arange(WORLD), received, color="tab:blue")
    ax.plot([-0.5, WORLD - 0.5], [slots[0], slots[0]], "k--", lw=1, label="buffer rows")
    ax.set_title(f"{label}\nfill {received.sum() / slots.sum():.2f}, "
                 f"dropped {per_rank(label, 'capacity', 'drop_rate').mean():.1%}", fontsize=8)
    ax.set_xlabel("rank")
axes[0].set_ylabel("pairs received per rank")
axes[0].legend(fontsize=7)
fig.suptitle(f"Load per rank under each router (capacity exchange, {WORLD} ranks, E={CONFIG['experts']}, "
             f"T={CONFIG['group_size']})", fontsize=10)
fig.tight_layout()
plt.show()

print(f"{'router':28s} {'fill (min over ranks)':>22s} {'dropped tokens':>15s} {'idle if variable':>17s}")
for label in LABELS:
    fill = per_rank(label, "capacity", "buffer_fill")
    load = per_rank(label, "variable", "tokens_received")
    print(f"{label:28s} {fill.min():22.3f} {per_rank(label, 'capacity', 'drop_rate').mean():15.1%} "
          f"{idle_fraction(load):17.1%}")

# %% [markdown]
# The chapter derives what each router must do here, and the run shows it:
#
# * **Expert choice** takes exactly $C$ tokens per expert and group (Proposition 1.4), so every
#   rank receives exactly $W\cdot\frac EW\cdot G\cdot C$ pairs. The fill is $1$ on every rank and
#   the loads are equal. Its cost is the tokens that no expert chose.
# * **BASE** assigns every token to one expert, with at most $\lceil T/E\rceil$ per expert. When
#   $E$ divides $T$ (here), all experts are exactly full: fill $1$, nothing dropped.
# * **Sinkhorn token choice** balances the *expected* loads, the column sums of the plan, exactly.
#   The realised loads, after the top-1 of each row, are balanced only in the limit
#   $\varepsilon\to 0$, where the plan becomes the balanced assignment (Proposition 2.9). At
#   $\varepsilon = 1$ its fill is well below 1; at $\varepsilon = 0.02$ it is close to 1.
# * **Softmax token choice** has nothing that balances the realised loads. The popular experts
#   overflow and drop requests, the unpopular ones leave their slots empty, and so the fill is below
#   1 and tokens are dropped at the same time. Dropless, its buffer must be sized for the busiest
#   expert.
#
# The assertions check the parts that are exact.

# %%
for label in ("expert choice c=1", "BASE (balanced assignment)"):
    assert (per_rank(label, "capacity", "buffer_fill") == 1).all(), label
    assert len(set(per_rank(label, "variable", "tokens_received"))) == 1, label  # equal loads
assert per_rank("BASE (balanced assignment)", "capacity", "drop_rate").max() == 0
for label in ("token choice top-1 c=1", "token choice top-2 c=1.25"):
    assert per_rank(label, "capacity", "buffer_fill").min() < 1 and per_rank(label, "capacity", "drop_rate").max() > 0
sink_loose = per_rank("Sinkhorn TC eps=1", "capacity", "buffer_fill").mean()
sink_tight = per_rank("Sinkhorn TC eps=0.02", "capacity", "buffer_fill").mean()
print(f"Sinkhorn token choice, mean fill: eps=1 {sink_loose:.3f}, eps=0.02 {sink_tight:.3f}")
assert sink_tight > sink_loose
# Proposition 8.5: a dropless buffer wastes at least the idle share of the variable exchange
label = "token choice dropless"
waste = 1 - per_rank(label, "capacity", "tokens_received").sum() / per_rank(label, "capacity", "slots").sum()
idle = idle_fraction(per_rank(label, "variable", "tokens_received"))
print(f"dropless token choice: capacity buffer wastes {waste:.1%} of its rows; the variable exchange idles "
      f"{idle:.1%} of the device time")
assert waste >= idle

# %% [markdown]
# (nb12-traffic)=
# ## What travels: padding against counts
#
# The capacity exchange ships the whole buffer, empty slots included. The variable exchange ships
# only the routed pairs, after a small all-to-all of counts. Below: the bytes each rank sends to the
# *other* ranks in one dispatch (the combine returns as many, and the backward pass repeats both).

# %%
width = 0.4
x_pos = np.arange(len(LABELS))
fig, ax = plt.subplots(figsize=(10, 3.8))
for shift, exchange, color in ((-width / 2, "capacity", "tab:orange"), (width / 2, "variable", "tab:green")):
    sent = [per_rank(label, exchange, "bytes_sent").mean() / 2**20 for label in LABELS]
    ax.bar(x_pos + shift, sent, width, color=color, label=f"{exchange} exchange")
ax.set_xticks(x_pos)
ax.set_xticklabels(LABELS, rotation=20, ha="right", fontsize=8)
ax.set_ylabel("MiB sent to other ranks per dispatch\n(mean over ranks)")
ax.set_title("Traffic of one dispatch: the capacity exchange carries its padding")
ax.legend()
fig.tight_layout()
plt.show()

for label in LABELS:
    cap, var = per_rank(label, "capacity", "bytes_sent").sum(), per_rank(label, "variable", "bytes_sent").sum()
    print(f"{label:28s} capacity / variable bytes = {cap / var:5.2f}")

# %% [markdown]
# With expert choice and BASE the two exchanges move the same bytes: there is no padding to carry.
# For token choice with a capacity the ratio is about one over the fill (only the pairs that leave
# the rank count). For dropless token choice the buffer is sized for the busiest expert, and the
# ratio is largest.
#
# (nb12-time)=
# ## Communication, compute and waiting
#
# Every rank's forward time, split by the layer's clocks ({py:class}`~minimoe.parallel.ExchangeStats`),
# median over the steps:
#
# * **compute**: the local experts;
# * **transfer**: the all-to-all calls (counts or header, dispatch, combine);
# * **waiting**: a barrier before each exchange (`measure_idle=True`): the time until the slowest
#   rank arrives;
# * **backward transfer**: the two reverse exchanges of the backward pass.

# %%
SHOW = ["token choice dropless", "token choice top-2 c=1.25", "expert choice c=1", "Sinkhorn TC eps=1"]
parts = [("compute_seconds", "compute", "tab:blue"), ("comm_seconds", "transfer", "tab:orange"),
         ("idle_seconds", "waiting", "tab:gray"), ("backward_comm_seconds", "backward transfer", "tab:purple")]
fig, axes = plt.subplots(1, len(SHOW), figsize=(3.2 * len(SHOW), 3.8), sharey=True)
for ax, label in zip(axes, SHOW):
    for block, exchange in enumerate(("capacity", "variable")):
        bottom = np.zeros(WORLD)
        positions = np.arange(WORLD) + block * (WORLD + 1)
        for key, name, color in parts:
            values = per_rank(label, exchange, key) * 1e3
            ax.bar(positions, values, bottom=bottom, color=color, label=name if block == 0 else None)
            bottom += values
    ax.set_xticks([(WORLD - 1) / 2, WORLD + 1 + (WORLD - 1) / 2])
    ax.set_xticklabels(["capacity\n(ranks)", "variable\n(ranks)"])
    ax.set_title(label, fontsize=9)
axes[0].set_ylabel("milliseconds per step")
axes[0].legend(fontsize=7)
fig.suptitle("Where each rank's time goes (median step)", fontsize=10)
fig.tight_layout()
plt.show()

for label in SHOW:
    for exchange in ("capacity", "variable"):
        comp, load = per_rank(label, exchange, "compute_seconds"), per_rank(label, exchange, "slots")
        print(f"{label:28s} {exchange:9s} rows computed per rank {load.astype(int).tolist()}, "
              f"compute ms {np.round(comp * 1e3, 1).tolist()}, step ms "
              f"{np.round(per_rank(label, exchange, 'step_seconds') * 1e3, 1).tolist()}")

# %% [markdown]
# The exact part of Proposition 8.3, from the counts rather than the clocks: with fixed capacity
# every rank computes the same number of rows, and the share of them that is padding is
# $1 - \sum_w n_w / (W\cdot WLGC)$; in the variable exchange the rows are the loads $n_w$ and the
# waiting share of the proposition is {py:func}`~minimoe.parallel.idle_fraction` $= 1 - 1/I$.

# %%
for label in SHOW:
    rows_capacity = per_rank(label, "capacity", "slots")
    assert np.all(rows_capacity == rows_capacity[0]), f"{label}: unequal capacity buffers"
    received = per_rank(label, "capacity", "tokens_received")
    padding = 1 - received.sum() / rows_capacity.sum()
    assert 0 <= padding < 1
    loads = per_rank(label, "variable", "slots")
    imbalance = loads.max() / loads.mean()
    assert abs(idle_fraction(loads) - (1 - 1 / imbalance)) < 1e-12
    print(f"{label:28s} capacity: {int(rows_capacity[0])} rows per rank, padding {padding:.2f};  "
          f"variable: loads {loads.astype(int).tolist()}, waiting share 1 - 1/I = {idle_fraction(loads):.2f}")

# %% [markdown]
# What to look for. In the capacity exchange every rank computes on a buffer of the same shape, so
# the compute bars are equal up to noise. For dropless token choice they are large, because the
# buffer is sized for the busiest expert. In the variable exchange each rank computes on the rows
# it received: compute tracks the load, and the less loaded ranks wait for the busiest one before
# the combine. On a laptop the picture is blurred. The "network" is the loopback interface, the
# messages are small, so latency dominates transfer, and $W$ processes share a few cores, so a
# rank can wait simply because the scheduler ran another one. On a GPU node (`SCALE = "gpu"`, one
# rank per GPU, NCCL) compute and transfer have their real proportions. The counts and fills above
# are exact either way; these times are one measurement on one machine.
#
# (nb12-drop-formula)=
# ## Expected drops and padding of a fixed capacity
#
# Proposition 8.2 of the chapter: if each of the $T$ tokens of a group asks for $k$ distinct experts
# uniformly at random, the requests of one expert are Binomial$(T, k/E)$, and the expected
# dropped share and empty share of the slots follow exactly
# ({py:func}`~minimoe.parallel.expected_overflow`). We check the formula against 4000 simulated
# groups, and plot it against the capacity factor for a small and a large group.

# %%
gen = torch.Generator().manual_seed(0)


def simulate(T, E, k, C, n=4000):
    choice = torch.rand(n, T, E, generator=gen).topk(k, -1).indices
    loads = torch.zeros(n, E).scatter_add_(1, choice.reshape(n, -1), torch.ones(n, T * k))
    return ((loads - C).clamp_min(0).sum(-1) / (k * T)).mean().item(), ((C - loads).clamp_min(0).sum(-1)
                                                                          / (E * C)).mean().item()


print(f"{'T':>5s} {'E':>3s} {'k':>2s} {'C':>4s} {'drop (formula)':>15s} {'drop (simulated)':>17s} "
      f"{'empty (formula)':>16s} {'empty (simulated)':>18s}")
for T, E, k, C in [(64, 8, 1, 8), (256, 8, 1, 32), (256, 8, 2, 80), (1024, 16, 2, 128)]:
    drop, empty = expected_overflow(T, E, C, k=k)
    sim_drop, sim_empty = simulate(T, E, k, C)
    print(f"{T:5d} {E:3d} {k:2d} {C:4d} {drop:15.4f} {sim_drop:17.4f} {empty:16.4f} {sim_empty:18.4f}")
    assert abs(drop - sim_drop) < 0.01 and abs(empty - sim_empty) < 0.01

factors = np.linspace(0.5, 2.0, 31)
fig, ax = plt.subplots(figsize=(6.5, 3.8))
for T, style in ((32, ":"), (256, "--"), (4096, "-")):
    E = 8
    curve = [expected_overflow(T, E, max(1, round(c * T / E)))[0] for c in factors]
    ax.plot(factors, curve, style, color="tab:red", label=f"dropped requests, T={T}")
    ax.plot(factors, [expected_overflow(T, E, max(1, round(c * T / E)))[1] for c in factors], style,
            color="tab:blue", label=f"empty slots, T={T}")
ax.axvline(1.0, color="gray", lw=0.5)
ax.set_xlabel("capacity factor c (C = round(c T / E), E = 8, k = 1)")
ax.set_ylabel("expected share")
ax.set_title("A uniform router still drops at c = 1, less so in larger groups")
ax.legend(fontsize=7, ncol=2)
fig.tight_layout()
plt.show()
for T in (32, 256, 4096):
    print(f"T={T:5d}, c=1: {expected_overflow(T, 8, T // 8)[0]:.2%} of requests dropped; "
          f"normal approximation sqrt((E-k)/(2 pi k T)) = {math.sqrt(7 / (2 * math.pi * T)):.2%}")

# %% [markdown]
# Even a router that is balanced *in expectation* drops about $\sqrt{(E-k)/(2\pi kT)}$ of its
# requests at $c = 1$: the random fluctuation of the loads, relative to $T/E$, shrinks only like
# $1/\sqrt T$. The skewed tokens of our run drop far more (see {ref}`nb12-load`), because their
# router prefers some experts systematically.
#
# (nb12-idle)=
# ## The busiest rank sets the pace
#
# Without a capacity, the expert phase ends when the busiest rank ends. Proposition 8.4 bounds the
# expected largest load when each of the $WN$ tokens goes to a uniformly random rank:
# $\mathbb E\max_r L_r \le \min_{\lambda>0}\big(\log W + N(e^\lambda - 1)\big)/\lambda \approx N + \sqrt{2N\log W}$
# ({py:func}`~minimoe.parallel.max_load_bound`). Below, the bound against 2000 simulated steps, and
# the idle share $1 - N/\max_r L_r$ it implies.

# %%
N = CONFIG["tokens"]
worlds = [2, 4, 8, 16, 32, 64]
simulated, bounds = [], []
for W in worlds:
    ranks = torch.randint(0, W, (2000, W * N), generator=gen)
    loads = torch.zeros(2000, W).scatter_add_(1, ranks, torch.ones(2000, W * N))
    simulated.append(loads.amax(1).mean().item())
    bounds.append(max_load_bound(N, W))
    assert simulated[-1] <= bounds[-1]
fig, ax = plt.subplots(figsize=(6.5, 3.8))
ax.plot(worlds, [1 - N / m for m in simulated], "o-", label="simulated: 1 - N / E[max load]")
ax.plot(worlds, [1 - N / b for b in bounds], "s--", label="from the bound (Proposition 8.4)")
ax.set_xscale("log", base=2)
ax.set_xlabel("ranks W")
ax.set_ylabel("share of device time idle")
ax.set_title(f"Idle time of a uniform router, N = {N} tokens per rank")
ax.legend()
fig.tight_layout()
plt.show()
for W, m, b in zip(worlds, simulated, bounds):
    print(f"W={W:3d}: E[max load] simulated {m:7.1f}, bound {b:7.1f}, N + sqrt(2 N log W) = "
          f"{N + math.sqrt(2 * N * math.log(W)):7.1f}")
print(f"notebook run time: {time.perf_counter() - NOTEBOOK_START:.0f} s")

# %% [markdown]
# A perfectly uniform router already leaves a few percent of the device time idle, more with more
# ranks. A router that prefers some experts adds the rest. In our run the skewed dropless router's
# variable exchange would idle the share printed in {ref}`nb12-load`. This is the price the
# balanced routers avoid by construction: expert choice and BASE make every rank's load equal.
