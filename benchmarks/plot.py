"""``python -m benchmarks.plot [results.json]``: the scaling figure of the book's appendix
"Performance", written to book/_static/performance-scaling.png. ``python -m benchmarks.plot assignment
[results.json]``: the exact assignment solver's time against T and E, book/_static/assignment-scaling.png
(from the newest results that have it, ``python -m benchmarks --only exact_assignment`` or a full run).

Left and middle: the MoE layer's forward + backward time against the group size T (log-log) for the
index, loop and einsum paths and the floor, at E=8 and E=64. Right: each router's routing time over
the top-1 floor (log scale), both timed after one training step where the run has that column.
Without an argument, the newest full CPU results file is plotted.
"""
from __future__ import annotations

import sys
from pathlib import Path

from .__main__ import RESULTS, read_json

FIGURE = Path(__file__).resolve().parents[1] / "book" / "_static" / "performance-scaling.png"
ASSIGNMENT_FIGURE = FIGURE.with_name("assignment-scaling.png")

PATHS = [("floor", "floor (expert matmuls only)", "k", ":"), ("index", "index path (default)", "C0", "-"),
         ("slots", "slot buffers", "C4", ":"),
         ("grouped", "grouped path (sorted segments)", "C2", "-"),
         ("loop", "loop over experts", "C1", "--"), ("einsum", "einsum (dense D, C)", "C3", "-.")]


def newest_results(device: str = "cpu") -> Path:
    """The newest full (not --quick) results JSON for ``device``: file names start with the date."""
    files = sorted(RESULTS.glob(f"*-{device}.json"))
    if not files:
        raise FileNotFoundError(f"no full {device} results in {RESULTS}: run `python -m benchmarks` first")
    return files[-1]


def plot(path: Path, out: Path = FIGURE) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, records = read_json(path)
    layer = [r for r in records if r["section"] == "layer" and "median_ms" in r]
    routers = [r for r in records if r["section"] == "router_overhead" and r["case"] != "floor"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [1, 1, 1.5]})
    for ax, E in zip(axes[:2], (8, 64)):
        for case, label, color, style in PATHS:
            points = sorted((r["T"], r["median_ms"]) for r in layer if r["E"] == E and r["case"] == case)
            if points:
                ax.plot(*zip(*points), style, color=color, marker="o", label=label)
        skipped = sorted({r["T"] for r in records if r["section"] == "layer" and r["E"] == E and "skipped" in r})
        title = f"MoE layer, E={E}, forward + backward"
        if skipped:
            title += f"\n(einsum skipped at T={', '.join(map(str, skipped))}: D and C too large)"
        ax.set(xscale="log", yscale="log", xlabel="tokens per group T", ylabel="median time (ms)", title=title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="upper left", fontsize=9)
    ax = axes[2]
    configs = sorted({(r["T"], r["E"]) for r in routers}, key=lambda c: (-c[1], c[0]))
    names = list(dict.fromkeys(r["case"] for r in routers))
    width = 0.8 / max(len(configs), 1)
    for i, (T, E) in enumerate(configs):
        # the in-training ratio where the run has it (after one training step: no page faults)
        ratios = {r["case"]: r.get("training_ratio", r["ratio"]) for r in routers if (r["T"], r["E"]) == (T, E)}
        xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, [ratios.get(n, float("nan")) for n in names], width, label=f"T={T}, E={E}")
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xticks(range(len(names)))
    # the "soft_moe floor" record holds Soft MoE over its own floor (its slot-logit matmul), not a router
    labels = ["soft_moe / its slot-logit matmul" if n == "soft_moe floor" else n for n in names]
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
    ax.set(yscale="log", ylabel="routing time / floor (gate + softmax + topk)",
           title="Routing overhead per router (training-mode forward, after a training step)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend()
    fig.suptitle(f"minimoe benchmarks, {meta['date']}, {meta['device']}, {meta['threads']} threads, "
                 f"torch {meta['torch']}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def newest_assignment_results(device: str = "cpu") -> Path:
    """The newest results JSON for ``device`` with the solver's T x E grid (a full run or ``--only``)."""
    files = sorted([*RESULTS.glob(f"*-{device}.json"), *RESULTS.glob(f"*-{device}-exact_assignment.json")],
                   key=lambda f: f.name[:10])
    if not files:
        raise FileNotFoundError(f"no {device} assignment results in {RESULTS}: run "
                                "`python -m benchmarks --only exact_assignment` first")
    return files[-1]


def plot_assignment(path: Path, out: Path = ASSIGNMENT_FIGURE) -> Path:
    """Median time of ``linear_assignment(method="auto")`` against T, one line per E (log-log), and
    scipy's on the expanded matrix where it was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, records = read_json(path)
    ours = [r for r in records if r["section"] == "assignment" and r["case"].endswith("(method='auto')")]
    scipy = [r for r in records if r["section"] == "assignment" and r["case"].startswith("scipy")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for E in sorted({r["E"] for r in ours}):
        points = sorted({r["T"]: r["median_ms"] for r in ours if r["E"] == E}.items())
        ax.plot(*zip(*points), "o-", label=f"linear_assignment, E={E}")
    for r in scipy:
        ax.plot([r["T"]], [r["median_ms"]], "k*", markersize=12,
                label=f"scipy linear_sum_assignment, E={r['E']} (expanded {r['T']}x{r['T']})")
    ax.axhline(2000, color="C3", ls=":", lw=1, label="2 s")
    ax.set(xscale="log", yscale="log", xlabel="tokens per group T (capacity T/E)", ylabel="median time (ms)",
           title=f"Exact balanced assignment, {meta['device']}, {meta['threads']} threads, {meta['date']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "assignment":
        path = Path(argv[1]) if len(argv) > 1 else newest_assignment_results()
        print(f"plotted {path.name} to {plot_assignment(path)}")
        return 0
    path = Path(argv[0]) if argv else newest_results()
    print(f"plotted {path.name} to {plot(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
