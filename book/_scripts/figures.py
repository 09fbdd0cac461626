"""The chapters' figures, each drawn from `minimoe` itself on a small seeded example.

    python book/_scripts/figures.py [--out DIR] [NAME ...]   # default: every figure, into _build/figures

`make book` draws them into the staged book (``book/figures/NAME.png``), so a figure always shows
what today's code computes; no image is committed. Each function returns a matplotlib figure; the
chapter that shows it is in ``FIGURES``. ``tests/test_book_figures.py`` checks that every figure draws,
that its axes are labelled and its text readable at the page's width, and that each chapter shows its
figure.

Every example is tiny (a dozen tokens, four experts) on purpose: a reader should be able to count
the cells.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from minimoe import ops, routers  # noqa: E402

WIDTH = 8.0        # inches: the width of the book's text column at 100 dpi, so text is shown at its size
FONT = 10          # the smallest text is FONT - 1 (tick labels)
DPI = 150
CMAP = "Blues"


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": FONT, "axes.titlesize": FONT, "axes.labelsize": FONT,
                         "xtick.labelsize": FONT - 1, "ytick.labelsize": FONT - 1,
                         "legend.fontsize": FONT - 1, "figure.dpi": 100})
    return plt


def _logits(T=12, E=4, seed=0, skew=1.5):
    """Router logits of one group: expert 0 is popular (a skewed router, as early in training)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    logits[:, 0] += skew
    return logits


def _router(name, logits, **options):
    """Router ``name`` whose gate reproduces ``logits`` exactly: x is the identity on T tokens, so the
    gate's weight is the logits' transpose. Eval mode: no noise, no coin."""
    T, E = logits.shape
    router = routers.router_class(name)(T, E, **options).double().eval()
    with torch.no_grad():
        router.gate.weight.copy_(logits.T)
    return router, torch.eye(T, dtype=torch.float64)[None]


def _heatmap(ax, values, *, title, xlabel="expert e", ylabel="token t", vmax=None, cmap=CMAP, fmt=None):
    values = values.detach().double()
    image = ax.imshow(values, cmap=cmap, vmin=0, vmax=vmax if vmax is not None else float(values.max()),
                      aspect="auto", interpolation="nearest")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_xticks(range(values.shape[1]))
    ax.set_yticks(range(0, values.shape[0], 2))
    if fmt:
        for i in range(values.shape[0]):
            for j in range(values.shape[1]):
                v = values[i, j].item()
                if v:
                    ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=FONT - 1,
                            color="white" if v > 0.6 * float(values.max()) else "black")
    return image


# ---------------------------------------------------------------------------------------- chapter 1
def dispatch_combine():
    """Softmax top-1 with a capacity: probabilities, the dispatch tensor D and the combine tensor C."""
    plt = _plt()
    logits = _logits()
    router, x = _router("softmax_topk", logits, k=1, capacity_factor=1.0)
    routing = router(x)
    probs = torch.softmax(logits, -1)
    T, E, C = routing.dispatch_tensor().shape[1:]
    dispatch = routing.dispatch_tensor()[0].reshape(T, E * C)
    combine = routing.combine_tensor()[0].reshape(T, E * C)
    dropped = (dispatch.sum(-1) == 0).nonzero().flatten().tolist()
    fig, axes = plt.subplots(1, 3, figsize=(WIDTH, 3.6), gridspec_kw={"width_ratios": [E, E * C, E * C]})
    _heatmap(axes[0], probs, title="router probabilities")
    axes[0].plot(logits.argmax(-1).numpy(), range(T), "o", mfc="none", mec="tab:red", ms=9)
    _heatmap(axes[1], dispatch, title="dispatch D (0 or 1)", xlabel="slot (expert, position)", vmax=1)
    _heatmap(axes[2], combine, title="combine C (gate weight)", xlabel="slot (expert, position)")
    for ax in axes[1:]:
        ax.set_xticks([e * C + (C - 1) / 2 for e in range(E)], [f"e={e}" for e in range(E)])
        for e in range(1, E):
            ax.axvline(e * C - 0.5, color="0.4", lw=1)
        for t in dropped:
            ax.axhspan(t - 0.5, t + 0.5, color="tab:red", alpha=0.15, lw=0)
    fig.suptitle(f"T = {T} tokens, E = {E} experts, capacity C = {C}: the red rows chose expert 0 after "
                 "its slots filled and are dropped", fontsize=FONT)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------- chapter 2
