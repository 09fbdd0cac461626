"""``python -m minimoe.experiments run ...`` trains the zoo; ``... show FOLDER`` prints its table."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import routers as router_registry
from . import claims as claims_module
from . import report, runner, stats
from .configs import SCALES
from .runner import read_results, run, study_origin, summarize

HEADLINE = {task: claims_module.headline(task)[0] for task in ("lm", "clustered", "vision")}
COLUMNS = ("drop_rate", "load_imbalance", "experts_per_token", "routing_entropy", "specialisation", "ms_per_step")


def intervals(rows, task: str) -> str:
    """Each router against the best one on the task's headline metric: the paired difference over the
    common seeds, its 95% t interval, the smallest Holm-adjusted p-value against a better router (all
    pairs corrected together, :func:`minimoe.experiments.stats.best_set`) and separated / tie; then
    the median half-width, the number chapter 9 reports as the study's resolution."""
    metric, higher = claims_module.headline(task)
    # the baselines that do not learn are compared with the routers in their own table (report.baselines_table)
    rows = [r for r in rows if r["router"] not in router_registry.baselines()]
    # a run still in progress (another command on the folder) or a smaller study: routers with fewer
    # than two seeds cannot be paired yet, and are named instead
    seeds = stats.by_seed(rows, task, metric)
    few = sorted(r for r, v in seeds.items() if len(v) < 2)
    rows = [r for r in rows if r["task"] != task or r["router"] not in few]
    note = [f"  (not compared yet, fewer than two seeds: {', '.join(few)})"] if few else []
    try:
        result = report.best_table(rows, task)
    except ValueError as error:  # e.g. two routers that share fewer than two seeds
        return "\n".join([f"  paired intervals against the best router: not yet ({error})", *note])
    best, table = result["best"], result["rows"]
    lines = [f"  paired 95% intervals against the best router, {best} ({metric}, "
             f"{'higher' if higher else 'lower'} is better; separated: a better router is, Holm over all "
             f"{len(table) * (len(table) - 1) // 2} pairs)",
             f"  {'router':24s} {'mean':>10s} {'router - best':>14s} {'95% interval':>22s} {'half-width':>11s} "
             f"{'p (Holm)':>9s}  verdict"]
    order = sorted(table, key=lambda r: table[r]["mean"], reverse=higher)
    half_widths = []
    for router in order:
        entry = table[router]
        if router == best:
            lines.append(f"  {router:24s} {entry['mean']:10.4f} {'(best)':>14s}")
            continue
        d = entry["diff"]
        half_widths.append(d.half_width)
        lines.append(f"  {router:24s} {entry['mean']:10.4f} {d.mean:+14.4f} {f'[{d.low:+.4f}, {d.high:+.4f}]':>22s} "
                     f"{d.half_width:11.4f} {stats.format_p(entry['p_holm']):>9s}  {'separated' if entry['separated'] else 'tie'}")
    if half_widths:
        lines.append(f"  median half-width {stats.median(half_widths):.4f}; separated from the best: "
                     f"{sum(table[r].get('separated', False) for r in table)} of {len(table) - 1}")
    return "\n".join(lines + note)


def _uneven_seeds(rows, task: str, metrics) -> list[str]:
    """Warnings for the routers whose metrics were not all measured on the same seeds: their means in
    the table below are then over different seeds, and not comparable column to column."""
    lines = []
    for router in dict.fromkeys(r["router"] for r in rows if r["task"] == task):
        seeds = {m: {r["seed"] for r in rows if (r["task"], r["router"], r["metric"]) == (task, router, m)}
                 for m in metrics}
        every = set().union(*seeds.values())
        gaps = {m: sorted(every - s) for m, s in seeds.items() if s and s != every}
        for metric, missing in gaps.items():
            lines.append(f"  warning: {router}: {metric} is missing for seeds {missing}, so its mean is over other "
                         "seeds than the other columns' (a damaged results file: rerun those runs)")
    return lines


