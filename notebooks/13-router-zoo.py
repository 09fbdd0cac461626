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
# # The router zoo
#
# Companion to {doc}`../book/09-what-the-routers-teach-us`. Every registered router of `minimoe`
# trains on the same three tasks at the same active compute, and we measure what each one buys and
# costs:
#
# * **quality**: validation loss of the character LM, $R^2$ of the clustered regression, accuracy of
#   the shape classifier;
# * **routing**: the fraction of tokens no expert processes (drop rate), the load of the busiest
#   expert over the mean load (imbalance), experts per token, the entropy of the router's
#   distribution;
# * **specialisation**: on the clustered task the right expert of every input is known, so we can
#   ask how often the router's top expert is the input's cluster (after the best relabelling of
#   experts);
# * **cost**: wall time per training step.
#
# Beside them train four **baselines that do not learn** (a fixed hash, a random expert, one dense
# network, one network as wide as all the experts), so that "router A beats router B" can be read
# against "routing helps". The numbers come from the committed **reference study**
# (`minimoe/experiments/results/reference-cpu/`: 8 paired seeds, 24 on the clustered task), made with
# `make reference-study`. Every router sees the same initialisation and the same batches at a seed, so
# routers are compared through their paired differences, with 95% intervals. The notebook first reruns
# a few of the committed runs live and checks that it gets the same numbers.
#
# *Run time:* about 30 seconds at CPU scale on a 2-core laptop CPU, the default. `MINIMOE_SCALE=gpu` chooses
# the larger configuration, for a GPU: the live run trains all 15 registered routers instead of 3, on all
# three tasks instead of the clustered one, with 3 seeds instead of 1, at the GPU sizes — on the clustered
# task alone about 2,000 times the arithmetic of the CPU scale (about 140 times per router and seed), plus the
# language-model and vision tasks, which the CPU scale does not run.

# %%
# Install minimoe when it is missing (e.g. on Colab), and scipy, which this notebook also uses.
import importlib.util
import subprocess
import sys

if importlib.util.find_spec("minimoe") is None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                           "minimoe[book] @ git+https://github.com/minimoe-book/minimoe", "scipy"])

# %%
import importlib.resources
import json
import os
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from scipy.stats import rankdata, spearmanr

import minimoe
from minimoe.experiments import (TASKS, claims, read_results, router_options, run, stats, study_variants,
                                 task_config)
from minimoe.experiments.runner import cpu_signature, same_processor

SCALE = os.environ.get("MINIMOE_SCALE", "cpu")  # "gpu" runs the larger configuration: chosen, never automatic
ROUTERS = minimoe.routers.available()
VARIANTS = study_variants()  # {entry: (router, options)}
BASELINES = minimoe.routers.baselines()  # hash, random, dense, dense_wide
HEADLINE = {task: claims.headline(task)[0] for task in TASKS}
HIGHER_IS_BETTER = {task: claims.headline(task)[1] for task in TASKS}
RESULTS = Path(str(importlib.resources.files("minimoe.experiments") / "results"))
NOTEBOOK_START = time.perf_counter()
print(f"SCALE={SCALE}: {len(ROUTERS)} routers, {len(VARIANTS)} variants and {len(BASELINES)} baselines "
      f"x {len(TASKS)} tasks")

# %% [markdown]
# (nb13-setup)=
# ## Equal footing
#
# Every router gets **one expert evaluation per token on average**: capacity routers have capacity
# factor 1 ($E\cdot C = T$ slots per routing group), the others route each token to $k=1$ expert,
# Soft MoE has $E \cdot S = T$ slots. Two routers spend differently by design, and the results show
# by how much: `probmoe_dynamic` draws 1 or 2 experts per token, and DenseMixer runs every expert in
# its backward pass. Two *variants* join the study because a paper's claim is about them:
# `ssr_p0` is SSR with its Sinkhorn coin switched off (noise only), and `softmax_topk_dropless` is
# top-1 under the Switch loss without capacity, the comparator of loss-free balancing. The tasks of
# the reference study, and what a routing group is in each:

# %%
for task in TASKS:
    c = task_config(task, "reference")
    print(f"{task:10s} steps={c.steps:5d} batch={c.batch_size:4d} experts={c.n_experts} d_model={c.d_model} "
          f"d_hidden={c.d_hidden} tokens per routing group={c.group_size} lr={c.lr:g} ({c.lr_schedule}) "
          f"data={c.data}")
