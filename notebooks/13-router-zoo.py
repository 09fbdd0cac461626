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
# The runs come from {py:func}`minimoe.experiments.run`, the function behind
# `python -m minimoe.experiments run`: the same configurations (`toy` on a CPU, `gpu` on one large
# GPU), the same results file, the same checkpoints. Rerunning this notebook resumes an interrupted
# run instead of starting again.

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
from minimoe.experiments import (REINFORCE_ROUTERS, TASKS, make_task, read_results, router_options, run, summarize,
                                 task_config)

SCALE = os.environ.get("MINIMOE_SCALE") or ("gpu" if torch.cuda.is_available() else "cpu")
ZOO_SCALE = "toy" if SCALE == "cpu" else "gpu"
SEEDS = 2 if SCALE == "cpu" else 3  # the committed CPU reference below has 3 (same configuration)
THREADS = 1 if SCALE == "cpu" else None  # tiny matrices: one thread is as fast as two, and robust to a busy machine
OUT = Path(f"runs/zoo-{ZOO_SCALE}")
ROUTERS = minimoe.routers.available()
HEADLINE = {"lm": "val_loss", "clustered": "val_r2", "vision": "val_accuracy"}
HIGHER_IS_BETTER = {"lm": False, "clustered": True, "vision": True}
print(f"SCALE={SCALE} -> zoo scale {ZOO_SCALE!r}, {len(ROUTERS)} routers x {len(TASKS)} tasks x {SEEDS} seeds")
NOTEBOOK_START = time.perf_counter()

# %% [markdown]
# (nb13-setup)=
# ## Equal footing
#
# Every router gets **one expert evaluation per token on average**: capacity routers have capacity
# factor 1 ($E\cdot C = T$ slots per routing group), the others route each token to $k=1$ expert,
# Soft MoE has $E \cdot S = T$ slots. Two routers spend differently by design, and the results show
# by how much: `probmoe_dynamic` draws 1 or 2 experts per token, and DenseMixer runs every expert in
# its backward pass. The tasks, and what a routing group is in each:

# %%
for task in TASKS:
    c = task_config(task, ZOO_SCALE)
    print(f"{task:10s} steps={c.steps:5d} batch={c.batch_size:5d} experts={c.n_experts:3d} d_model={c.d_model:4d} "
          f"d_hidden={c.d_hidden:4d} tokens per routing group={c.group_size:4d} "
          f"slots per expert={c.group_size // c.n_experts}")
print()
print(f"{'router':25s} options (lm; the clustered and vision tasks differ only in Soft MoE's slots)")
for router in ROUTERS:
    extra = "  + REINFORCE surrogate, moving-average baseline" if router in REINFORCE_ROUTERS else ""
    print(f"{router:25s} {router_options(router, task_config('lm', ZOO_SCALE))}{extra}")

# %% [markdown]
# The LM routes the tokens **at the same position of the 16 sequences of a batch** together
# (`routing_groups="position"`). Routing a whole sequence as a group would let expert choice,
# Sinkhorn, BASE, Soft MoE and USMoE look at later characters of the same sequence: they would
# win the LM by reading the answer (chapter 6, "Which tokens compete"). By position, every router is
# causal; `tests/test_experiments.py::test_position_grouping_is_causal_for_every_router` checks it.

# %% [markdown]
# (nb13-run)=
# ## Training the zoo

# %%
start = time.perf_counter()
results_path = run("all", "all", scale=ZOO_SCALE, seeds=SEEDS, out=OUT, threads=THREADS,
                   command=f"notebook 13, run('all', 'all', scale={ZOO_SCALE!r}, seeds={SEEDS})")
rows = read_results(results_path)
print(f"{len(rows)} result rows in {results_path} after {time.perf_counter() - start:.0f} s")


def table(rows, task, metric):
    """router -> (mean, half-range, values) over seeds."""
    values = {}
    for r in rows:
        if r["task"] == task and r["metric"] == metric:
            values.setdefault(r["router"], []).append(r["value"])
    return {k: (float(np.mean(v)), (max(v) - min(v)) / 2, v) for k, v in values.items()}