def show(path) -> str:
    """A plain-text table: per task, each router's headline metric and routing metrics (mean ± half-range),
    then (with at least two seeds) the paired intervals against the best router and the papers' claims."""
    rows = read_results(path)
    if not rows:
        raise ValueError(f"{path} holds no results yet: nothing to show")
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    lines = [study_origin(folder)["sentence"], ""] if (folder / "provenance.json").exists() else []
    for task in dict.fromkeys(r["task"] for r in rows):
        metrics = [HEADLINE.get(task, "val_loss"),
                   *[m for m in COLUMNS if any(r["metric"] == m and r["task"] == task for r in rows)]]
        tables = {m: summarize(rows, m, task=task) for m in metrics}
        seeds = max((n for _, _, n in tables[metrics[0]].values()), default=0)
        lines.append(f"{task}  ({seeds} seeds; mean ± half-range)")
        lines += _uneven_seeds(rows, task, metrics)
        lines.append(f"  {'router':24s}" + "".join(f"{m:>22s}" for m in metrics))
        for router in tables[metrics[0]]:
            cells = []
            for m in metrics:
                mean, half, _ = tables[m].get(router, (float("nan"), 0.0, 0))
                cells.append(f"{mean:13.4g} ± {half:<6.2g}")
            lines.append(f"  {router:24s}" + "".join(f"{c:>22s}" for c in cells))
        lines.append("")
        if seeds >= 2:
            lines += [intervals(rows, task), ""]
    evaluated = claims_module.evaluate(rows)
    if evaluated:
        lines += ["the papers' claims (a beats b; Holm over the whole table)",
                  claims_module.format_table(evaluated), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minimoe.experiments", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="train routers on tasks; the same command resumes an interrupted run")
    p.add_argument("--task", default="all", help="lm, clustered, vision, a comma-separated list, or all")
    p.add_argument("--routers", default="all", help="registered router names, comma-separated, or all")
    p.add_argument("--scale", default="toy", choices=sorted(SCALES))
    p.add_argument("--seeds", type=int, default=3, help="number of seeds (0 .. seeds-1)")
    p.add_argument("--out", default=None, help="results folder (default runs/zoo-<scale>)")
    p.add_argument("--device", default=None, help="cpu, cuda, mps (default: the best available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per worker (default: torch's choice)")
    p.add_argument("--workers", type=int, default=1, help="training processes side by side (default 1)")
    p.add_argument("--steps", type=int, default=None, help="override every task's number of steps")
    p.add_argument("--checkpoint-every", type=int, default=None, help="override the checkpoint interval (steps)")
    p.add_argument("--fresh", action="store_true", help="discard the folder's results and checkpoints first")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    s = sub.add_parser("show", help="print the table of a results folder or file")
    s.add_argument("path")
    s.add_argument("--markdown", action="store_true", help="the tables of chapter 9, in Markdown")
    args = parser.parse_args(argv)
    if args.command == "show":
        try:
            if args.markdown:
                rows = read_results(args.path)
                tables = [report.results_table(rows), report.claims_table(rows)]
                if any(row["router"] in router_registry.baselines() for row in rows):
                    tables += [report.baselines_table(rows, task) for task in SCALES["reference"]]
                print("\n\n".join(tables))
            else:
                print(show(args.path))
        except FileNotFoundError:
            parser.error(f"no results at {args.path!r}: give a results folder or its results.csv")
        except ValueError as error:  # a damaged or empty results file: its message names the file and the fix
            parser.error(str(error))
        return 0
    # `is not None`, not truthiness: --steps 0 must be refused, not replaced by the default
    overrides = {k: v for k, v in (("steps", args.steps), ("checkpoint_every", args.checkpoint_every))
                 if v is not None}
    try:
        path = run(args.task, args.routers, scale=args.scale, seeds=args.seeds, out=args.out, device=args.device,
                   threads=args.threads, workers=args.workers,
                   fresh=args.fresh, progress=not args.no_progress, **overrides)
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    print(show(path))
    done = runner.LAST_RUN
    total = len(done["trained"]) + len(done["by_others"]) + done["already_done"]
    print(f"results: {path} (this command trained {len(done['trained'])} of {total} runs; "
          f"{len(done['by_others'])} trained by another command on the folder; {done['already_done']} done before)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