print()
print(f"{'entry':25s} options (lm; the clustered and vision tasks differ only in Soft MoE's slots)")
for entry in [*ROUTERS, *VARIANTS, *BASELINES]:
    rule = minimoe.routers.router_class(VARIANTS[entry][0] if entry in VARIANTS else entry).training_rule
    extra = f"  + {rule}" if rule else ""
    extra += f"  (variant of {VARIANTS[entry][0]})" if entry in VARIANTS else ""
    extra += "  (baseline: does not learn)" if entry in BASELINES else ""
    print(f"{entry:25s} {router_options(entry, task_config('lm', 'reference'))}{extra}")

# %% [markdown]
# Why these tasks. The LM reads **prose and Python code interleaved** (the standard library's
# help topics and the source of 18 of its modules), two kinds of text that want different experts.
# The clustered task has **32 clusters on 8 experts**, so every expert must serve four clusters and
# which clusters a router puts together decides the fit. The vision task has **16 classes** (8
# shapes at 2 sizes). Each run ends with a cosine decay of the learning rate, so the final metric is
# that of a settled model, not of the last noisy steps.
#
# The LM routes the tokens **at the same position of the 32 sequences of a batch** together
# (`routing_groups="position"`). Routing a whole sequence as a group would let expert choice,
# Sinkhorn, BASE, Soft MoE and USMoE look at later characters of the same sequence: they would
# win the LM by reading the answer (chapter 6, "Which tokens compete"). By position, every router is
# causal; `tests/test_experiments.py::test_position_grouping_is_causal_for_every_router` checks it.

# %% [markdown]
# (nb13-committed)=
# ## The committed study and its provenance
#
# The folder holds the tidy results file (one row per task, router, seed and metric) and
# `provenance.json`: the commands, the commit, the processor and the library versions.

# %%
REFERENCE = RESULTS / "reference-cpu"
provenance = json.loads((REFERENCE / "provenance.json").read_text())
rows = read_results(REFERENCE)
print("commands:")
for part in [provenance, *provenance.get("resumed", [])]:
    print(f"  {part['command']}\n    commit {part['commit'][:10]}"
          f"{' (with uncommitted changes)' if part.get('uncommitted_changes') else ''}, {part['date']}")
print(f"processor: {provenance['cpu']} ({provenance['cpu_capability']}, flags {provenance['cpu_flags_sha1']}), "
      f"torch {provenance['torch']}, Python {provenance['python']}")
runs = {(r["task"], r["router"], r["seed"]): r["wall_time_s"] for r in rows}
print(f"{len(rows)} rows, {len(runs)} training runs, {sum(runs.values()) / 3600:.2f} CPU-hours of training")
for task in TASKS:
    seeds = sorted({s for (t, _, s) in runs if t == task})
    print(f"  {task:10s} seeds {seeds[0]}..{seeds[-1]} ({len(seeds)}), "
          f"{sum(w for (t, _, _), w in runs.items() if t == task) / 3600:.2f} CPU-hours")

# %% [markdown]
# (nb13-run)=
# ## Rerunning part of it live
#
# A run is a function of (task, router, seed): the batches of a step come from a generator seeded by
# (seed, step), the model from the seed. Below, three of the clustered task's runs at seed 0 (a
# token-choice, an optimal-transport and a soft router), at the reference configuration, on one
# thread as in the study (about a minute), are compared with the committed ones as chapter 9's
# contract says: the mean loss of the first five steps to $10^{-4}$, the end of training inside the
# range of the router's seeds widened by half. On the processor and code that made the study the
# numbers agree digit for digit; elsewhere the last bits of float32 arithmetic differ and training
# amplifies them, as a new seed would. On a GPU this cell runs the `gpu` configuration of the zoo
# instead (its own, larger experiment: all routers, three seeds; see the last section).

# %%
LIVE_ROUTERS = ["softmax_topk", "sinkhorn_expert_choice", "soft_moe"]
start = time.perf_counter()
if SCALE == "cpu":
    # fresh=True: a rerun of the notebook recomputes, instead of resuming a finished folder
    live_path = run("clustered", LIVE_ROUTERS, scale="reference", seeds=1, out=Path("runs/nb13-live"), threads=1,
                    progress=False, fresh=True, command="notebook 13, the live rerun")
