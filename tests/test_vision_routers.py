"""The six routers of Liu et al. (2024) through one layer (chapter 4): sparsity-constrained expert choice,
Soft MoE, and "softmax expert choice is Sinkhorn stopped after one row normalisation".

Oracles: the einsum path of eq. (2) (index path == einsum path for the sparse routers); eqs. (10)-(11)
written out by hand with per-slot loops (Soft MoE); torch.autograd.gradcheck; the plan of
minimoe.ops.sparsity_constrained_plan (checked against its own oracles in test_sparse_ot.py).
"""
import math

import pytest
import torch
from torch.func import functional_call

from minimoe import MoELayer
from minimoe.ops import sinkhorn, sparsity_constrained_plan
from minimoe.ops.allocation import expert_choice_allocation
from minimoe.routers import (ExpertChoice, SinkhornExpertChoice, SoftMoE, SparsityConstrainedExpertChoice,
                             available, build)

SPARSE = [
    ("softmax_topk", {"k": 1}),
    ("softmax_topk", {"k": 2, "noise": "vmoe", "balance_loss": "vmoe"}),
    ("sinkhorn_token_choice", {"k": 2}),
    ("expert_choice", {"capacity_factor": 1.0}),
    ("sinkhorn_expert_choice", {"capacity_factor": 2.0, "noise": "vmoe"}),
    ("sparsity_constrained_ec", {"capacity_factor": 1.0}),
    ("sparsity_constrained_ec", {"capacity_factor": 2.0, "ot_method": "annealed", "noise": "vmoe"}),
    ("sparsity_constrained_ec", {"capacity_factor": 1.0, "gamma": 1e-3}),  # columns with < C nonzeros
]


def skewed_logits(G, T, E, seed=0, dtype=torch.float64, skew=2.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(G, T, E, generator=gen, dtype=dtype) + skew * torch.randn(E, generator=gen, dtype=dtype)


def test_the_six_routers_are_registered():
    assert {"softmax_topk", "sinkhorn_token_choice", "expert_choice", "sinkhorn_expert_choice",
            "sparsity_constrained_ec", "soft_moe"} <= set(available())


def run(layer, x, path, seed):
    layer.zero_grad()
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)  # the same noise for every path
    routing = layer.router(x)
    out = layer.apply_routing(x, routing, path)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().add(routing.aux_loss).backward()
    grads = {"x": x.grad, **{n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}}
    return out.detach(), grads, routing


@pytest.mark.parametrize("name, options", SPARSE)
def test_sparse_routers_index_path_equals_einsum_path(name, options):
    torch.manual_seed(0)
    layer = MoELayer(8, 16, 4, name, router_options=options).double().train()
    with torch.no_grad():  # nonzero biases: an empty slot computes MLP(0) != 0 and must not leak
        layer.experts.b_in.normal_()
        layer.experts.b_out.normal_()
    x = torch.randn(3, 32, 8, dtype=torch.float64)
    out_e, grad_e, _ = run(layer, x, "einsum", 1)
    out_i, grad_i, r = run(layer, x, "index", 1)
    torch.testing.assert_close(out_i, out_e, rtol=1e-10, atol=1e-12)
    assert grad_i.keys() == grad_e.keys() and "router.gate.weight" in grad_e
    for key in grad_e:
        torch.testing.assert_close(grad_i[key], grad_e[key], rtol=1e-9, atol=1e-11, msg=key)
    D, Cmb = r.dispatch_tensor(), r.combine_tensor()
    assert set(D.unique().tolist()) <= {0.0, 1.0} and (D.sum(1) <= 1).all() and (D.sum(-1) <= 1).all()
    assert torch.equal(Cmb, D * r.probs.unsqueeze(-1))  # the softmax combines, exactly 0 off the dispatch
    assert set(r.stats) >= {"drop_rate", "load_imbalance"}


def test_sparsity_constrained_ec_dispatches_from_the_plan():
    logits = skewed_logits(4, 64, 8, seed=1)
    for options in ({}, {"ot_method": "annealed", "gamma": 0.5}, {"capacity_factor": 2.0, "ot_iters": 5}):
        router = SparsityConstrainedExpertChoice(8, 8, **options).eval()
        r = router.route(logits)
        probs = torch.softmax(logits, -1)
        C = router.capacity(64)
        info = sparsity_constrained_plan(probs, C, gamma=router.gamma, method=router.ot_method,
                                         max_iter=router.ot_iters, return_info=True)
        plan = info.plan
        want = expert_choice_allocation(plan, C)
        assert torch.equal(r.position, torch.where(plan > 0, want, -1))
        assert torch.equal(r.mask, plan > 0)  # with a positive utility, every nonzero is dispatched
        assert torch.equal(r.combine, probs * r.mask)
        assert (r.tokens_per_expert() <= C).all()
        assert abs(float(r.stats["plan_row_error"]) - info.row_error) < 1e-12


