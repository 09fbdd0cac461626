"""Paired comparisons of routers over seeds (book: chapter 9, "Reading a head-to-head").

Every router of a study trains on the same seeds, and a seed fixes the data order and the data set,
so two routers are compared through their **paired differences** ``d_s = x_A(s) - x_B(s)``, one per
seed: what varies from seed to seed but is common to both routers cancels. With ``n`` seeds::

    mean  d = (1/n) sum_s d_s,    sd  s_d,    standard error  s_d / sqrt(n),
    95% interval  d -/+ t_{0.975, n-1} * s_d / sqrt(n),                    (Student's t)
    p-value of "no difference"  2 * P(T_{n-1} > |d| / (s_d / sqrt(n))).

A family of comparisons is corrected with Holm's step-down procedure: sort the m p-values,
multiply the i-th smallest by (m - i + 1), carry the running maximum, cap at 1. A pair is
*separated* when its Holm-adjusted p-value is below 0.05 (so its 95% interval excludes zero, and
stays so after the correction); otherwise it is a *tie*, reported with its interval.

No scipy: the t distribution is computed from the regularised incomplete beta function (a
continued fraction), checked against ``scipy.stats.t`` in ``tests/test_experiment_stats.py``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

__all__ = ["t_cdf", "t_quantile", "paired", "Paired", "holm", "compare_to_best", "pairwise", "versus", "describe", "verdict",
           "median", "format_p", "best_set", "equivalent", "noninferior", "Equivalence"]


def format_p(p: float) -> str:
    """A p-value for a table: two significant digits, and ``<1e-10`` below that (the t tail is computed
    to about 1e-15 absolute, so smaller values are not resolved)."""
    return "<1e-10" if p < 1e-10 else f"{p:.2g}"


def median(values) -> float:
    """The median of a non-empty sequence of numbers (the mean of the middle two for an even count)."""
    values = sorted(float(v) for v in values)
    if not values:
        raise ValueError("median of an empty sequence")
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for numerator in (m * (b - m) * x / ((a + m2 - 1) * (a + m2)),
                          -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side; use symmetry otherwise
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if not df > 0:
        raise ValueError(f"df must be > 0, got {df}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(q: float, df: float) -> float:
    """The ``q``-quantile of Student's t (bisection on :func:`t_cdf`, to 1e-12). Remembered per
    ``(q, df)``: a study asks for the same few quantiles thousands of times."""
    return _t_quantile(float(q), float(df))


@functools.lru_cache(maxsize=1024)
def _t_quantile(q: float, df: float) -> float:
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be in (0, 1), got {q}")
    if q < 0.5:
        return -_t_quantile(1.0 - q, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < q:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if t_cdf(mid, df) < q else (low, mid)
        if high - low < 1e-12:
            break
    return 0.5 * (low + high)


@dataclass(frozen=True)
class Paired:
    """The paired comparison of A against B: ``mean`` of A - B over ``n`` seeds, its 95% interval
    ``[low, high]`` (``half_width`` each side) and the two-sided p-value of a zero mean."""

    mean: float
    low: float
    high: float
    half_width: float
    p_value: float
    n: int

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def paired(a, b, *, level: float = 0.95) -> Paired:
    """Student-t interval and test of the mean of ``a[i] - b[i]`` (the same seeds in the same order)."""
    a, b = [float(v) for v in a], [float(v) for v in b]
    if len(a) != len(b):
        raise ValueError(f"paired samples need the same seeds: got {len(a)} and {len(b)} values")
    if len(a) < 2:
        raise ValueError(f"a paired interval needs at least 2 seeds, got {len(a)}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    n = len(a)
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    se = sd / math.sqrt(n)
    half = t_quantile(0.5 + level / 2, n - 1) * se
    if se == 0.0:
        p = 1.0 if mean == 0.0 else 0.0
    else:
        p = 2.0 * (1.0 - t_cdf(abs(mean) / se, n - 1))
    return Paired(mean, mean - half, mean + half, half, min(1.0, p), n)


def holm(p_values) -> list[float]:
    """Holm-adjusted p-values, in the input order (family-wise error control, any dependence)."""
    p_values = [float(p) for p in p_values]
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def by_seed(rows, task: str, metric: str) -> dict[str, dict[int, float]]:
    """``{router: {seed: value}}`` of one metric of one task in a results file's rows."""
    values: dict[str, dict[int, float]] = {}
    for row in rows:
        if row["task"] == task and row["metric"] == metric:
            values.setdefault(row["router"], {})[int(row["seed"])] = float(row["value"])
    return values