else:
    live_path = run("all", "all", scale="gpu", seeds=3, out=Path("runs/zoo-gpu"), progress=False,
                    command="notebook 13, run('all', 'all', scale='gpu', seeds=3)")
live = read_results(live_path)
print(f"{len(live)} rows in {time.perf_counter() - start:.0f} s")

same_machine = same_processor(provenance)
if SCALE == "cpu":
    committed = {(r["task"], r["router"], r["seed"], r["metric"]): r["value"] for r in rows}
    pairs = [(committed[(r["task"], r["router"], r["seed"], r["metric"])], r["value"], r["metric"]) for r in live
             if r["metric"] != "ms_per_step"]
    gap = max(abs(a - b) / max(abs(a), 1e-12) for a, b, _ in pairs)
    print(f"{len(pairs)} values compared with the committed study: largest relative difference {gap:.3g}")
    first = [(a, b) for a, b, metric in pairs if metric == "train_loss_first"]
    assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in first), first
    for r in live:
        if r["metric"] != "ms_per_step":
            cell = [c["value"] for c in rows if (c["task"], c["router"], c["metric"]) == (r["task"], r["router"], r["metric"])]
            low, high = min(cell), max(cell)
            assert low - (high - low) / 2 <= r["value"] <= high + (high - low) / 2, r
    if gap == 0:
        verdict = "identical, digit for digit"
    elif same_machine:
        verdict = "not identical: the code has changed since the study (chapter 9)"
    else:
        verdict = f"not identical: this processor ({cpu_signature()}) rounds otherwise than the study's"
    print(f"the first five steps agree to 1e-4 and every end value lies inside its cell; {verdict}")

# %% [markdown]
# (nb13-quality)=
# ## Quality, with intervals
#
# For each task: every router's paired difference to the best router (router minus best, in the
# metric's own units, oriented so that right is worse), with its 95% Student-t interval over the
# seeds. A router is *separated* (filled) when some better router is separated from it after Holm's
# correction over **all pairs** of routers at once, and a *tie* (open) otherwise: the best router
# was chosen for being ahead, and only a family that contains every pair keeps that choice from
# inflating the error (chapter 9, "Separated from the best, honestly"). Variants and the baselines
# are left out of this figure: they answer the claims and the baseline table below.

# %%
def symlog_axis(ax, values, linthresh):
    """A symmetric-log x axis around 0 that shows every value: linear within +-linthresh (where the
    close calls are), logarithmic beyond (where the routers that fail by a wide margin are)."""
    low, high = min(min(values), -linthresh), max(max(values), linthresh)
    ax.set_xscale("symlog", linthresh=linthresh, linscale=0.6)
    ax.set_xlim(low * 1.6 if low < -linthresh else -linthresh, high * 1.6)
    ticks = [t for t in (-1, -0.1, -0.01, 0, 0.01, 0.1, 1) if low * 1.6 <= t <= high * 1.6]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])


# %%
LINTHRESH = {"lm": 0.01, "clustered": 0.005, "vision": 0.005}
fig, axes = plt.subplots(len(TASKS), 1, figsize=(9, 16))  # one panel per task, stacked: readable at page width
resolution = {}
for ax, task in zip(axes, TASKS):
    metric, higher = HEADLINE[task], HIGHER_IS_BETTER[task]
    router_rows = [r for r in rows if r["router"] in ROUTERS]
    result = stats.best_set(stats.by_seed(router_rows, task, metric), higher_is_better=higher)
    best, table = result["best"], result["rows"]
    worse = {r: (0.0 if r == best else (-1 if higher else 1) * table[r]["diff"].mean) for r in table}
    order = sorted(table, key=worse.get)
    half_widths = [table[r]["diff"].half_width for r in table if r != best]
    extent = [0.0]
    resolution[task] = (best, stats.median(half_widths), sum(table[r].get("separated", False) for r in table))
    for y, router in enumerate(order):
        if router == best:
            ax.plot(0, y, "D", color="black", ms=6)
            continue
        d = table[router]["diff"]
        sign = -1 if higher else 1
        low, high = sorted((sign * d.low, sign * d.high))
        separated = table[router]["separated"]
        # separated means beaten by a better router after Holm over all pairs: every router that beats
        # it has the better mean, and the router of best mean is never separated
        assert not separated or all(table[b]["mean"] * (1 if higher else -1) > table[router]["mean"] * (1 if higher else -1)
                                    for b in table[router]["beaten_by"]), router
        color = "tab:orange" if router == "softmax_topk" else "tab:blue"
        ax.plot([low, high], [y, y], color=color, lw=2)
        ax.plot(sign * d.mean, y, "o", color=color, mfc=color if separated else "white", ms=6)
        extent += [low, high]
    ax.axvline(0, color="gray", lw=0.8)
    ax.set_yticks(range(len(order)), [f"{r} ({table[r]['mean']:.4g})" for r in order], fontsize=9)
    ax.invert_yaxis()
    symlog_axis(ax, extent, LINTHRESH[task])
    ax.set_xlabel(f"{metric}: best router minus router (worse to the right)" if higher
                  else f"{metric}: router minus best router (worse to the right)")
    ax.set_title(f"{task}: best = {best}; median half-width {resolution[task][1]:.4f}")
