"""Where a task's seed-to-seed noise comes from (book: chapter 9, "How finely the study resolves").

A paired difference between two routers, ``d_s = L_A(s) - L_B(s)`` over seeds ``s``, varies for two
reasons: the two trainings of seed ``s`` end at different points (training noise), and the
validation sample on which both are measured is finite (evaluation noise). This module trains
``routers x seeds`` runs exactly as the study does (:func:`~minimoe.experiments.runner.train_one`)
and evaluates each final model on

* the study's fixed validation batches (``fixed``),
* ``draws`` further independent draws of the same size (``draw0 .. draw{draws-1}``), and
* the whole validation split, every character once (``whole``),

and, with ``ema_decay``, the same on an exponential moving average of the weights (``ema_...``).
:func:`decompose` then splits the variance of ``d_s`` under the fixed batches into its evaluation
part, ``mean_s var_j d_{s,j}`` over the independent draws ``j`` (what a different fixed sample would
have changed), and the rest, training noise; and reports the spread under the whole split and under
the average.

``python -m minimoe.experiments.noise --routers softmax_topk,expert_choice --seeds 6 --draws 8``
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import torch

from ..ops._checks import check_int
from .configs import task_config
from .runner import cpu_signature, train_one
from .tasks import LanguageModelling

NOISE_SEED = 7  # the independent validation draws: another generator than the study's EVAL_SEED


class _NoiseTask(LanguageModelling):
    """The study's LM task whose final evaluation measures the model on every validation sample."""

    def __init__(self, config, draws: int):
        super().__init__(config)
        self.whole = self.whole_split_batches()
        # a draw has the study's number of batches, or, where the study evaluates the whole split, as
        # many random batches as the whole split has
        size = config.eval_batches if config.eval_batches is not None else len(self.whole)
        generator = torch.Generator().manual_seed(NOISE_SEED)
        self.draws = [self.random_batches(size, generator) for _ in range(draws)]

    def evaluate(self, model, device, batches=None):
        out = {"fixed": super().evaluate(model, device)["val_loss"],
               "whole": super().evaluate(model, device, self.whole)["val_loss"]}
        for j, draw in enumerate(self.draws):
            out[f"draw{j}"] = super().evaluate(model, device, draw)["val_loss"]
        return out


def _job(args):
    router, seed, draws, ema_decay, scale, overrides = args
    torch.set_num_threads(1)
    config = task_config("lm", scale, ema_decay=ema_decay, **overrides)
    metrics, wall = train_one(_NoiseTask(config, draws), router, seed, device=torch.device("cpu"), progress=False)
    return {"router": router, "seed": seed, "wall_time_s": wall,
            **{k: v for k, v in metrics.items() if k.startswith(("fixed", "whole", "draw", "ema_"))}}


def measure(routers, seeds: int, draws: int = 8, *, ema_decay: float | None = 0.99, workers: int = 2,
            scale: str = "reference", **overrides) -> list[dict]:
    """Train and evaluate every (router, seed) as described in the module docstring; one row per run.
    ``overrides`` replace fields of the task's configuration (``steps=1600``). Needs two seeds and
    two draws at least (a spread over seeds, and one over draws), checked before anything trains."""
    if len(routers) < 2:
        raise ValueError(f"routers must name at least two routers (the decomposition is of paired differences), "
                         f"got {list(routers)}")
    check_int(seeds, "seeds", low=2)
    check_int(draws, "draws", low=2)
    check_int(workers, "workers", low=1)
    task_config("lm", scale, ema_decay=ema_decay, **overrides)  # a bad option fails here, not in a worker
    jobs = [(r, s, draws, ema_decay, scale, overrides) for r in routers for s in range(seeds)]
    if workers == 1:
        return [_job(job) for job in jobs]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        return list(pool.imap(_job, jobs))


def _paired(rows, a, b, key):
    by = {(r["router"], r["seed"]): r for r in rows}
    seeds = sorted(s for (r, s) in by if r == a and (b, s) in by)
    return [by[(a, s)][key] - by[(b, s)][key] for s in seeds]


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else float("nan")


def decompose(rows: list[dict], draws: int) -> dict:
    """Per pair of routers: the standard deviation over seeds of the paired difference under each
    evaluation, and the split of its variance under the fixed batches into evaluation and training
    parts (module docstring). Every value in nats."""
    routers = list(dict.fromkeys(r["router"] for r in rows))
    pairs = {}
    for a, b in itertools.combinations(routers, 2):
        per_draw = [_paired(rows, a, b, f"draw{j}") for j in range(draws)]
        eval_var = statistics.mean(statistics.variance([d[s] for d in per_draw]) for s in range(len(per_draw[0])))
        fixed = _paired(rows, a, b, "fixed")
        entry = {"seeds": len(fixed), "mean_whole": statistics.mean(_paired(rows, a, b, "whole")),
                 "sd_fixed": statistics.stdev(fixed), "sd_whole": statistics.stdev(_paired(rows, a, b, "whole")),
                 "sd_eval_sampling": math.sqrt(eval_var),
                 "eval_share_of_variance": _share(eval_var, statistics.variance(fixed))}
        if all("ema_whole" in row for row in rows):
            entry["sd_ema_whole"] = statistics.stdev(_paired(rows, a, b, "ema_whole"))
            entry["mean_ema_whole"] = statistics.mean(_paired(rows, a, b, "ema_whole"))
        pairs[f"{a} - {b}"] = entry
    per_router = {r: {"mean_whole": statistics.mean(x["whole"] for x in rows if x["router"] == r),
                      "sd_whole": statistics.stdev(x["whole"] for x in rows if x["router"] == r),
                      **({"mean_ema_whole": statistics.mean(x["ema_whole"] for x in rows if x["router"] == r),
                          "sd_ema_whole": statistics.stdev(x["ema_whole"] for x in rows if x["router"] == r)}
                         if all("ema_whole" in row for row in rows) else {})}
                  for r in routers}
    return {"pairs": pairs, "routers": per_router}


def _commit() -> tuple[str, bool]:
    """The commit of the package's code and whether ``minimoe/`` has uncommitted changes."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "minimoe"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return commit, bool(dirty)
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minimoe.experiments.noise", description=__doc__.split("\n")[0])
    parser.add_argument("--routers", default="softmax_topk,expert_choice,sinkhorn_token_choice")
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--draws", type=int, default=8)
    parser.add_argument("--ema-decay", type=float, default=0.99, help="the weight average's decay (0: none)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--scale", default="reference")
    parser.add_argument("--steps", type=int, default=None, help="train this many steps instead of the scale's")
    parser.add_argument("--out", default=None, help="a JSON file for the runs and the decomposition")
    args = parser.parse_args(argv)
    started = time.time()
    overrides = {} if args.steps is None else {"steps": args.steps}
    rows = measure(args.routers.split(","), args.seeds, args.draws, ema_decay=args.ema_decay or None,
                   workers=args.workers, scale=args.scale, **overrides)
    commit, dirty = _commit()
    report = {"command": " ".join(["python -m minimoe.experiments.noise", *(argv or sys.argv[1:])]),
              "commit": commit, "uncommitted_changes": dirty, **cpu_signature(), "torch": torch.__version__,
              "seconds": time.time() - started, "cpu_seconds": sum(r["wall_time_s"] for r in rows), "runs": rows}

    def write():
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")

    write()  # the runs first: a decomposition that fails must not lose what was trained
    result = decompose(rows, args.draws)
    report.update(result)
    write()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
