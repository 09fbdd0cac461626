"""The benchmark code runs (issue 9): every case the suite uses, in-process at tiny sizes, returns
finite numbers; the JSON results round-trip; the einsum case is skipped where D and C cannot fit.
Timings themselves are measured, not tested."""
import math
import time
from pathlib import Path

import pytest
import torch

from benchmarks import cases
from benchmarks.__main__ import (EINSUM_BUDGET_GB, Report, dense_dispatch_gb, einsum_skip_reason, read_json,
                                 write_json)
from minimoe.routers import available


@pytest.fixture(autouse=True)
def one_thread():
    # tiny cases: a second thread only waits on a core another process may be using
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _finite(value):
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return isinstance(value, (int, float)) and math.isfinite(value)


def _check(result, quality=None):
    assert result["repeats"] >= 1
    assert _finite(result["median_ms"]) and result["median_ms"] > 0
    assert _finite(result["peak_mb"]) and result["peak_mb"] >= 0
    assert "output" not in result
    if quality is not None:
        assert _finite(result["quality"])
        assert quality(result["quality"])


TINY = dict(device="cpu", repeats=2)


@pytest.mark.parametrize("router", available())
def test_router_overhead_every_router(router):
    result = cases.run("router_overhead", dict(router=router, T=32, E=4, d=8, **TINY))
    # quality: experts per token; Soft MoE's combine touches every expert, a dropping router fewer than 1
    _check(result, lambda experts: 0 <= experts <= 4)


def test_router_overhead_options_override_and_floor():
    _check(cases.run("router_overhead", dict(router="ssr", options={"p": 1.0}, T=32, E=4, d=8, **TINY)))
    _check(cases.run("router_floor", dict(T=32, E=4, d=8, **TINY)))


@pytest.mark.parametrize("case, extra", [("expert_floor", {}), ("layer_path", {"path": "index"}),
                                         ("layer_path", {"path": "grouped"}),
                                         ("layer_path", {"path": "loop"}), ("layer_path", {"path": "einsum"})])
def test_layer_cases(case, extra):
    _check(cases.run(case, dict(T=32, E=4, d=8, h=16, k=2, **extra, **TINY)))


def test_soft_moe_floor():
    _check(cases.run("soft_moe_floor", dict(T=32, E=4, d=8, **TINY)))


def test_routing_from_logits_and_copy_bandwidth():
    _check(cases.run("routing_floor", dict(T=32, E=4, k=2, **TINY)))
    _check(cases.run("routing_softmax_topk", dict(T=32, E=4, k=2, capacity_factor=1.0, **TINY)))
    _check(cases.run("copy_bandwidth", dict(mb=1, **TINY)))


def test_budget_stops_early_and_warmup_can_be_skipped():
    result = cases.run("copy_bandwidth", dict(mb=1, device="cpu", repeats=1000, budget_s=0.0, min_repeats=2,
                                              warmup=False))
    assert result["repeats"] == 2


def test_ot_assignment_subset_and_matching_cases():
    ot = dict(T=64, E=4, tol=1e-4, max_iter=2000, **TINY)
    _check(cases.run("sinkhorn_minimoe", dict(eps=0.1, method="auto", **ot)), lambda err: err <= 1e-4)
    _check(cases.run("sinkhorn_pot", dict(eps=0.1, method="sinkhorn_log", backend="torch", **ot)),
           lambda err: err <= 1e-4)
    scores = [cases.run(name, dict(T=16, E=4, **TINY, **extra))["quality"]
              for name, extra in [("assignment_scipy", {}), ("assignment_minimoe", {"method": "scipy"})]]
    assert scores[0] == pytest.approx(scores[1], abs=1e-4)  # both optimal: equal total score
    subset = dict(T=16, E=6, k=2, dtype="float64", **TINY)
    _check(cases.run("ksubset_minimoe", subset), lambda q: q["vs_f64"] < 1e-10)
    _check(cases.run("ksubset_autograd_loop", subset), lambda q: q["vs_f64"] == 0)
    _check(cases.run("ksubset_sample_minimoe", subset), lambda share: share == 1)
    _check(cases.run("gumbel_topk_sample", subset), lambda share: share == 1)
    totals = [cases.run("gumbel_matching_minimoe", dict(T=16, E=4, method=m, **TINY))["quality"]
              for m in ("assignment", "cycle")]
    assert totals[0] == pytest.approx(totals[1], abs=1e-6)