def _common(x: dict, y: dict) -> list[int]:
    return sorted(set(x) & set(y))


def compare_to_best(rows, task: str, metric: str, *, higher_is_better: bool, alpha: float = 0.05) -> dict:
    """Each router against the router of best mean: ``{"best": name, "rows": {router: {...}}}``, each
    row with the router's mean, the paired difference to the best (router - best, in the metric's own
    sign), its interval, the Holm-adjusted p-value over the family of all routers and ``separated``."""
    values = by_seed(rows, task, metric)
    if not values:
        raise ValueError(f"no values of {metric!r} for task {task!r}")
    means = {r: sum(v.values()) / len(v) for r, v in values.items()}
    best = (max if higher_is_better else min)(means, key=means.get)
    out, p_values = {}, []
    for router, v in values.items():
        entry = {"mean": means[router], "n": len(v)}
        if router != best:
            seeds = _common(v, values[best])
            comparison = paired([v[s] for s in seeds], [values[best][s] for s in seeds])
            entry["diff"] = comparison
            p_values.append((router, comparison.p_value))
        out[router] = entry
    for (router, _), p in zip(p_values, holm([p for _, p in p_values])):
        out[router]["p_holm"] = p
        out[router]["separated"] = p < alpha
    return {"best": best, "rows": out}


def pairwise(rows, task: str, metric: str, *, alpha: float = 0.05) -> dict[tuple[str, str], dict]:
    """Every pair of routers: ``{(a, b): {"diff": Paired(a - b), "p_holm": ..., "separated": ...}}``,
    Holm-corrected over all pairs of the task."""
    values = by_seed(rows, task, metric)
    routers = sorted(values)
    pairs = [(a, b) for i, a in enumerate(routers) for b in routers[i + 1:]]
    results = {}
    for a, b in pairs:
        seeds = _common(values[a], values[b])
        results[(a, b)] = {"diff": paired([values[a][s] for s in seeds], [values[b][s] for s in seeds])}
    for pair, p in zip(pairs, holm([results[p]["diff"].p_value for p in pairs])):
        results[pair]["p_holm"] = p
        results[pair]["separated"] = p < alpha
    return results


def versus(values: dict, reference: str, *, alpha: float = 0.05) -> dict[str, dict]:
    """Every entry of ``values`` against ``reference``, paired over their common seeds and
    Holm-corrected over the family: ``{label: {"diff": Paired(label - reference), "p_holm": ...,
    "separated": ...}}`` (the reference itself is left out). ``values`` maps a label to
    ``{seed: value}``, or to a list of values in a common seed order. The method of chapter 9,
    for a notebook's own runs."""
    as_dict = {label: (dict(v) if isinstance(v, dict) else dict(enumerate(v))) for label, v in values.items()}
    if reference not in as_dict:
        raise ValueError(f"reference {reference!r} is not one of the labels {sorted(as_dict)}")
    base = as_dict[reference]
    out = {}
    for label, v in as_dict.items():
        if label == reference:
            continue
        seeds = _common(v, base)
        if len(seeds) < 2:
            raise ValueError(f"{label!r} and {reference!r} share {len(seeds)} seed(s); a paired interval needs 2")
        out[label] = {"diff": paired([v[s] for s in seeds], [base[s] for s in seeds])}
    for label, p in zip(out, holm([entry["diff"].p_value for entry in out.values()])):
        out[label]["p_holm"] = p
        out[label]["separated"] = p < alpha
    return out


def describe(entry: dict, *, lower_is_better: bool = True) -> str:
    """One line for an entry of :func:`versus`: ``"+0.012 [-0.030, +0.054], p (Holm) 0.41: tie"``, or
    ``"...: separated (better)"`` / ``"(worse)"``, better meaning lower when ``lower_is_better``."""
    d = entry["diff"]
    text = f"{d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}], p (Holm) {format_p(entry['p_holm'])}: "
    if not entry["separated"]:
        return text + "tie"
    return text + f"separated ({'better' if (d.mean < 0) == lower_is_better else 'worse'})"


