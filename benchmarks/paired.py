"""``python -m benchmarks.paired ROUTER[,ROUTER...] [--rounds 6] [--T 4096] [--E 64]``: each router's
training-mode overhead against the top-1 floor, measured in rounds; ``python -m benchmarks.paired
from_logits``: softmax_topk from the logits (capacity factor 1 and dropless, T = 8192, E = 64, k = 2)
against softmax + top-k, as the first section of ``python -m benchmarks``; ``python -m
benchmarks.paired ksubset``: ``ksubset_marginals`` at T = 8192, E = 64, k = 8 against autograd through
the loop DP, in float32 and float64, reported as speed-ups (loop over minimoe; the goal is >= 5x);
``python -m benchmarks.paired optimizer_step``: gradient clipping and one AdamW step on the
parameters of notebook 04's toy LM, AdamW in torch's multi-tensor form against its per-parameter
loop, as a speed-up.
Book: appendix "Performance", sections "Routing overhead", "k-subset marginals" and "A training
step of the notebooks' models".

On a shared machine the same case can move by 30-40% between two runs of ``python -m benchmarks``,
which puts a ratio near its goal on either side by chance. Here each round times the floor and then
every named router, each in its own fresh process after one training step
(``benchmarks.cases.router_overhead`` with ``after_training_step``), so that a slow stretch of the
machine hits the floor and the routers of that round alike: the round's ratio is router median over
floor median.

The report gives each router's ratios round by round, their median, and a distribution-free 95%
interval for the median ratio (sign test: with n rounds the interval is between the j-th smallest and
the j-th largest ratio, for the largest j whose binomial tail keeps the coverage >= 95%; n = 6 gives
[min, max] at 96.9%). A goal is met when the interval lies below it, missed when above it, and
undecided when the interval contains it; for ``ksubset`` the goal is a lower bound on the speed-up,
so there it is met when the interval lies above it.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys

from .__main__ import run_case


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """``(lower, upper, coverage)``: the order-statistic interval ``[x_(j), x_(n+1-j)]`` for the median
    of the law the values are drawn from, with the largest ``j`` whose coverage
    ``1 - 2 P(Binomial(n, 1/2) < j)`` is at least ``level``. Needs n >= 6 for 95%."""
    n = len(values)
    ordered = sorted(values)
    best = None
    for j in range(1, n // 2 + 1):
        coverage = 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2**n
        if coverage >= level:
            best = (ordered[j - 1], ordered[n - j], coverage)
    if best is None:
        raise ValueError(f"{n} rounds cannot give a {level:.0%} interval for the median: use at least 6")
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("routers", help="comma-separated registered router names, from_logits, ksubset or optimizer_step")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--E", type=int, default=64)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    median_interval([0.0] * args.rounds)  # fail before the first round if rounds are too few
    # groups of (floor case, {name: case}): within a round each group runs its floor, then its cases
    invert = False  # report floor / case (a speed-up) instead of case / floor
    baseline = "floor"  # what the round lines call each group's first case
    if args.routers == "from_logits":
        common = dict(T=8192, E=64, k=2, device=args.device, repeats=500)
        groups = [(("routing_floor", {}),
                   {"capacity factor 1": ("routing_softmax_topk", {"capacity_factor": 1.0}),
                    "dropless": ("routing_softmax_topk", {"capacity_factor": None})})]
        print(f"softmax_topk from logits (forward, eval, no grad), T=8192, E=64, k=2, against softmax + torch.topk; "
              f"{args.rounds} rounds of fresh processes (floor, then each case)", flush=True)
    elif args.routers == "ksubset":
        common = dict(T=8192, E=64, k=8, device=args.device, repeats=30, budget_s=3.0)
        groups = [(("ksubset_autograd_loop", {"dtype": dtype}),
                   {f"ksubset_marginals {dtype}": ("ksubset_minimoe", {"dtype": dtype})})
                  for dtype in ("float32", "float64")]
        invert, baseline = True, "loop"
        print(f"ksubset_marginals, T=8192, E=64, k=8, speed-up over autograd through the loop DP; "
              f"{args.rounds} rounds of fresh processes (the loop, then minimoe, per dtype)", flush=True)
    elif args.routers == "optimizer_step":
        common = dict(device=args.device, threads=1, repeats=500, budget_s=3.0)
        groups = [(("optimizer_step", {"foreach": False}), {"foreach=True": ("optimizer_step", {"foreach": True})})]
        invert, baseline = True, "loop"
        print(f"clipping and one AdamW step on notebook 04's toy LM, one thread (as the notebooks run under make "
              f"test), speed-up of AdamW's foreach=True over its per-parameter loop; {args.rounds} rounds of "
              f"fresh processes (the loop, then foreach)", flush=True)
    else:
        common = dict(T=args.T, E=args.E, d=args.d, device=args.device, after_training_step=True)
        groups = [(("router_floor", {"repeats": 500}),
                   {name: ("router_overhead", {"router": name, "options": {}, "repeats": 200, "budget_s": 3.0})
                    for name in args.routers.split(",")})]
        print(f"training-mode router overhead after one training step, T={args.T}, E={args.E}, d={args.d}; "
              f"{args.rounds} rounds of fresh processes (floor, then each router)", flush=True)
    names = [name for _, cases in groups for name in cases]
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        line = [f"  round {r + 1}:"]
        for (floor_name, floor_params), cases in groups:
            floor = run_case(floor_name, **floor_params, **common)["median_ms"]
            line.append(f"{baseline} {floor:.2f} ms")
            for name, (case, params) in cases.items():
                ms = run_case(case, **params, **common)["median_ms"]
                ratios[name].append(floor / ms if invert else ms / floor)
                line.append(f"{name} {ms:.2f} ms ({ratios[name][-1]:.2f}x)")
        print(line[0] + " " + ", ".join(line[1:]), flush=True)
    for name in names:
        low, high, coverage = median_interval(ratios[name])
        print(f"{name:26s} median {statistics.median(ratios[name]):.2f}x, {coverage:.1%} interval for the median "
              f"[{low:.2f}x, {high:.2f}x]; rounds: {', '.join(f'{x:.2f}' for x in ratios[name])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
