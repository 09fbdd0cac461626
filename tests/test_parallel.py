"""Expert parallelism (minimoe.parallel): the sharded layer against the single-device MoELayer.

The oracle of every multi-process test is :class:`minimoe.MoELayer` on one device, with the same
weights, on the tokens of *all* ranks, routing each rank's tokens as their own groups (the sharded
layer routes each rank's tokens locally). Forward outputs, gradients with respect to the inputs,
the expert weights and the (all-reduced) router weights must agree in float64 to 1e-12, and the
routing masks (hence the dropped tokens) must be identical. The per-rank statistics are checked
against counts taken from the reference routing.

Each world size is one spawned gloo run (2 and 4 processes on the CPU) that executes every case and
returns its measurements; the tests below assert on them.
"""
from __future__ import annotations

import copy
import math
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from minimoe import MoELayer, Routing
from minimoe.models import TinyLM
from minimoe.parallel import (EXCHANGES, ExpertParallelMoELayer, all_to_all, allreduce_replicated_grads,
                              convert_to_expert_parallel, expected_overflow, idle_fraction, max_load_bound,
                              run_local, send_counts)
from minimoe.routers import Router, available

TOL = 1e-12
D_MODEL, D_HIDDEN = 6, 5

# name: (router, options, groups per rank, tokens per group); each runs with both exchanges
ROUTER_CASES = {
    2: {
        "topk1_cap0.75": ("softmax_topk", {"k": 1, "capacity_factor": 0.75}, 2, 8),
        "topk2_cap1": ("softmax_topk", {"k": 2, "capacity_factor": 1.0}, 1, 16),
        "topk1_dropless": ("softmax_topk", {"k": 1, "capacity_factor": None}, 1, 16),
        "expert_choice": ("expert_choice", {"capacity_factor": 1.0}, 2, 8),
        "base": ("base", {}, 1, 16),
        "sinkhorn_tc": ("sinkhorn_token_choice", {"k": 1, "capacity_factor": 1.0}, 1, 16),
        "empty_rank": ("softmax_topk", {"k": 1, "capacity_factor": None}, 1, 16),
    },
    4: {
        "topk2_cap1": ("softmax_topk", {"k": 2, "capacity_factor": 1.0}, 1, 16),
        "topk1_dropless": ("softmax_topk", {"k": 1, "capacity_factor": None}, 2, 8),
        "expert_choice": ("expert_choice", {"capacity_factor": 1.0}, 1, 16),
        "base": ("base", {}, 1, 16),
        "empty_rank": ("softmax_topk", {"k": 1, "capacity_factor": None}, 1, 16),
    },
}
EXPERTS = {2: 4, 4: 8}


class _SoftRouter(Router):
    """A minimal soft router (every token in every slot), to check that it is refused."""

    def route(self, logits, x=None):
        dispatch = torch.softmax(logits, -2).unsqueeze(-1)  # one slot per expert
        return Routing(slot_dispatch=dispatch, slot_combine=torch.softmax(logits, -1).unsqueeze(-1), probs=None)


# -- the code each rank runs ------------------------------------------------------------------------------