assert {r["router"] for r in rows} == set(ROUTERS) and {r["task"] for r in rows} == set(TASKS)
assert all(np.isfinite(r["value"]) for r in rows)

# %% [markdown]
# (nb13-committed)=
# ## Committed runs and their provenance
#
# Results of runs made with the command line are committed under `minimoe/experiments/results/`,
# each with the command, commit, device and date that produced it. The CPU reference was made with
# the same configuration as the live run above, so on a CPU the two should agree digit for digit
# (the code is deterministic given the seed, one thread); the times per step are measurements and
# differ. A GPU run appears here only once one has been made and committed: nothing is filled in.

# %%
committed = {}
results_root = Path(str(importlib.resources.files("minimoe.experiments") / "results"))
for folder in sorted(p for p in results_root.glob("*") if (p / "results.csv").exists()):
    provenance = json.loads((folder / "provenance.json").read_text())
    committed[folder.name] = (provenance, read_results(folder))
    print(f"{folder.name}: {provenance['command']}\n    commit {provenance['commit'][:10]}"
          f"{' (with uncommitted changes)' if provenance.get('uncommitted_changes') else ''}, {provenance['date']}, "
          f"{provenance['device']}, torch {provenance['torch']}, {len(committed[folder.name][1])} rows")

reference = committed.get(f"{ZOO_SCALE}-cpu")
if reference is not None and SCALE == "cpu":
    live = {(r["task"], r["router"], r["seed"], r["metric"]): r["value"] for r in rows if r["metric"] != "ms_per_step"}
    ref = {(r["task"], r["router"], r["seed"], r["metric"]): r["value"] for r in reference[1]
           if r["metric"] != "ms_per_step"}
    shared = live.keys() & ref.keys()
    gap = max(abs(live[k] - ref[k]) for k in shared)
    print(f"\nlive vs committed {ZOO_SCALE}-cpu on {len(shared)} shared values: max |difference| = {gap:.3g}"
          + ("  (identical)" if gap == 0 else "  (the code or the machine changed since the committed run)"))
gpu_runs = {name: data for name, data in committed.items() if data[0]["device"].lower().find("cpu") < 0}
print("GPU runs committed:", ", ".join(gpu_runs) if gpu_runs else "none yet (see the last section)")

# %% [markdown]
# (nb13-quality)=
# ## Quality
#
# One panel per task; routers sorted best first; each seed is a dot, the bar is the mean. Beside
# them, when a GPU run has been committed, its results (on their own axis: a larger model reaches
# other values).

# %%
sources = [("live " + ZOO_SCALE, rows)] + [(f"committed {name}", data[1]) for name, data in gpu_runs.items()]
fig, axes = plt.subplots(len(sources), len(TASKS), figsize=(16, 5.2 * len(sources)), squeeze=False)
for row_axes, (label, source) in zip(axes, sources):
    for ax, task in zip(row_axes, TASKS):
        t = table(source, task, HEADLINE[task])
        order = sorted(t, key=lambda r: t[r][0], reverse=HIGHER_IS_BETTER[task])
        for y, router in enumerate(order):
            mean, half, values = t[router]
            ax.barh(y, mean, color="tab:blue" if router != "softmax_topk" else "tab:orange", alpha=0.35)
            ax.plot(values, [y] * len(values), "o", color="black", ms=3)
        ax.set_yticks(range(len(order)), order, fontsize=8)
        ax.invert_yaxis()
        lo = min(min(v[2]) for v in t.values())
        hi = max(max(v[2]) for v in t.values())
        ax.set_xlim(lo - 0.1 * (hi - lo), hi + 0.1 * (hi - lo))
        ax.set_xlabel(HEADLINE[task] + (" (higher is better)" if HIGHER_IS_BETTER[task] else " (lower is better)"))
        ax.set_title(f"{task} ({label})")
fig.suptitle("Quality of every router at equal active compute (dots: seeds; bars: mean; orange: softmax top-1)")
fig.tight_layout()
plt.show()