def sinkhorn_temperatures():
    """The entropic transport plan of one group at three temperatures, with its balanced columns."""
    plt = _plt()
    logits = _logits()
    T, E = logits.shape
    fig, axes = plt.subplots(1, 4, figsize=(WIDTH, 3.4), gridspec_kw={"width_ratios": [1, 1, 1, 1]})
    _heatmap(axes[0], torch.softmax(logits, -1) / 1, title="softmax (no balance)", vmax=1)
    for ax, eps in zip(axes[1:], (1.0, 0.3, 0.03)):
        plan = ops.sinkhorn(logits, eps, row_sums=1.0, col_sums=T / E, max_iter=5000, tol=1e-10)
        _heatmap(ax, plan, title=f"plan, ε = {eps:g}", vmax=1, ylabel="")
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.suptitle("Every plan's rows sum to 1 and its columns to T/E = 3; as ε shrinks it becomes a "
                 "balanced hard assignment", fontsize=FONT)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------- chapter 3
def ssr_coin():
    """SSR's per-layer coin: which forward passes of which layers route with the Sinkhorn plan."""
    plt = _plt()
    layers, steps, p = 6, 120, 0.1
    used = torch.zeros(layers, steps)
    for layer in range(layers):
        # each layer's router has its own generator; flip_coin is the draw its forward pass makes
        router = routers.router_class("ssr")(8, 4, k=1, p=p, seed=layer).train()
        for step in range(steps):
            used[layer, step] = float(router.flip_coin())
    fig, (ax, bar) = plt.subplots(1, 2, figsize=(WIDTH, 2.8), gridspec_kw={"width_ratios": [5, 1]})
    ax.imshow(used, cmap="Oranges", aspect="auto", interpolation="nearest", vmin=0, vmax=1.3)
    ax.set_xlabel("training step (one forward pass of every layer)")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(layers))
    ax.set_title(f"orange: that layer routed with the Sinkhorn plan (coin with p = {p:g})")
    share = used.mean(1)
    bar.barh(range(layers), share, color="tab:orange")
    bar.axvline(p, color="0.3", ls="--", lw=1)
    bar.set_ylim(layers - 0.5, -0.5)
    bar.set_yticks([])
    bar.set_xlabel("share of steps")
    bar.set_title("dashed: p")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------- chapter 4
def six_routers():
    """The six routers of Liu et al. on one group: the combine weight each gives each (token, expert)."""
    plt = _plt()
    logits = _logits()
    T, E = logits.shape
    panels = [("softmax_topk", "softmax, token choice", {"k": 1, "capacity_factor": 1.0}),
              ("sinkhorn_token_choice", "Sinkhorn, token choice", {"k": 1, "capacity_factor": 1.0}),
              ("expert_choice", "softmax, expert choice", {"capacity_factor": 1.0}),
              ("sinkhorn_expert_choice", "Sinkhorn, expert choice", {"capacity_factor": 1.0}),
              ("sparsity_constrained_ec", "sparsity-constrained EC", {"capacity_factor": 1.0})]
    fig, axes = plt.subplots(2, 3, figsize=(WIDTH, 6.2))
    for ax, (name, title, options) in zip(axes.flat, panels):
        router, x = _router(name, logits, **options)
        weight = router(x).combine_tensor()[0].sum(-1)     # (T, E): summed over the slot position
        _heatmap(ax, weight, title=title, vmax=1)
    soft = routers.router_class("soft_moe")(T, E).double().eval()
    with torch.no_grad():
        soft.slot_embed.copy_(logits.T.reshape(soft.slot_embed.shape))
    routing = soft(torch.eye(T, dtype=torch.float64)[None])
    _heatmap(axes.flat[5], routing.slot_combine[0].sum(-1), title="Soft MoE (every cell > 0)", vmax=1)
    for ax in axes[:, 1:].flat:
        ax.set_ylabel("")
    fig.suptitle(f"The same logits (T = {T}, E = {E}, capacity 3): combine weight of each token at "
                 "each expert; white = not sent", fontsize=FONT)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------- chapter 5