def test_zero_plan_entries_are_never_dispatched():
    """A small gamma makes columns sparser than C: top-C would then pick tokens with plan 0 (A15)."""
    logits = skewed_logits(4, 64, 8, seed=2, skew=0.0) * 3
    router = SparsityConstrainedExpertChoice(8, 8, gamma=1e-3).eval()
    r = router.route(logits)
    plan = sparsity_constrained_plan(torch.softmax(logits, -1), 8, gamma=1e-3, method="adam")
    nonzeros = (plan > 0).sum(-2)
    assert (nonzeros < 8).any(), "the test needs columns with fewer than C nonzeros"
    assert torch.equal(r.tokens_per_expert(), nonzeros)
    assert not (r.mask & (plan == 0)).any()
    positions = torch.where(r.mask, r.position, -1).amax(-2)
    assert torch.equal(positions + 1, nonzeros), "kept slots are 0, 1, ... (no gaps)"


def test_sparsity_constrained_ec_leaves_fewer_tokens_unprocessed_than_softmax_ec():
    """Liu et al. App. A / the brief: under expert skew the plan's row prices spread the tokens."""
    logits = skewed_logits(16, 64, 8, seed=3, skew=2.0)
    unprocessed = lambda r: float((~r.mask.any(-1)).double().mean())  # noqa: E731
    softmax_ec = unprocessed(ExpertChoice(8, 8).eval().route(logits))
    sparse_ec = unprocessed(SparsityConstrainedExpertChoice(8, 8, ot_method="annealed").eval().route(logits))
    assert sparse_ec < 0.5 * softmax_ec


def test_sparsity_constrained_ec_gate_learns_through_the_softmax_only():
    layer = MoELayer(8, 16, 4, "sparsity_constrained_ec")
    layer(torch.randn(2, 16, 8), group_size=16).square().sum().backward()
    assert layer.router.gate.weight.grad.abs().sum() > 0


def test_extreme_logits_route_without_nan():
    logits = 1e4 * skewed_logits(2, 32, 4, seed=7, dtype=torch.float32)
    for method in ("adam", "annealed"):
        r = SparsityConstrainedExpertChoice(8, 4, ot_method=method).route(logits)
        assert torch.isfinite(r.combine).all() and (r.tokens_per_expert() <= 8).all()
        assert torch.isfinite(r.stats["plan_row_error"])
    r = SoftMoE(8, 4).route(None, 1e4 * torch.randn(2, 16, 8))
    assert torch.isfinite(r.slot_dispatch).all() and torch.isfinite(r.slot_combine).all()


def test_infeasible_capacity_needs_ceil():
    router = SparsityConstrainedExpertChoice(8, 32)
    with pytest.raises(ValueError, match=r"capacity_factor=1.0 gives capacity=6 .*capacity_rounding='ceil'"):
        router.route(torch.randn(196, 32))
    r = SparsityConstrainedExpertChoice(8, 32, capacity_rounding="ceil").route(torch.randn(196, 32))
    assert r.capacity == 7


# ---------------------------------------------------------------- Soft MoE

def soft_moe_by_hand(layer, x):
    """Eqs. (10)-(11) and (2) with loops over groups, experts and slots (normalisation as documented)."""
    router = layer.router
    G, T, _ = x.shape
    E, S = router.n_experts, router.slots_per_expert
    out = torch.zeros_like(x)
    for g in range(G):
        xs = x[g]
        Z = torch.zeros(T, E, S, dtype=x.dtype)
        for r in range(E):
            for s in range(S):
                phi = router.slot_embed[:, r, s].to(x.dtype)
                if router.normalize:
                    Z[:, r, s] = router.scale * (xs / xs.norm(dim=-1, keepdim=True)) @ (phi / phi.norm())
                else:
                    Z[:, r, s] = xs @ phi
        D = Z.exp() / Z.exp().sum(0, keepdim=True)  # over tokens
        Cmb = Z.exp() / Z.exp().sum((1, 2), keepdim=True)  # over all slots
        for r in range(E):
            for s in range(S):
                y = layer.experts.forward_one(r, (D[:, r, s, None] * xs).sum(0, keepdim=True))[0]
                out[g] += Cmb[:, r, s, None] * y
    return out


