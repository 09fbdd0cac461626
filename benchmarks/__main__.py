"""``python -m benchmarks [--quick] [--device cpu|cuda]``: every timing in one run, as a table of
medians and ratios, also written to benchmarks/results/<date>-<device>.txt.

Goals (issue "Foundation"): softmax_topk routing <= 1.3x the bare softmax+topk floor; the MoE
layer's index path >= 3x faster than the einsum path of eq. (2) with a fraction of its memory, no
slower than a Python loop over experts on CPU (>= 2x faster on a GPU), and <= 1.3x the floor
(the expert matmuls alone on pre-gathered tokens).

Goals (issue "Entropic OT"): ``minimoe.ops.sinkhorn`` in float32 at T=8192, E=64 no slower than
0.5x POT's fastest converging method at the same marginal error, and finite where POT's exp-domain
method overflows; ``linear_assignment`` against scipy's ``linear_sum_assignment`` at T=1024.

Goals (issue 7, "ProbMoE"): ``minimoe.ops.ksubset_marginals`` at T=8192, E=64, k=8 >= 5x faster than
the marginals by autograd through the log-space loop DP (the authors' way), at equal values to 1e-6;
``ksubset_sample`` throughput in samples (tokens) per second.

Goals (issue 5, "Kool et al."): ``gumbel_matching_sample(method="cycle")`` (cycle cancelling) faster
than the linear-assignment method for k << n (T=1024, E=8; T=4096, E=8; T=2048, E=16), at equal
total score.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch


# glibc returns freed multi-MB blocks to the OS, so a fresh process page-faults on every large
# allocation; a long training process usually does not. We report routing both ways.
KEEP_FREED_MEMORY = {"MALLOC_TRIM_THRESHOLD_": str(2**28), "MALLOC_MMAP_THRESHOLD_": str(2**28)}


def run_case(name: str, env: dict | None = None, **params) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.cases", name, json.dumps(params)],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1],
                         env={**os.environ, **(env or {})})
    if out.returncode:
        raise RuntimeError(f"benchmark case {name} {params} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def optimal_transport(args, run_case) -> list[str]:
    """sinkhorn vs POT to the same marginal error; linear_assignment vs scipy (issue "Entropic OT")."""
    T = 2048 if args.quick else 8192
    E, tol, max_iter = 64, 1e-4, 10000
    reps = 3 if args.quick else 5
    lines = [f"Entropic OT plan, float32, T={T}, E=64, scores ~ N(0, 1), to a relative marginal error "
             f"<= {tol:g} (max over rows and columns) or {max_iter} iterations",
             f"  {'eps':>5s}  {'solver':44s} {'median ms':>10s} {'error':>9s}  {'vs fastest POT':>14s}"]
    pot_methods = [("sinkhorn", "numpy"), ("sinkhorn", "torch"), ("sinkhorn_log", "torch"),
                   ("sinkhorn_stabilized", "torch")]
    for eps in (1.0, 0.1, 0.03):
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
            status = "" if err == err and err <= tol else ("  (NaN/inf)" if err != err else "  (not converged)")
            ratio = f"{res['median_ms'] / best:13.2f}x" if best else "   no POT conv."
            lines.append(f"  {eps:5.2f}  {label:44s} {res['median_ms']:10.2f} {err:9.2e}  {ratio}{status}")
        lines.append("")
    Ta = 512 if args.quick else 1024
    common = dict(T=Ta, E=E, device="cpu", repeats=3 if args.quick else 5)
    scipy_res = run_case("assignment_scipy", **common)
    rows = [("scipy linear_sum_assignment (expanded slots)", scipy_res),
            ("minimoe linear_assignment(method='scipy')", run_case("assignment_minimoe", method="scipy", **common)),
            ("minimoe linear_assignment(method='auction')", run_case("assignment_minimoe", method="auction", **{**common, "repeats": 1}))]
    lines.append(f"Balanced linear assignment, T={Ta}, E=64, capacity {Ta // 64} (CPU)")
    lines.append(f"  {'solver':50s} {'median ms':>10s} {'total score':>12s} {'vs scipy':>9s}")
    for label, res in rows:
        lines.append(f"  {label:50s} {res['median_ms']:10.2f} {res['quality']:12.4f} "
                     f"{res['median_ms'] / scipy_res['median_ms']:8.2f}x")
    return lines


def subset_marginals(args, run_case) -> list[str]:
    """ksubset_marginals vs autograd through the loop DP; ksubset_sample throughput (issue 7)."""
    T = 2048 if args.quick else 8192
    E, k = 64, 8
    reps = 5 if args.quick else 15
    lines = [f"k-subset marginals P(j in S), |S| = k, T={T}, E={E}, k={k}, logits ~ N(0, 1); goal: >= 5x faster "
             f"than autograd through the loop DP, equal to 1e-6",
             "(max |m - f64|: against the loop DP in float64; in float32 the loop itself is only that close)",
             f"  {'dtype':8s} {'method':46s} {'median ms':>10s} {'speed-up':>9s} {'max |m - loop|':>15s} "
             f"{'max |m - f64|':>14s}"]
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
            lines.append(f"  {dtype:8s} {label:46s} {res['median_ms']:10.2f} "
                         f"{loop['median_ms'] / res['median_ms']:8.2f}x {vs_loop} {q['vs_f64']:14.1e}")
    lines.append("")
    lines.append(f"k-subset sampling, float32, T={T}, E={E}, k={k}: one subset per token")
    lines.append(f"  {'sampler':60s} {'median ms':>10s} {'samples/s':>12s} {'rows with k':>12s}")
    common = dict(T=T, E=E, k=k, dtype="float32", device=args.device, repeats=reps)
    for label, case in [("minimoe ksubset_sample (exact k-subset law)", "ksubset_sample_minimoe"),
                        ("floor: Gumbel-top-k (a different law)", "gumbel_topk_sample")]:
        res = run_case(case, **common)
        lines.append(f"  {label:60s} {res['median_ms']:10.2f} {T / res['median_ms'] * 1e3:12.3g} "
                     f"{res['quality']:12.3f}")
    return lines


def gumbel_matching_solvers(args, run_case) -> list[str]:
    """Gumbel-matching: cycle cancelling against the linear-assignment solver when k << n (issue 5)."""
    reps = 3 if args.quick else 5
    sizes = [(1024, 8), (2048, 16)] if args.quick else [(1024, 8), (4096, 8), (2048, 16)]
    # one thread: the cycle method's E x E steps are too small to share, and a second thread that
    # waits on a busy core costs it several times over
    lines = ["Gumbel-matching sample (exact), float32 logits ~ N(0, 1), capacity T/E, fixed Gumbel noise, "
             "1 CPU thread",
             f"  {'T':>5s} {'E':>3s}  {'method':36s} {'median ms':>10s} {'total score':>12s} {'vs assignment':>14s}"]
    for T, E in sizes:
        common = dict(T=T, E=E, repeats=reps, threads=1)
        base = run_case("gumbel_matching_minimoe", method="assignment", device="cpu", **common)
        rows = [("assignment (scipy LSA), cpu", base),
                ("cycle cancelling, cpu", run_case("gumbel_matching_minimoe", method="cycle", device="cpu", **common))]
        if args.device != "cpu":
            rows.append((f"cycle cancelling, {args.device}",
                         run_case("gumbel_matching_minimoe", method="cycle", device=args.device, **common)))
        for label, res in rows:
            lines.append(f"  {T:5d} {E:3d}  {label:36s} {res['median_ms']:10.2f} {res['quality']:12.4f} "
                         f"{res['median_ms'] / base['median_ms']:13.2f}x")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI-sized: T=2048 and fewer repeats")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    T = 2048 if args.quick else 8192
    shape = dict(T=T, E=64, d=256, h=512, k=2, device=args.device)
    reps = 3 if args.quick else 7
    lines = [f"minimoe benchmarks  {datetime.date.today()}  device={args.device}  torch {torch.__version__}  "
             f"python {platform.python_version()}  threads={torch.get_num_threads()}",
             f"shape: T={T} tokens, E=64 experts, d=256, hidden=512, k=2, capacity factor 1 "
             f"(C={2 * T // 64} slots per expert)", ""]

    def table(title, rows, baseline_label, ratio_label):
        base = next(r for r in rows if r[0] == baseline_label)[1]["median_ms"]
        lines.append(title)
        lines.append(f"  {'case':44s} {'median ms':>10s} {'peak MB':>9s} {ratio_label:>16s}")
        for label, res in rows:
            lines.append(f"  {label:44s} {res['median_ms']:10.2f} {res['peak_mb']:9.1f} "
                         f"{res['median_ms'] / base:15.2f}x")
        lines.append("")

    route_reps = 200 if args.quick else 500
    table("Routing (forward, from logits)", [
        ("floor: softmax + torch.topk", run_case("routing_floor", repeats=route_reps, **shape)),
        ("softmax_topk, capacity factor 1 (Alg. 1)", run_case("routing_softmax_topk", repeats=route_reps,
                                                              capacity_factor=1.0, **shape)),
        ("softmax_topk, dropless", run_case("routing_softmax_topk", repeats=route_reps,
                                            capacity_factor=None, **shape)),
        ("floor, glibc keeping freed memory", run_case("routing_floor", repeats=route_reps,
                                                       env=KEEP_FREED_MEMORY, **shape)),
        ("softmax_topk, capacity 1, glibc keeping freed", run_case("routing_softmax_topk", repeats=route_reps,
                                                                   capacity_factor=1.0, env=KEEP_FREED_MEMORY,
                                                                   **shape)),
    ], "floor: softmax + torch.topk", "vs floor")

    layer_rows = [
        ("floor: expert matmuls on gathered tokens", run_case("expert_floor", repeats=reps, **shape)),
        ("MoELayer path='index'", run_case("layer_path", path="index", repeats=reps, **shape)),
        ("MoELayer path='loop' (loop over experts)", run_case("layer_path", path="loop", repeats=reps, **shape)),
        ("MoELayer path='einsum' (eq. 2, dense D and C)", run_case("layer_path", path="einsum",
                                                                  repeats=max(2, reps // 2), **shape)),
    ]
    table("MoE layer, forward + backward (routing precomputed)", layer_rows,
          "floor: expert matmuls on gathered tokens", "vs floor")
    index = layer_rows[1][1]
    lines.append("Index path speed-up:  "
                 f"vs einsum {layer_rows[3][1]['median_ms'] / index['median_ms']:.2f}x (memory "
                 f"{index['peak_mb']:.0f} MB vs {layer_rows[3][1]['peak_mb']:.0f} MB),  "
                 f"vs loop {layer_rows[2][1]['median_ms'] / index['median_ms']:.2f}x")
    lines.append("")
    lines += optimal_transport(args, run_case)
    lines.append("")
    lines += subset_marginals(args, run_case)
    lines.append("")
    lines += gumbel_matching_solvers(args, run_case)
    text = "\n".join(lines)
    print(text)
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    out = results / f"{datetime.date.today()}-{args.device}{'-quick' if args.quick else ''}.txt"
    out.write_text(text + "\n")
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