fig.suptitle("Paired differences to the best router, 95% intervals over seeds\n"
             "(filled: separated, Holm over all pairs; open: tie; orange: softmax top-1)")
fig.tight_layout()
plt.show()

# %%
TARGET = {"lm": 0.015, "clustered": 0.004, "vision": 0.004}
for task, (best, half, separated) in resolution.items():
    print(f"{task:10s} best {best:24s} median half-width {half:.4f} (target {TARGET[task]}), "
          f"{separated} of {len(ROUTERS) - 1} routers separated from it")

# %% [markdown]
# The x axis is linear near zero and logarithmic beyond, so the close calls and the routers that
# fail by a wide margin fit on one axis. How wide an interval is tells what the study can resolve on
# that task; chapter 9 reads the figure.

# %% [markdown]
# (nb13-baselines)=
# ## Baselines that do not learn
#
# Is a learned router better than no learning at all? Four controls run through the same layer, with
# the same experts, optimiser and data: `hash` sends each token to the expert a fixed hash of its
# *key* picks (its id in the LM, the sign pattern of fixed random projections of its raw input on the
# other tasks), `random` draws an expert uniformly at every forward, `dense` sends every token to one
# expert (one feed-forward network of the same active compute), and `dense_wide` sends every token
# to every expert with weight 1 (one network as wide as all experts together: the same parameters, eight
# times the compute). The two hashes, from scratch, next to the package's:

# %%
def hash_ids(ids, n_experts, a, b, p=2**31 - 1):
    """Hash routing of token ids (Roller et al. 2021): a fixed universal hash, chosen before training."""
    return (ids * a + b) % p % n_experts


def hash_vectors(vectors, directions, n_experts):
    """Random-hyperplane hashing of raw inputs: the signs of fixed projections, read as a binary number."""
    bits = (vectors.double() @ directions > 0).long()
    return (bits * 2 ** torch.arange(bits.shape[-1])).sum(-1) % n_experts


hasher = minimoe.routers.build("hash", d_model=8, n_experts=8)
ids, patches = torch.randint(0, 167, (4, 32)), torch.rand(4, 16, 16)
assert torch.equal(hash_ids(ids, 8, hasher.hash_a, hasher.hash_b), hasher.hash_keys(ids))
assert torch.equal(hash_vectors(patches, hasher.directions(16), 8), hasher.hash_keys(patches))
print("experts of the first 12 ids:", hash_ids(ids[0, :12], 8, hasher.hash_a, hasher.hash_b).tolist())

# %% [markdown]
# Every learned router against the best of the three equal-compute controls (`hash`, `random`,
# `dense`) on each task, and where the eight-times-wider dense network stands (the dashed line).
# Filled dots are separated from that control after Holm's correction over every (router, control,
# task) comparison ({py:func}`minimoe.experiments.report.baseline_comparisons`).

# %%
from minimoe.experiments import report