@pytest.mark.parametrize("options", [{}, {"slots_per_expert": 3}, {"slots_per_expert": 2, "normalize": False}])
def test_soft_moe_layer_equals_equations_10_and_11(options):
    torch.manual_seed(0)
    layer = MoELayer(6, 10, 4, "soft_moe", router_options=options).double()
    with torch.no_grad():
        layer.experts.b_out.normal_()
        if layer.router.normalize:
            layer.router.scale.fill_(2.5)
    x = torch.randn(3, 7, 6, dtype=torch.float64)
    out = layer(x, group_size=7)
    torch.testing.assert_close(out, soft_moe_by_hand(layer, x), rtol=1e-10, atol=1e-12)
    for path in ("einsum", "loop"):  # every path runs the dense tensors
        torch.testing.assert_close(layer.apply_routing(x, layer.last_routing, path), out, rtol=0, atol=0)


def test_soft_moe_routing_tensors_are_on_the_simplex():
    router = SoftMoE(6, 4, slots_per_expert=2).double()
    r = router(torch.randn(5, 9, 6, dtype=torch.float64))
    assert r.slot_dispatch.shape == r.slot_combine.shape == (5, 9, 4, 2) and r.is_soft and r.num_slots == 2
    torch.testing.assert_close(r.slot_dispatch.sum(1), torch.ones(5, 4, 2, dtype=torch.float64))
    torch.testing.assert_close(r.slot_combine.sum((-2, -1)), torch.ones(5, 9, dtype=torch.float64))
    assert (r.slot_dispatch > 0).all() and (r.slot_combine > 0).all()
    torch.testing.assert_close(r.probs, r.slot_combine.sum(-1))
    assert r.dispatch_tensor() is r.slot_dispatch and r.combine_tensor() is r.slot_combine
    stats = r.stats
    assert float(stats["drop_rate"]) == 0 and float(stats["mean_experts_per_token"]) == 4
    assert 0 < float(stats["dispatch_entropy"]) <= math.log(9) + 1e-9
    assert float(r.aux_loss) == 0


def test_soft_moe_groups_are_independent_and_tokens_equivariant():
    torch.manual_seed(1)
    layer = MoELayer(6, 10, 4, "soft_moe", router_options={"slots_per_expert": 2}).double()
    x = torch.randn(3, 8, 6, dtype=torch.float64)
    out = layer(x, group_size=8)
    other = x.clone()
    other[1:] = torch.randn(2, 8, 6, dtype=torch.float64)
    torch.testing.assert_close(layer(other, group_size=8)[0], out[0], rtol=0, atol=1e-14)
    torch.testing.assert_close(layer(x[:1], group_size=8)[0], out[0], rtol=0, atol=1e-14)
    perm = torch.randperm(8)
    torch.testing.assert_close(layer(x[:, perm], group_size=8), out[:, perm], rtol=1e-12, atol=1e-13)


def test_soft_moe_gradcheck_and_learnable_scale():
    torch.manual_seed(2)
    layer = MoELayer(4, 6, 3, "soft_moe", router_options={"slots_per_expert": 2}).double()
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: layer(x, group_size=5), (x,))
    params = {name: p.detach() for name, p in layer.named_parameters()}

    def through_slot_parameters(scale, slot_embed):
        return functional_call(layer, {**params, "router.scale": scale, "router.slot_embed": slot_embed},
                               (x.detach(),), {"group_size": 5})

    scale = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)
    slot_embed = params["router.slot_embed"].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(through_slot_parameters, (scale, slot_embed))
    layer.zero_grad()
    layer(x.detach(), group_size=5).square().sum().backward()
    assert layer.router.scale.grad is not None and layer.router.scale.grad.abs() > 0
    assert layer.router.slot_embed.grad.abs().sum() > 0


def test_soft_moe_scale_limits():
    """Scale 0: every slot reads the mean token (Proposition 4.7(d)); large scale: one-hot dispatch.
    Seeded: at scale 1e4 a slot whose two best tokens are within about 5e-4 in cosine would not be
    one-hot, which unseeded draws hit now and then."""
    torch.manual_seed(0)
    router = SoftMoE(6, 4, slots_per_expert=2).double()
    x = torch.randn(2, 9, 6, dtype=torch.float64)
    with torch.no_grad():
        router.scale.zero_()
    r = router(x)
    slot_inputs = torch.einsum("gtes,gtd->gesd", r.slot_dispatch, x)
    torch.testing.assert_close(slot_inputs, x.mean(1)[:, None, None, :].expand_as(slot_inputs))
    with torch.no_grad():
        router.scale.fill_(1e4)
    r = router(x)
    assert torch.isfinite(r.slot_dispatch).all() and (r.slot_dispatch.amax(1) > 0.99).all()


def test_soft_moe_needs_the_tokens():
    router = build("soft_moe", 8, 4)
    assert router.gate is None
    with pytest.raises(TypeError, match="soft_moe computes its logits from the tokens"):
        router.route(torch.randn(2, 16, 4))
    r = router.route(None, torch.randn(2, 16, 8))
    assert r.slot_dispatch.shape == (2, 16, 4, 1)