# %% [markdown]
# How many routers can we actually tell apart? We call two routers *separated* on a task when
# their seed ranges do not overlap. Below: the routers separated from the best one, and from
# softmax top-1 (Switch), the default everyone starts from.

# %%
verdicts = {}
for task in TASKS:
    t = table(rows, task, HEADLINE[task])
    sign = 1 if HIGHER_IS_BETTER[task] else -1
    best = max(t, key=lambda r: sign * t[r][0])

    def separated(a, b):
        return min(t[a][2]) > max(t[b][2]) or min(t[b][2]) > max(t[a][2])

    tied = [r for r in t if not separated(r, best)]
    beat_switch = [r for r in t if separated(r, "softmax_topk") and sign * (t[r][0] - t["softmax_topk"][0]) > 0]
    lose_switch = [r for r in t if separated(r, "softmax_topk") and sign * (t[r][0] - t["softmax_topk"][0]) < 0]
    verdicts[task] = dict(best=best, tied=tied, beat_switch=beat_switch, lose_switch=lose_switch)
    print(f"{task:10s} best {best} ({t[best][0]:.4g}); not separated from it: {len(tied) - 1} others")
    print(f"{'':10s} separated and better than softmax_topk: {', '.join(beat_switch) or 'none'}")
    print(f"{'':10s} separated and worse than softmax_topk:  {', '.join(lose_switch) or 'none'}")

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
fig, axes = plt.subplots(1, len(TASKS), figsize=(18, 6.5))
for ax, task in zip(axes, TASKS):
    cols = [c for c in COLUMNS if any(r["task"] == task and r["metric"] == c for r in rows)]
    grid = np.full((len(ROUTERS), len(cols)), np.nan)
    for j, c in enumerate(cols):
        t = table(rows, task, c)
        for i, router in enumerate(ROUTERS):
            if router in t:
                grid[i, j] = t[router][0]
    ranks = np.full_like(grid, np.nan)
    for j in range(len(cols)):
        ok = ~np.isnan(grid[:, j])
        ranks[ok, j] = (rankdata(grid[ok, j]) - 1) / max(ok.sum() - 1, 1)  # ties share a colour
    ax.imshow(np.ma.masked_invalid(ranks), cmap="Blues", aspect="auto", vmin=-0.2, vmax=1.2)
    for i in range(len(ROUTERS)):
        for j in range(len(cols)):
            text = "–" if np.isnan(grid[i, j]) else f"{grid[i, j]:.3g}"
            ax.text(j, i, text, ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(cols)), [c.replace("_", "\n") for c in cols], fontsize=8)
    ax.set_yticks(range(len(ROUTERS)), ROUTERS if ax is axes[0] else [""] * len(ROUTERS), fontsize=8)
    ax.set_xlabel("metric")
    ax.set_title(f"{task}: routing metrics (mean over seeds)")
axes[0].set_ylabel("router")
fig.tight_layout()
plt.show()

# %% [markdown]
# Routing entropy is that of each router's own distribution over experts (for Soft MoE, of the
# combine weights summed over each expert's slots). Soft MoE's "experts per token" is $E$ because
# every token mixes every slot, although its compute is the same $T$ expert evaluations per group.

# %% [markdown]
# (nb13-accounting)=
# ### Where the unused compute goes
#
# {ref}`Proposition 9.1 <ch9-prop-accounting>`: with $E\cdot C = T$ slots, a dropped token is
# either an empty slot (top-1 token choice: experts per token $= 1 -$ drop rate) or the price of a
# token served twice (expert choice fills every slot: experts per token $= 1$, drop rate $=$ the
# excess $\sum_{j\ge 2}(j-1)\,n_j$). The results file obeys both identities run by run.

# %%
by_run = {}
for r in rows:
    by_run.setdefault((r["task"], r["router"], r["seed"]), {})[r["metric"]] = r["value"]
