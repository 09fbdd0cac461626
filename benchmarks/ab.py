"""``python -m benchmarks.ab OLD_CHECKOUT ROUTER:E[,ROUTER:E...] [--rounds 6] [--T 4096]``: a router's
time under this checkout's code against another checkout's (an older commit: ``git worktree add
/tmp/old <commit>``), as a ratio new / old, in alternating fresh processes.

The paired rounds of :mod:`benchmarks.paired` measure each router against the floor of the same
code; a change to the code is then read as the difference of two ratios taken minutes apart, and on
a shared 2-core machine the floor itself moves by a third between such runs. Here each round times
the old and then the new code (the order flips every round, so that a drift within a round favours
neither), each in its own process after one training step, timed by that checkout's
``benchmarks.cases.run("router_overhead", ...)`` with the paired rounds' settings; the round's ratio
is new median over old median. The report gives each case's ratios, their
median and the order-statistic interval for the median (:func:`benchmarks.paired.median_interval`;
[min, max] at 96.9% for 6 rounds). Book: appendix "Performance" reports the results.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from .paired import median_interval

# one case in a fresh process, measured by the checkout's own benchmark (as benchmarks.paired measures it)
_CHILD = """
import pathlib, torch
import minimoe
# the checkout's own code, not an installed copy found first
assert pathlib.Path(minimoe.__file__).resolve().is_relative_to(pathlib.Path({checkout!r})), minimoe.__file__
torch.set_num_threads({threads})
from benchmarks.cases import run
print(run("router_overhead", dict(router={name!r}, options={{}}, T={T}, E={E}, d={d}, device="cpu",
                                  after_training_step=True, repeats=200, budget_s=3.0))["median_ms"])
"""


def time_case(checkout: Path, name: str, E: int, T: int, d: int, threads: int) -> float:
    """Median ms of one router call, measured by the code of ``checkout`` in a fresh process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(checkout), os.environ.get("PYTHONPATH")) if p))
    code = _CHILD.format(checkout=str(checkout.resolve()), threads=threads, name=name, T=T, E=E, d=d)
    done = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} at E={E} failed under {checkout}:\n{done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="a checkout of the code to compare against")
    parser.add_argument("cases", help="comma-separated ROUTER:E, e.g. softmax_topk:8,sinkhorn_token_choice:64")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    median_interval([0.0] * args.rounds)  # fail before the first round if rounds are too few
    new = Path(__file__).resolve().parent.parent
    old = args.old.resolve()
    if not (old / "minimoe").is_dir():
        parser.error(f"{old} is not a minimoe checkout (no minimoe/ in it): make one with git worktree add")
    cases = []
    for item in args.cases.split(","):
        name, _, E = item.partition(":")
        if not name or not E.isdigit():
            parser.error(f"case {item!r} must be ROUTER:E, e.g. softmax_topk:8")
        if (name, int(E)) in cases:
            parser.error(f"case {item!r} is given twice")
        cases.append((name, int(E)))
    print(f"router time, this checkout over {old}, T={args.T}, d={args.d}, {args.threads} threads, training mode after "
          f"one training step; {args.rounds} rounds of fresh processes (old then new, the order flipped every round)",
          flush=True)
    ratios = {case: [] for case in cases}
    for r in range(args.rounds):
        for name, E in cases:
            order = (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old))
            ms = {label: time_case(tree, name, E, args.T, args.d, args.threads) for label, tree in order}
            ratios[(name, E)].append(ms["new"] / ms["old"])
            print(f"  round {r + 1}: {name} E={E}: old {ms['old']:.3f} ms, new {ms['new']:.3f} ms, "
                  f"new/old {ms['new'] / ms['old']:.3f}", flush=True)
    for (name, E), values in ratios.items():
        low, high, coverage = median_interval(values)
        print(f"{name + ' E=' + str(E):30s} median new/old {statistics.median(values):.3f}, {coverage:.1%} interval "
              f"[{low:.3f}, {high:.3f}]; rounds: {', '.join(f'{v:.3f}' for v in values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