def _reference_and_inputs(world, router, options, groups, group_tokens, seed, empty=False):
    torch.manual_seed(seed)
    E = EXPERTS[world]
    ref = MoELayer(D_MODEL, D_HIDDEN, E, router, router_options=options, group_size=group_tokens).double()
    with torch.no_grad():  # nonzero biases: an empty slot would leak MLP(0) into the output
        ref.experts.b_in.normal_()
        ref.experts.b_out.normal_()
    n = world * groups * group_tokens
    x = torch.randn(n, D_MODEL, dtype=torch.float64)
    if empty:  # every logit of the upper half of the experts is -sum(x) < 0: nothing is routed there
        x = x.abs() + 0.5
        with torch.no_grad():
            ref.router.gate.weight[: E // 2].uniform_(0.0, 1.0)
            ref.router.gate.weight[E // 2:] = -1.0
    return ref, x, torch.randn(n, D_MODEL, dtype=torch.float64)


def _compare(rank, world, name, exchange, group=None):
    router, options, groups, T = ROUTER_CASES[world][name]
    ref, x, grad_out = _reference_and_inputs(world, router, options, groups, T, seed=7, empty=name == "empty_rank")
    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref)
    (out_ref * grad_out).sum().backward()

    ep = ExpertParallelMoELayer.from_single_device(ref, exchange=exchange, process_group=group)
    ep.zero_grad(set_to_none=True)
    mine = slice(rank * groups * T, (rank + 1) * groups * T)
    x_mine = x[mine].clone().requires_grad_()
    out = ep(x_mine)
    (out * grad_out[mine]).sum().backward()
    allreduce_replicated_grads(ep, group)

    L, E = ep.local_experts, ep.n_experts
    experts = slice(rank * L, (rank + 1) * L)
    grad_diff = max((getattr(ep.experts, p).grad - getattr(ref.experts, p).grad[experts]).abs().max().item()
                    for p in ("w_in", "b_in", "w_out", "b_out"))
    # the reference's routing, cut into the ranks' groups: the oracle of the statistics
    ref_mask = ref.last_routing.mask.view(world, groups, T, E)
    mask_mine = ref_mask[rank]
    received_from = ref_mask[:, :, :, experts].sum((1, 2, 3))
    if exchange == "capacity":
        cap = ref.last_routing.capacity
        C = cap if cap is not None else int(ref.last_routing.position.max()) + 1  # largest need over all ranks
        slots = world * L * groups * C
    else:
        slots = int(received_from.sum())
    stats = ep.last_stats
    return {
        "forward": (out - out_ref[mine]).abs().max().item(),
        "grad_x": (x_mine.grad - x_ref.grad[mine]).abs().max().item(),
        "grad_experts": grad_diff,
        "grad_router": (ep.router.gate.weight.grad - ref.router.gate.weight.grad).abs().max().item(),
        "same_mask": bool(torch.equal(ep.last_routing.mask, mask_mine)),
        "dropped_tokens": stats.dropped_tokens,
        "dropped_expected": int((~mask_mine.any(-1)).sum()),
        "sent": stats.sent_per_rank,
        "sent_expected": mask_mine.reshape(-1, world, L).sum((0, 2)).tolist(),
        "received": stats.received_per_rank,
        "received_expected": received_from.tolist(),
        "expert_load": stats.expert_load,
        "expert_load_expected": ref_mask[..., experts].sum((0, 1, 2)).tolist(),
        "slots": stats.slots,
        "slots_expected": slots,
        "fill": stats.buffer_fill,
        "grad_experts_norm": sum(float(getattr(ep.experts, p).grad.abs().sum()) for p in ("w_in", "b_out")),
    }


def _adjoint(rank, world):
    """all_to_all moves exactly the rows it should, and its backward is its adjoint (uneven and empty splits)."""
    gen = torch.Generator().manual_seed(3)
    sizes = torch.randint(0, 4, (world, world), generator=gen)  # sizes[r, s]: rows from rank r to rank s
    sizes[0, world - 1] = 0
    xs = [torch.randn(int(sizes[r].sum()), 3, generator=gen, dtype=torch.float64) for r in range(world)]
    gs = [torch.randn(int(sizes[:, r].sum()), 3, generator=gen, dtype=torch.float64) for r in range(world)]
    x = xs[rank].clone().requires_grad_()
    y = all_to_all(x, sizes[rank].tolist(), sizes[:, rank].tolist())
    (y * gs[rank]).sum().backward()
    # what rank `rank` must receive: from every s, the block of s's rows addressed to it
    want_y = torch.cat([xs[s].split(sizes[s].tolist())[rank] for s in range(world)])
    want_grad = torch.cat([gs[s].split(sizes[:, s].tolist())[rank] for s in range(world)])
    dots = torch.stack([(y.detach() * gs[rank]).sum(), (x.detach() * x.grad).sum()])
    dist.all_reduce(dots)
    return {"forward_exact": bool(torch.equal(y.detach(), want_y)),
            "backward_exact": bool(torch.equal(x.grad, want_grad)),
            "adjoint_gap": abs(float(dots[0] - dots[1]))}


def _errors(rank, world):
    out = {}
    try:
        ExpertParallelMoELayer(D_MODEL, D_HIDDEN, 3)
    except ValueError as err:
        out["indivisible"] = str(err)
    soft = ExpertParallelMoELayer(D_MODEL, D_HIDDEN, 2 * world, _SoftRouter(D_MODEL, 2 * world))
    try:
        soft(torch.randn(8, D_MODEL))
    except ValueError as err:
        out["soft"] = str(err)
    dense = ExpertParallelMoELayer(D_MODEL, D_HIDDEN, 2 * world, "densemixer")
    try:
        dense(torch.randn(8, D_MODEL))
    except ValueError as err:
        out["densemixer"] = str(err)
    dense.eval()
    out["densemixer_eval_shape"] = list(dense(torch.randn(8, D_MODEL)).shape)  # eval is plain top-k: fine
    # unequal token counts: refused by the capacity exchange on every rank, handled by the variable one
    ref, x, grad_out = _reference_and_inputs(world, "softmax_topk", {"k": 2, "capacity_factor": 1.0}, 1, 8, seed=1)
    counts = [8 * (2 if r == 0 else 1) for r in range(world)]
    x = torch.randn(sum(counts), D_MODEL, dtype=torch.float64)
    grad_out = torch.randn_like(x)
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])
    cap = ExpertParallelMoELayer.from_single_device(ref, exchange="capacity")
    try:
        cap(x[mine])
    except ValueError as err:
        out["unequal_capacity"] = str(err)
    x_ref = x.clone().requires_grad_()
    (ref(x_ref) * grad_out).sum().backward()
    var = ExpertParallelMoELayer.from_single_device(ref, exchange="variable")
    x_mine = x[mine].clone().requires_grad_()
    y = var(x_mine, group_size=8)
    (y * grad_out[mine]).sum().backward()
    out["unequal_variable_forward"] = (y - ref(x)[mine]).abs().max().item()
    out["unequal_variable_grad_x"] = (x_mine.grad - x_ref.grad[mine]).abs().max().item()
    return out


