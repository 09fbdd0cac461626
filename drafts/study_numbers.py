"""Every number the prose of chapters 3-7, 9, 10, the choosing page and README quotes, computed from
the results file (run at the merge; prints a sheet to paste from). Usage:
python drafts/study_numbers.py [results folder]"""
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from scipy.stats import spearmanr

from minimoe import routers as registry
from minimoe.experiments import claims, read_results, report, stats
from minimoe.experiments.configs import TASKS
from minimoe.experiments.runner import summarize

ROOT = Path(__file__).resolve().parents[1]
folder = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "minimoe/experiments/results/reference-cpu"
rows = read_results(folder)
ROUTERS = [r for r in registry.available() if any(row["router"] == r for row in rows)]
BASELINES = [b for b in registry.baselines() if any(row["router"] == b for row in rows)]
ENTRIES = list(dict.fromkeys(row["router"] for row in rows))


def h(title):
    print(f"\n## {title}\n")


def mean_of(task, router, metric):
    return summarize(rows, metric, task=task).get(router, (float("nan"),))[0]


h("Size and cost")
runs = {(r["task"], r["router"], r["seed"]): r for r in rows if r["metric"] == "ms_per_step"}
total = 0.0
for task in TASKS:
    walls = [r["wall_time_s"] for (t, *_), r in runs.items() if t == task]
    seeds = sorted({s for (t, _, s) in runs if t == task})
    total += sum(walls)
    print(f"{task}: {len(walls)} runs, seeds {len(seeds)}, mean {statistics.mean(walls):.1f} s per run, "
          f"{sum(walls) / 3600:.2f} CPU-h")
print(f"entries {len(ENTRIES)} ({len(ROUTERS)} routers), runs {len(runs)}, total {total / 3600:.2f} CPU-h, "
      f"about {total / 3600 / 2:.1f} h wall on two workers")

h("Resolution against the best (best_set over the registered routers)")
for task in TASKS:
    metric, higher = claims.headline(task)
    values = {r: v for r, v in stats.by_seed(rows, task, metric).items() if r in ROUTERS}
    table = stats.best_set(values, higher_is_better=higher)
    others = [r for r in ROUTERS if r != table["best"]]
    hw = [table["rows"][r]["diff"].half_width for r in others]
    sd = [e.half_width * math.sqrt(e.n) / stats.t_quantile(0.975, e.n - 1)
          for e in (table["rows"][r]["diff"] for r in others)]
    sep = [r for r in others if table["rows"][r]["separated"]]
    leader = stats.compare_to_best([row for row in rows if row["router"] in ROUTERS], task, metric,
                                   higher_is_better=higher)
    lead_sep = sum(1 for r, e in leader.get("rows", leader).items() if isinstance(e, dict) and e.get("separated"))
    n = len(next(iter(values.values())))
    print(f"{task}: best {table['best']} ({table['rows'][table['best']]['mean']:.4f}), seeds {n}, "
          f"median half-width {stats.median(hw):.4f}, median s_d {stats.median(sd):.4f},",
          f"separated {len(sep)} of {len(others)} (leader's comparisons: {lead_sep})")
    print("   not separated:", ", ".join(r for r in others if r not in sep))
    if True:
        target = {"lm": 0.015, "clustered": 0.004, "vision": 0.004}[task]
        s = stats.median(sd)
        print(f"   seeds for a half-width {target}: (1.96*{s:.4f}/{target})^2 = {(1.96 * s / target) ** 2:.0f}")
    for r in sorted(others, key=lambda r: -table["rows"][r]["mean"] if higher else table["rows"][r]["mean"]):
        e = table["rows"][r]
        print(f"   {r:28s} {e['mean']:.4f} {e['diff'].mean:+.4f} ± {e['diff'].half_width:.4f} "
              f"p_holm {e['p_holm']:.3g} {'SEP' if e['separated'] else 'tie'} beaten by {e['beaten_by'][:3]}")