comparisons = report.baseline_comparisons(rows)
fig, axes = plt.subplots(1, len(TASKS), figsize=(13, 6), sharey=False)
for ax, task in zip(axes, TASKS):
    metric, higher = HEADLINE[task], HIGHER_IS_BETTER[task]
    means = {r: m for r, (m, *_) in minimoe.experiments.summarize(rows, metric, task=task).items()}
    sign = 1 if higher else -1  # right is better on every panel
    control = max(("hash", "random", "dense"), key=lambda b: sign * means[b])
    learned = sorted(ROUTERS, key=lambda r: sign * comparisons[task, r, control]["diff"].mean)
    for y, router in enumerate(learned):
        entry = comparisons[task, router, control]
        d = entry["diff"]
        low, high = sorted((sign * d.low, sign * d.high))
        filled = entry["better"] or entry["worse"]
        ax.plot([low, high], [y, y], color="tab:blue", lw=2)
        ax.plot(sign * d.mean, y, "o", color="tab:blue", mfc="tab:blue" if filled else "white", ms=6)
    ax.axvline(0, color="gray", lw=0.8)
    ax.axvline(sign * (means["dense_wide"] - means[control]), color="tab:red", ls="--", lw=1, label="dense_wide")
    ax.set_yticks(range(len(learned)), learned, fontsize=8)
    ax.set_xlabel(f"{metric}: router vs {control}\n(better to the right)")
    ax.set_title(f"{task}: best control {control} ({means[control]:.4g})", fontsize=10)
axes[0].legend(loc="lower right", fontsize=8)
fig.suptitle("Learned routers against the best equal-compute control, paired 95% intervals")
fig.tight_layout()
plt.show()

# %%
for task in TASKS:
    ahead = {b: sum(comparisons[task, r, b]["better"] for r in ROUTERS) for b in BASELINES}
    behind = {b: sum(comparisons[task, r, b]["worse"] for r in ROUTERS) for b in BASELINES}
    print(f"{task:10s} " + "; ".join(f"{b}: {ahead[b]} routers ahead, {behind[b]} behind" for b in BASELINES))

# %% [markdown]
# (nb13-claims)=
# ## The papers' claims, re-tested
#
# Each claim is "router A beats router B on a metric", tested on every task by the paired
# difference over seeds. Holm's correction runs over the whole table, so a verdict of *holds* or
# *reversed* survives the number of claims tested; *tie* means the Holm-adjusted p-value is 0.05 or
# more, so the unadjusted 95% interval of a tie may exclude 0 (chapter 9, {ref}`ch9-reading`). Kool et
# al.'s two "trains as well as Switch" claims are not superiority claims: each is tested as "not
# worse by a margin fixed before the study" (non-inferiority, {ref}`ch9-equivalence`), with the
# verdicts *holds* or *not shown*. The figure shows the claims about quality, oriented so that right
# means the paper's direction.

# %%
results = claims.evaluate(rows)
quality = [r for r in results if r["claim"].metric == "quality"]
fig, axes = plt.subplots(len(TASKS), 1, figsize=(9, 14), sharey=True)
labels = list(dict.fromkeys(f"{r['claim'].a} vs {r['claim'].b if r['claim'].b != claims.BEST_OTHER else 'best other'}"
                            for r in quality))
colors = {"holds": "tab:green", "reversed": "tab:red", "tie": "tab:gray", "not shown": "tab:purple"}
for ax, task in zip(axes, TASKS):
    extent = [0.0]
    for r in quality:
        if r["task"] != task:
            continue
        y = labels.index(f"{r['claim'].a} vs {r['claim'].b if r['claim'].b != claims.BEST_OTHER else 'best other'}")
        sign = 1 if r["higher_is_better"] else -1  # right = the paper's direction
        d = r["diff"]
        low, high = sorted((sign * d.low, sign * d.high))
        ax.plot([low, high], [y, y], color=colors[r["verdict"]], lw=2)
        ax.plot(sign * d.mean, y, "o", color=colors[r["verdict"]], ms=6)
        extent += [low, high]
    ax.axvline(0, color="black", lw=0.8)
    symlog_axis(ax, extent, LINTHRESH[task])
    ax.set_xlabel(f"{HEADLINE[task]} difference, oriented: A better than B  →")
    ax.set_title(task)
axes[0].set_yticks(range(len(labels)), labels, fontsize=9)
axes[0].invert_yaxis()
for ax in axes:
    ax.set_ylabel("claim: A beats B")
fig.suptitle("The papers' quality claims: paired effect and 95% interval\n"
             "(green: holds, red: reversed, grey: tie, purple: not shown; Holm over the whole table)")
