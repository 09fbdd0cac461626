"""Property tests (hypothesis) over every registered router: random group counts, group sizes and
expert counts, float32 / bfloat16 / float16 logits, logit scales from 1e-3 to 1e4.

For every draw: the combine weights, the aux loss and every statistic are finite; the slot table is a
valid one (``mask`` is ``position >= 0``, each expert's dispatched tokens sit in slots 0 .. n_e - 1, one
token per slot, never more than the capacity); combine weights are 0 off the dispatch. Stochastic
routers given a generator (or SSR a seed) draw *only* from it: the same seed gives the same routing
whatever torch's global generator has done in between. And routers and the layer run under
``torch.autocast`` (bfloat16 on the CPU).
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minimoe
from minimoe.ops import smallest_feasible_capacity
from minimoe.routers import available, build

ROUTERS = available()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Options that make any (T, E) feasible: capacity at least 1 slot, the sparse plan's feasibility bound.
FEASIBLE = {
    "softmax_topk": lambda T, E: {"min_capacity": 1},
    "expert_choice": lambda T, E: {"min_capacity": 1},
    "sparsity_constrained_ec": lambda T, E: {"min_capacity": smallest_feasible_capacity(T, E)},
    "kool_skip": lambda T, E: {"min_capacity": 1},
    "densemixer": lambda T, E: {"capacity_factor": 1.0, "min_capacity": 1},
    "sinkhorn_token_choice": lambda T, E: {"capacity_factor": None},
    "sinkhorn_expert_choice": lambda T, E: {"capacity_factor": max(1.0, E / T)},
    "usmoe": lambda T, E: {"k": 1.0, "grouping": "sequence"},
    "ssr": lambda T, E: {"k": 1, "p": 0.5, "noise_scale": 0.1, "seed": 0},
    "probmoe_exact": lambda T, E: {"k": 1},
    "probmoe_dynamic": lambda T, E: {"k_min": 1, "k_max": min(2, E)},
}
# Each stochastic router with its randomness switched on, and where its generator goes.
STOCHASTIC = {
    "softmax_topk": {"noise": "vmoe", "noise_std": 1.0},
    "expert_choice": {"noise": "vmoe", "noise_std": 1.0},
    "sinkhorn_token_choice": {"noise": "vmoe", "noise_std": 1.0},
    "sinkhorn_expert_choice": {"noise": "vmoe", "noise_std": 1.0},
    "sparsity_constrained_ec": {"noise": "vmoe", "noise_std": 1.0, "capacity_rounding": "ceil"},
    "densemixer": {"noise": "vmoe", "noise_std": 1.0},
    "kool_skip": {},
    "kool_gumbel_matching": {},
    "probmoe_exact": {"k": 2},
    "probmoe_dynamic": {},
    "ssr": {"p": 0.5, "noise_scale": 1.0},  # seed, not generator
}


def options_for(name, T, E):
    return FEASIBLE.get(name, lambda T, E: {})(T, E)


def check_routing(routing, name):
    if routing.is_soft:
        for t in (routing.slot_dispatch, routing.slot_combine):
            assert torch.isfinite(t.float()).all(), name
        assert torch.allclose(routing.slot_combine.float().sum((-1, -2)), torch.ones(()), atol=1e-2)
    else:
        combine, position = routing.combine.float(), routing.position
        assert torch.isfinite(combine).all(), name
        assert torch.equal(routing.mask, position >= 0)
        assert (combine[~routing.mask] == 0).all(), f"{name}: weight off the dispatch"
        counts = routing.mask.sum(-2)  # (..., E)
        if routing.capacity is not None:
            assert (counts <= routing.capacity).all(), name
            assert (position < routing.capacity).all(), name
        # slots 0 .. n_e - 1, each once: the sorted slots of an expert are 0, 1, 2, ...
        slots = torch.where(routing.mask, position, position.new_full((), 10**9)).sort(-2).values
        ranks = torch.arange(position.shape[-2]).view(-1, 1).expand_as(slots)
        expected = torch.where(ranks < counts.unsqueeze(-2), ranks, slots.new_full((), 10**9))
        assert torch.equal(slots, expected), f"{name}: slots are not 0 .. n_e - 1"
    assert torch.isfinite(routing.aux_loss.float()), name
    for key, value in routing.stats.items():
        # scalars, or one value per expert (loss-free balancing reports its bias vector)
        assert torch.as_tensor(value).numel() in (1, routing.mask.shape[-1]), (name, key, value)
        assert torch.isfinite(torch.as_tensor(value, dtype=torch.float64)).all(), (name, key, value)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
@pytest.mark.parametrize("name", ROUTERS)
def test_routing_is_valid_for_any_shape_dtype_and_scale(name, data):
    G = data.draw(st.integers(1, 3), label="groups")
    T = data.draw(st.integers(1, 40), label="tokens")
    E = data.draw(st.integers(2, 8), label="experts")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    scale = data.draw(st.sampled_from([1e-3, 1e-1, 1.0, 10.0, 1e2, 1e3, 1e4]), label="scale")
    training = data.draw(st.booleans(), label="training")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    gen = torch.Generator().manual_seed(seed)
    router = build(name, 8, E, **options_for(name, T, E)).train(training)
    if name == "soft_moe":
        x = (torch.randn(G, T, 8, generator=gen) * scale).clamp(-6e4, 6e4).to(dtype)
        routing = router.to(dtype)(x)
    else:
        logits = (torch.randn(G, T, E, generator=gen) * scale).clamp(-6e4, 6e4).to(dtype)
        routing = router.route(logits)
    check_routing(routing, name)


@pytest.mark.parametrize("name", sorted(STOCHASTIC))
def test_a_seeded_router_draws_only_from_its_own_generator(name):
    T, E = 32, 4
    logits = torch.randn(2, T, E)
    runs = []
    for global_seed in (0, 12345):
        torch.manual_seed(global_seed)  # the global generator differs between the two runs
        options = {**options_for(name, T, E), **STOCHASTIC[name]}
        if name == "ssr":
            options["seed"] = 7
        else:
            options["generator"] = torch.Generator().manual_seed(7)
        router = build(name, 8, E, **options).train()
        runs.append([router.route(logits) for _ in range(3)])
    for a, b in zip(*runs):
        assert torch.equal(a.position, b.position), name
        assert torch.equal(a.combine, b.combine), name
    # and the draws do vary from call to call (the generator advances): the test can fail
    first = runs[0]
    assert any(not torch.equal(first[0].position, r.position) or not torch.equal(first[0].combine, r.combine)
               for r in first[1:]), f"{name}: three identical draws, is the noise on?"


@pytest.mark.parametrize("name", ROUTERS)
@pytest.mark.parametrize("path", ["index", "slots", "grouped", "einsum", "loop"])
def test_the_layer_runs_under_autocast(name, path):
    """bfloat16 autocast on the CPU: forward and backward, finite, the output in the input's dtype."""
    T, E = 16, 4
    layer = minimoe.MoELayer(8, 16, E, router=name, router_options=options_for(name, T, E), path=path).train()
    x = torch.randn(2, T, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x, group_size=T)
        loss = y.float().pow(2).mean() + layer.aux_loss
    loss.backward()
    assert y.dtype == x.dtype
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    check_routing(layer.last_routing, name)


def test_statistics_and_losses_are_finite_in_float16():
    """The 1e-30 clamp of an entropy is 0 in float16 (0 * log 0 = NaN), and logsumexp(logits)^2
    overflows float16 once logits reach 256: statistics and losses are computed in float32."""
    probs = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float16)
    assert float(minimoe.metrics.routing_entropy(probs)) == 0.0
    logits = torch.full((4, 8), 300.0, dtype=torch.float16)
    z = minimoe.losses.z_loss(logits)
    assert torch.isfinite(z) and abs(float(z) - (300 + math.log(8)) ** 2) < 1e-2 * (300 + math.log(8)) ** 2
    soft = build("soft_moe", 8, 4).half()
    routing = soft(torch.randn(2, 16, 8).half() * 100)
    assert math.isfinite(float(routing.stats["dispatch_entropy"]))