def gumbel_matching():
    """A balanced sampler's marginals are not the router's softmax: Gumbel-matching by Monte Carlo."""
    plt = _plt()
    T, E, C, samples = 8, 4, 2, 3000
    logits = _logits(T, E, seed=1, skew=1.0)
    g = torch.Generator().manual_seed(0)
    # one batched call: every sample is an independent Gumbel perturbation of the same logits
    assignments = ops.gumbel_matching_sample(logits.expand(samples, T, E), C, generator=g)   # (samples, T)
    counts = torch.nn.functional.one_hot(assignments, E).sum(0).double()
    first = assignments[0]
    marginals = counts / samples
    softmax = torch.softmax(logits, -1)
    fig, (ax, sc) = plt.subplots(1, 2, figsize=(WIDTH, 3.6), gridspec_kw={"width_ratios": [1, 1.3]})
    _heatmap(ax, marginals, title=f"P(token t → expert e), {samples} samples", vmax=1, fmt="{:.2f}")
    ax.plot(first.numpy(), range(T), "s", mfc="none", mec="tab:red", ms=13)
    ax.set_yticks(range(T))
    sc.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--")
    sc.scatter(softmax.flatten(), marginals.flatten(), s=18, color="tab:green")
    sc.set_xlabel("router softmax probability")
    sc.set_ylabel("marginal under Gumbel-matching")
    sc.set_title("off the diagonal: REINFORCE needs importance weights")
    sc.set_xlim(0, 1)
    sc.set_ylim(0, 1)
    fig.suptitle(f"Gumbel-matching: T = {T} tokens, E = {E} experts, exactly C = {C} tokens each "
                 "(red squares: one sample)", fontsize=FONT)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------- chapter 6