fig.tight_layout()
plt.show()
print(claims.format_table(results))

# %% [markdown]
# The "as well as" rows read off an interval too, a one-sided one: the claim holds when the bad end of
# the 90% paired interval stays inside the margin (before Holm's correction; with it, the p-value
# decides).

# %%
for r in results:
    test = r["equivalence"]
    if test is None:
        continue
    bad_end = test.low if r["higher_is_better"] else test.high
    sign = 1 if r["higher_is_better"] else -1
    assert test.equivalent == (sign * bad_end > -test.margin)   # the interval rule of Proposition 9.4
    assert r["verdict"] == ("holds" if r["p_holm"] < 0.05 else "not shown")
    print(f"{r['claim'].a:22s} {r['task']:10s} A - B {test.mean:+.4f}, 90% interval [{test.low:+.4f}, {test.high:+.4f}], "
          f"margin {test.margin:g}: {r['verdict']}")

# %% [markdown]
# (nb13-accounting)=
# ### Where the unused compute goes
#
# {ref}`Proposition 9.5 <ch9-prop-accounting>`: with $E\cdot C = T$ slots, a dropped token is
# either an empty slot (top-1 token choice: experts per token $= 1 -$ drop rate) or the price of a
# token served twice (expert choice fills every slot: experts per token $= 1$, drop rate $=$ the
# excess $\sum_{j\ge 2}(j-1)\,n_j$). Every run of the committed study obeys both identities.

# %%
by_run = {}
for r in rows:
    by_run.setdefault((r["task"], r["router"], r["seed"]), {})[r["metric"]] = r["value"]
checked = 0
for (task, router, seed), m in by_run.items():
    if router in ("softmax_topk", "sinkhorn_token_choice", "kool_skip"):  # top-1 with capacity C = T/E
        assert abs(m["experts_per_token"] + m["drop_rate"] - 1) < 1e-9, (task, router, seed)
        checked += 1
    if router in ("expert_choice", "sinkhorn_expert_choice"):  # every slot filled
        assert abs(m["experts_per_token"] - 1) < 1e-9, (task, router, seed)
        checked += 1
print(f"both identities hold on the {checked} runs they apply to")


def table(source, task, metric):
    """router -> (mean, half-range, values) over seeds."""
    values = {}
    for r in source:
        if r["task"] == task and r["metric"] == metric:
            values.setdefault(r["router"], []).append(r["value"])
    return {k: (float(np.mean(v)), (max(v) - min(v)) / 2, v) for k, v in values.items()}


for router in ("softmax_topk", "expert_choice"):
    print(f"{router:14s} " + "   ".join(
        f"{task}: drop {table(rows, task, 'drop_rate')[router][0]:.3f}, experts/token "
        f"{table(rows, task, 'experts_per_token')[router][0]:.3f}" for task in TASKS))

# %% [markdown]
# (nb13-routing)=
# ## Routing behaviour at a glance
#
# One row per router, one column per metric, one panel per task. Colour is the rank within the
# column (dark: the most of it); the number is the mean over seeds. Drop rate, imbalance, experts
# per token and entropy are averaged over the last quarter of training (the routing the model
# trains with, capacity included; several routers route differently at evaluation).

# %%
COLUMNS = ["drop_rate", "load_imbalance", "experts_per_token", "routing_entropy", "specialisation", "ms_per_step"]
ENTRIES = [*ROUTERS, *VARIANTS]
fig, axes = plt.subplots(len(TASKS), 1, figsize=(9, 20))
for ax, task in zip(axes, TASKS):
    cols = [c for c in COLUMNS if any(r["task"] == task and r["metric"] == c for r in rows)]
    grid = np.full((len(ENTRIES), len(cols)), np.nan)
    for j, c in enumerate(cols):
        t = table(rows, task, c)
        for i, entry in enumerate(ENTRIES):
            if entry in t:
                grid[i, j] = t[entry][0]
    ranks = np.full_like(grid, np.nan)
    for j in range(len(cols)):
        ok = ~np.isnan(grid[:, j])
        ranks[ok, j] = (rankdata(grid[ok, j]) - 1) / max(ok.sum() - 1, 1)  # ties share a colour
    ax.imshow(np.ma.masked_invalid(ranks), cmap="Blues", aspect="auto", vmin=-0.2, vmax=1.2)
    for i in range(len(ENTRIES)):
        for j in range(len(cols)):
            text = "–" if np.isnan(grid[i, j]) else f"{grid[i, j]:.3g}"
            ax.text(j, i, text, ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(cols)), [c.replace("_", "\n") for c in cols], fontsize=8)
    ax.set_yticks(range(len(ENTRIES)), ENTRIES, fontsize=8)
    ax.set_ylabel("router (the last two: variants)")
    ax.set_xlabel("metric")
    ax.set_title(f"{task}: routing metrics (mean over seeds)")