def verdict(diff: Paired, *, expected_sign: int, p_adjusted: float | None = None, alpha: float = 0.05) -> str:
    """"holds" when the difference has the claimed sign (``expected_sign`` +1 or -1, in the direction
    of "better") and is significant, "reversed" when significant the other way, "tie" otherwise. The
    significance is the adjusted p-value when given, else the interval."""
    if expected_sign not in (1, -1):
        raise ValueError(f"expected_sign must be +1 or -1, got {expected_sign}")
    significant = diff.excludes_zero() if p_adjusted is None else p_adjusted < alpha
    if not significant:
        return "tie"
    return "holds" if (diff.mean > 0) == (expected_sign > 0) else "reversed"


def best_set(values: dict, *, higher_is_better: bool, alpha: float = 0.05) -> dict:
    """Which routers are indistinguishable from the best, *including the choice of the best* in the
    error: at most ``alpha`` under the global null, proved, and under a one-better alternative by
    simulation (book: chapter 9, "Separated from the best, honestly").

    ``values`` maps a router to ``{seed: value}``. Every pair is compared by the paired t-test over its
    common seeds, and the K(K-1)/2 p-values are Holm-corrected together. Router ``i`` is **separated
    from the best** when some router ``j`` is Holm-separated from it and better; the others form the
    set of routers not separated from the best (it always holds the router of best mean).

    Why all pairs. Declaring ``i`` worse than the best is an error only when ``i`` is one of the true
    best routers; it then needs some ``j`` with ``mu_j <= mu_i`` declared better than ``i``: either a
    rejection of a true "no difference" (``mu_j = mu_i``) or a directional error (``mu_j < mu_i`` and
    the sample puts ``j`` ahead). Which routers are the true best is unknown, and under the global null
    (all equal) every pair is a true null, so the family that must be controlled is all pairs. Holm
    over them bounds the first kind of error by ``alpha`` for every configuration of the means (Holm's
    theorem), hence every error under the global null; that it bounds the directional kind too is
    proved for independent test statistics (Shaffer 1980), not for these pairwise ones, which share
    routers, and the Monte Carlo test checks it under a one-better alternative. Comparing every router
    with the one of best *sample* mean, Holm-corrected over those K - 1 comparisons
    (:func:`compare_to_best`), does not control even the global null: that router was chosen for being
    ahead, and with 15 routers and 8 seeds at least one router is separated from it in 12-16% of
    studies, where all-pairs Holm does so in 4.9% (20,000 simulated studies; the Monte Carlo test is in
    tests/test_experiment_stats.py).

    Returns ``{"best": router of best mean, "rows": {router: {"mean", "n", "separated", "beaten_by"
    (routers Holm-separated from it and better, best mean first), "diff" (Paired: router - best, for
    display), "p_holm" (the smallest Holm p-value against a better router; 1.0 for the best)}}}``."""
    if not values:
        raise ValueError("values is empty: give {router: {seed: value}} for at least one router")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    as_dict = {r: (dict(v) if isinstance(v, dict) else dict(enumerate(v))) for r, v in values.items()}
    means = {r: sum(v.values()) / len(v) for r, v in as_dict.items()}
    sign = 1.0 if higher_is_better else -1.0
    best = max(means, key=lambda r: sign * means[r])
    routers = sorted(as_dict)
    pairs = [(a, b) for i, a in enumerate(routers) for b in routers[i + 1:]]
    diffs = {}
    for a, b in pairs:
        seeds = _common(as_dict[a], as_dict[b])
        if len(seeds) < 2:
            raise ValueError(f"{a!r} and {b!r} share {len(seeds)} seed(s); a paired comparison needs 2")
        diffs[(a, b)] = paired([as_dict[a][s] for s in seeds], [as_dict[b][s] for s in seeds])
    adjusted = dict(zip(pairs, holm([diffs[pair].p_value for pair in pairs])))
    rows = {}
    for r in routers:
        beaten_by, p_min = [], 1.0
        for (a, b), d in diffs.items():
            if r not in (a, b):
                continue
            other, r_minus_other = (b, d.mean) if a == r else (a, -d.mean)
            if sign * r_minus_other < 0:  # the other router is ahead of r
                p_min = min(p_min, adjusted[(a, b)])
                if adjusted[(a, b)] < alpha:
                    beaten_by.append(other)
        entry = {"mean": means[r], "n": len(as_dict[r]), "separated": bool(beaten_by), "p_holm": p_min,
                 "beaten_by": sorted(beaten_by, key=lambda o: -sign * means[o])}
        if r != best:
            seeds = _common(as_dict[r], as_dict[best])
            entry["diff"] = paired([as_dict[r][s] for s in seeds], [as_dict[best][s] for s in seeds])
        rows[r] = entry
    return {"best": best, "rows": rows}