def selection_lp():
    """Token choice, expert choice and global top-c: three selections from one LP, with their totals."""
    plt = _plt()
    # sigmoid scores, one per (token, expert) on its own: a softmax's rows sum to one, which makes token
    # choice nearly optimal and hides the difference
    scores = torch.sigmoid(_logits())
    T, E = scores.shape
    c = T                                       # the budget: one (token, expert) pair per token on average
    token = torch.zeros_like(scores)
    token[torch.arange(T), scores.argmax(-1)] = 1
    expert = torch.zeros_like(scores)
    expert.scatter_(0, scores.topk(c // E, dim=0).indices, 1)
    top = ops.global_topc(scores, c).to(scores.dtype)
    fig, axes = plt.subplots(1, 3, figsize=(WIDTH, 3.8))
    for ax, (title, mask) in zip(axes, (("token choice: 1 per token", token),
                                        ("expert choice: 3 per expert", expert),
                                        (f"global top-c, c = {c}", top))):
        _heatmap(ax, scores, title=f"{title}\ntotal score {(scores * mask).sum():.2f}", vmax=1, cmap="Greys")
        rows, cols = mask.nonzero(as_tuple=True)
        ax.plot(cols.numpy(), rows.numpy(), "o", color="tab:red", ms=6)
    for ax in axes[1:]:
        ax.set_ylabel("")
    fig.suptitle(f"Red: the {c} selected pairs over the scores σ(logit) (grey); fewer constraints, a higher total",
                 fontsize=FONT)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------- chapter 7
def ksubset_lattice():
    """The k-subset dynamic program: states (experts seen, experts chosen), each with its partial sum."""
    plt = _plt()
    E, k = 6, 3
    logits = _logits(1, E, seed=2, skew=0.0)[0]
    w = logits.exp()
    # a[i][j]: the sum over j-subsets of the first i experts of the product of their weights
    a = [[0.0] * (k + 1) for _ in range(E + 1)]
    a[0][0] = 1.0
    for i in range(1, E + 1):
        for j in range(k + 1):
            a[i][j] = a[i - 1][j] + (w[i - 1].item() * a[i - 1][j - 1] if j else 0.0)
    assert math.isclose(math.log(a[E][k]), ops.ksubset_log_partition(logits, k).item(), rel_tol=1e-9)
    top = set(logits.topk(k).indices.tolist())
    path, j = [(0, 0)], 0
    for i in range(E):
        j += i in top
        path.append((i + 1, j))
    fig, ax = plt.subplots(figsize=(WIDTH, 3.9))
    for i in range(E):
        for j in range(k + 1):
            if a[i][j] == 0:
                continue
            ax.annotate("", (i + 1, j), (i, j), arrowprops={"arrowstyle": "->", "color": "0.6", "shrinkA": 13, "shrinkB": 13})
            if j < k:
                ax.annotate("", (i + 1, j + 1), (i, j), arrowprops={"arrowstyle": "->", "color": "tab:blue", "shrinkA": 13, "shrinkB": 13})
    xs, ys = zip(*path)
    ax.plot(xs, ys, color="tab:red", lw=3, alpha=0.5, zorder=1)
    for i in range(E + 1):
        for j in range(k + 1):
            if a[i][j] > 0:
                ax.scatter(i, j, s=650, color="white", edgecolor="0.3", zorder=2)
                ax.text(i, j, f"{a[i][j]:.2g}", ha="center", va="center", fontsize=FONT - 1, zorder=3)
    ax.set_xticks(range(E + 1))
    ax.set_yticks(range(k + 1))
    ax.set_xlim(-0.5, E + 0.5)
    ax.set_ylim(-0.6, k + 0.6)
    ax.set_xlabel("experts considered so far (i)")
    ax.set_ylabel("experts chosen (j)")
    ax.set_title(f"E = {E}, k = {k}: blue = take expert i (× w_i), grey = skip it; "
                 f"corner = Z = {a[E][k]:.3g}; red = top-k")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------- chapter 8
def all_to_all():
    """Rows each rank sends to each rank in the all-to-all, for a skewed top-1 router and expert choice."""
    plt = _plt()
    from minimoe.parallel.analysis import send_counts
    W, E, T = 4, 8, 64
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(W, T, E, generator=g, dtype=torch.float64)
    logits[..., :2] += 1.0                                 # the experts of rank 0 are popular
    panels = []
    for name, title, options in (("softmax_topk", "token choice, top-1, no capacity", {"k": 1, "capacity_factor": None}),
                                 ("expert_choice", "expert choice (C = T/E per expert)", {"capacity_factor": 1.0})):
        counts = torch.zeros(W, W)
        for rank in range(W):
            router, x = _router(name, logits[rank], **options)
            counts[rank] = send_counts(router(x), W).double()
        panels.append((title, counts))
    vmax = max(float(c.max()) for _, c in panels)
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 3.7))
    for ax, (title, counts) in zip(axes, panels):
        _heatmap(ax, counts, title=f"{title}\nbusiest rank receives {int(counts.sum(0).max())} rows",
                 xlabel="receiving rank", ylabel="sending rank", vmax=vmax, fmt="{:.0f}")
        ax.set_yticks(range(W))
    fig.suptitle(f"{W} ranks, {E // W} experts each, {T} tokens per rank: the all-to-all's send counts",
                 fontsize=FONT)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------- chapter 9
