"""The papers' headline empirical claims, re-tested on a study's results (book: chapter 9, "The
papers' claims, re-tested").

Each :class:`Claim` names two entries of a study and the metric on which the paper says the first
beats the second. :func:`evaluate` turns a results file into one row per (claim, task): the paired
difference over seeds (:func:`minimoe.experiments.stats.paired`), its 95% interval, a Holm-adjusted
p-value over the whole table (every row is one test of one family) and a verdict:

* ``holds``: the difference has the paper's sign and survives the correction;
* ``reversed``: it has the other sign and survives the correction;
* ``tie``: neither; the interval says how large a difference the study can rule out.

A claim that ``a`` does *as well as* ``b`` (``margin`` set, per task, in the metric's units) is not
tested as superiority. With ``noninferiority=True`` it is "``a`` is not worse than ``b`` by the
margin or more", the one one-sided test on the bad side (:func:`minimoe.experiments.stats.noninferior`);
otherwise it is equivalence, ``|mean(a - b)| < margin`` by two one-sided tests
(:func:`minimoe.experiments.stats.equivalent`). Either p-value enters the same Holm family, and the
verdicts are ``holds`` and ``not shown``. The margins are part of the claim, fixed before the study
they are tested on was run (:data:`EQUIVALENCE_MARGINS`).

The comparator can be another entry, ``BEST_OTHER`` (the registered router of best mean on that task,
other than the claim's own router) or a number (a one-sample comparison, e.g. ProbMoE's dynamic k
against its ceiling ``k_max``). A claim about cost (``ratio=True``) compares logarithms, so its
interval is that of the ratio ``a / b``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .. import routers as router_registry
from .stats import by_seed, equivalent, format_p, holm, noninferior, paired, verdict
from .tasks import TASK_CLASSES

__all__ = ["BEST_OTHER", "CLAIMS", "Claim", "EQUIVALENCE_MARGINS", "evaluate", "effect_text", "format_table",
           "headline"]

BEST_OTHER = "best other router"


def headline(task: str) -> tuple[str, bool]:
    """The task's quality metric and whether higher is better (``("val_loss", False)`` for ``lm``)."""
    cls = TASK_CLASSES[task]
    return cls.quality_metric, cls.higher_is_better


@dataclass(frozen=True)
class Claim:
    """"``a`` beats ``b`` on ``metric``" as one paper states it.

    ``metric="quality"`` is each task's headline metric in its own direction; otherwise
    ``higher_is_better`` gives the direction. ``section`` is the book label of the chapter section
    that discusses the paper's own result."""

    paper: str
    cite: str
    section: str
    claim: str
    a: str
    b: str | float
    metric: str = "quality"
    higher_is_better: bool | None = None
    ratio: bool = False
    tasks: tuple[str, ...] = ("lm", "clustered", "vision")
    margin: dict | None = None  # {task: margin}: an "as well as" claim, tested as equivalence ...
    noninferiority: bool = False  # ... or, with True, as "not worse by the margin" (one-sided)

    def __post_init__(self):
        if self.noninferiority and self.margin is None:
            raise ValueError(f"claim {self.claim!r}: noninferiority=True needs a margin ({{task: margin}})")

    @property
    def is_equivalence(self) -> bool:
        return self.margin is not None

    def direction(self, task: str) -> tuple[str, bool]:
        if self.metric == "quality":
            return headline(task)
        return self.metric, bool(self.higher_is_better)


#: The equivalence margins of "as well as" claims on each task's headline metric, stated before the
#: study they are tested on (book: chapter 9, "As good as, as a test"): 0.02 nats per character on
#: the LM (2% of perplexity), 0.005 of R^2 on the clustered task, one point of accuracy on vision.
#: Each is small against the spread of the router means in the study's first run (0.61 nats, 0.20 of
#: R^2, 7.3 points of accuracy from the worst router to the best) and near what a practitioner
#: would call "the same" on that task.
EQUIVALENCE_MARGINS = {"lm": 0.02, "clustered": 0.005, "vision": 0.01}

LIU, SSR, KOOL, USMOE, PROBMOE, LOSS_FREE = (
    "Liu et al. 2024", "Nguyen et al. (SSR)", "Kool et al. 2021", "Do et al. (USMoE)", "Zhao et al. (ProbMoE)",
    "Wang et al. 2024 (loss-free)")