def _model(rank, world):
    """A whole TinyLM switched with convert_to_expert_parallel: logits and every gradient agree, for the
    sum and the mean of the ranks' losses."""
    torch.manual_seed(0)
    E = EXPERTS[world]
    model = TinyLM(11, d_model=8, n_layers=2, n_heads=2, block_size=8, n_experts=E, d_hidden=8,
                   router="softmax_topk", router_options={"k": 2, "capacity_factor": 1.0}).double()
    idx = torch.randint(0, 11, (2 * world, 8))
    grad_out = torch.randn(2 * world, 8, 11, dtype=torch.float64)
    sharded = convert_to_expert_parallel(copy.deepcopy(model), exchange="capacity")
    logits_ref = model(idx)
    (logits_ref * grad_out).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    mine = slice(2 * rank, 2 * rank + 2)
    out = {"layers": sum(isinstance(m, ExpertParallelMoELayer) for m in sharded.modules())}
    for op in ("sum", "mean"):
        sharded.zero_grad(set_to_none=True)
        logits = sharded(idx[mine])
        (logits * grad_out[mine]).sum().backward()
        allreduce_replicated_grads(sharded, op=op)
        scale = 1.0 if op == "sum" else 1.0 / world
        worst = 0.0
        for n, p in sharded.named_parameters():
            want = ref_grads[n]
            if ".experts." in n:  # this rank's slice of the stacked expert weights
                L = E // world
                want = want[rank * L:(rank + 1) * L]
            worst = max(worst, (p.grad - scale * want).abs().max().item())
        out[f"grad_{op}"] = worst
        out["logits"] = (logits - logits_ref[mine]).abs().max().item()
    return out