# ---------------------------------------------------------------- softmax EC = Sinkhorn EC stopped early

@pytest.mark.parametrize("method", ["log", "sinkhorn", "auto"])
def test_softmax_is_sinkhorn_after_one_row_normalisation(method):
    """Proposition 4.1(a): one Sinkhorn iteration starts with a row update from g = 0, whose row
    potential is -LSE(S): exp(S + f) is the softmax. The iteration then updates the columns, which
    rescales each column by one factor and leaves every column ranking as the softmax's."""
    S = skewed_logits(4, 32, 8, seed=5) * 2
    res = sinkhorn(S, 1.0, max_iter=1, tol=0, method=method, return_potentials=True)
    torch.testing.assert_close(res.f, -torch.logsumexp(S, -1), atol=1e-12, rtol=0)
    torch.testing.assert_close((S + res.f[..., None]).exp(), torch.softmax(S, -1), atol=1e-14, rtol=0)
    assert torch.equal(res.plan.argsort(-2), torch.softmax(S, -1).argsort(-2))


def test_softmax_expert_choice_is_sinkhorn_expert_choice_with_one_iteration():
    S = skewed_logits(6, 48, 8, seed=6)
    softmax_ec = ExpertChoice(8, 8).eval().route(S)
    one_step = SinkhornExpertChoice(8, 8, sinkhorn_iters=1, last_update="columns",
                                    balance_tol=None).eval().route(S)
    assert torch.equal(one_step.position, softmax_ec.position)
    assert torch.equal(one_step.combine, softmax_ec.combine)
    converged = SinkhornExpertChoice(8, 8, sinkhorn_iters=20).eval().route(S)
    assert not torch.equal(converged.position, softmax_ec.position), "under skew the column updates matter"


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("make, match", [
    (lambda: build("sparsity_constrained_ec", 8, 4, gamma=0.0), "gamma must be a finite number > 0"),
    (lambda: build("sparsity_constrained_ec", 8, 4, capacity_factor=0.0), "capacity_factor"),
    (lambda: build("sparsity_constrained_ec", 8, 4, ot_method="sinkhorn"), "ot_method must be one of"),
    (lambda: build("sparsity_constrained_ec", 8, 4, ot_iters=-1), "ot_iters must be >= 0"),
    (lambda: build("sparsity_constrained_ec", 8, 4, noise="shazeer"), "noise must be one of None, 'vmoe'"),
    (lambda: build("sparsity_constrained_ec", 8, 4, capacity_factor=0.5).route(torch.randn(16, 4)),
     "capacity_factor=0.5 gives capacity=2"),
    (lambda: build("soft_moe", 8, 4, slots_per_expert=0), "slots_per_expert must be >= 1"),
    (lambda: build("soft_moe", 8, 4, scale_init=0.0), "scale_init must be a finite number > 0"),
    (lambda: build("soft_moe", 8, 4)(torch.randn(2, 16, 6)), "d_model=8 in the last dimension"),
    (lambda: build("soft_moe", 8, 4)(torch.full((16, 8), float("nan"))), "contains NaN"),
])
def test_bad_arguments_raise_value_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()
    with pytest.raises(TypeError, match="slots_per_expert must be an int"):
        build("soft_moe", 8, 4, slots_per_expert=1.5)


def test_vmoe_importance_loss_is_computed_from_the_clean_softmax():
    """Ported from V-MoE's routing test: x = arange(20).reshape(1, 5, 4), gate W = I, E = 4, k = 2. The
    importance loss is CV^2 of the *clean* softmax's column sums, 0.917444 whatever the noise draw
    (every row of x is an arithmetic progression, so every token's softmax is softmax([0, 1, 2, 3]))."""
    x = torch.arange(20, dtype=torch.float32).reshape(1, 5, 4)
    loads = set()
    for seed in range(5):
        router = build("softmax_topk", 4, 4, k=2, noise="vmoe", balance_loss="vmoe", capacity_factor=None,
                       generator=torch.Generator().manual_seed(seed)).train()
        with torch.no_grad():
            router.gate.weight.copy_(torch.eye(4))
        routing = router(x)
        assert float(routing.stats["importance_loss"]) == pytest.approx(0.917444, abs=1e-6)
        loads.add(round(float(routing.stats["load_loss"]), 6))
        expected = 0.005 * (routing.stats["importance_loss"] + routing.stats["load_loss"])
        assert torch.allclose(routing.aux_loss.detach(), expected)
    assert len(loads) > 1, "the load term is a probability over the noise: it changes with the draw"
