"""The tables of chapter 9, written from a results file (``python -m minimoe.experiments show --markdown``).

The chapter quotes these tables verbatim, and ``tests/test_book_numbers.py`` checks that it still
does for the committed reference study: a number in the book is a number the code computes from the
committed file.
"""
from __future__ import annotations

from .. import routers as router_registry
from . import claims as claims_module
from . import stats
from .configs import TASKS
from .runner import summarize

__all__ = ["best_table", "results_table", "claims_table", "choosing_table", "baseline_comparisons", "baselines_table"]


def best_table(rows, task: str) -> dict:
    """:func:`minimoe.experiments.stats.best_set` of one task's headline metric over the routers in
    ``rows``: which are separated from the best, all pairs Holm-corrected together (book: chapter 9,
    "Separated from the best, honestly")."""
    metric, higher = claims_module.headline(task)
    return stats.best_set(stats.by_seed(rows, task, metric), higher_is_better=higher)


def _mean(rows, task, router, metric) -> float:
    return summarize(rows, metric, task=task).get(router, (float("nan"),))[0]


def results_table(rows) -> str:
    """Every registered router: per task, the mean of the quality metric and the paired difference to
    the task's best router with its 95% half-width (*tie* when no better router is separated from it,
    all pairs Holm-corrected together: :func:`best_table`), then the drop rate and the load imbalance
    per task. Sorted by the LM's loss."""
    routers = [r for r in router_registry.available() if any(row["router"] == r for row in rows)]
    router_rows = [r for r in rows if r["router"] in routers]
    tables = {task: best_table(router_rows, task) for task in TASKS}

    def cell(task, router):
        entry = tables[task]["rows"][router]
        if router == tables[task]["best"]:
            return f"**{entry['mean']:.4f}** (best)"
        d = entry["diff"]
        return f"{entry['mean']:.4f} ({d.mean:+.4f} ± {d.half_width:.4f}{'' if entry['separated'] else ', tie'})"

    lines = ["| router | LM val loss ↓ | clustered $R^2$ ↑ | vision accuracy ↑ | drop rate (LM / clustered / vision) "
             "| load imbalance (LM / clustered / vision) |", "|---|---|---|---|---|---|"]
    for router in sorted(routers, key=lambda r: tables["lm"]["rows"][r]["mean"]):
        drops = " / ".join(f"{_mean(rows, t, router, 'drop_rate'):.2f}" for t in TASKS)
        imbalance = " / ".join(f"{_mean(rows, t, router, 'load_imbalance'):.2f}" for t in TASKS)
        lines.append(f"| `{router}` | {cell('lm', router)} | {cell('clustered', router)} | {cell('vision', router)} "
                     f"| {drops} | {imbalance} |")
    return "\n".join(lines)


