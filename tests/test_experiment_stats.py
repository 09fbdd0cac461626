"""minimoe.experiments.stats against scipy (t distribution, paired t-test) and by hand (Holm)."""
import random

import pytest

from minimoe.experiments import stats

scipy_stats = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize("df", [1, 2, 3, 7, 15, 40, 200])
def test_t_cdf_and_quantile_match_scipy(df):
    for t in (-12.0, -3.1, -1.0, -0.2, 0.0, 0.4, 1.7, 2.36, 5.0, 30.0):
        assert stats.t_cdf(t, df) == pytest.approx(scipy_stats.t.cdf(t, df), abs=1e-12, rel=1e-10)
    for q in (0.001, 0.025, 0.3, 0.5, 0.9, 0.975, 0.9995):
        assert stats.t_quantile(q, df) == pytest.approx(scipy_stats.t.ppf(q, df), abs=1e-9, rel=1e-9)


def test_paired_matches_scipy_ttest_rel_and_interval():
    rng = random.Random(0)
    for n in (2, 3, 8, 20):
        a = [rng.gauss(0, 1) for _ in range(n)]
        b = [x + rng.gauss(0.3, 0.5) for x in a]
        result = stats.paired(a, b)
        reference = scipy_stats.ttest_rel(a, b)
        assert result.p_value == pytest.approx(reference.pvalue, rel=1e-9)
        d = [x - y for x, y in zip(a, b)]
        mean = sum(d) / n
        se = scipy_stats.sem(d)
        low, high = scipy_stats.t.interval(0.95, n - 1, loc=mean, scale=se)
        assert (result.low, result.high) == (pytest.approx(low, rel=1e-9), pytest.approx(high, rel=1e-9))
        assert result.half_width == pytest.approx((high - low) / 2, rel=1e-9)
        # the interval excludes zero exactly when the test rejects at 5 %
        assert result.excludes_zero() == (result.p_value < 0.05)


def test_paired_is_paired_not_two_sample():
    # a large seed effect shared by both routers cancels in the paired difference
    a = [10.0, 20.0, 30.0, 40.0]
    b = [x - 1.0 + e for x, e in zip(a, (0.01, -0.01, 0.02, -0.02))]
    result = stats.paired(a, b)
    assert result.mean == pytest.approx(1.0)
    assert result.half_width < 0.05
    assert scipy_stats.ttest_ind(a, b).pvalue > 0.5  # unpaired, the same data show nothing


def test_holm_by_hand_and_against_the_definition():
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.5, 0.9]) == [1.0, 1.0]
    rng = random.Random(1)
    for _ in range(200):
        p = [rng.random() ** 3 for _ in range(rng.randint(1, 9))]
        adjusted = stats.holm(p)
        m = len(p)
        order = sorted(range(m), key=lambda i: p[i])
        for rank, i in enumerate(order):  # the step-down definition, written out
            expected = min(1.0, max((m - r) * p[order[r]] for r in range(rank + 1)))
            assert adjusted[i] == pytest.approx(expected)


def _rows(values):
    return [{"task": "t", "router": r, "seed": s, "metric": "m", "value": v}
            for r, vs in values.items() for s, v in enumerate(vs)]