fig.tight_layout()
plt.show()

# %% [markdown]
# Routing entropy is that of each router's own distribution over experts (for Soft MoE, of the
# combine weights summed over each expert's slots). Soft MoE's "experts per token" is $E$ because
# every token mixes every slot, although its compute is the same $T$ expert evaluations per group.
# The times per step are from two training processes running side by side on a 2-core machine.

# %% [markdown]
# (nb13-specialisation)=
# ## Does the router find the true experts?
#
# On the clustered task each input belongs to one of 32 clusters with its own nonlinear map, and 8
# experts must share them. Agreement of the router's top expert with the cluster is taken after the
# best one-to-one matching of experts to clusters ({py:func}`minimoe.experiments.specialisation`).
# With 32 clusters of about equal size, a matching covers 8 of them, so about $8/32$ is the most
# any router reaches; a router that serves whole clusters with whole experts gets there, one that
# scatters each cluster over several experts stays below. A dropped input never agrees.

# %%
t_spec = table(rows, "clustered", "specialisation")
t_r2 = table(rows, "clustered", "val_r2")
order = [r for r in sorted(t_spec, key=lambda r: -t_spec[r][0]) if r in ROUTERS]
fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 4.8))
ax.bar(range(len(order)), [t_spec[r][0] for r in order], color="tab:green", alpha=0.5)
for x, r in enumerate(order):
    ax.plot([x] * len(t_spec[r][2]), t_spec[r][2], "o", color="black", ms=3)
clustered_config = task_config("clustered", "reference")
ax.axhline(clustered_config.n_experts / clustered_config.data["n_clusters"], color="gray", ls="--",
           label="the most a one-to-one matching allows (about 8/32)")
ax.set_xticks(range(len(order)), order, rotation=60, ha="right", fontsize=8)
ax.set_ylabel("agreement with the true cluster")
ax.set_title("Specialisation on the clustered task (dots: seeds)")
ax.legend(loc="lower left")
for r in order:
    ax2.errorbar(t_spec[r][0], t_r2[r][0], xerr=t_spec[r][1], yerr=t_r2[r][1], fmt="o", ms=4)
    ax2.annotate(r, (t_spec[r][0], t_r2[r][0]), fontsize=7, xytext=(3, 3), textcoords="offset points")
ax2.set_xlabel("specialisation (agreement with the true cluster)")
ax2.set_ylabel("validation R^2")
ax2.set_title("Does finding the clusters pay? (bars: seed half-range)")
fig.tight_layout()
plt.show()
rho = spearmanr([t_spec[r][0] for r in order], [t_r2[r][0] for r in order])
print(f"Spearman rank correlation between specialisation and R^2 over the {len(order)} routers: "
      f"{rho.statistic:.2f} (p = {rho.pvalue:.2g})")

# %% [markdown]
# (nb13-tradeoff)=
# ## What each router costs
#
# Quality against wall time per training step (the routing, the layer and its backward; one CPU
# thread), one panel per task. Left of a panel is cheaper; the quality axis points up for "better"
# on every task.

