"""minimoe.experiments.claims and the study's variants: verdicts on results with a known answer, the
one-sample and ratio comparisons against scipy, Holm over the table, and the variants' options.

Oracles: scipy.stats.ttest_rel / ttest_1samp for the p-values, the definition of Holm's procedure,
and hand-made results whose verdicts are fixed by construction."""
import math
import random
import re
from pathlib import Path

import pytest
import torch

import minimoe
from minimoe.experiments import claims, make_task, run, read_results, stats, task_config, train_one
from minimoe.experiments.configs import base_router, router_options, study_entries, study_variants

ROOT = Path(__file__).resolve().parents[1]
scipy_stats = pytest.importorskip("scipy.stats")


def _rows(task, metric, values):
    return [{"task": task, "router": r, "seed": s, "metric": metric, "value": v}
            for r, vs in values.items() for s, v in enumerate(vs)]


def _noise(n, scale, seed):
    rng = random.Random(seed)
    return [rng.gauss(0.0, scale) for _ in range(n)]


def test_verdicts_follow_the_sign_and_the_metric_direction():
    n = 8
    base = [2.0 + e for e in _noise(n, 0.05, 0)]  # a common seed effect, shared by every router
    lm = {"softmax_topk": base,
          "expert_choice": [b - 0.1 + e for b, e in zip(base, _noise(n, 0.005, 1))],   # lower loss: better
          "usmoe": [b + 0.1 + e for b, e in zip(base, _noise(n, 0.005, 2))],           # higher loss: worse
          "sinkhorn_token_choice": [b + e for b, e in zip(base, _noise(n, 0.005, 3))]}  # the same
    rows = _rows("lm", "val_loss", lm)
    one = [c for c in claims.CLAIMS if (c.a, c.b, c.metric) in
           {("expert_choice", "softmax_topk", "quality"), ("usmoe", "softmax_topk", "quality")}]
    result = {(r["claim"].a, r["task"]): r for r in claims.evaluate(rows, one)}
    assert set(result) == {("expert_choice", "lm"), ("usmoe", "lm")}  # tasks without values are skipped
    assert result[("expert_choice", "lm")]["verdict"] == "holds"  # lower val_loss is better on the LM
    assert result[("usmoe", "lm")]["verdict"] == "reversed"
    # the same numbers read as accuracies (higher is better) flip both verdicts
    vision = [dict(r, task="vision", metric="val_accuracy") for r in rows]
    flipped = {r["claim"].a: r["verdict"] for r in claims.evaluate(vision, one)}
    assert flipped == {"expert_choice": "reversed", "usmoe": "holds"}
    tie_claim = claims.Claim("p", "k", "s", "sinkhorn beats softmax", "sinkhorn_token_choice", "softmax_topk",
                             tasks=("lm",))
    (tie,) = claims.evaluate(rows, [tie_claim])
    assert tie["verdict"] == "tie" and tie["diff"].low < 0 < tie["diff"].high


def test_paired_p_values_match_scipy_and_holm_spans_the_table():
    n = 10
    rows = _rows("clustered", "val_r2", {
        "usmoe": [0.9 + e for e in _noise(n, 0.01, 4)], "softmax_topk": [0.88 + e for e in _noise(n, 0.01, 5)],
        "expert_choice": [0.89 + e for e in _noise(n, 0.01, 6)]})
    rows += _rows("clustered", "drop_rate", {"usmoe": [0.01 + 0.001 * i for i in range(n)],
                                             "softmax_topk": [0.1 + 0.002 * i for i in range(n)]})
    out = claims.evaluate(rows)
    assert {(r["claim"].a, r["b"], r["metric"]) for r in out} == {
        ("usmoe", "softmax_topk", "val_r2"), ("usmoe", "expert_choice", "val_r2"),
        ("expert_choice", "softmax_topk", "val_r2"), ("usmoe", "softmax_topk", "drop_rate")}
    for r in out:
        by_seed = {(row["router"], row["seed"]): row["value"] for row in rows if row["metric"] == r["metric"]}
        a = [by_seed[(r["claim"].a, s)] for s in range(n)]
        b = [by_seed[(r["b"], s)] for s in range(n)]
        assert r["diff"].p_value == pytest.approx(scipy_stats.ttest_rel(a, b).pvalue, rel=1e-8)
    raw = [r["diff"].p_value for r in out]
    assert [r["p_holm"] for r in out] == pytest.approx(stats.holm(raw))
    assert max(r["p_holm"] for r in out) <= 1.0