def test_compare_to_best_and_verdicts():
    values = {"good": [1.0, 1.1, 0.9, 1.05], "same": [1.001, 1.099, 0.902, 1.048], "bad": [0.5, 0.62, 0.41, 0.55]}
    table = stats.compare_to_best(_rows(values), "t", "m", higher_is_better=True)
    assert table["best"] == "good"
    assert table["rows"]["bad"]["separated"] and not table["rows"]["same"]["separated"]
    bad = table["rows"]["bad"]["diff"]
    assert bad.mean == pytest.approx(-0.4925) and bad.high < 0
    assert stats.verdict(bad, expected_sign=-1) == "holds"
    assert stats.verdict(bad, expected_sign=+1) == "reversed"
    assert stats.verdict(table["rows"]["same"]["diff"], expected_sign=+1) == "tie"
    pairs = stats.pairwise(_rows(values), "t", "m")
    assert set(pairs) == {("bad", "good"), ("bad", "same"), ("good", "same")}
    assert pairs[("bad", "good")]["separated"] and not pairs[("good", "same")]["separated"]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="same seeds"):
        stats.paired([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="at least 2 seeds"):
        stats.paired([1], [2])
    with pytest.raises(ValueError, match="expected_sign"):
        stats.verdict(stats.paired([1, 2], [0, 0]), expected_sign=0)
    with pytest.raises(ValueError, match="q must be"):
        stats.t_quantile(1.0, 3)


def test_interval_coverage_and_holm_family_error_by_monte_carlo():
    """Proposition 9.2 by simulation. Paired normal data with a shared seed effect: the 95% interval
    covers the true mean difference in 95% of studies (4000 studies of 8 seeds: the Monte Carlo
    standard error is 0.0034, the tolerance 0.012 is 3.5 of them), and is narrower than the unpaired
    interval by the factor the proposition gives. Under the null, Holm over 14 comparisons rejects
    at least one in at most 5% of studies (tolerance 3.5 standard errors)."""
    import math

    rng = random.Random(2)
    n, studies, delta = 8, 4000, 0.03
    covered, widths = 0, []
    for _ in range(studies):
        seed_effect = [rng.gauss(0, 0.05) for _ in range(n)]  # shared by both routers: rho = 0.05^2/(0.05^2+0.01^2)
        a = [s + delta + rng.gauss(0, 0.01) for s in seed_effect]
        b = [s + rng.gauss(0, 0.01) for s in seed_effect]
        result = stats.paired(a, b)
        covered += result.low <= delta <= result.high
        widths.append(result.half_width)
    assert abs(covered / studies - 0.95) < 0.012, covered / studies
    # E[half-width] = t * E[s_d] / sqrt(n) with s_d estimating sqrt(2) * 0.01 (the seed effect cancels);
    # E[s] = sigma * c4(n), c4 = sqrt(2/(n-1)) Gamma(n/2) / Gamma((n-1)/2)
    c4 = math.sqrt(2 / (n - 1)) * math.exp(math.lgamma(n / 2) - math.lgamma((n - 1) / 2))
    expected = stats.t_quantile(0.975, n - 1) * c4 * math.sqrt(2) * 0.01 / math.sqrt(n)
    assert sum(widths) / studies == pytest.approx(expected, rel=0.03)
    family_errors, m = 0, 14
    for _ in range(2000):
        p = []
        for _ in range(m):
            seed_effect = [rng.gauss(0, 1) for _ in range(n)]
            p.append(stats.paired([s + rng.gauss(0, 0.1) for s in seed_effect],
                                  [s + rng.gauss(0, 0.1) for s in seed_effect]).p_value)
        family_errors += min(stats.holm(p)) < 0.05
    assert family_errors / 2000 < 0.05 + 3.5 * math.sqrt(0.05 * 0.95 / 2000), family_errors / 2000


def test_format_p_bounds_unresolved_values():
    assert stats.format_p(0.0) == "<1e-10" and stats.format_p(3e-12) == "<1e-10"
    assert stats.format_p(0.0123) == "0.012" and stats.format_p(1.0) == "1"


def test_versus_is_paired_and_holm_corrected_against_a_reference():
    """stats.versus: each label minus the reference, paired over the common seeds (scipy's ttest_rel),
    Holm over the family; the reference itself is not compared."""
    rng = random.Random(3)
    base = {s: rng.gauss(0, 1) for s in range(6)}
    values = {"ref": base,
              "same": {s: base[s] + rng.gauss(0, 0.01) for s in base},
              "better": {s: base[s] - 0.5 + rng.gauss(0, 0.01) for s in base},
              "fewer seeds": {s: base[s] + 0.2 for s in range(4)}}
    out = stats.versus(values, "ref")
    assert set(out) == {"same", "better", "fewer seeds"}
    for label, entry in out.items():
        seeds = sorted(set(values[label]) & set(base))
        reference = scipy_stats.ttest_rel([values[label][s] for s in seeds], [base[s] for s in seeds])
        assert entry["diff"].p_value == pytest.approx(reference.pvalue, rel=1e-5)   # t tails to 1e-5 relative
        assert entry["diff"].n == len(seeds)
    adjusted = stats.holm([out[k]["diff"].p_value for k in out])
    assert [out[k]["p_holm"] for k in out] == adjusted
    assert out["better"]["separated"] and out["better"]["diff"].mean == pytest.approx(-0.5, abs=0.02)
    assert not out["same"]["separated"]
    # lists are values in a common seed order; two seeds give one degree of freedom
    two = stats.versus({"a": [1.0, 2.0], "b": [1.5, 2.4]}, "a")
    assert two["b"]["diff"].n == 2 and two["b"]["diff"].half_width == pytest.approx(12.706 * 0.05, rel=1e-3)
    with pytest.raises(ValueError, match="reference"):
        stats.versus(values, "nobody")
    with pytest.raises(ValueError, match="share 1 seed"):
        stats.versus({"a": {0: 1.0, 1: 2.0}, "b": {1: 3.0}}, "a")


def test_describe_names_the_interval_and_the_verdict():
    out = stats.versus({"a": [1.0, 2.0, 3.0, 4.0], "b": [0.5, 1.4, 2.5, 3.6], "c": [1.3, 2.0, 3.2, 3.9]}, "a")
    assert stats.describe(out["b"]).endswith("separated (better)") and "[" in stats.describe(out["b"])
    assert stats.describe(out["b"], lower_is_better=False).endswith("separated (worse)")
    assert stats.describe(out["c"]).endswith(": tie")


def _study(rng, K, n, means, seed_sd=1.0, noise_sd=0.1):
    """One simulated study: K routers, n seeds, a seed effect shared by every router of a seed."""
    seed_effect = [rng.gauss(0, seed_sd) for _ in range(n)]
    return {f"r{i:02d}": {s: seed_effect[s] + means[i] + rng.gauss(0, noise_sd) for s in range(n)} for i in range(K)}


def _as_rows(values):
    return [{"task": "t", "router": r, "seed": s, "metric": "m", "value": v}
            for r, by_seed in values.items() for s, v in by_seed.items()]


def test_best_set_by_hand():
    """Three routers, lower is better: c is ahead of a by 1 on every seed but with noise, b is far
    behind. b is separated (a and c both beat it), a and c are not separated from each other."""
    values = {"a": {0: 1.0, 1: 1.2, 2: 0.9, 3: 1.1}, "b": {0: 5.0, 1: 5.1, 2: 4.9, 3: 5.2},
              "c": {0: 0.2, 1: 1.5, 2: -0.4, 3: 0.8}}
    result = stats.best_set(values, higher_is_better=False)
    rows = result["rows"]
    assert result["best"] == "c"
    assert rows["b"]["separated"] and rows["b"]["beaten_by"] == ["c", "a"]
    assert not rows["a"]["separated"] and not rows["c"]["separated"] and rows["c"]["p_holm"] == 1.0
    # b's smallest Holm p-value against a better router is the pairwise Holm of the pair (a, b)
    pair = stats.paired(list(values["a"].values()), list(values["b"].values())).p_value
    others = [stats.paired(list(values[x].values()), list(values[y].values())).p_value for x, y in (("a", "c"), ("b", "c"))]
    assert rows["b"]["p_holm"] == pytest.approx(min(stats.holm([pair, *others])[:2]))
    assert rows["a"]["diff"].mean == pytest.approx(sum(values["a"].values()) / 4 - sum(values["c"].values()) / 4)
    with pytest.raises(ValueError, match="share 1 seed"):
        stats.best_set({"a": {0: 1.0, 1: 2.0}, "b": {1: 1.0}}, higher_is_better=True)


def test_best_set_keeps_the_family_error_including_the_choice_of_the_best_by_monte_carlo():
    """Chapter 9's procedure by simulation, 15 routers and 8 seeds with a shared seed effect. Under the
    global null (all routers equal) any separation is an error: all-pairs Holm separates some router
    in at most 5% of studies (1000 studies; tolerance 3.5 Monte Carlo standard errors, 0.024), while
    comparing with the router of best sample mean, Holm over its 14 comparisons, does so in 12-16%
    (the error of choosing the best; asserted above 10%). Under a one-better alternative the only
    possible error is a directional one: a truly worse router ahead in the sample and separated from
    the true best. It is likeliest when the gap is small, so the true best is put ahead by 0.5, 1 and 2
    standard errors of a paired mean (0.025, 0.05, 0.1; 300 studies each), and it must be separated in
    at most 5% of studies (same tolerance). At a gap of 10 standard errors (0.5) the others, truly
    worse, are separated in most studies: the procedure has power."""
    import math
    rng = random.Random(48)
    K, n, studies = 15, 8, 1000
    errors_new = errors_old = 0
    for _ in range(studies):
        values = _study(rng, K, n, [0.0] * K)
        errors_new += any(r["separated"] for r in stats.best_set(values, higher_is_better=True)["rows"].values())
        old = stats.compare_to_best(_as_rows(values), "t", "m", higher_is_better=True)
        errors_old += any(r.get("separated") for r in old["rows"].values())
    tolerance = 3.5 * math.sqrt(0.05 * 0.95 / studies)
    assert errors_new / studies <= 0.05 + tolerance, errors_new / studies
    assert errors_old / studies > 0.10, errors_old / studies
    standard_error = 0.1 * math.sqrt(2) / math.sqrt(n)  # of a paired mean: noise_sd * sqrt(2) / sqrt(n)
    for gap in (0.5, 1.0, 2.0):
        separated = 0
        for _ in range(300):
            values = _study(rng, K, n, [gap * standard_error] + [0.0] * (K - 1))
            separated += stats.best_set(values, higher_is_better=True)["rows"]["r00"]["separated"]
        assert separated / 300 <= 0.05 + 3.5 * math.sqrt(0.05 * 0.95 / 300), (gap, separated)
    best_separated, others_separated = 0, 0
    for _ in range(300):
        values = _study(rng, K, n, [0.5] + [0.0] * (K - 1))
        rows = stats.best_set(values, higher_is_better=True)["rows"]
        best_separated += rows["r00"]["separated"]
        others_separated += sum(rows[f"r{i:02d}"]["separated"] for i in range(1, K))
    assert best_separated / 300 <= 0.05 + 3.5 * math.sqrt(0.05 * 0.95 / 300), best_separated
    assert others_separated / (300 * (K - 1)) > 0.5, others_separated / (300 * (K - 1))


def test_equivalence_is_two_one_sided_tests():
    """TOST against scipy's one-sided t-tests, the interval rule, and its error by Monte Carlo: at a true
    difference equal to the margin, "equivalent" is declared in at most alpha = 5% of studies
    (2000 studies, tolerance 3.5 standard errors); at a true difference of 0 with a narrow interval,
    in nearly all."""
    import math
    from scipy import stats as sps
    rng = random.Random(9)
    a = [rng.gauss(0.0, 0.01) for _ in range(8)]
    b = [x + rng.gauss(0.002, 0.004) for x in a]
    result = stats.equivalent(a, b, 0.01)
    d = [x - y for x, y in zip(a, b)]
    lower = sps.ttest_1samp(d, -0.01, alternative="greater").pvalue
    upper = sps.ttest_1samp(d, 0.01, alternative="less").pvalue
    assert result.p_value == pytest.approx(max(lower, upper), rel=1e-6)
    assert result.equivalent == (result.p_value < 0.05) == (-0.01 < result.low and result.high < 0.01)
    ninety = stats.paired(a, b, level=0.90)
    assert (result.low, result.high) == pytest.approx((ninety.low, ninety.high))
    declared = 0
    for _ in range(2000):
        base = [rng.gauss(0, 1) for _ in range(8)]
        declared += stats.equivalent([x + 0.01 + rng.gauss(0, 0.005) for x in base],
                                     [x + rng.gauss(0, 0.005) for x in base], 0.01).equivalent
    assert declared / 2000 <= 0.05 + 3.5 * math.sqrt(0.05 * 0.95 / 2000), declared / 2000
    close = sum(stats.equivalent([x + rng.gauss(0, 0.001) for x in a], a, 0.01).equivalent for _ in range(100))
    assert close >= 95
    with pytest.raises(ValueError, match="margin"):
        stats.equivalent(a, b, 0.0)


def test_noninferiority_is_the_one_sided_test_on_the_bad_side():
    """The one-sided test against scipy, in both directions of "better"; the interval rule; a router
    far better than its comparator passes (where TOST does not); the level by Monte Carlo at a true
    loss of exactly the margin (2000 studies, tolerance 3.5 standard errors)."""
    import math
    from scipy import stats as sps
    rng = random.Random(11)
    base = [rng.gauss(0.0, 0.05) for _ in range(8)]
    a = [x + rng.gauss(0.004, 0.004) for x in base]   # a little higher: worse if lower is better
    d = [x - y for x, y in zip(a, base)]
    low_better = stats.noninferior(a, base, 0.01, higher_is_better=False)
    assert low_better.p_value == pytest.approx(sps.ttest_1samp(d, 0.01, alternative="less").pvalue, rel=1e-6)
    high_better = stats.noninferior(a, base, 0.01, higher_is_better=True)
    assert high_better.p_value == pytest.approx(sps.ttest_1samp(d, -0.01, alternative="greater").pvalue, rel=1e-6)
    ninety = stats.paired(a, base, level=0.90)
    assert low_better.equivalent == (ninety.high < 0.01) == (low_better.p_value < 0.05)
    assert high_better.equivalent == (ninety.low > -0.01) == (high_better.p_value < 0.05)
    far_better = [x - 0.2 + rng.gauss(0, 0.004) for x in base]  # much lower loss
    assert stats.noninferior(far_better, base, 0.01, higher_is_better=False).equivalent
    assert not stats.equivalent(far_better, base, 0.01).equivalent
    declared = 0
    for _ in range(2000):
        common = [rng.gauss(0, 1) for _ in range(8)]
        worse = [x + 0.01 + rng.gauss(0, 0.005) for x in common]  # exactly the margin worse (lower is better)
        declared += stats.noninferior(worse, [x + rng.gauss(0, 0.005) for x in common], 0.01,
                                      higher_is_better=False).equivalent
    assert declared / 2000 <= 0.05 + 3.5 * math.sqrt(0.05 * 0.95 / 2000), declared / 2000
    with pytest.raises(ValueError, match="margin"):
        stats.noninferior(a, base, -1.0, higher_is_better=True)
