"""One benchmark case per function. Each runs in a fresh process (``python -m benchmarks.cases NAME
JSON``) so that its peak memory is its own; it prints one JSON line: median milliseconds and the
peak memory above the process's baseline.

Notation: T tokens in one routing group, E experts, d model width, h expert hidden width, k experts
per token, C = capacity (slots per expert).
"""
from __future__ import annotations

import json
import resource
import statistics
import sys
import time

import torch


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _measure(fn, repeats: int, device: str) -> dict:
    # The baseline is taken before the first call: ru_maxrss is a lifetime peak.
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_mb()
    warm = time.perf_counter()
    for i in range(1000):  # warm-up: thread pools, allocator caches, first-call dispatch
        fn()
        if i >= 2 and time.perf_counter() - warm > 0.3:
            break
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    if device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:  # ru_maxrss is the lifetime peak (KiB on Linux): peak above the baseline before the runs
        peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base, 0.0)
    return {"median_ms": statistics.median(times), "peak_mb": peak}


def _setup_layer(p):
    from minimoe import MoELayer

    torch.manual_seed(0)
    layer = MoELayer(p["d"], p["h"], p["E"], "softmax_topk",
                     router_options={"k": p["k"], "capacity_factor": 1.0}).to(p["device"])
    x = torch.randn(1, p["T"], p["d"], device=p["device"], requires_grad=True)
    with torch.no_grad():
        routing = layer.router(x)
    return layer, x, routing


def layer_path(p):
    """MoELayer forward + backward along one path, routing precomputed."""
    layer, x, routing = _setup_layer(p)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer.apply_routing(x, routing, p["path"]).sum().backward()
    return step


def expert_floor(p):
    """The floor: the expert matmuls alone (forward + backward) on tokens already in their slots."""
    layer, x, routing = _setup_layer(p)
    E, C, d = p["E"], routing.num_slots, p["d"]
    with torch.no_grad():
        buffer = torch.zeros(E, C, d, device=p["device"])
        g, t, e = (routing.position >= 0).nonzero(as_tuple=True)
        buffer[e, routing.position[g, t, e]] = x[g, t]
    buffer.requires_grad_(True)

    def step():
        layer.zero_grad(set_to_none=True)
        buffer.grad = None
        layer.experts(buffer).sum().backward()
    return step


def routing_softmax_topk(p):
    """The softmax_topk router from logits (forward, no grad): softmax, Alg. 1 allocation, combine."""
    from minimoe.routers import build

    router = build("softmax_topk", 8, p["E"], k=p["k"], capacity_factor=p["capacity_factor"]).to(p["device"]).eval()
    logits = torch.randn(1, p["T"], p["E"], device=p["device"])

    def step():
        with torch.no_grad():
            router.route(logits)
    return step


def routing_floor(p):
    """The floor of any top-k router: softmax, then torch.topk."""
    logits = torch.randn(1, p["T"], p["E"], device=p["device"])

    def step():
        with torch.no_grad():
            torch.softmax(logits, -1).topk(p["k"], dim=-1)
    return step


CASES = {f.__name__: f for f in (layer_path, expert_floor, routing_softmax_topk, routing_floor)}

if __name__ == "__main__":
    name, params = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(params.get("threads", torch.get_num_threads()))
    print(json.dumps(_measure(CASES[name](params), params["repeats"], params["device"])))