def _sweep(rank, world):
    """Every registered router at its default options, in eval mode (no sampling, so the reference and
    the sharded layer route alike): sparse ones must match the single-device layer on this rank's
    tokens, soft ones be refused. (The reference is called per rank: USMoE's default
    grouping="position" makes the groups of one call compete, so a call on all ranks' tokens would
    route differently; a rank only sees its own groups.)"""
    out = {}
    E, T = EXPERTS[world], 16
    for name in available():
        torch.manual_seed(5)
        try:
            ref = MoELayer(D_MODEL, D_HIDDEN, E, name, group_size=T).double().eval()
            x = torch.randn(world * 2 * T, D_MODEL, dtype=torch.float64)
            mine = slice(rank * 2 * T, (rank + 1) * 2 * T)
            out_ref = torch.zeros_like(x)
            out_ref[mine] = ref(x[mine])
        except Exception as err:  # the router itself fails on one device: not this file's business
            out[name] = {"skipped": f"{type(err).__name__}: {err}"}
            continue
        for exchange in EXCHANGES:
            ep = ExpertParallelMoELayer.from_single_device(ref, exchange=exchange).eval()
            try:
                out[(name, exchange)] = {"forward": (ep(x[mine]) - out_ref[mine]).abs().max().item()}
            except ValueError as err:
                out[(name, exchange)] = {"error": str(err), "soft": bool(ref.last_routing.is_soft)}
    return out


def _worker(rank, world):
    start = time.perf_counter()
    results = {"adjoint": _adjoint(rank, world)}
    for name in ROUTER_CASES[world]:
        for exchange in EXCHANGES:
            results[(name, exchange)] = _compare(rank, world, name, exchange)
    results["errors"] = _errors(rank, world)
    if world == 2:
        results["model"] = _model(rank, world)
        results["sweep"] = _sweep(rank, world)
    else:  # a 2-rank expert group inside the 4 processes, on non-adjacent ranks (as in EP x data parallel)
        members = [1, 3]
        group = dist.new_group(members)
        if rank in members:
            for exchange in EXCHANGES:
                results[("subgroup", exchange)] = _compare(members.index(rank), 2, "topk2_cap1", exchange, group)
    results["seconds"] = time.perf_counter() - start
    return results


_RUNS: dict = {}


def _run(world):
    if world not in _RUNS:
        _RUNS[world] = run_local(_worker, world, timeout_s=90)
    return _RUNS[world]


# -- the tests --------------------------------------------------------------------------------------------

CASES = [(w, name, ex) for w in ROUTER_CASES for name in ROUTER_CASES[w] for ex in EXCHANGES]


@pytest.mark.parametrize("world,name,exchange", CASES)
def test_sharded_layer_equals_single_device(world, name, exchange):
    for rank, res in enumerate(_run(world)):
        r = res[(name, exchange)]
        for key in ("forward", "grad_x", "grad_experts", "grad_router"):
            assert r[key] < TOL, f"rank {rank}: {key} differs by {r[key]:.2e}"
        assert r["same_mask"], f"rank {rank}: the routing (hence the dropped tokens) differs"
        assert r["dropped_tokens"] == r["dropped_expected"]


@pytest.mark.parametrize("world,name,exchange", CASES)
def test_statistics_match_the_reference_routing(world, name, exchange):
    results = _run(world)
    for rank, res in enumerate(results):
        r = res[(name, exchange)]
        assert r["sent"] == r["sent_expected"]
        assert r["received"] == r["received_expected"]
        assert r["expert_load"] == r["expert_load_expected"]
        assert r["slots"] == r["slots_expected"]
        assert math.isclose(r["fill"], sum(r["received"]) / r["slots"] if r["slots"] else 1.0)
    # what one rank sends to another is what the other receives from it
    for a in range(world):
        for b in range(world):
            assert results[a][(name, exchange)]["sent"][b] == results[b][(name, exchange)]["received"][a]