#: The claims of the five papers and of loss-free balancing, in the order of chapter 9's table.
CLAIMS: tuple[Claim, ...] = (
    Claim(LIU, "liu2024routers", "ch4-reference", "expert choice beats token choice at c = 1",
          "expert_choice", "softmax_topk"),
    Claim(LIU, "liu2024routers", "ch4-reference", "Sinkhorn drops fewer tokens (token choice)",
          "sinkhorn_token_choice", "softmax_topk", metric="drop_rate", higher_is_better=False),
    Claim(LIU, "liu2024routers", "ch4-reference", "Sinkhorn drops fewer tokens (expert choice)",
          "sinkhorn_expert_choice", "expert_choice", metric="drop_rate", higher_is_better=False),
    Claim(LIU, "liu2024routers", "ch4-reference", "Soft MoE is the best router",
          "soft_moe", BEST_OTHER),
    Claim(LIU, "liu2024routers", "ch4-reference",
          "the sparsity-constrained plan costs more than softmax expert choice (the paper: 1.52-1.96x)",
          "sparsity_constrained_ec", "expert_choice", metric="ms_per_step", higher_is_better=True, ratio=True),
    Claim(SSR, "nguyen2026ssr", "ch3-reference", "SSR beats the vanilla router (dropless top-1, Switch loss)",
          "ssr", "softmax_topk_dropless"),
    Claim(SSR, "nguyen2026ssr", "ch3-reference", "the selective Sinkhorn steps help (p = 0.05 against p = 0, "
          "the same noise)", "ssr", "ssr_p0"),
    Claim(KOOL, "kool2021unbiased", "ch5-reference", "unbiased balanced sampling (skip) trains as well as Switch",
          "kool_skip", "softmax_topk", margin=EQUIVALENCE_MARGINS, noninferiority=True),
    Claim(KOOL, "kool2021unbiased", "ch5-reference", "unbiased balanced sampling (Gumbel-matching) trains as well as Switch",
          "kool_gumbel_matching", "softmax_topk", margin=EQUIVALENCE_MARGINS, noninferiority=True),
    Claim(KOOL, "kool2021unbiased", "ch5-reference", "the unbiased skip estimator beats Gumbel-matching",
          "kool_skip", "kool_gumbel_matching"),
    Claim(USMOE, "do2025usmoe", "ch6-reference", "global top-c beats token choice", "usmoe", "softmax_topk"),
    Claim(USMOE, "do2025usmoe", "ch6-reference", "global top-c beats expert choice", "usmoe", "expert_choice"),
    Claim(USMOE, "do2025usmoe", "ch6-reference", "global top-c drops fewer tokens than token choice",
          "usmoe", "softmax_topk", metric="drop_rate", higher_is_better=False),
    Claim(PROBMOE, "zhao2026probmoe", "ch7-reference", "ProbMoE exact-k beats DenseMixer", "probmoe_exact",
          "densemixer"),
    Claim(PROBMOE, "zhao2026probmoe", "ch7-reference", "ProbMoE dynamic-k beats DenseMixer", "probmoe_dynamic",
          "densemixer"),
    Claim(PROBMOE, "zhao2026probmoe", "ch7-reference", "dynamic k spends fewer experts than its ceiling k_max = 2 "
          "(the paper: 75-85% of k_max)", "probmoe_dynamic", 2.0, metric="experts_per_token",
          higher_is_better=False),
    Claim(LOSS_FREE, "wang2024auxiliary", "ch10-reference", "loss-free balancing beats the Switch loss "
          "(both dropless top-1)", "loss_free", "softmax_topk_dropless"),
    Claim(LOSS_FREE, "wang2024auxiliary", "ch10-reference", "... at a balance at least as good (load imbalance)",
          "loss_free", "softmax_topk_dropless", metric="load_imbalance", higher_is_better=False),
)


def _best_other(values: dict, exclude: str, higher_is_better: bool) -> str | None:
    registered = set(router_registry.available())
    means = {r: sum(v.values()) / len(v) for r, v in values.items() if r != exclude and r in registered}
    if not means:
        return None
    return (max if higher_is_better else min)(means, key=means.get)