for (task, router, seed), m in by_run.items():
    if router in ("softmax_topk", "sinkhorn_token_choice", "kool_skip"):  # top-1 with capacity C = T/E
        assert abs(m["experts_per_token"] + m["drop_rate"] - 1) < 1e-9, (task, router, seed)
    if router in ("expert_choice", "sinkhorn_expert_choice"):  # every slot filled
        assert abs(m["experts_per_token"] - 1) < 1e-9, (task, router, seed)
for router in ("softmax_topk", "expert_choice"):
    print(f"{router:14s} " + "   ".join(
        f"{task}: drop {table(rows, task, 'drop_rate')[router][0]:.3f}, experts/token "
        f"{table(rows, task, 'experts_per_token')[router][0]:.3f}" for task in TASKS))

# %% [markdown]
# (nb13-specialisation)=
# ## Does the router find the true experts?
#
# On the clustered task each input belongs to one of 8 clusters with its own nonlinear map; a
# router that sends each cluster to its own expert lets every expert fit one map. Agreement of the
# router's top expert with the cluster, after the best one-to-one relabelling (Hungarian algorithm
# on the contingency table); a dropped input never agrees.

# %%
t_spec = table(rows, "clustered", "specialisation")
t_r2 = table(rows, "clustered", "val_r2")
order = sorted(t_spec, key=lambda r: -t_spec[r][0])
fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 4.5))
ax.bar(range(len(order)), [t_spec[r][0] for r in order], color="tab:green", alpha=0.5)
for x, r in enumerate(order):
    ax.plot([x] * len(t_spec[r][2]), t_spec[r][2], "o", color="black", ms=3)
ax.axhline(1 / task_config("clustered", ZOO_SCALE).n_experts, color="gray", ls="--", label="chance (1/E)")
ax.set_xticks(range(len(order)), order, rotation=60, ha="right", fontsize=8)
ax.set_ylabel("agreement with the true expert")
ax.set_title("Specialisation on the clustered task (dots: seeds)")
ax.legend()
for r in order:
    ax2.errorbar(t_spec[r][0], t_r2[r][0], xerr=t_spec[r][1], yerr=t_r2[r][1], fmt="o", ms=4)
    ax2.annotate(r, (t_spec[r][0], t_r2[r][0]), fontsize=7, xytext=(3, 3), textcoords="offset points")
ax2.set_xlabel("specialisation (agreement with the true expert)")
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
# thread at the toy scale), one panel per task. Left of a panel is cheaper; the quality axis points
# up for "better" on every task.

# %%
fig, axes = plt.subplots(1, len(TASKS), figsize=(17, 5))
for ax, task in zip(axes, TASKS):
    q, ms = table(rows, task, HEADLINE[task]), table(rows, task, "ms_per_step")
    for r in q:
        ax.errorbar(ms[r][0], q[r][0], yerr=q[r][1], fmt="o", ms=4,
                    color="tab:orange" if r == "softmax_topk" else "tab:blue")
        ax.annotate(r, (ms[r][0], q[r][0]), fontsize=7, xytext=(3, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("ms per training step (log)")
    ax.set_ylabel(HEADLINE[task])
    if not HIGHER_IS_BETTER[task]:
        ax.invert_yaxis()
    ax.set_title(f"{task}: quality vs cost")
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
mean_rank = {r: np.mean([sorted(score[t], key=score[t].get, reverse=True).index(r) + 1 for t in TASKS])
             for r in ROUTERS}
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
# and resumes from its last checkpoint if the session drops. Committing `runs/zoo-gpu` as
# `minimoe/experiments/results/gpu/` makes its results appear in the quality figure above, beside
# the live ones, with the provenance printed in "Committed runs".

# %%
if gpu_runs:
    for name, (provenance, gpu_rows) in gpu_runs.items():
        print(f"{name}: made on {provenance['device']} at commit {provenance['commit'][:10]} ({provenance['date']})")
else:
    print("No GPU run has been committed: the quality figure shows the live run only.")
print(f"notebook wall time {time.perf_counter() - NOTEBOOK_START:.0f} s")