def test_one_sample_claim_and_best_other():
    n = 6
    epts = [1.8 + 0.01 * i for i in range(n)]
    rows = _rows("vision", "experts_per_token", {"probmoe_dynamic": epts})
    (row,) = claims.evaluate(rows, [c for c in claims.CLAIMS if c.b == 2.0])
    assert row["b"] == 2.0 and row["mean_b"] == 2.0
    assert row["diff"].p_value == pytest.approx(scipy_stats.ttest_1samp(epts, 2.0).pvalue, rel=1e-8)
    assert row["verdict"] == "holds"  # fewer experts than k_max, with a small spread
    # Soft MoE against the best other *registered* router (a variant is not a candidate)
    acc = _rows("vision", "val_accuracy", {"soft_moe": [0.80, 0.82, 0.81, 0.83], "base": [0.85, 0.86, 0.84, 0.87],
                                           "expert_choice": [0.84, 0.85, 0.83, 0.86],
                                           "softmax_topk_dropless": [0.95, 0.95, 0.96, 0.95]})
    (soft,) = claims.evaluate(acc, [c for c in claims.CLAIMS if c.b == claims.BEST_OTHER])
    assert soft["b"] == "base" and soft["verdict"] == "reversed"


def test_ratio_claim_is_the_interval_of_log_ratios():
    a, b = [47.0, 45.0, 52.0, 49.0, 44.0], [30.0, 31.0, 33.0, 29.0, 30.5]
    rows = _rows("lm", "ms_per_step", {"sparsity_constrained_ec": a, "expert_choice": b})
    (row,) = claims.evaluate(rows, [c for c in claims.CLAIMS if c.ratio])
    logs = stats.paired([math.log(x) for x in a], [math.log(y) for y in b])
    assert row["ratio"] == pytest.approx((math.exp(logs.mean), math.exp(logs.low), math.exp(logs.high)))
    assert row["ratio"][1] < sum(x / y for x, y in zip(a, b)) / len(a) < row["ratio"][2]
    assert row["verdict"] == "holds"
    with pytest.raises(ValueError, match="positive"):
        claims.evaluate(_rows("lm", "ms_per_step", {"sparsity_constrained_ec": [1.0, 0.0],
                                                     "expert_choice": [1.0, 1.0]}), [c for c in claims.CLAIMS
                                                                                   if c.ratio])


def test_every_claim_names_study_entries_book_sections_and_references():
    entries = set(study_entries())
    labels = set()
    for path in (ROOT / "book").glob("*.md"):
        labels |= set(re.findall(r"^\(([\w-]+)\)=", path.read_text(), flags=re.M))
    bib = (ROOT / "references.bib").read_text()
    for claim in claims.CLAIMS:
        assert claim.a in entries, claim
        assert claim.b == claims.BEST_OTHER or isinstance(claim.b, float) or claim.b in entries, claim
        assert claim.section in labels, claim
        assert "{" + claim.cite + "," in bib, claim


def test_variants_are_their_router_with_other_options():
    variants = study_variants()
    assert set(variants) == {"ssr_p0", "softmax_topk_dropless"}
    assert set(variants) <= set(study_entries()) and not set(variants) & set(minimoe.routers.available())
    config = task_config("clustered", "toy")
    for name, (router, options) in variants.items():
        assert base_router(name) == router and router_options(name, config) == options
    assert router_options("ssr_p0", config) == {**router_options("ssr", config), "p": 0.0}
    assert router_options("softmax_topk_dropless", config) == {**router_options("softmax_topk", config),
                                                              "capacity_factor": None}
    with pytest.raises(ValueError, match="no study entry"):
        base_router("ssr_p1")