@dataclass(frozen=True)
class Equivalence:
    """Two one-sided tests of ``|mean(A - B)| < margin``: the paired difference, its (1 - 2 alpha)
    interval ``[low, high]``, the larger of the two one-sided p-values (``p_value``) and whether the
    interval lies inside ``(-margin, margin)`` (``equivalent``)."""

    mean: float
    low: float
    high: float
    margin: float
    p_value: float
    equivalent: bool
    n: int


def _margin_test(a, b, margin, alpha) -> tuple[float, Paired, float]:
    """The checked margin, the (1 - 2 alpha) paired interval of A - B and its standard error (0 for
    identical differences): what :func:`equivalent` and :func:`noninferior` share."""
    margin = float(margin)
    if not (margin > 0 and math.isfinite(margin)):
        raise ValueError(f"margin must be a finite number > 0 (in the metric's units), got {margin!r}")
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5), got {alpha}")
    d = paired(a, b, level=1 - 2 * alpha)
    se = (d.high - d.mean) / t_quantile(1 - alpha, d.n - 1) if d.high > d.mean else 0.0
    return margin, d, se


def equivalent(a, b, margin: float, *, alpha: float = 0.05) -> Equivalence:
    """"A is as good as B" as a test (book: chapter 9): equivalence within ``margin`` by two one-sided
    paired t-tests (TOST), each at level ``alpha``. Equivalent exactly when the (1 - 2 alpha) paired
    interval of A - B lies inside ``(-margin, margin)``; the margin is part of the claim and must be
    fixed before the results are seen. A tie of a superiority test (an interval that contains 0) is
    not evidence of equivalence: with few seeds a wide interval is both."""
    margin, d, se = _margin_test(a, b, margin, alpha)
    if se == 0.0:
        p = 0.0 if abs(d.mean) < margin else 1.0
    else:  # P(T > (mean + margin) / se) under mean = -margin, and its mirror
        p_low = 1.0 - t_cdf((d.mean + margin) / se, d.n - 1)
        p_high = 1.0 - t_cdf((margin - d.mean) / se, d.n - 1)
        p = max(p_low, p_high)
    return Equivalence(d.mean, d.low, d.high, margin, min(1.0, p), bool(-margin < d.low and d.high < margin), d.n)


def noninferior(a, b, margin: float, *, higher_is_better: bool, alpha: float = 0.05) -> Equivalence:
    """"A is not worse than B by ``margin`` or more" as a test (book: chapter 9, "As good as, as a
    test"): the one one-sided paired t-test of H0 "A is worse by at least ``margin``" (on the side
    that ``higher_is_better`` makes bad), at level ``alpha``. Rejected exactly when the bad end of the
    (1 - 2 alpha) paired interval of A - B lies inside the margin. Returns an :class:`Equivalence`
    whose ``p_value`` is that test's and whose ``equivalent`` says "not worse by the margin"; ``low``
    and ``high`` are the (1 - 2 alpha) interval. Unlike :func:`equivalent`, a router far *better* than
    its comparator passes: this is the reading of "trains as well as" that a paper's claim means."""
    margin, d, se = _margin_test(a, b, margin, alpha)
    sign = 1.0 if higher_is_better else -1.0   # the gain of A over B, in the direction of "better"
    gain = sign * d.mean
    if se == 0.0:
        p = 0.0 if gain > -margin else 1.0
    else:  # P(T > (gain + margin) / se) at gain = -margin
        p = 1.0 - t_cdf((gain + margin) / se, d.n - 1)
    bad_end = d.low if higher_is_better else d.high
    return Equivalence(d.mean, d.low, d.high, margin, min(1.0, p), bool(sign * bad_end > -margin), d.n)