def test_the_cases_exercise_drops_padding_and_exact_fill():
    """Guards the test data: drops happen, padding happens, and expert choice fills the buffers exactly."""
    res = _run(2)
    assert sum(r[("topk1_cap0.75", "capacity")]["dropped_tokens"] for r in res) > 0
    assert sum(r[("expert_choice", "capacity")]["dropped_tokens"] for r in res) > 0
    assert min(r[("topk1_dropless", "capacity")]["fill"] for r in res) < 1
    for world in (2, 4):
        for r in _run(world):
            assert r[("expert_choice", "capacity")]["fill"] == 1.0
            assert r[("base", "capacity")]["fill"] == 1.0  # 16 tokens, E divides T: every expert exactly T/E


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_a_rank_that_receives_nothing(world, exchange):
    results = _run(world)
    for rank, res in enumerate(results):
        r = res[("empty_rank", exchange)]
        if rank >= world // 2:  # holds the experts nobody chose
            assert sum(r["received"]) == 0 and r["expert_load"] == [0, 0]
            assert r["grad_experts_norm"] == 0.0
            assert r["fill"] == (0.0 if exchange == "capacity" else 1.0)
    assert sum(sum(res[("empty_rank", exchange)]["received"]) for res in results[: world // 2]) > 0


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_a_subgroup_of_the_processes(exchange):
    results = _run(4)
    for rank in (1, 3):
        r = results[rank][("subgroup", exchange)]
        assert max(r[k] for k in ("forward", "grad_x", "grad_experts", "grad_router")) < TOL
        assert r["same_mask"] and r["received"] == r["received_expected"]
    assert ("subgroup", exchange) not in results[0]


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_rows_and_adjoint(world):
    for res in _run(world):
        a = res["adjoint"]
        assert a["forward_exact"] and a["backward_exact"]
        assert a["adjoint_gap"] < 1e-12


@pytest.mark.parametrize("world", [2, 4])
def test_clear_errors(world):
    for res in _run(world):
        e = res["errors"]
        assert "n_experts=3" in e["indivisible"] and f"world size {world}" in e["indivisible"]
        assert "soft router" in e["soft"]
        assert "DenseMixer" in e["densemixer"]
        assert e["densemixer_eval_shape"] == [8, D_MODEL]
        assert "same number of groups and tokens" in e["unequal_capacity"] and "variable" in e["unequal_capacity"]
        assert e["unequal_variable_forward"] < TOL and e["unequal_variable_grad_x"] < TOL


def test_every_registered_router():
    """Sparse routers (eval mode, default options) match the single-device layer; soft ones are refused."""
    for res in _run(2):
        sweep = res["sweep"]
        checked = 0
        for key, r in sweep.items():
            if not isinstance(key, tuple):
                continue
            if "error" in r:
                assert r["soft"] and "soft router" in r["error"], (key, r)
            else:
                assert r["forward"] < TOL, (key, r)
                checked += 1
        assert checked >= 2 * 8, sweep  # at least the eight routers of chapters 1-2 and 6-7


def test_model_switch_with_one_call():
    for res in _run(2):
        m = res["model"]
        assert m["layers"] == 2
        assert m["logits"] < TOL
        assert m["grad_sum"] < TOL and m["grad_mean"] < TOL


def _uneven_routing_calls(rank, world):
    """Rank 0 routes twice, rank 1 once and leaves: rank 0's second load all-reduce has no partner."""
    torch.manual_seed(0)
    layer = ExpertParallelMoELayer(D_MODEL, D_HIDDEN, 4, "loss_free", router_options={"bias_rate": 0.01}).train()
    x = torch.randn(1, 8, D_MODEL)
    layer(x)
    if rank == 1:
        return "left after one routing call"
    try:
        layer(x)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_ranks_that_route_a_different_number_of_times_get_a_message_that_says_what_must_match():
    """Loss-free balancing sums the loads over the ranks once per routing call: a rank that routes once
    more than its partner fails with a message naming the rule, within the collective's timeout."""
    start = time.monotonic()
    results = run_local(_uneven_routing_calls, 2, timeout_s=30.0)
    assert results[1] == "left after one routing call"
    assert "every rank must route the same number of times" in results[0], results[0]
    assert "routing call 2" in results[0]
    assert time.monotonic() - start < 60


def test_needs_an_initialised_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ExpertParallelMoELayer(D_MODEL, D_HIDDEN, 4)


# -- the formulas (no processes needed) --------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 6), st.sampled_from([(4, 1), (4, 2), (4, 4), (6, 3)]), st.integers(0, 10**6))
def test_send_counts_by_brute_force(groups, tokens, experts_world, seed):
    E, W = experts_world
    gen = torch.Generator().manual_seed(seed)
    position = torch.where(torch.rand(groups, tokens, E, generator=gen) < 0.4,
                           torch.randint(0, 3, (groups, tokens, E), generator=gen), -1)
    want = [0] * W
    for g in range(groups):
        for t in range(tokens):
            for e in range(E):
                if position[g, t, e] >= 0:
                    want[e // (E // W)] += 1
    assert send_counts(position, W).tolist() == want
    assert int(send_counts(Routing(combine=position.clamp_min(0).double(), position=position), W).sum()) == int(
        (position >= 0).sum())


def test_send_counts_errors():
    with pytest.raises(ValueError, match="not divisible"):
        send_counts(torch.zeros(2, 3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="world_size"):
        send_counts(torch.zeros(2, 4, dtype=torch.long), 0)


@pytest.mark.parametrize("T,E,C", [(4, 2, 2), (5, 3, 1), (6, 2, 4), (3, 3, 2)])
def test_expected_overflow_by_enumeration(T, E, C):
    """k = 1: enumerate all E^T assignments of the tokens to experts."""
    dropped = empty = 0.0
    for code in range(E ** T):
        loads = [0] * E
        for _ in range(T):
            loads[code % E] += 1
            code //= E
        dropped += sum(max(m - C, 0) for m in loads)
        empty += sum(max(C - m, 0) for m in loads)
    drop, pad = expected_overflow(T, E, C)
    assert math.isclose(drop, dropped / E ** T / T, rel_tol=1e-12)
    assert math.isclose(pad, empty / E ** T / (E * C), rel_tol=1e-12)


def test_expected_overflow_k2_monte_carlo_and_identity():
    """k = 2 distinct experts per token: 20000 simulated groups, 4 standard errors."""
    T, E, k, C, n = 32, 8, 2, 8, 20000
    gen = torch.Generator().manual_seed(0)
    choice = torch.rand(n, T, E, generator=gen).topk(k, -1).indices  # k distinct uniform experts
    loads = torch.zeros(n, E).scatter_add_(1, choice.reshape(n, -1), torch.ones(n, T * k))
    per_group = (loads - C).clamp_min(0).sum(-1) / (k * T)
    drop, pad = expected_overflow(T, E, C, k=k)
    assert abs(per_group.mean().item() - drop) < 4 * per_group.std().item() / math.sqrt(n)
    # slots minus requests = empty slots minus dropped requests, in expectation exactly
    assert math.isclose(pad * E * C - drop * k * T, E * C - k * T, abs_tol=1e-9)
    with pytest.raises(ValueError, match="k"):
        expected_overflow(T, E, C, k=E + 1)


@pytest.mark.parametrize("N,W", [(3, 2), (2, 3), (64, 4), (500, 8)])
def test_max_load_bound(N, W):
    gen = torch.Generator().manual_seed(1)
    if W ** (N * W) <= 10**5:  # exact expectation by enumeration
        total = 0
        for code in range(W ** (N * W)):
            loads = [0] * W
            for _ in range(N * W):
                loads[code % W] += 1
                code //= W
            total += max(loads)
        expected = total / W ** (N * W)
    else:  # 4000 simulated steps
        ranks = torch.randint(0, W, (4000, N * W), generator=gen)
        expected = torch.zeros(4000, W).scatter_add_(1, ranks, torch.ones(4000, N * W)).amax(1).mean().item()
    bound = max_load_bound(N, W)
    assert expected <= bound
    lam = torch.logspace(-4, 1, 100001, dtype=torch.float64)  # an independent minimisation, on a grid
    grid = ((math.log(W) + N * torch.expm1(lam)) / lam).min().item()
    assert bound <= grid + 1e-9 and grid - bound < 1e-3 * grid
    lam0 = math.sqrt(2 * math.log(W) / N)  # the closed-form bound of Proposition 8.4
    assert bound <= N + math.sqrt(2 * N * math.log(W)) * (1 + math.exp(lam0)) / 2


def test_idle_fraction():
    assert idle_fraction([3, 3, 3]) == 0.0
    assert math.isclose(idle_fraction([4, 2, 0, 2]), 0.5)
    assert idle_fraction([0, 0]) == 0.0