def study_intervals():
    """Chapter 9's study: each router's paired difference to the best router, per task, 95% intervals,
    separated or not by the best set (all pairs Holm-corrected); the baselines in grey."""
    plt = _plt()
    from minimoe import routers as registry
    from minimoe.experiments import claims, configs, read_results, stats
    rows = read_results(ROOT / "minimoe" / "experiments" / "results" / "reference-cpu")
    labels = {"lm": "LM validation loss (lower is better)", "clustered": "clustered R² (higher is better)",
              "vision": "vision accuracy (higher is better)"}
    fig, axes = plt.subplots(len(configs.TASKS), 1, figsize=(WIDTH, 15))
    for ax, task in zip(axes, configs.TASKS):
        metric, higher = claims.headline(task)
        values = stats.by_seed(rows, task, metric)
        table = stats.best_set({r: v for r, v in values.items() if r in registry.available()},
                               higher_is_better=higher)
        best = table["best"]
        order = sorted(table["rows"], key=lambda r: table["rows"][r]["mean"], reverse=higher)  # best first
        baselines = [b for b in registry.baselines() if b in values]
        for y, router in enumerate(order):
            entry = table["rows"][router]
            if router == best:
                ax.plot(0, y, "*", color="black", ms=11)
                continue
            d = entry["diff"]
            color = "tab:red" if entry["separated"] else "tab:blue"
            ax.plot([d.low, d.high], [y, y], color=color, lw=2)
            ax.plot(d.mean, y, "o", color=color, ms=5)
        for y, baseline in enumerate(baselines, start=len(order)):
            seeds = sorted(set(values[baseline]) & set(values[best]))
            d = stats.paired([values[baseline][s] for s in seeds], [values[best][s] for s in seeds])
            ax.plot([d.low, d.high], [y, y], color="0.55", lw=2)
            ax.plot(d.mean, y, "D", color="0.55", ms=5)
        ax.axvline(0, color="0.5", lw=1)
        ax.set_yticks(range(len(order) + len(baselines)), order + [f"{b} (baseline)" for b in baselines])
        ax.invert_yaxis()
        ax.set_ylabel("router")
        ax.set_xlabel(f"{labels[task]}: router − best, paired over seeds")
        ax.set_title(f"{task}: best router {best} (star); red: separated from it; blue: not; grey: baselines",
                     fontsize=9)
    fig.tight_layout()
    return fig


def choosing_map():
    """The choosing page: per task, each router's quality against the best router's (paired 95%
    interval) beside the baselines that do not learn (vertical lines), and its time per training
    step relative to softmax top-1 (bars)."""
    plt = _plt()
    from minimoe import routers as registry
    from minimoe.experiments import claims, configs, read_results, stats
    from minimoe.experiments.runner import summarize
    rows = read_results(ROOT / "minimoe" / "experiments" / "results" / "reference-cpu")
    names = {"lm": "LM loss", "clustered": "clustered R²", "vision": "vision accuracy"}
    styles = {"hash": ("tab:green", "--"), "random": ("tab:purple", ":"), "dense": ("tab:brown", "-."),
              "dense_wide": ("0.3", (0, (5, 1, 1, 1)))}
    fig, axes = plt.subplots(len(configs.TASKS), 2, figsize=(WIDTH, 15), width_ratios=(2.2, 1))
    for (left, right), task in zip(axes, configs.TASKS):
        metric, higher = claims.headline(task)
        values = stats.by_seed(rows, task, metric)
        table = stats.best_set({r: v for r, v in values.items() if r in registry.available()},
                               higher_is_better=higher)
        best, sign = table["best"], 1.0 if higher else -1.0
        order = sorted(table["rows"], key=lambda r: -sign * table["rows"][r]["mean"])  # best first
        ms = {r: m for r, (m, *_) in summarize(rows, "ms_per_step", task=task).items()}
        for y, router in enumerate(order):
            entry = table["rows"][router]
            if router == best:
                left.plot(0, y, "*", color="black", ms=11)
                continue
            d = entry["diff"]  # router - best, shown as "better is right" on every task
            lo, hi = sorted((sign * d.low, sign * d.high))
            color = "tab:red" if entry["separated"] else "tab:blue"
            left.plot([lo, hi], [y, y], color=color, lw=2)
            left.plot(sign * d.mean, y, "o", color=color, ms=5)
        low, high = left.get_xlim()
        for baseline, (color, style) in styles.items():
            if baseline in values:
                gap = sign * (summarize(rows, metric, task=task)[baseline][0] - table["rows"][best]["mean"])
                left.axvline(gap, color=color, ls=style, lw=1.3, label=baseline)
                low, high = min(low, gap), max(high, gap)
        pad = 0.04 * (high - low)
        left.set_xlim(low - pad, high + pad)
        left.axvline(0, color="0.6", lw=0.8)
        left.set_yticks(range(len(order)), order)
        left.invert_yaxis()
        left.set_ylabel("router (best first)")
        left.set_xlabel(f"{names[task]}: {'router − best' if higher else 'best − router'} (right is better)")
        ratios = [ms[r] / ms["softmax_topk"] for r in order]
        right.barh(range(len(order)), ratios, color="0.6")
        right.axvline(1, color="tab:orange", lw=1)
        right.set_xlim(0, max(3.0, max(ratios) * 1.05))
        right.set_yticks(range(len(order)), [])
        right.invert_yaxis()
        right.set_xlabel("step time ÷ top-1's")
        left.set_title(f"{task}: red = separated from the best, blue = not")
        right.set_title("cost per training step")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=4, title="baselines that do not learn (their mean)",
               fontsize=FONT - 1, title_fontsize=FONT - 1, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.965))
    return fig