def test_optimizer_step_case_gives_the_same_parameters_in_both_forms():
    """``optimizer_step`` (``python -m benchmarks.paired optimizer_step``): after the same three steps
    the loop and the multi-tensor form leave the same parameters (their sum, to the bit), and the
    steps moved them."""
    sums = [cases.run("optimizer_step", dict(foreach=foreach, device="cpu", repeats=3, warmup=False))
            for foreach in (False, True)]
    for result in sums:
        _check(result)
    assert sums[0]["quality"] == sums[1]["quality"]
    unmoved = cases.run("optimizer_step", dict(foreach=False, device="cpu", repeats=1, warmup=False))["quality"]
    assert unmoved != sums[0]["quality"]  # one step is not three


def test_json_round_trip(tmp_path):
    report = Report()
    report.record("layer", "index", {"median_ms": 1.5, "peak_mb": 2.0, "repeats": 3, "output": "dropped"},
                  T=1024, E=8, ratio=1.2, ratio_to="floor")
    report.record("layer", "einsum", None, T=65536, E=8, skipped=einsum_skip_reason(65536, 8))
    meta = {"date": "2026-01-01", "device": "cpu", "quick": True}
    write_json(tmp_path / "r.json", meta, report.records)
    assert read_json(tmp_path / "r.json") == (meta, report.records)
    assert report.records[0] == {"section": "layer", "case": "index", "median_ms": 1.5, "peak_mb": 2.0,
                                 "repeats": 3, "T": 1024, "E": 8, "ratio": 1.2, "ratio_to": "floor"}


def test_einsum_skip_rule():
    # D and C hold T * E * C values each, C = 2T/E: 2 * 2T^2 * 4 bytes whatever E is
    assert dense_dispatch_gb(8192, 64) == pytest.approx(2 * 8192 * 64 * 256 * 4 / 1e9)
    for E in (8, 64):
        assert einsum_skip_reason(1024, E) is None
        assert einsum_skip_reason(8192, E) is None  # 1.07 GB
        reason = einsum_skip_reason(65536, E)
        assert reason == f"skipped: dense D and C would need {2 * 2 * 65536**2 * 4 / 1e9:.1f} GB"
        assert dense_dispatch_gb(65536, E) > EINSUM_BUDGET_GB
    assert einsum_skip_reason(8192, 8, budget_gb=1.0) is not None


def test_layer_section_with_the_cuda_bandwidth_lines():
    # the CUDA-only lines cannot run here: feed the section a stand-in for run_case
    from argparse import Namespace

    from benchmarks.__main__ import layer_paths

    calls = []

    def fake_run_case(name, **params):
        calls.append((name, params.get("path")))
        return {"median_ms": {"expert_floor": 10.0, "copy_bandwidth": 1.0}.get(name, 12.0), "peak_mb": 1.0}

    report = Report()
    layer_paths(Namespace(quick=True, device="cuda"), fake_run_case, report)
    assert ("copy_bandwidth", None) in calls
    bandwidth = 2 * 2**30 / 1e-3  # bytes/s: 1 GiB copied (read + write) in 1 ms
    for E in (8, 64):
        rec = next(r for r in report.records if r["section"] == "bandwidth" and r.get("E") == E)
        assert rec["bound_ms"] == pytest.approx(8 * 1024 * 2 * 256 * 4 / bandwidth * 1e3)
        assert rec["ratio"] == pytest.approx(rec["bound_ms"] / 2.0)  # index 12 ms - floor 10 ms
        assert rec["tokens_per_s"] == pytest.approx(1024 / 12e-3)
    ratios = [r for r in report.records if r["section"] == "layer_ratios"]
    assert [r["case"] for r in ratios] == ["index", "index", "grouped", "grouped"]
    assert [r["einsum_over_path"] for r in ratios] == [1.0] * 4
    assert {path for name, path in calls if name == "layer_path"} == {"index", "slots", "grouped", "loop", "einsum"}
    assert any("achieved" in line for line in report.lines)