def evaluate(rows, claims=CLAIMS, *, alpha: float = 0.05) -> list[dict]:
    """One row per (claim, task) whose entries the results hold: ``claim``, ``task``, ``metric``,
    ``b`` (the comparator as resolved: the best other router's name, or the number), ``mean_a``,
    ``mean_b``, ``diff`` (a :class:`~minimoe.experiments.stats.Paired` of ``a - b``, of
    ``log a - log b`` for a ratio), ``ratio`` (``exp`` of the mean log ratio and its interval, or None),
    ``p_holm`` (over every row returned) and ``verdict``."""
    out = []
    for claim in claims:
        for task in claim.tasks:
            metric, higher = claim.direction(task)
            values = by_seed(rows, task, metric)
            if claim.a not in values:
                continue
            b = claim.b
            if b == BEST_OTHER:
                b = _best_other(values, claim.a, higher)
            if isinstance(b, str):
                if b not in values:
                    continue
                seeds = sorted(set(values[claim.a]) & set(values[b]))
                xs, ys = [values[claim.a][s] for s in seeds], [values[b][s] for s in seeds]
            else:
                seeds = sorted(values[claim.a])
                xs, ys = [values[claim.a][s] for s in seeds], [float(b)] * len(seeds)
            if len(seeds) < 2:
                continue
            if claim.ratio:
                if min(xs + ys) <= 0:
                    raise ValueError(f"claim {claim.claim!r}: a ratio needs positive values of {metric}")
                diff = paired([math.log(x) for x in xs], [math.log(y) for y in ys])
                ratio = (math.exp(diff.mean), math.exp(diff.low), math.exp(diff.high))
            else:
                diff, ratio = paired(xs, ys), None
            test = None
            if claim.is_equivalence:
                if claim.ratio or task not in claim.margin:
                    raise ValueError(f"claim {claim.claim!r}: an equivalence claim needs a margin for {task} "
                                     "and a difference, not a ratio")
                test = (noninferior(xs, ys, claim.margin[task], higher_is_better=higher, alpha=alpha)
                        if claim.noninferiority else equivalent(xs, ys, claim.margin[task], alpha=alpha))
            out.append({"claim": claim, "task": task, "metric": metric, "higher_is_better": higher, "b": b,
                        "mean_a": sum(xs) / len(xs), "mean_b": sum(ys) / len(ys), "n": len(seeds), "diff": diff,
                        "ratio": ratio, "equivalence": test})
    p_values = [row["diff"].p_value if row["equivalence"] is None else row["equivalence"].p_value for row in out]
    for row, p in zip(out, holm(p_values)):
        row["p_holm"] = p
        if row["equivalence"] is not None:
            row["verdict"] = "holds" if p < alpha else "not shown"
        else:
            row["verdict"] = verdict(row["diff"], expected_sign=1 if row["higher_is_better"] else -1, p_adjusted=p,
                                     alpha=alpha)
    return out


def effect_text(row: dict, digits: int = 4) -> str:
    """A row's effect with its 95% interval: ``a - b [low, high]``, or ``xratio [low, high]`` for a
    cost claim (ratios with ``digits - 2`` decimals)."""
    if row["ratio"] is not None:
        mean, low, high = row["ratio"]
        return f"×{mean:.{digits - 2}f} [{low:.{digits - 2}f}, {high:.{digits - 2}f}]"
    d = row["diff"]
    test = row.get("equivalence")
    if test is not None:  # the interval that decides is the 90% one, and the margin is part of the claim
        text = f"{test.mean:+.{digits}f}, 90% [{test.low:+.{digits}f}, {test.high:+.{digits}f}]"
        return text + (f", not worse by {test.margin:g}" if row["claim"].noninferiority else f", margin ±{test.margin:g}")
    return f"{d.mean:+.{digits}f} [{d.low:+.{digits}f}, {d.high:+.{digits}f}]"


def format_table(results: list[dict]) -> str:
    """A plain-text table of :func:`evaluate`'s rows (what ``python -m minimoe.experiments show`` prints)."""
    lines = [f"  {'paper':28s} {'claim':58s} {'task':10s} {'a':>10s} {'b':>10s} {'a - b [95% CI]':>30s} "
             f"{'p (Holm)':>9s}  verdict"]
    for row in results:
        claim = row["claim"]
        b = row["b"] if isinstance(row["b"], str) else f"{row['b']:g}"
        effect = effect_text(row)
        text = claim.claim if len(claim.claim) <= 58 else claim.claim[:55] + "..."
        lines.append(f"  {claim.paper:28s} {text:58s} {row['task']:10s} {row['mean_a']:10.4g} {row['mean_b']:10.4g} "
                     f"{effect:>30s} {format_p(row['p_holm']):>9s}  {row['verdict']}  ({claim.a} vs {b}, {row['metric']})")
    return "\n".join(lines)
