"""The experiment of notebook 12, as a script for ``torchrun``. Book: chapter 8, "Running it".

    torchrun --standalone --nproc_per_node=4 -m minimoe.parallel.demo --out results.json

Every rank builds the same single-device layers (same seeds), keeps its slice of the experts and
its share of the tokens, and runs each router of the suite with both exchanges:

1. ``--check``: in float64 on small sizes, the sharded forward and backward against the
   single-device :class:`~minimoe.MoELayer` on all ranks' tokens (largest difference over ranks);
2. ``--repeats`` timed forward + backward steps at the requested sizes, keeping every rank's
   :class:`~minimoe.parallel.ExchangeStats` (times averaged over the steps) and step time.

Rank 0 writes everything to the JSON file ``--out``. Tokens are ``N(skew * mu, I)`` for a fixed
random ``mu``: a shared offset makes some experts more attractive to every token, the imbalance a
trained router without a balancing loss drifts into.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from ..layers import MoELayer
from .launch import init_from_env
from .layer import EXCHANGES, ExpertParallelMoELayer, allreduce_replicated_grads

TIMES = ("route_seconds", "comm_seconds", "idle_seconds", "compute_seconds", "backward_comm_seconds", "step_seconds")
SUITE = {
    "token choice top-1 c=1": ("softmax_topk", {"k": 1, "capacity_factor": 1.0}),
    "token choice top-2 c=1.25": ("softmax_topk", {"k": 2, "capacity_factor": 1.25}),
    "token choice dropless": ("softmax_topk", {"k": 1, "capacity_factor": None}),
    "expert choice c=1": ("expert_choice", {"capacity_factor": 1.0}),
    "BASE (balanced assignment)": ("base", {}),
    "Sinkhorn TC eps=1": ("sinkhorn_token_choice", {"k": 1, "capacity_factor": 1.0, "eps": 1.0}),
    "Sinkhorn TC eps=0.02": ("sinkhorn_token_choice", {"k": 1, "capacity_factor": 1.0, "eps": 0.02,
                                                       "sinkhorn_iters": 500}),
}


def _tokens(n, d, skew, seed, dtype, device):
    gen = torch.Generator().manual_seed(seed)
    mu = torch.randn(d, generator=gen)
    return (torch.randn(n, d, generator=gen) + skew * mu).to(dtype=dtype, device=device)


def _layer(router, options, experts, d_model, d_hidden, group_size, seed, dtype, device):
    torch.manual_seed(seed)
    layer = MoELayer(d_model, d_hidden, experts, router, router_options=options, group_size=group_size)
    return layer.to(dtype=dtype, device=device)


def check_equality(args, rank, world, device) -> dict:
    """Largest |sharded - single device| over all ranks, float64, forward and each gradient."""
    d, h, n = 16, 32, args.check_tokens
    out = {}
    for label, (router, options) in SUITE.items():
        if label not in args.routers:
            continue
        ref = _layer(router, options, args.experts, d, h, n // 2, seed=1, dtype=torch.float64, device=device)
        x = _tokens(world * n, d, args.skew, seed=2, dtype=torch.float64, device=device).requires_grad_()
        weights = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(device)
        (ref(x) * weights).sum().backward()
        out_ref = ref(x).detach()
        mine = slice(rank * n, (rank + 1) * n)
        L = args.experts // world
        for exchange in EXCHANGES:
            ep = ExpertParallelMoELayer.from_single_device(ref, exchange=exchange)
            ep.zero_grad(set_to_none=True)
            x_mine = x.detach()[mine].clone().requires_grad_()
            y = ep(x_mine)
            (y * weights[mine]).sum().backward()
            allreduce_replicated_grads(ep)
            same_routing = torch.equal(ep.last_routing.mask, ref.last_routing.mask.view(
                world, -1, args.experts)[rank].view_as(ep.last_routing.mask))
            diffs = torch.tensor([
                (y.detach() - out_ref[mine]).abs().max().item(),
                (x_mine.grad - x.grad[mine]).abs().max().item(),
                max((getattr(ep.experts, p).grad - getattr(ref.experts, p).grad[rank * L:(rank + 1) * L]).abs().max()
                    .item() for p in ("w_in", "b_in", "w_out", "b_out")),
                (ep.router.gate.weight.grad - ref.router.gate.weight.grad).abs().max().item(),
                float(not same_routing),
            ], dtype=torch.float64, device=device)
            dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
            out.setdefault(label, {})[exchange] = dict(zip(
                ("forward", "grad_x", "grad_experts", "grad_router", "routing_differs"), diffs.tolist()))
    return out


def measure(args, rank, world, device) -> dict:
    """Per-rank statistics of ``--repeats`` forward + backward steps for every router and exchange."""
    dtype = getattr(torch, args.dtype)
    n = args.tokens
    x_all = _tokens(world * n, args.d_model, args.skew, seed=2, dtype=dtype, device=device)
    x = x_all[rank * n:(rank + 1) * n]
    runs = {}
    for label, (router, options) in SUITE.items():
        if label not in args.routers:
            continue
        single = _layer(router, options, args.experts, args.d_model, args.d_hidden, args.group_size, seed=1,
                        dtype=dtype, device=device)
        for exchange in EXCHANGES:
            ep = ExpertParallelMoELayer.from_single_device(single, exchange=exchange, measure_idle=True)
            steps = []
            for step in range(args.repeats + 1):  # the first step warms up and is not counted
                dist.barrier()
                start = time.perf_counter()
                xi = x.clone().requires_grad_()
                ep(xi).square().mean().backward()
                allreduce_replicated_grads(ep)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if step:
                    steps.append({**ep.last_stats.as_dict(), "step_seconds": time.perf_counter() - start})
            # the counts are the same at every step (same tokens, no noise); times: the median step
            totals = dict(steps[0])
            for key in TIMES:
                totals[key] = statistics.median(s[key] for s in steps)
            gathered = [None] * world
            dist.all_gather_object(gathered, totals)
            runs.setdefault(label, {})[exchange] = gathered
    return runs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file written by rank 0")
    parser.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with a GPU per rank)")
    parser.add_argument("--routers", default=",".join(SUITE), help="comma-separated labels of the suite")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--d-hidden", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--skew", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check", action="store_true", help="also compare with the single-device layer")
    parser.add_argument("--check-tokens", type=int, default=64,
                        help="tokens per rank for --check (routed in two groups)")
    args = parser.parse_args(argv)
    args.routers = [r for r in args.routers.split(",") if r]
    unknown = [r for r in args.routers if r not in SUITE]
    if unknown:
        parser.error(f"unknown router labels {unknown}; the suite has {list(SUITE)}")

    start = time.perf_counter()
    rank, world, device = init_from_env(args.backend)
    if device.type == "cpu":
        torch.set_num_threads(1)
    result = {"world_size": world, "backend": dist.get_backend(), "device": str(device),
              "config": {k: v for k, v in vars(args).items() if k != "out"}, "suite": SUITE}
    if args.check:
        result["equality"] = check_equality(args, rank, world, device)
    result["runs"] = measure(args, rank, world, device)
    result["seconds"] = time.perf_counter() - start
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