def test_a_variant_trains_and_is_recorded(tmp_path):
    torch.set_num_threads(1)
    task = make_task(task_config("clustered", "toy", steps=8, data=dict(n_samples=1024)))
    model = task.build_model(base_router("ssr_p0"), router_options("ssr_p0", task.config)).train()
    for _ in range(20):
        model(task.train_batch(0, 0)[0])
        assert model.moe.last_routing.stats["used_sinkhorn"] == 0.0  # p = 0: the coin never says Sinkhorn
    run("clustered", "all,ssr_p0", scale="toy", seeds=1, out=tmp_path, progress=False, threads=1, steps=4,
        data=dict(n_samples=1024))
    rows = read_results(tmp_path)
    assert {r["router"] for r in rows} == {*minimoe.routers.available(), "ssr_p0"}
    provenance = (tmp_path / "provenance.json").read_text()
    assert '"ssr_p0": "ssr"' in provenance and '"cpu_capability"' in provenance
    # the variant's run is the router's run with the variant's options, digit for digit
    metrics, _ = train_one(make_task(task_config("clustered", "toy", steps=4, data=dict(n_samples=1024))), "ssr_p0",
                           0, device=torch.device("cpu"), progress=False)
    recorded = {r["metric"]: r["value"] for r in rows if r["router"] == "ssr_p0"}
    assert all(recorded[k] == v for k, v in metrics.items() if k != "ms_per_step")


def test_median():
    assert stats.median([3, 1, 2]) == 2 and stats.median([4, 1, 3, 2]) == 2.5
    with pytest.raises(ValueError, match="empty"):
        stats.median([])


def test_an_as_well_as_claim_is_tested_as_equivalence_with_its_margin():
    """TOST inside the Holm family: a narrow tie within the margin holds; a wide tie (the same mean,
    ten times the noise) is not shown, where a superiority test would call both a tie; a clear
    difference beyond the margin is not shown either. Oracle: scipy's one-sided paired t-tests."""
    n, margin = 8, 0.02
    base = [2.0 + e for e in _noise(n, 0.05, 0)]
    claim = claims.Claim("paper", "cite", "sec", "a trains as well as b", "a", "b", tasks=("lm",),
                         margin={"lm": margin})
    cases = {"narrow": ([b + 0.002 + e for b, e in zip(base, _noise(n, 0.004, 1))], "holds"),
             "wide": ([b + 0.002 + e for b, e in zip(base, _noise(n, 0.04, 2))], "not shown"),
             "beyond": ([b + 0.05 + e for b, e in zip(base, _noise(n, 0.004, 3))], "not shown")}
    for name, (a, expected) in cases.items():
        rows = _rows("lm", "val_loss", {"a": a, "b": base})
        (row,) = claims.evaluate(rows, (claim,))
        assert row["verdict"] == expected, name
        d = [x - y for x, y in zip(a, base)]
        p_low = scipy_stats.ttest_1samp(d, -margin, alternative="greater").pvalue
        p_high = scipy_stats.ttest_1samp(d, margin, alternative="less").pvalue
        assert row["p_holm"] == pytest.approx(max(p_low, p_high), rel=1e-6), name  # a family of one
        text = claims.effect_text(row)
        assert text.endswith(f"margin ±{margin:g}") and f"90% [{row['equivalence'].low:+.4f}" in text
    # in a family with a superiority claim, both p-values are Holm-adjusted together
    sup = claims.Claim("paper", "cite", "sec", "a beats b", "a", "b", tasks=("lm",))
    rows = _rows("lm", "val_loss", {"a": cases["narrow"][0], "b": base})
    both = claims.evaluate(rows, (claim, sup))
    raw = [both[0]["equivalence"].p_value, both[1]["diff"].p_value]
    assert [r["p_holm"] for r in both] == pytest.approx(stats.holm(raw))
    # "not worse by the margin": the far-better router passes, one-sided, where TOST does not
    better = [b - 0.05 + e for b, e in zip(base, _noise(n, 0.004, 4))]
    one_sided = claims.Claim("paper", "cite", "sec", "a trains as well as b", "a", "b", tasks=("lm",),
                             margin={"lm": margin}, noninferiority=True)
    rows = _rows("lm", "val_loss", {"a": better, "b": base})
    assert claims.evaluate(rows, (one_sided,))[0]["verdict"] == "holds"
    assert claims.evaluate(rows, (claim,))[0]["verdict"] == "not shown"
    d = [x - y for x, y in zip(better, base)]
    assert claims.evaluate(rows, (one_sided,))[0]["p_holm"] == pytest.approx(
        scipy_stats.ttest_1samp(d, margin, alternative="less").pvalue, rel=1e-6)
    with pytest.raises(ValueError, match="needs a margin for clustered"):
        claims.evaluate(_rows("clustered", "val_r2", {"a": base, "b": base}),
                        (claims.Claim("p", "c", "s", "x", "a", "b", tasks=("clustered",), margin={"lm": 0.1}),))


