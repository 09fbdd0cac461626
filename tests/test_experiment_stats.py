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