def claims_table(rows, *, section: str | None = None) -> str:
    """One row per (claim, task) of :func:`minimoe.experiments.claims.evaluate`: the two means, the
    paired difference (or ratio) with its 95% interval, the Holm-adjusted p-value and the verdict.
    ``section`` (a chapter's label, e.g. ``"ch5-reference"``): only the claims that chapter discusses,
    with the p-values of the whole table (one Holm family)."""
    lines = ["| paper | claim | task | A | B | A − B, 95% interval | p (Holm) | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    previous = None
    for row in claims_module.evaluate(rows):
        claim = row["claim"]
        if section is not None and claim.section != section:
            continue
        # B is another router (its name and mean) or a constant the claim compares with (just the value)
        b = f"`{row['b']}` {row['mean_b']:.4g}" if isinstance(row["b"], str) else f"constant {row['b']:g}"
        effect = claims_module.effect_text(row)
        verdict = f"**{row['verdict']}**" if row["verdict"] in ("holds", "reversed") else row["verdict"]
        head = (claim.paper, claim.claim)
        paper, text = head if head != previous else ("", "")
        previous = head
        lines.append(f"| {paper} | {text} | {row['task']} | `{claim.a}` {row['mean_a']:.4g} | {b} "
                     f"| {effect} | {stats.format_p(row['p_holm'])} | {verdict} |")
    return "\n".join(lines)


def choosing_table(rows) -> str:
    """The table of the "Choosing a router" page: every registered router's rank on each task's quality
    metric (1 = the best mean; *tie* when Holm does not separate it from the best), its training step's
    time relative to the default router's (softmax top-k, top-1 in the study) on the same task (the mean ``ms_per_step`` over seeds), and its drop
    rate. Sorted by the mean of the three ranks. *tie* as in :func:`results_table`."""
    routers = [r for r in router_registry.available() if any(row["router"] == r for row in rows)]
    router_rows = [r for r in rows if r["router"] in routers]
    ranks, verdicts, cost = {}, {}, {}
    for task in TASKS:
        metric, higher = claims_module.headline(task)
        table = best_table(router_rows, task)
        order = sorted(routers, key=lambda r: table["rows"][r]["mean"], reverse=higher)
        for rank, router in enumerate(order, start=1):
            ranks[task, router] = rank
            verdicts[task, router] = ("best" if router == table["best"] else
                                      "separated" if table["rows"][router]["separated"] else "tie")
        steps = summarize(rows, "ms_per_step", task=task)
        base = router_registry.DEFAULT_ROUTER  # softmax top-k, which the study runs at k = 1
        for router in routers:
            cost[task, router] = steps[router][0] / steps[base][0] if base in steps else float("nan")

    def rank_cell(task, router):
        verdict = verdicts[task, router]
        return f"{ranks[task, router]}" + {"best": " (best)", "tie": ", tie", "separated": ""}[verdict]

    lines = ["| router | rank LM | rank clustered | rank vision | step time vs top-1 (LM / clustered / vision) "
             "| drop rate (LM / clustered / vision) |", "|---|---|---|---|---|---|"]
    for router in sorted(routers, key=lambda r: (sum(ranks[t, r] for t in TASKS), r)):
        times = " / ".join(f"{cost[t, router]:.2f}x" for t in TASKS)
        drops = " / ".join(f"{_mean(rows, t, router, 'drop_rate'):.2f}" for t in TASKS)
        lines.append(f"| `{router}` | {rank_cell('lm', router)} | {rank_cell('clustered', router)} "
                     f"| {rank_cell('vision', router)} | {times} | {drops} |")
    return "\n".join(lines)


def baseline_comparisons(rows, *, alpha: float = 0.05) -> dict:
    """Every learned entry of a study (registered routers and variants) against every baseline that
    does not learn (:func:`minimoe.routers.baselines`), on each task's quality metric: the paired
    difference ``router - baseline`` over seeds, Holm-corrected over the whole family (every router,
    baseline and task at once). ``{(task, router, baseline): {"diff": Paired, "p_holm", "better",
    "worse"}}``, ``better``/``worse`` meaning separated in the router's favour or against it."""
    baselines = [b for b in router_registry.baselines() if any(row["router"] == b for row in rows)]
    learned = list(dict.fromkeys(row["router"] for row in rows if row["router"] not in baselines))
    out = {}
    for task in TASKS:
        metric, higher = claims_module.headline(task)
        values = stats.by_seed(rows, task, metric)
        for router in learned:
            for baseline in baselines:
                if router not in values or baseline not in values:
                    continue
                seeds = sorted(set(values[router]) & set(values[baseline]))
                if len(seeds) < 2:
                    continue
                diff = stats.paired([values[router][s] for s in seeds], [values[baseline][s] for s in seeds])
                out[task, router, baseline] = {"diff": diff, "higher_is_better": higher}
    keys = list(out)
    for key, p in zip(keys, stats.holm([out[k]["diff"].p_value for k in keys])):
        entry = out[key]
        ahead = (entry["diff"].mean > 0) == entry["higher_is_better"]
        entry.update(p_holm=p, better=p < alpha and ahead, worse=p < alpha and not ahead)
    return out


def baselines_table(rows, task: str) -> str:
    """One task's learned entries against the baselines (:func:`baseline_comparisons`, Holm over every
    task): each cell ``router - baseline`` with its 95% half-width, **bold** where the router is
    separated ahead of the baseline, *italic* where it is separated behind; the baselines' own means
    head the table. Rows sorted by the router's mean, best first."""
    comparisons = baseline_comparisons(rows)
    metric, higher = claims_module.headline(task)
    means = {r: m for r, (m, *_) in summarize(rows, metric, task=task).items()}
    baselines = [b for b in router_registry.baselines() if b in means]
    learned = sorted({r for (t, r, _) in comparisons if t == task}, key=lambda r: -means[r] if higher else means[r])
    arrow = "↑" if higher else "↓"
    head = " | ".join(f"− `{b}` ({means[b]:.4f})" for b in baselines)
    lines = [f"| router ({metric} {arrow}) | {head} |", "|---|" + "---|" * len(baselines)]
    for router in learned:
        cells = []
        for baseline in baselines:
            entry = comparisons.get((task, router, baseline))
            if entry is None:  # fewer than two seeds in common: nothing to compare
                cells.append("—")
                continue
            text = f"{entry['diff'].mean:+.4f} ± {entry['diff'].half_width:.4f}"
            cells.append(f"**{text}**" if entry["better"] else f"*{text}*" if entry["worse"] else text)
        lines.append(f"| `{router}` {means[router]:.4f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
