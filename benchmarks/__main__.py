"""``python -m benchmarks [--quick] [--device cpu|cuda] [--only SECTION] [--fork | --no-fork]``: every
timing in one run, as a table of medians and ratios written to
benchmarks/results/<date>-<device>[-quick].txt (a later full run of the same day: <date>b-<device>.txt,
then c, d, ...; never over an earlier one; a full run with --fork: <date>-<device>-forked.txt, not
committed), and the raw numbers to the .json file of the same name (read by
``python -m benchmarks.plot``). The header names the processor. Book: appendix "Performance".

Every case runs in a fresh process (``benchmarks/cases.py``) so that its peak memory is its own; with
``--quick``, in a process forked from a server that has only imported torch and minimoe (``ForkedCases``).

Goals (issue "Foundation"): softmax_topk routing <= 1.3x the bare softmax+topk floor; the MoE
layer's index path >= 3x faster than the einsum path of eq. (2) with a fraction of its memory, no
slower than a Python loop over experts on CPU (>= 2x faster on a GPU), and <= 1.3x the floor
(the expert matmuls alone on pre-gathered tokens).

Goals (issue "Entropic OT"): ``minimoe.ops.sinkhorn`` in float32 at T=8192, E=64 no slower than
0.5x POT's fastest converging method at the same marginal error, and finite where POT's exp-domain
method overflows.

Goals (issue 17, "Exact balanced assignment"): ``linear_assignment`` (the exact solver of
``minimoe.ops.transport``) >= 50x faster than scipy's ``linear_sum_assignment`` on the expanded matrix
at T=4096, E=64, capacity 64; T=65,536, E=64 in under 2 s on 2 cores.

Goals (issue 7, "ProbMoE"): ``minimoe.ops.ksubset_marginals`` at T=8192, E=64, k=8 >= 5x faster than
the marginals by autograd through the log-space loop DP (the authors' way), at equal values to 1e-6;
``ksubset_sample`` throughput in samples (tokens) per second.

Goals (issue 5, "Kool et al."): ``gumbel_matching_sample(method="cycle")`` (cycle cancelling) faster
than the linear-assignment method for k << n (T=1024, E=8; T=4096, E=8; T=2048, E=16), at equal
total score.

Issue 9 ("Benchmarks"): the routing overhead of every registered router against the floor; the
layer's three paths at T in {1024, 8192, 65536} x E in {8, 64}, time and memory; on CUDA, the
index path's tokens/s against the memory-bandwidth bound of its dispatch and combine.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"

# glibc may hand freed multi-MB blocks back to the kernel, so a process that has done nothing else
# can page-fault on every large allocation; a training process does not (its thresholds have risen:
# cases._after_training_step). The routing-from-logits section also reports a run with them pinned high.
KEEP_FREED_MEMORY = {"MALLOC_TRIM_THRESHOLD_": str(2**28), "MALLOC_MMAP_THRESHOLD_": str(2**28)}

# The einsum path materialises D and C, (T, E, C) each: skip it when the two would exceed this.
EINSUM_BUDGET_GB = 4.0


# The longest case of a full run took 284 s on the 2-core AVX2 machine; a quick case takes seconds.
# A case past its limit is killed and the run stops with an error naming it: a hung case cannot hang
# the run (or CI).
CASE_TIMEOUT_S = {"full": 1800.0, "quick": 300.0}


def run_case(name: str, env: dict | None = None, *, timeout_s: float = CASE_TIMEOUT_S["full"],
             **params) -> dict:
    """Run ``benchmarks.cases`` case ``name`` in a fresh process; its result plus ``wall_s``. Raises
    RuntimeError when the case fails or runs past ``timeout_s`` (the process is then killed)."""
    start = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-m", "benchmarks.cases", name, json.dumps(params)],
                             capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1],
                             env={**os.environ, **(env or {})}, timeout=timeout_s)
    except subprocess.TimeoutExpired as timeout:
        stderr = timeout.stderr or b""  # bytes, even with text=True
        stderr = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
        raise RuntimeError(f"benchmark case {name} {params} ran past {timeout_s:.0f} s and was killed:\n"
                           f"{stderr[-2000:]}") from None
    if out.returncode:
        raise RuntimeError(f"benchmark case {name} {params} failed:\n{out.stderr[-2000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - start}


class ForkedCases:
    """Run cases in processes forked from a server that has imported torch and minimoe (``--quick``).

    A fresh interpreter spends about 3 s importing them on 2 cores, most of a quick case's time. A
    forked case is still a process of its own: its peak memory is its own (``cases._measure`` resets
    the peak) and it inherits no other case's allocator state, thread pools or caches. The server is
    multiprocessing's fork server, a process that only imports and forks: a process that has run a
    torch kernel could not be forked safely (its child would wait on the OpenMP threads that were not
    forked with it). A case with ``env`` runs in a fresh process: glibc reads its malloc variables at
    start-up. Call the object as :func:`run_case`; a case past ``timeout_s`` is killed and raises (the
    limit counts from the fork: a fork server that never answers is not covered)."""

    def __init__(self, timeout_s: float = CASE_TIMEOUT_S["quick"]):
        import multiprocessing

        self.timeout_s = timeout_s
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["benchmarks.cases", "minimoe.routers"])

    def __call__(self, name: str, env: dict | None = None, **params) -> dict:
        if env:
            return run_case(name, env, timeout_s=self.timeout_s, **params)
        from benchmarks.cases import run_to_pipe

        start = time.perf_counter()
        receive, send = self.context.Pipe(duplex=False)
        child = self.context.Process(target=run_to_pipe, args=(send, name, params))
        ok, value = False, "no result"  # what stays when the child dies without sending (killed, out of memory)
        try:
            child.start()
            send.close()
            if receive.poll(self.timeout_s):
                try:
                    ok, value = receive.recv()
                except EOFError:
                    pass
            else:
                value = f"ran past {self.timeout_s:.0f} s and was killed"
                child.kill()
            child.join(timeout=60)  # once it has sent, the child only exits
            if ok and child.is_alive():
                ok, value = False, "sent its result but did not exit within 60 s"
        finally:  # after a timeout, an error or an interrupt alike: no child left running
            if child.is_alive():
                child.kill()
                child.join()
            exitcode = child.exitcode
            send.close()
            receive.close()
            child.close()
        if not ok or exitcode:
            code = f" (exit code {exitcode})" if exitcode else ""
            raise RuntimeError(f"benchmark case {name} {params} failed{code}:\n{str(value)[-2000:]}")
        return {**value, "wall_s": time.perf_counter() - start}


def dense_dispatch_gb(T: int, E: int, k: int = 2, capacity_factor: float = 1.0, itemsize: int = 4) -> float:
    """GB (1e9 bytes) of the dense dispatch and combine tensors of eq. (2): 2 * T * E * C values."""
    from minimoe.ops import compute_capacity

    return 2 * T * E * compute_capacity(T, E, capacity_factor, k=k) * itemsize / 1e9


def einsum_skip_reason(T: int, E: int, k: int = 2, budget_gb: float = EINSUM_BUDGET_GB) -> str | None:
    """Why the einsum case is skipped at (T, E), or None when D and C fit in ``budget_gb``."""
    need = dense_dispatch_gb(T, E, k)
    return f"skipped: dense D and C would need {need:.1f} GB" if need > budget_gb else None


class Report:
    """The text table (``lines``) and the raw numbers behind it (``records``, one dict per case)."""

    def __init__(self):
        self.lines: list[str] = []
        self.records: list[dict] = []

    def line(self, text: str = "") -> None:
        self.lines.append(text)
        print(text, flush=True)  # as it goes: the full run takes minutes

    def record(self, section: str, case: str, result: dict | None = None, **fields) -> dict:
        rec = {"section": section, "case": case}
        if result is not None:
            keys = ("median_ms", "peak_mb", "repeats", "quality", "wall_s", "faults_per_call", "peak_reset")
            rec.update({key: result[key] for key in keys if key in result})
        rec.update(fields)
        self.records.append(rec)
        return rec


def write_json(path: Path, meta: dict, records: list[dict]) -> None:
    """The raw numbers: ``{"meta": {...}, "records": [{section, case, median_ms, peak_mb, ratio, ...}]}``."""
    Path(path).write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")


def read_json(path: Path) -> tuple[dict, list[dict]]:
    """``(meta, records)`` as written by :func:`write_json`."""
    data = json.loads(Path(path).read_text())
    return data["meta"], data["records"]


def softmax_topk_routing(args, run_case, report: Report) -> None:
    """softmax_topk from logits against softmax + topk (issue "Foundation")."""
    T = 2048 if args.quick else 8192
    shape = dict(T=T, E=64, k=2, device=args.device)
    reps = 200 if args.quick else 500
    rows = [
        ("floor: softmax + torch.topk", run_case("routing_floor", repeats=reps, **shape)),
        ("softmax_topk, capacity factor 1 (Alg. 1)", run_case("routing_softmax_topk", repeats=reps,
                                                              capacity_factor=1.0, **shape)),
        ("softmax_topk, dropless", run_case("routing_softmax_topk", repeats=reps, capacity_factor=None, **shape)),
        ("floor, glibc keeping freed memory", run_case("routing_floor", repeats=reps, env=KEEP_FREED_MEMORY,
                                                       **shape)),
        ("softmax_topk, capacity 1, glibc keeping freed", run_case("routing_softmax_topk", repeats=reps,
                                                                   capacity_factor=1.0, env=KEEP_FREED_MEMORY,
                                                                   **shape)),
    ]
    base = rows[0][1]["median_ms"]
    report.line(f"Routing from logits (forward, eval, no grad), T={T}, E=64, k=2")
    report.line(f"  {'case':46s} {'median ms':>10s} {'peak MB':>9s} {'vs floor':>9s}")
    for label, res in rows:
        ratio = res["median_ms"] / base
        report.line(f"  {label:46s} {res['median_ms']:10.2f} {res['peak_mb']:9.1f} {ratio:8.2f}x")
        report.record("routing_from_logits", label, res, T=T, E=64, k=2, ratio=ratio, ratio_to=rows[0][0])
    if isinstance(run_case, ForkedCases):
        report.line("  the two 'glibc keeping freed' rows ran in fresh processes (glibc reads these settings at "
                    "start-up), the others forked: compare those two with each other")


# routers whose one call takes long: an assignment solved per group on the CPU (base,
# kool_gumbel_matching), 20 Adam steps (sparsity_constrained_ec), T x E x T/E slot logits (soft_moe)
SLOW_ROUTERS = ("base", "kool_gumbel_matching", "sparsity_constrained_ec", "soft_moe")


def router_overhead(args, run_case, report: Report) -> None:
    """Every registered router against the top-1 floor, gate included (issue 9)."""
    from minimoe.routers import available

    d = 256
    sizes = [(1024, 8)] if args.quick else [(4096, 64), (4096, 8)]
    rows_spec = []
    for name in available():
        rows_spec.append((name, name, {}))
        if name == "ssr":  # p = 0.05: most calls skip Sinkhorn; p = 1 shows the cost of one call
            rows_spec.append(("ssr (Sinkhorn branch, p=1)", "ssr", {"p": 1.0}))
    for i, (T, E) in enumerate(sizes):
        if i:
            report.line()
        report.line(f"Routing overhead of every router, training mode, one group of T={T} tokens, E={E}, d={d}, "
                    "one expert per token (each router's study_options)")
        report.line("  timed: router(x), gate matmul + routing, forward with autograd recording; floor: gate "
                    "matmul + softmax + torch.topk(k=1). soft_moe has no gate: its slot logits (S = T/E) count instead")
        report.line("  faults: minor page faults per timed call (memory the kernel maps and zeroes again); "
                    "in training: the same case after one forward and backward of a MoE layer on T tokens of the "
                    "same shape, as in a training loop (glibc then reuses freed memory: no faults)")
        report.line(f"  {'router':34s} {'median ms':>10s} {'peak MB':>9s} {'vs floor':>9s} {'faults':>7s} "
                    f"{'in training ms':>15s} {'vs floor':>9s}")
        common = dict(T=T, E=E, d=d, device=args.device)
        floor = run_case("router_floor", repeats=200 if args.quick else 500, **common)
        floor_trained = run_case("router_floor", repeats=200 if args.quick else 500, after_training_step=True,
                                 **common)
        report.line(f"  {'floor: gate + softmax + topk':34s} {floor['median_ms']:10.2f} {floor['peak_mb']:9.1f} "
                    f"{1:8.2f}x {_faults(floor):>7s} {floor_trained['median_ms']:15.2f} {1:8.2f}x")
        report.record("router_overhead", "floor", floor, T=T, E=E, d=d, ratio=1.0,
                      **_in_training(floor_trained, floor_trained))
        for label, name, options in rows_spec:
            slow = name in SLOW_ROUTERS or options
            reps = (10 if args.quick else 15) if slow else (50 if args.quick else 200)
            timing = dict(router=name, options=options, repeats=reps, budget_s=1.0 if args.quick else 3.0, **common)
            res = run_case("router_overhead", **timing)
            trained = run_case("router_overhead", after_training_step=True, **timing)
            ratio = res["median_ms"] / floor["median_ms"]
            in_training = _in_training(trained, floor_trained)
            report.line(f"  {label:34s} {res['median_ms']:10.2f} {res['peak_mb']:9.1f} {ratio:8.2f}x "
                        f"{_faults(res):>7s} {trained['median_ms']:15.2f} {in_training['training_ratio']:8.2f}x")
            report.record("router_overhead", label, res, router=name, options=options, T=T, E=E, d=d,
                          ratio=ratio, ratio_to="floor", **in_training)
            if name == "soft_moe":  # its own floor: the T x (E * S) slot logits (goal: <= 1.5x)
                own_timing = dict(repeats=reps, budget_s=1.0 if args.quick else 3.0, **common)
                own = run_case("soft_moe_floor", **own_timing)
                own_trained = run_case("soft_moe_floor", after_training_step=True, **own_timing)
                own_ratio = res["median_ms"] / own["median_ms"]
                # the record's times and faults are the floor's own; its ratios are soft_moe's over it
                own_in_training = {**_in_training(own_trained, own_trained),
                                   "training_ratio": trained["median_ms"] / own_trained["median_ms"]}
                report.line(f"  {'  soft_moe floor: slot-logit matmul':34s} {own['median_ms']:10.2f} "
                            f"{own['peak_mb']:9.1f} {'':9s} {_faults(own):>7s} {own_trained['median_ms']:15.2f}   "
                            f"soft_moe / it: {own_ratio:.2f}x, in training {own_in_training['training_ratio']:.2f}x")
                report.record("router_overhead", "soft_moe floor", own, T=T, E=E, d=d, ratio=own_ratio,
                              ratio_to="soft_moe over its slot-logit matmul", **own_in_training)


QUICK_COMPILED = ("softmax_topk", "sinkhorn_token_choice", "kool_skip")


def compiled_routers(args, run_case, report: Report) -> None:
    """Every registered router eager and compiled (``torch.compile(fullgraph=True)``, inductor) against
    the same floor, eager and compiled, with the time of the first compiled call (the compilation)."""
    from minimoe.routers import available

    d = 256
    T, E = (1024, 8) if args.quick else (4096, 64)
    report.line(f"Routing overhead, eager and compiled (torch.compile(fullgraph=True), inductor), training mode, "
                f"one group of T={T} tokens, E={E}, d={d}, one expert per token")
    report.line("  eager and compiled: median ms of router(x) and its ratio to the floor run the same way (gate "
                "matmul + softmax + torch.topk, itself compiled for the compiled column), each case after one "
                "training step of a MoE layer (as in a training loop: no fresh-process page faults)")
    report.line("  compile s: the first compiled call, with inductor's caches empty (a cold compilation)")
    report.line(f"  {'router':34s} {'eager ms':>9s} {'vs floor':>9s} {'compiled ms':>12s} {'vs floor':>9s} "
                f"{'compile s':>10s}")
    common = dict(T=T, E=E, d=d, device=args.device)
    common["after_training_step"] = True
    floors = {compiled: run_case("router_floor", repeats=200 if args.quick else 500, compiled=compiled, **common)
              for compiled in (False, True)}
    report.line(f"  {'floor: gate + softmax + topk':34s} {floors[False]['median_ms']:9.2f} {1:8.2f}x "
                f"{floors[True]['median_ms']:12.2f} {1:8.2f}x {floors[True]['quality']['compile_s']:10.1f}")
    report.record("compiled_routers", "floor", floors[True], T=T, E=E, d=d, eager_ms=floors[False]["median_ms"],
                  compile_s=floors[True]["quality"]["compile_s"])
    # --quick: three routers, since every compilation takes 5-40 s of a CPU (the full run: all of them)
    for name in (QUICK_COMPILED if args.quick else available()):
        slow = name in SLOW_ROUTERS
        reps = (10 if args.quick else 15) if slow else (50 if args.quick else 200)
        timing = dict(router=name, options={}, repeats=reps, budget_s=1.0 if args.quick else 3.0, **common)
        eager = run_case("router_overhead", **timing)
        try:
            compiled = run_case("router_overhead", compiled=True, **timing)
        except RuntimeError as error:  # the compiler itself failed (it runs the machine's C++ compiler)
            text = str(error)
            cause = ("the C++ compiler's internal compiler error" + text.split("internal compiler error", 1)[1].split("\n")[0]
                     if "internal compiler error" in text else text.splitlines()[0])[:90]
            report.line(f"  {name:34s} {eager['median_ms']:9.2f} {eager['median_ms'] / floors[False]['median_ms']:8.2f}x "
                        f"  compilation failed: {cause}")
            report.record("compiled_routers", name, eager, router=name, T=T, E=E, d=d, compile_failed=cause)
            continue
        ratios = (eager["median_ms"] / floors[False]["median_ms"], compiled["median_ms"] / floors[True]["median_ms"])
        compile_s = compiled["quality"]["compile_s"]
        report.line(f"  {name:34s} {eager['median_ms']:9.2f} {ratios[0]:8.2f}x {compiled['median_ms']:12.2f} "
                    f"{ratios[1]:8.2f}x {compile_s:10.1f}")
        report.record("compiled_routers", name, compiled, router=name, T=T, E=E, d=d, eager_ms=eager["median_ms"],
                      eager_ratio=ratios[0], ratio=ratios[1], ratio_to="compiled floor", compile_s=compile_s)


def _faults(result: dict) -> str:
    """Page faults per timed call, as the report prints them ("-" where the device does not count them)."""
    return f"{result['faults_per_call']:.0f}" if "faults_per_call" in result else "-"


def _in_training(result: dict, floor: dict) -> dict:
    """The record fields of a case timed after a training step, against the floor timed the same way."""
    fields = {"training_median_ms": result["median_ms"], "training_ratio": result["median_ms"] / floor["median_ms"]}
    if "faults_per_call" in result:
        fields["training_faults_per_call"] = result["faults_per_call"]
    return fields


def layer_paths(args, run_case, report: Report) -> None:
    """MoELayer index vs einsum vs loop vs the floor, time and memory, over T and E (issues 1 and 9)."""
    d, h, k = 256, 512, 2
    Ts = [1024] if args.quick else [1024, 8192, 65536]
    report.line(f"MoE layer, forward + backward (routing precomputed), d={d}, hidden={h}, k={k}, capacity factor 1 "
                f"(C = 2T/E slots per expert); einsum skipped above {EINSUM_BUDGET_GB:g} GB of dense D and C")
    report.line(f"  {'T':>6s} {'E':>3s}  {'case':46s} {'median ms':>10s} {'peak MB':>9s} {'vs floor':>9s}")
    summary = []
    for T in Ts:
        for E in (8, 64):
            shape = dict(T=T, E=E, d=d, h=h, k=k, device=args.device)
            # slow sizes: fewer repeats (at T = 65536 one call takes seconds on a 2-core CPU)
            timing = dict(repeats=3 if args.quick else 7, budget_s=2.0 if args.quick else 10.0,
                          min_repeats=2 if T >= 65536 else 3)
            rows = [("floor", "floor: expert matmuls on gathered tokens", run_case("expert_floor", **timing, **shape))]
            for path, label in (("index", "MoELayer path='index' (default)"),
                                ("slots", "MoELayer path='slots' (slot buffers)"),
                                ("grouped", "MoELayer path='grouped' (sorted segments)"),
                                ("loop", "MoELayer path='loop' (loop over experts)"),
                                ("einsum", "MoELayer path='einsum' (eq. 2, dense D and C)")):
                skip = einsum_skip_reason(T, E, k) if path == "einsum" else None
                rows.append((path, label, {"skipped": skip} if skip else
                             run_case("layer_path", path=path, **timing, **shape)))
            base = rows[0][2]["median_ms"]
            results = {}
            for case, label, res in rows:
                if "skipped" in res:
                    report.line(f"  {T:6d} {E:3d}  {label:46s} {res['skipped']}")
                    report.record("layer", case, None, label=label, T=T, E=E, d=d, h=h, k=k,
                                  skipped=res["skipped"], dense_gb=dense_dispatch_gb(T, E, k))
                    continue
                ratio = res["median_ms"] / base
                report.line(f"  {T:6d} {E:3d}  {label:46s} {res['median_ms']:10.2f} {res['peak_mb']:9.1f} "
                            f"{ratio:8.2f}x")
                results[case] = report.record("layer", case, res, label=label, T=T, E=E, d=d, h=h, k=k,
                                              ratio=ratio, ratio_to="floor")
            summary.append((T, E, results))
    report.line()
    for fast in ("index", "grouped"):
        report.line()
        report.line(f"The {fast} path against the others (ratios > 1: the {fast} path is faster / smaller; goal: "
                    "loop/path >= 1/1.05, path/floor <= 1.2, memory loop/path >= 1)")
        report.line(f"  {'T':>6s} {'E':>3s}  {'einsum/path':>12s} {'loop/path':>11s} {'path/floor':>12s} "
                    f"{'memory einsum/path':>20s} {'memory loop/path':>18s}")
        for T, E, res in summary:
            cells = [_over(res, "einsum", fast), _over(res, "loop", fast), _over(res, fast, "floor"),
                     _over(res, "einsum", fast, "peak_mb"), _over(res, "loop", fast, "peak_mb")]
            text = [f"{c:.2f}x" if c is not None else "skipped" for c in cells]
            report.line(f"  {T:6d} {E:3d}  {text[0]:>12s} {text[1]:>11s} {text[2]:>12s} {text[3]:>20s} "
                        f"{text[4]:>18s}")
            report.record("layer_ratios", fast, None, T=T, E=E, einsum_over_path=cells[0], loop_over_path=cells[1],
                          path_over_floor=cells[2], memory_einsum_over_path=cells[3],
                          memory_loop_over_path=cells[4])
    if args.device == "cuda":
        dispatch_bandwidth(args, run_case, report, summary, d, k)


def dropless_layer(args, run_case, report: Report) -> None:
    """Dropless routing (capacity None) with unequal loads: the slot path pads every expert to the
    busiest one; the default path (grouped, without a capacity) computes the routed pairs only."""
    d, h, k = 256, 512, 2
    T = 2048 if args.quick else 16384
    report.line(f"MoE layer, dropless top-{k} (capacity None), forward + backward, T={T}, d={d}, hidden={h}; the "
                "logits skewed towards the first experts; imbalance = largest load / mean load")
    report.line(f"  {'E':>3s} {'imbalance':>9s}  {'path':32s} {'median ms':>10s} {'peak MB':>9s} {'vs index':>9s}")
    timing = dict(repeats=3 if args.quick else 7, budget_s=2.0 if args.quick else 10.0)
    for E in (8, 64):
        for skew in (0.0, 4.0):
            shape = dict(T=T, E=E, d=d, h=h, k=k, capacity_factor=None, skew=skew, device=args.device)
            rows = [(path, run_case("layer_path", path=path, **timing, **shape)) for path in ("index", "slots", "loop")]
            base = rows[0][1]
            for path, res in rows:
                ratio = res["median_ms"] / base["median_ms"]
                report.line(f"  {E:3d} {res['quality']:9.2f}  {path:32s} {res['median_ms']:10.2f} {res['peak_mb']:9.1f} "
                            f"{ratio:8.2f}x")
                report.record("dropless_layer", path, res, T=T, E=E, d=d, h=h, k=k, skew=skew,
                              imbalance=res["quality"], ratio=ratio, ratio_to="index")


def _over(results: dict, case: str, base: str, key: str = "median_ms") -> float | None:
    """``results[case][key] / results[base][key]``; None when ``case`` was skipped."""
    if case not in results:
        return None
    return results[case][key] / results[base][key] if results[base][key] > 0 else float("nan")


def dispatch_bandwidth(args, run_case, report: Report, summary, d: int, k: int) -> None:
    """CUDA: tokens/s of the index path, and its dispatch + combine against the bandwidth bound.

    The least the index path must move beyond the floor: forward, the T*k dispatched rows of d values
    are gathered into the slot buffer and the T*k expert outputs scattered back (each read once and
    written once); the backward pass moves the same again. Divided by the measured copy bandwidth,
    that is the shortest time the dispatch could take; the achieved fraction compares it with the
    measured overhead of each path (index, grouped) over the floor."""
    copy = run_case("copy_bandwidth", mb=1024, repeats=20, device=args.device)
    bandwidth = 2 * 1024 * 2**20 / (copy["median_ms"] / 1e3)  # bytes/s: a copy reads and writes each byte
    report.line()
    report.line(f"Index path on {args.device}: tokens/s and the memory-bandwidth bound of dispatch + combine "
                f"(copy bandwidth {bandwidth / 1e9:.0f} GB/s; bound = 8 T k d float32 values / bandwidth, fwd+bwd)")
    report.line(f"  {'T':>6s} {'E':>3s}  {'path':8s} {'tokens/s':>10s} {'bound ms':>9s} {'path - floor ms':>16s} "
                f"{'achieved':>9s}")
    report.record("bandwidth", "copy", copy, bandwidth_gbs=bandwidth / 1e9)
    for T, E, res in summary:
        for path in ("index", "grouped"):
            ms, floor = res[path]["median_ms"], res["floor"]["median_ms"]
            bound_ms = 2 * 2 * 2 * T * k * d * 4 / bandwidth * 1e3  # fwd+bwd, gather+scatter, read+write
            overhead = ms - floor
            fraction = bound_ms / overhead if overhead > 0 else float("nan")
            report.line(f"  {T:6d} {E:3d}  {path:8s} {T / (ms / 1e3):10.3g} {bound_ms:9.3f} {overhead:16.3f} "
                        f"{fraction:8.1%}")
            report.record("bandwidth", path, None, T=T, E=E, tokens_per_s=T / (ms / 1e3), bound_ms=bound_ms,
                          overhead_ms=overhead, ratio=fraction, ratio_to="bandwidth bound / (path - floor)")


def optimal_transport(args, run_case, report: Report) -> None:
    """sinkhorn vs POT to the same marginal error (issue "Entropic OT")."""
    T = 2048 if args.quick else 8192
    E, tol, max_iter = 64, 1e-4, 10000
    reps = 3 if args.quick else 5
    report.line(f"Entropic OT plan, float32, T={T}, E=64, scores ~ N(0, 1), to a relative marginal error "
                f"<= {tol:g} (max over rows and columns) or {max_iter} iterations")
    report.line(f"  {'eps':>5s}  {'solver':50s} {'median ms':>10s} {'error':>9s}  {'vs fastest POT':>14s}")
    pot_methods = [("sinkhorn", "numpy"), ("sinkhorn", "torch"), ("sinkhorn_log", "torch"),
                   ("sinkhorn_stabilized", "torch")]
    for eps in (1.0, 0.03) if args.quick else (1.0, 0.1, 0.03):
        common = dict(T=T, E=E, eps=eps, tol=tol, max_iter=max_iter, device=args.device)
        rows = []
        for method, backend in pot_methods:
            res = run_case("sinkhorn_pot", method=method, backend=backend, repeats=reps, **common)
            rows.append((f"POT ot.sinkhorn(method='{method}'), {backend}", res))
        ours = [(f"minimoe sinkhorn(method='{m}')", run_case("sinkhorn_minimoe", method=m, repeats=reps, **common))
                for m in ("auto", "sinkhorn", "log")]
        ok = [r for _, r in rows if r["quality"] == r["quality"] and r["quality"] <= tol]  # finite and converged
        best = min((r["median_ms"] for r in ok), default=None)
        for label, res in rows + ours:
            err = res["quality"]
            converged = err == err and err <= tol
            status = "" if converged else ("  (NaN/inf)" if err != err else "  (not converged)")
            ratio = res["median_ms"] / best if best else None
            text = f"{ratio:13.2f}x" if best else "   no POT conv."
            report.line(f"  {eps:5.2f}  {label:50s} {res['median_ms']:10.2f} {err:9.2e}  {text}{status}")
            report.record("sinkhorn", label, res, T=T, E=E, eps=eps, tol=tol, converged=converged, ratio=ratio,
                          ratio_to="fastest converged POT")
        report.line()


def exact_assignment(args, run_case, report: Report) -> None:
    """linear_assignment (minimoe.ops.transport) against scipy, and its time against T and E (issue 17)."""
    E = 64
    Ta = 1024 if args.quick else 4096
    common = dict(T=Ta, E=E, device="cpu", repeats=3 if args.quick else 5)
    scipy_res = run_case("assignment_scipy", **common)
    rows = [("scipy linear_sum_assignment (expanded slots)", scipy_res),
            ("minimoe linear_assignment(method='auto')", run_case("assignment_minimoe", method="auto", **common)),
            ("minimoe linear_assignment(method='scipy')", run_case("assignment_minimoe", method="scipy", **common))]
    report.line(f"Balanced linear assignment, T={Ta}, E={E}, capacity {Ta // E}, scores ~ N(0, 1) (CPU); goal: auto "
                ">= 50x faster than scipy")
    report.line(f"  {'solver':50s} {'median ms':>10s} {'total score':>12s} {'vs scipy':>9s}")
    for label, res in rows:
        ratio = res["median_ms"] / scipy_res["median_ms"]
        report.line(f"  {label:50s} {res['median_ms']:10.2f} {res['quality']:12.4f} {ratio:8.4f}x")
        report.record("assignment", label, res, T=Ta, E=E, ratio=ratio, ratio_to=rows[0][0])
    # the routers built on it (goal: base and kool_gumbel_matching within 30x the top-1 floor at T = 4096)
    common = dict(T=Ta, E=E, d=256, device=args.device)
    floor = run_case("router_floor", repeats=200 if args.quick else 500, **common)
    report.line(f"  routers that solve it, training-mode forward at T={Ta}, E={E}, d=256, against the gate + softmax + "
                f"top-1 floor ({floor['median_ms']:.2f} ms)")
    for name in ("base", "kool_gumbel_matching"):
        res = run_case("router_overhead", router=name, options={}, repeats=10 if args.quick else 15,
                       budget_s=1.0 if args.quick else 3.0, **common)
        ratio = res["median_ms"] / floor["median_ms"]
        report.line(f"    {name:48s} {res['median_ms']:10.2f} ms {ratio:8.2f}x")
        report.record("assignment_routers", name, res, router=name, T=Ta, E=E, d=256, ratio=ratio, ratio_to="floor")
    Ts = (1024, 4096, 16384) if args.quick else (1024, 4096, 16384, 65536)
    Es = (8, 64) if args.quick else (8, 16, 64, 128)
    report.line("  the exact solver alone against T and E, capacity T/E (goal: T = 65,536, E = 64 in under 2 s on 2 "
                "cores)")
    report.line("    " + " " * 8 + "".join(f"{f'E={Eb}':>11s}" for Eb in Es) + "   (median ms)")
    for Tb in Ts:
        cells = []
        for Eb in Es:
            res = run_case("assignment_minimoe", method="auto", T=Tb, E=Eb, device="cpu", repeats=3)
            report.record("assignment", "minimoe linear_assignment(method='auto')", res, T=Tb, E=Eb)
            cells.append(f"{res['median_ms']:11.2f}")
        report.line(f"    T={Tb:6d}" + "".join(cells))
    report.line()


def subset_marginals(args, run_case, report: Report) -> None:
    """ksubset_marginals vs autograd through the loop DP; ksubset_sample throughput (issue 7)."""
    T = 2048 if args.quick else 8192
    E, k = 64, 8
    reps = 5 if args.quick else 15
    report.line(f"k-subset marginals P(j in S), |S| = k, T={T}, E={E}, k={k}, logits ~ N(0, 1); goal: >= 5x "
                f"faster than autograd through the loop DP, equal to 1e-6")
    report.line("(max |m - f64|: against the loop DP in float64; in float32 the loop itself is only that close)")
    report.line(f"  {'dtype':8s} {'method':46s} {'median ms':>10s} {'speed-up':>9s} {'max |m - loop|':>15s} "
                f"{'max |m - f64|':>14s}")
    for dtype in ("float32", "float64"):
        common = dict(T=T, E=E, k=k, dtype=dtype, device=args.device, repeats=reps)
        loop = run_case("ksubset_autograd_loop", **common)
        rows = [("autograd through the loop DP (authors' way)", loop)]
        if dtype == "float32":
            rows.append(("  the same with create_graph=True (training)",
                         run_case("ksubset_autograd_loop", create_graph=True, **common)))
        rows.append(("minimoe ksubset_marginals (forward-backward)", run_case("ksubset_minimoe", **common)))
        for label, res in rows:
            q = res["quality"]
            vs_loop = f"{q['vs_loop']:15.1e}" if "vs_loop" in q else f"{'':15s}"
            speedup = loop["median_ms"] / res["median_ms"]
            report.line(f"  {dtype:8s} {label:46s} {res['median_ms']:10.2f} {speedup:8.2f}x {vs_loop} "
                        f"{q['vs_f64']:14.1e}")
            report.record("ksubset_marginals", label.strip(), res, T=T, E=E, k=k, dtype=dtype, ratio=speedup,
                          ratio_to="autograd loop (speed-up)")
    report.line()
    report.line(f"k-subset sampling, float32, T={T}, E={E}, k={k}: one subset per token")
    report.line(f"  {'sampler':60s} {'median ms':>10s} {'samples/s':>12s} {'rows with k':>12s}")
    common = dict(T=T, E=E, k=k, dtype="float32", device=args.device, repeats=reps)
    for label, case in [("minimoe ksubset_sample (exact k-subset law)", "ksubset_sample_minimoe"),
                        ("floor: Gumbel-top-k (a different law)", "gumbel_topk_sample")]:
        res = run_case(case, **common)
        rate = T / res["median_ms"] * 1e3
        report.line(f"  {label:60s} {res['median_ms']:10.2f} {rate:12.3g} {res['quality']:12.3f}")
        report.record("ksubset_sample", label, res, T=T, E=E, k=k, samples_per_s=rate)


def gumbel_matching_solvers(args, run_case, report: Report) -> None:
    """Gumbel-matching: cycle cancelling against the linear-assignment solver when k << n (issue 5)."""
    reps = 3 if args.quick else 5
    sizes = [(1024, 8), (2048, 16)] if args.quick else [(1024, 8), (4096, 8), (2048, 16)]
    # one thread: the cycle method's E x E steps are too small to share, and a second thread that
    # waits on a busy core costs it several times over
    report.line("Gumbel-matching sample (exact), float32 logits ~ N(0, 1), capacity T/E, fixed Gumbel noise, "
                "1 CPU thread")
    report.line(f"  {'T':>5s} {'E':>3s}  {'method':36s} {'median ms':>10s} {'total score':>12s} "
                f"{'vs assignment':>14s}")
    for T, E in sizes:
        common = dict(T=T, E=E, repeats=reps, threads=1)
        base = run_case("gumbel_matching_minimoe", method="assignment", device="cpu", **common)
        rows = [("assignment (scipy LSA), cpu", base),
                ("cycle cancelling, cpu", run_case("gumbel_matching_minimoe", method="cycle", device="cpu", **common))]
        if args.device != "cpu":
            rows.append((f"cycle cancelling, {args.device}",
                         run_case("gumbel_matching_minimoe", method="cycle", device=args.device, **common)))
        for label, res in rows:
            ratio = res["median_ms"] / base["median_ms"]
            report.line(f"  {T:5d} {E:3d}  {label:36s} {res['median_ms']:10.2f} {res['quality']:12.4f} "
                        f"{ratio:13.2f}x")
            report.record("gumbel_matching", label, res, T=T, E=E, ratio=ratio, ratio_to=rows[0][0])


SECTIONS = (softmax_topk_routing, router_overhead, compiled_routers, layer_paths, dropless_layer, optimal_transport, exact_assignment,
            subset_marginals, gumbel_matching_solvers)


def _results_path(date: str, rest: str, quick: bool = False) -> Path:
    """``<date><letter><rest>.txt`` in RESULTS. A full run never takes an earlier run's file: the
    first of a day gets no letter, the next ones b, c, d, ... (committed runs are quoted by name in
    the book). A quick run (not committed: .gitignore) replaces the day's last quick run."""
    if quick:
        return RESULTS / f"{date}{rest}.txt"
    for letter in ["", *"bcdefghijklmnopqrstuvwxyz"]:
        out = RESULTS / f"{date}{letter}{rest}.txt"
        if not out.exists() and not out.with_suffix(".json").exists():
            return out
    raise RuntimeError(f"26 runs of {date}{rest} in {RESULTS} already: move some away")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI-sized: small T, fewer sizes and repeats")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", choices=[section.__name__ for section in SECTIONS],
                        help="run one section; its files are named ...-<section>.txt/.json")
    parser.add_argument("--fork", action=argparse.BooleanOptionalAction, default=None,
                        help="fork each case from a server process that has imported torch and minimoe "
                             "instead of starting a fresh interpreter (default: with --quick; see ForkedCases)")
    args = parser.parse_args(argv)
    fork = args.quick if args.fork is None else args.fork
    timeout_s = CASE_TIMEOUT_S["quick" if args.quick else "full"]
    runner = ForkedCases(timeout_s) if fork else functools.partial(run_case, timeout_s=timeout_s)

    start = time.perf_counter()
    report = Report()
    from minimoe.experiments.runner import cpu_signature

    meta = {"date": str(datetime.date.today()), "device": args.device, "quick": args.quick,
            "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "only": args.only, "forked": fork, **cpu_signature()}
    report.line(f"minimoe benchmarks  {meta['date']}  device={args.device}{'  (quick)' if args.quick else ''}  "
                f"torch {meta['torch']}  python {meta['python']}  threads={meta['threads']}")
    # ratios move between processors (a run on AVX2 and one on AVX512 of the same model name differ):
    # the header names the one that ran
    report.line(f"processor: {meta['cpu']}, {meta['cpu_capability']} kernels, feature flags "
                f"{meta['cpu_flags_sha1']} (sha1 prefix)")
    launch = "a process forked from one that has imported torch and minimoe" if fork else "a fresh process"
    report.line(f"each case in {launch}; median of the timed repeats after a warm-up; peak MB: peak resident "
                "memory above the process's baseline (CUDA: peak allocated)")
    report.line()
    for section in SECTIONS:
        if args.only and section.__name__ != args.only:
            continue
        section(args, runner, report)
        report.line()
    meta["wall_s"] = time.perf_counter() - start
    report.line(f"total wall time {meta['wall_s']:.0f} s")
    text = "\n".join(report.lines)
    RESULTS.mkdir(exist_ok=True)
    # a full run in forked cases is named apart: the committed full runs, which the book quotes and
    # plot.py reads, start every case fresh
    out = _results_path(meta["date"], f"-{args.device}{'-quick' if args.quick else ''}"
                        f"{'-forked' if fork and not args.quick else ''}"
                        f"{'-' + args.only if args.only else ''}", quick=args.quick)
    out.write_text(text + "\n")
    write_json(out.with_suffix(".json"), meta, report.records)
    print(f"\nwritten to {out} and {out.with_suffix('.json').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