def test_dropless_layer_case_reports_the_imbalance():
    balanced = cases.run("layer_path", dict(T=64, E=4, d=8, h=16, k=2, path="grouped", capacity_factor=None, **TINY))
    skewed = cases.run("layer_path", dict(T=64, E=4, d=8, h=16, k=2, path="grouped", capacity_factor=None, skew=8.0,
                                          **TINY))
    _check(balanced, lambda imbalance: 1.0 <= imbalance < 2.0)
    # the first expert is in nearly every token's top 2: about T of the 2T/E pairs an expert gets on average
    _check(skewed, lambda imbalance: imbalance > 1.6)


def test_dropless_section_runs_every_path():
    from argparse import Namespace

    from benchmarks.__main__ import dropless_layer

    calls = []

    def fake_run_case(name, **params):
        calls.append((params["path"], params["E"], params["skew"]))
        return {"median_ms": {"index": 2.0}.get(params["path"], 3.0), "peak_mb": 1.0, "quality": 1.5}

    report = Report()
    dropless_layer(Namespace(quick=True, device="cpu"), fake_run_case, report)
    assert len(calls) == 12 and {c[0] for c in calls} == {"index", "slots", "loop"}
    assert [r["ratio"] for r in report.records[:3]] == [1.0, 1.5, 1.5]


def test_router_section_reports_both_memory_regimes():
    from argparse import Namespace

    from benchmarks.__main__ import router_overhead

    def fake_run_case(name, env=None, **params):
        base = {"router_floor": 1.0, "soft_moe_floor": 2.0}.get(name, 3.0)
        faults = 0.0 if params.get("after_training_step") else 7.0
        return {"median_ms": base / 2 if params.get("after_training_step") else base, "peak_mb": 1.0, "repeats": 3,
                "faults_per_call": faults}

    report = Report()
    router_overhead(Namespace(quick=True, device="cpu"), fake_run_case, report)
    rows = [r for r in report.records if r["case"] not in ("floor", "soft_moe floor")]
    assert rows and all(r["ratio"] == 3.0 and r["training_ratio"] == 3.0 and r["training_median_ms"] == 1.5
                        and r["faults_per_call"] == 7.0 and r["training_faults_per_call"] == 0.0 for r in rows)
    own = [r for r in report.records if r["case"] == "soft_moe floor"]
    assert len(own) == 1 and own[0]["ratio"] == 1.5  # soft_moe (3 ms) over its own floor (2 ms here)
    # the record's times and faults are the floor's own: in training 1 ms, and soft_moe's 1.5 ms over it
    assert own[0]["median_ms"] == 2.0 and own[0]["training_median_ms"] == 1.0 and own[0]["training_ratio"] == 1.5
    assert own[0]["training_faults_per_call"] == 0.0 and own[0]["faults_per_call"] == 7.0


def test_a_case_after_a_training_step_runs_and_counts_page_faults():
    for name in ("router_overhead", "router_floor", "soft_moe_floor"):
        result = cases.run(name, dict(router="softmax_topk", T=32, E=4, d=8, after_training_step=True, **TINY))
        _check(result)
        assert result["faults_per_call"] >= 0