h("Seeds (LM): per-router range, best and worst seed")
for task in TASKS:
    metric, higher = claims.headline(task)
    values = stats.by_seed(rows, task, metric)
    best_seed, worst_seed = defaultdict(int), defaultdict(int)
    for r, v in values.items():
        order = sorted(v, key=lambda s: v[s], reverse=higher)
        best_seed[order[0]] += 1
        worst_seed[order[-1]] += 1
    print(f"{task}: best seed counts {dict(best_seed)}, worst seed counts {dict(worst_seed)}")
    for r in ENTRIES:
        v = values[r]
        print(f"   {r:28s} {min(v.values()):.4f}-{max(v.values()):.4f} sd {statistics.stdev(v.values()):.4f}")

h("Baselines")
comparisons = report.baseline_comparisons(rows)
for task in TASKS:
    metric, higher = claims.headline(task)
    print(f"{task}: baselines " + ", ".join(f"{b} {mean_of(task, b, metric):.4f}" for b in BASELINES))
    for b in BASELINES:
        better = [r for (t, r, bb), e in comparisons.items() if t == task and bb == b and e["better"]]
        worse = [r for (t, r, bb), e in comparisons.items() if t == task and bb == b and e["worse"]]
        tie = [r for (t, r, bb), e in comparisons.items() if t == task and bb == b and not e["better"] and not e["worse"]]
        print(f"   vs {b}: ahead {len(better)}, behind {len(worse)} {worse}, tie {len(tie)} {tie}")
    values = stats.by_seed(rows, task, metric)
    if "dense" in values and "dense_wide" in values:
        common = sorted(set(values["dense_wide"]) & set(values["dense"]))
        d = stats.paired([values["dense_wide"][s] for s in common], [values["dense"][s] for s in common])
        print(f"   dense_wide - dense {d.mean:+.4f} ± {d.half_width:.4f} p {d.p_value:.3g}")
        qd, qw = mean_of(task, "dense", metric), mean_of(task, "dense_wide", metric)
        for r in ROUTERS:
            print(f"      r({r}) = {(mean_of(task, r, metric) - qd) / (qw - qd):+.2f}")

h("Claims")
results = claims.evaluate(rows)
counts = defaultdict(int)
for row in results:
    counts[row["verdict"]] += 1
print(f"{len(results)} tests: {dict(counts)}")
print(claims.format_table(results))

h("Routing and cost (means over seeds; cost relative to softmax_topk's ms_per_step)")
for task in TASKS:
    base = mean_of(task, "softmax_topk", "ms_per_step")
    print(f"{task}:")
    for r in ENTRIES:
        print(f"   {r:28s} drop {mean_of(task, r, 'drop_rate'):.3f} imb {mean_of(task, r, 'load_imbalance'):.2f} "
              f"ept {mean_of(task, r, 'experts_per_token'):.3f} cost {mean_of(task, r, 'ms_per_step') / base:.2f}x")

h("Transfer of rankings (Spearman over the registered routers' mean quality, sign so higher is better)")
score = {}
for task in TASKS:
    metric, higher = claims.headline(task)
    score[task] = {r: (1 if higher else -1) * mean_of(task, r, metric) for r in ROUTERS}
for i, a in enumerate(TASKS):
    for b in TASKS[i + 1:]:
        rho = spearmanr([score[a][r] for r in ROUTERS], [score[b][r] for r in ROUTERS])
        print(f"{a} vs {b}: rho {rho.statistic:+.2f} p {rho.pvalue:.3f}")
spec = {r: mean_of("clustered", r, "specialisation") for r in ROUTERS}
rho = spearmanr([spec[r] for r in ROUTERS], [score["clustered"][r] for r in ROUTERS])
print(f"specialisation vs R^2: rho {rho.statistic:+.2f} p {rho.pvalue:.3f}")
for r in sorted(ROUTERS, key=spec.get):
    print(f"   {r:28s} specialisation {spec[r]:.3f}")

h("The capacity (softmax_topk_dropless - softmax_topk)")
for task in TASKS:
    metric, higher = claims.headline(task)
    values = stats.by_seed(rows, task, metric)
    if "softmax_topk_dropless" in values:
        seeds = sorted(set(values["softmax_topk"]) & set(values["softmax_topk_dropless"]))
        d = stats.paired([values["softmax_topk_dropless"][s] for s in seeds], [values["softmax_topk"][s] for s in seeds])
        print(f"{task}: {d.mean:+.4f} ± {d.half_width:.4f} p {d.p_value:.3g}")