# %%
fig, axes = plt.subplots(len(TASKS), 1, figsize=(9, 15))
for ax, task in zip(axes, TASKS):
    q, ms = table(rows, task, HEADLINE[task]), table(rows, task, "ms_per_step")
    for r in ROUTERS:
        ax.errorbar(ms[r][0], q[r][0], yerr=q[r][1], fmt="o", ms=4,
                    color="tab:orange" if r == "softmax_topk" else "tab:blue")
        ax.annotate(r, (ms[r][0], q[r][0]), fontsize=7, xytext=(3, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("ms per training step (log)")
    ax.set_ylabel(HEADLINE[task])
    if not HIGHER_IS_BETTER[task]:
        ax.invert_yaxis()
    ax.set_title(f"{task}: quality vs cost (bars: seed half-range)")
fig.tight_layout()
plt.show()
cost = {r: np.mean([table(rows, t, "ms_per_step")[r][0] / table(rows, t, "ms_per_step")["softmax_topk"][0]
                    for t in TASKS]) for r in ROUTERS}
print("time per step relative to softmax_topk, mean over the three tasks:")
print("  " + ", ".join(f"{r} {cost[r]:.2f}x" for r in sorted(cost, key=cost.get)))

# %% [markdown]
# (nb13-transfer)=
# ## Does a ranking transfer between tasks?
#
# If one router were simply better, its rank would be the same on every task. Spearman's rank
# correlation between the tasks' quality rankings (signs aligned so that larger is better), and
# between quality and drop rate within each task.

# %%
score = {t: {r: (1 if HIGHER_IS_BETTER[t] else -1) * v[0] for r, v in table(rows, t, HEADLINE[t]).items()}
         for t in TASKS}
for a in range(len(TASKS)):
    for b in range(a + 1, len(TASKS)):
        ta, tb = TASKS[a], TASKS[b]
        rho = spearmanr([score[ta][r] for r in ROUTERS], [score[tb][r] for r in ROUTERS])
        print(f"rank correlation of quality, {ta} vs {tb}: {rho.statistic:+.2f} (p = {rho.pvalue:.2g})")
for t in TASKS:
    drops = table(rows, t, "drop_rate")
    rho = spearmanr([score[t][r] for r in ROUTERS], [drops[r][0] for r in ROUTERS])
    print(f"{t}: rank correlation of quality with drop rate: {rho.statistic:+.2f} (p = {rho.pvalue:.2g})")
mean_rank = {r: np.mean([sorted(ROUTERS, key=lambda x: -score[t][x]).index(r) + 1 for t in TASKS]) for r in ROUTERS}
print("\nmean rank over the three tasks (1 = best):")
print("  " + ", ".join(f"{r} {mean_rank[r]:.1f}" for r in sorted(mean_rank, key=mean_rank.get)))

# %% [markdown]
# (nb13-gpu)=
# ## At GPU scale
#
# The `gpu` configuration (a 4-layer LM of width 256 with 16 experts on the whole corpus, a 6-block
# ViT on 32×32 shapes, the clustered task with 16 clusters and 262k samples; 1500–2000 steps) runs
# with
#
# ```bash
# python -m minimoe.experiments run --task all --routers all --scale gpu --seeds 3 --out runs/zoo-gpu
# ```
#
# (this notebook runs it in "Rerunning part of it live" when CUDA is present) and resumes from its
# last checkpoint if the session drops. Committing `runs/zoo-gpu` as
# `minimoe/experiments/results/gpu/` makes it appear below with its provenance. No GPU run has been
# made for this book, and none is filled in.

# %%
gpu_runs = {}
for folder in sorted(p for p in RESULTS.glob("*") if (p / "results.csv").exists()):
    folder_provenance = json.loads((folder / "provenance.json").read_text())
    if "cpu" not in folder_provenance["device"].lower():
        gpu_runs[folder.name] = (folder_provenance, read_results(folder))
if SCALE == "gpu":
    gpu_runs["live gpu run"] = ({"device": torch.cuda.get_device_name(), "commit": "this checkout", "date": "now"},
                                live)
for name, (gpu_provenance, gpu_rows) in gpu_runs.items():
    print(f"{name}: {gpu_provenance['device']}, commit {gpu_provenance['commit'][:10]} ({gpu_provenance['date']})")
    for task in TASKS:
        if any(r["task"] == task for r in gpu_rows):
            result = stats.best_set(stats.by_seed([r for r in gpu_rows if r["router"] in ROUTERS], task, HEADLINE[task]),
                                    higher_is_better=HIGHER_IS_BETTER[task])
            widths = [e["diff"].half_width for e in result["rows"].values() if "diff" in e]
            print(f"  {task:10s} best {result['best']}, median half-width "
                  f"{stats.median(widths) if widths else float('nan'):.4f}")
if not gpu_runs:
    print("No GPU run has been committed.")
print(f"notebook wall time {time.perf_counter() - NOTEBOOK_START:.0f} s")