@pytest.mark.parametrize("n", [6, 7, 10, 20, 41])
def test_paired_median_interval_is_the_sign_test_interval(n):
    from scipy.stats import binom

    from benchmarks.paired import median_interval

    values = [float(v) for v in torch.randperm(n, generator=torch.Generator().manual_seed(n))]
    low, high, coverage = median_interval(values)
    # oracle: the largest j with P(x_(j) <= median <= x_(n+1-j)) = 1 - 2 P(Bin(n, 1/2) <= j - 1) >= 0.95
    j = max(j for j in range(1, n // 2 + 1) if 1 - 2 * binom.cdf(j - 1, n, 0.5) >= 0.95)
    assert (low, high) == (float(j - 1), float(n - j))  # the values are a permutation of 0 .. n-1
    assert coverage == pytest.approx(1 - 2 * binom.cdf(j - 1, n, 0.5), abs=1e-12)
    if n == 6:
        assert (low, high, coverage) == (0.0, 5.0, pytest.approx(31 / 32))


def test_paired_median_interval_refuses_too_few_rounds():
    from benchmarks.paired import median_interval

    with pytest.raises(ValueError, match="at least 6"):
        median_interval([1.0, 2.0, 3.0, 4.0, 5.0])


@pytest.mark.parametrize("routers", ["softmax_topk,ssr", "from_logits"])
def test_paired_rounds_divide_each_case_by_its_rounds_floor(routers, monkeypatch, capsys):
    import benchmarks.paired as paired

    calls = []

    def fake_run_case(name, **params):
        calls.append((name, params))
        floor = name in ("router_floor", "routing_floor")
        # round r's floor takes r ms and every other case 3r ms: each round's ratio is 3
        rounds = sum(1 for c, _ in calls if c in ("router_floor", "routing_floor"))
        return {"median_ms": float(rounds) * (1 if floor else 3)}

    monkeypatch.setattr(paired, "run_case", fake_run_case)
    assert paired.main([routers, "--rounds", "6"]) == 0
    out = capsys.readouterr().out
    assert out.count("median 3.00x") == 2 and out.count("[3.00x, 3.00x]") == 2
    floors = [p for c, p in calls if c in ("router_floor", "routing_floor")]
    assert len(floors) == 6 and len(calls) == 18
    if routers == "from_logits":
        assert {p.get("capacity_factor", "floor") for _, p in calls} == {1.0, None, "floor"}
    else:
        assert all(p["after_training_step"] for _, p in calls)


def test_paired_ksubset_rounds_give_each_dtype_its_own_loop_as_floor(monkeypatch, capsys):
    """``benchmarks.paired ksubset``: per round and dtype the autograd loop, then minimoe; the
    speed-up is loop over minimoe, each dtype against its own loop."""
    import benchmarks.paired as paired

    calls = []

    def fake_run_case(name, **params):
        calls.append((name, params))
        loop = name == "ksubset_autograd_loop"
        ms = {"float32": 10.0, "float64": 20.0}[params["dtype"]]  # float64 loop 20 ms, minimoe 4 ms: 5x
        return {"median_ms": ms if loop else ms / {"float32": 8.0, "float64": 5.0}[params["dtype"]]}

    monkeypatch.setattr(paired, "run_case", fake_run_case)
    assert paired.main(["ksubset", "--rounds", "6"]) == 0
    out = capsys.readouterr().out
    assert "ksubset_marginals float32  median 8.00x" in out and "[8.00x, 8.00x]" in out
    assert "ksubset_marginals float64  median 5.00x" in out and "[5.00x, 5.00x]" in out
    assert [c for c, _ in calls[:4]] == ["ksubset_autograd_loop", "ksubset_minimoe"] * 2
    assert [p["dtype"] for _, p in calls[:4]] == ["float32", "float32", "float64", "float64"]
    assert len(calls) == 24 and all(p["T"] == 8192 and p["k"] == 8 for _, p in calls)


def test_paired_optimizer_step_reports_the_loops_time_over_foreachs(monkeypatch, capsys):
    import benchmarks.paired as paired

    calls = []

    def fake_run_case(name, **params):
        calls.append((name, params))
        return {"median_ms": 30.0 if not params["foreach"] else 24.0}  # a 1.25x speed-up

    monkeypatch.setattr(paired, "run_case", fake_run_case)
    assert paired.main(["optimizer_step", "--rounds", "6"]) == 0
    out = capsys.readouterr().out
    assert "foreach=True" in out and "median 1.25x" in out and "[1.25x, 1.25x]" in out
    assert [p["foreach"] for _, p in calls[:2]] == [False, True] and len(calls) == 12
    assert all(name == "optimizer_step" and p["threads"] == 1 for name, p in calls)


def test_a_full_run_never_takes_an_earlier_runs_file(tmp_path, monkeypatch):
    """Committed runs are quoted by name in the book: a second full run of the day gets the letter b,
    a third c (a .json alone also counts as taken); a quick run (not committed) keeps its one name."""
    import benchmarks.__main__ as bench

    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    first = bench._results_path("2026-01-01", "-cpu")
    assert first == tmp_path / "2026-01-01-cpu.txt"
    first.write_text("run 1")
    second = bench._results_path("2026-01-01", "-cpu")
    assert second == tmp_path / "2026-01-01b-cpu.txt"
    second.with_suffix(".json").write_text("{}")
    assert bench._results_path("2026-01-01", "-cpu") == tmp_path / "2026-01-01c-cpu.txt"
    assert bench._results_path("2026-01-01", "-cpu-router_overhead") == tmp_path / "2026-01-01-cpu-router_overhead.txt"
    quick = tmp_path / "2026-01-01-cpu-quick.txt"
    quick.write_text("quick 1")
    assert bench._results_path("2026-01-01", "-cpu-quick", quick=True) == quick


def _raise_peak_of_this_process(mb: int = 400) -> None:
    """Touch ``mb`` MiB and free them: this process's lifetime peak is then at least that high."""
    import numpy

    block = numpy.ones(mb * 2**20 // 4, dtype=numpy.float32)
    del block


def test_a_fresh_cases_peak_memory_is_its_own_not_its_launchers():
    # A process started by fork and exec inherits its parent's lifetime peak (ru_maxrss). Measured
    # that way, a 1 MiB copy started from a process whose peak was 400 MiB above a fresh
    # interpreter's reported about 400 MB. The case resets its peak before its first call.
    from benchmarks.__main__ import run_case

    _raise_peak_of_this_process()
    result = run_case("copy_bandwidth", mb=16, repeats=3, device="cpu")
    assert 14 <= result["peak_mb"] < 30  # the destination's 16 MiB, faulted in on the first copy


def test_forked_cases_measure_the_case_alone_and_report_failures():
    # --quick forks every case from a server that has imported torch and minimoe. This process has
    # run a parallel torch kernel: a child forked from it directly would wait forever on OpenMP threads
    # that were not forked (this test would then fail on ForkedCases's time limit, after 300 s).
    from benchmarks.__main__ import ForkedCases

    torch.set_num_threads(2)
    torch.ones(2**22).sum()  # a parallel kernel in this process
    runner = ForkedCases()
    assert runner.context.get_start_method() == "forkserver"
    small = runner("copy_bandwidth", mb=1, repeats=3, device="cpu")
    large = runner("copy_bandwidth", mb=64, repeats=3, device="cpu")
    assert small["peak_mb"] < 16 and 60 <= large["peak_mb"] < 80
    assert large["repeats"] == 3 and large["wall_s"] > 0
    params = dict(router="softmax_topk", T=32, E=4, d=8, repeats=3, device="cpu")
    # the same seeded routing as in this process: the same experts per token (capacity drops some)
    assert runner("router_overhead", **params)["quality"] == cases.run("router_overhead", params)["quality"]
    with pytest.raises(RuntimeError, match="(?s)benchmark case copy_bandwidth .*KeyError: 'device'"):
        runner("copy_bandwidth", mb=1, repeats=3)  # no device: the case's own error, with its traceback


def test_quick_runs_fork_and_full_runs_start_fresh_processes(monkeypatch, tmp_path):
    import benchmarks.__main__ as bench

    used = []

    def record_section(args, run_case, report):
        if isinstance(run_case, bench.ForkedCases):
            used.append(("forked", run_case.timeout_s))
        else:
            used.append((run_case.func.__name__, run_case.keywords["timeout_s"]))

    record_section.__name__ = "gumbel_matching_solvers"
    monkeypatch.setattr(bench, "SECTIONS", (record_section,))
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    for argv in (["--quick"], [], ["--quick", "--no-fork"], ["--fork"]):
        bench.main([*argv, "--device", "cpu"])
    quick, full = bench.CASE_TIMEOUT_S["quick"], bench.CASE_TIMEOUT_S["full"]
    assert used == [("forked", quick), ("run_case", full), ("run_case", quick), ("forked", full)]
    # a forked full run does not take the name of a committed one (plot.py reads the newest *-cpu.json)
    names = sorted(path.name[len("YYYY-MM-DD"):] for path in tmp_path.glob("*.txt"))  # after the date
    assert names == ["-cpu-forked.txt", "-cpu-quick.txt", "-cpu.txt"]


def _children_of(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process has gone meanwhile
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def test_a_forked_case_past_its_time_limit_is_killed_and_reported():
    from multiprocessing import forkserver

    from benchmarks.__main__ import ForkedCases

    runner = ForkedCases(timeout_s=3)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="(?s)copy_bandwidth .*ran past 3 s and was killed"):
        runner("copy_bandwidth", mb=1, repeats=10**9, device="cpu")  # hours of copies
    assert time.perf_counter() - start < 30
    server = forkserver._forkserver._forkserver_pid
    assert isinstance(server, int) and _children_of(server) == []  # the case's process is gone
    runner.timeout_s = 120
    assert runner("copy_bandwidth", mb=1, repeats=3, device="cpu")["repeats"] == 3  # and the next runs


def test_a_forked_case_is_killed_when_the_wait_is_interrupted(monkeypatch):
    # Ctrl-C (or any error) while waiting for the case: the finally clause kills the child
    from multiprocessing import connection, forkserver

    from benchmarks.__main__ import ForkedCases

    def interrupted(self, timeout=0.0):
        time.sleep(2)  # the case is running by now
        raise KeyboardInterrupt

    runner = ForkedCases(timeout_s=60)
    runner("copy_bandwidth", mb=1, repeats=3, device="cpu")  # the fork server is up
    server = forkserver._forkserver._forkserver_pid
    monkeypatch.setattr(connection.Connection, "poll", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner("copy_bandwidth", mb=1, repeats=10**9, device="cpu")
    assert _children_of(server) == []


def test_a_fresh_case_past_its_time_limit_is_killed_and_reported():
    from benchmarks.__main__ import run_case

    with pytest.raises(RuntimeError, match="copy_bandwidth .*ran past 5 s and was killed"):
        run_case("copy_bandwidth", timeout_s=5, mb=1, repeats=10**9, device="cpu")


def test_ab_refuses_a_folder_that_is_no_checkout_and_a_case_without_its_experts(tmp_path, capsys):
    from benchmarks import ab

    with pytest.raises(SystemExit):
        ab.main([str(tmp_path), "softmax_topk:8"])
    assert "is not a minimoe checkout" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main([str(Path(__file__).resolve().parent.parent), "softmax_topk"])
    assert "must be ROUTER:E" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main([str(Path(__file__).resolve().parent.parent), ":8"])
    assert "must be ROUTER:E" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main([str(Path(__file__).resolve().parent.parent), "softmax_topk:8,softmax_topk:8"])
    assert "given twice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least 6"):
        ab.main([str(tmp_path), "softmax_topk:8", "--rounds", "3"])


def test_ab_times_a_router_with_the_code_of_the_checkout_it_is_given():
    from benchmarks import ab

    here = Path(__file__).resolve().parent.parent
    ms = ab.time_case(here, "softmax_topk", 4, 64, 16, 1)
    assert 0 < ms < 1000
    with pytest.raises(RuntimeError, match="no_such_router"):
        ab.time_case(here, "no_such_router", 4, 64, 16, 1)
