"""``python -m benchmarks.paired ROUTER[,ROUTER...] [--rounds 6] [--T 4096] [--E 64]``: each router's
training-mode overhead against the top-1 floor, measured in rounds; ``python -m benchmarks.paired
from_logits``: softmax_topk from the logits (capacity factor 1 and dropless, T = 8192, E = 64, k = 2)
against softmax + top-k, as the first section of ``python -m benchmarks``. Book: appendix
"Performance", section "Routing overhead".

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
undecided when the interval contains it.
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
    parser.add_argument("routers", help="comma-separated registered router names, or from_logits")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--E", type=int, default=64)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    median_interval([0.0] * args.rounds)  # fail before the first round if rounds are too few
    if args.routers == "from_logits":
        common = dict(T=8192, E=64, k=2, device=args.device, repeats=500)
        floor_case = ("routing_floor", {})
        cases = {"capacity factor 1": ("routing_softmax_topk", {"capacity_factor": 1.0}),
                 "dropless": ("routing_softmax_topk", {"capacity_factor": None})}
        print(f"softmax_topk from logits (forward, eval, no grad), T=8192, E=64, k=2, against softmax + torch.topk; "
              f"{args.rounds} rounds of fresh processes (floor, then each case)", flush=True)
    else:
        common = dict(T=args.T, E=args.E, d=args.d, device=args.device, after_training_step=True)
        floor_case = ("router_floor", {"repeats": 500})
        cases = {name: ("router_overhead", {"router": name, "options": {}, "repeats": 200, "budget_s": 3.0})
                 for name in args.routers.split(",")}
        print(f"training-mode router overhead after one training step, T={args.T}, E={args.E}, d={args.d}; "
              f"{args.rounds} rounds of fresh processes (floor, then each router)", flush=True)
    names = list(cases)
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        floor = run_case(floor_case[0], **floor_case[1], **common)["median_ms"]
        line = [f"  round {r + 1}: floor {floor:.2f} ms"]
        for name, (case, params) in cases.items():
            ms = run_case(case, **params, **common)["median_ms"]
            ratios[name].append(ms / floor)
            line.append(f"{name} {ms:.2f} ms ({ms / floor:.2f}x)")
        print(", ".join(line), flush=True)
    for name in names:
        low, high, coverage = median_interval(ratios[name])
        print(f"{name:26s} median {statistics.median(ratios[name]):.2f}x, {coverage:.1%} interval for the median "
              f"[{low:.2f}x, {high:.2f}x]; rounds: {', '.join(f'{x:.2f}' for x in ratios[name])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