# --------------------------------------------------------------------------------------- chapter 10
def bias_dynamics():
    """Loss-free balancing on a stream of skewed batches: the biases and the load violation per step."""
    plt = _plt()
    E, T, steps, rate = 8, 256, 300, 0.01
    g = torch.Generator().manual_seed(0)
    affinity = torch.linspace(0.6, -0.6, E)                 # expert 0 is preferred by every token
    runs = {}
    for update in ("none", "sign", "proportional"):
        bias, history, violation = torch.zeros(E), [], []
        g.manual_seed(0)
        for _ in range(steps):
            scores = torch.softmax(affinity + torch.randn(T, E, generator=g), -1)
            chosen = (scores + bias).argmax(-1)                # the bias changes the selection only
            loads = torch.bincount(chosen, minlength=E).float()
            violation.append(float(ops.max_violation(loads)))
            history.append(bias.clone())
            if update != "none":
                bias = ops.bias_update(bias, loads, rate, update)
        runs[update] = (torch.stack(history), violation)
    fig, (left, right) = plt.subplots(1, 2, figsize=(WIDTH, 3.5))
    for e in range(E):
        left.plot(runs["sign"][0][:, e], lw=1.2, color=plt.cm.viridis(e / (E - 1)))
    left.set_xlabel("step")
    left.set_ylabel("bias b_e")
    left.set_title("sign update: one line per expert\n(expert 0, the popular one, goes down)")
    for update, color in (("none", "0.5"), ("sign", "tab:blue"), ("proportional", "tab:orange")):
        right.plot(runs[update][1], color=color, lw=1.2, label=update)
    right.set_xlabel("step")
    right.set_ylabel("max violation (max load / mean − 1)")
    right.set_title(f"load violation, rate γ = {rate:g}")
    right.legend()
    fig.tight_layout()
    return fig


# name: (function, the chapter that shows it)
FIGURES = {
    "ch01-dispatch-combine": (dispatch_combine, "01-moe-layer.md"),
    "ch02-sinkhorn-temperatures": (sinkhorn_temperatures, "02-optimal-transport.md"),
    "ch03-ssr-coin": (ssr_coin, "03-selective-sinkhorn.md"),
    "ch04-six-routers": (six_routers, "04-six-routers.md"),
    "ch05-gumbel-matching": (gumbel_matching, "05-balanced-assignments.md"),
    "ch06-selection-lp": (selection_lp, "06-linear-programming.md"),
    "ch07-ksubset-lattice": (ksubset_lattice, "07-probabilistic-routing.md"),
    "ch08-all-to-all": (all_to_all, "08-expert-parallelism.md"),
    "ch09-study-intervals": (study_intervals, "09-what-the-routers-teach-us.md"),
    "ch10-bias-dynamics": (bias_dynamics, "10-loss-free-balancing.md"),
    "choosing-map": (choosing_map, "choosing-a-router.md"),
}


def draw(out: Path, names=None) -> list[Path]:
    """Draw the figures ``names`` (default: all) as ``out/NAME.png``; returns the paths written."""
    plt = _plt()
    out.mkdir(parents=True, exist_ok=True)
    unknown = sorted(set(names or ()) - set(FIGURES))
    if unknown:
        raise SystemExit(f"unknown figure(s) {unknown}; the figures are {sorted(FIGURES)}")
    written = []
    for name in names or FIGURES:
        fig = FIGURES[name][0]()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        written.append(path)
    return written


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"figures to draw (default: all): {', '.join(FIGURES)}")
    parser.add_argument("--out", type=Path, default=ROOT / "_build" / "figures")
    args = parser.parse_args()
    for path in draw(args.out, args.names):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