def test_every_router_against_the_baselines_in_one_holm_family():
    from minimoe.experiments import report

    n = 8
    rows = []
    effects = {"lm": {"softmax_topk": 0.0, "expert_choice": -0.05, "hash": 0.001, "random": 0.2, "dense": 0.1,
                      "dense_wide": -0.1},
               "clustered": {"softmax_topk": 0.0, "expert_choice": 0.01, "hash": -0.05, "random": -0.1, "dense": -0.1,
                             "dense_wide": 0.0},
               "vision": {"softmax_topk": 0.0, "expert_choice": 0.0, "hash": 0.0, "random": -0.02, "dense": 0.0,
                          "dense_wide": 0.01}}
    for i, (task, by_router) in enumerate(effects.items()):
        metric, _ = claims.headline(task)
        base = [1.0 + e for e in _noise(n, 0.05, 10 + i)]
        rows += _rows(task, metric, {r: [b + eff + e for b, e in zip(base, _noise(n, 0.005, 20 + 7 * i + j))]
                                     for j, (r, eff) in enumerate(by_router.items())})
    table = report.baseline_comparisons(rows)
    assert len(table) == 3 * 2 * 4  # every (task, learned entry, baseline)
    keys = list(table)
    assert [table[k]["p_holm"] for k in keys] == pytest.approx(stats.holm([table[k]["diff"].p_value for k in keys]))
    lm = {b: table["lm", "softmax_topk", b] for b in ("hash", "random", "dense", "dense_wide")}
    assert lm["random"]["better"] and lm["dense"]["better"]        # lower loss than both
    assert not lm["hash"]["better"] and not lm["hash"]["worse"]     # the same, a tie
    assert lm["dense_wide"]["worse"]                                # eight times the compute wins
    assert table["clustered", "softmax_topk", "hash"]["better"]    # R^2: higher is better
    assert table["vision", "expert_choice", "random"]["better"] and not table["vision", "expert_choice", "dense"]["better"]
    text = report.baselines_table(rows, "lm")
    line = next(l for l in text.splitlines() if l.startswith("| `softmax_topk`"))
    dense, dense_wide, hash_, random_ = [c.strip(" |") for c in line.split(" | ")[1:]]  # the baselines, sorted
    assert dense.startswith("**") and random_.startswith("**")     # separated ahead: bold
    assert dense_wide.startswith("*") and not dense_wide.startswith("**")  # separated behind: italic
    assert not hash_.startswith("*")                                # a tie: plain
    assert text.splitlines()[0].startswith("| router (val_loss ↓) | − `dense` (")
