"""The MoE layer: the index path equals eq. (2) (einsum) and the loop, outputs and gradients."""
import pytest
import torch

import minimoe
from minimoe import MoELayer
from reference import moe_per_token

ROUTER_CASES = [
    ("softmax_topk", {"k": 1}),
    ("softmax_topk", {"k": 2, "capacity_factor": 0.5, "min_capacity": 1}),
    ("softmax_topk", {"k": 2, "batch_priority": True, "renormalize": True}),
    ("softmax_topk", {"k": 3, "capacity_factor": None}),
    ("softmax_topk", {"k": 2, "noise": "vmoe", "balance_loss": "vmoe"}),
    ("softmax_topk", {"k": 2, "noise": "shazeer", "balance_loss": "switch", "z_loss_weight": 1e-3}),
    ("expert_choice", {"capacity_factor": 1.0}),
    ("expert_choice", {"capacity_factor": 2.0, "noise": "vmoe"}),
]


def grads(layer, x, path, seed):
    layer.zero_grad()
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)  # same noise draw for every path
    routing = layer.router(x)
    out = layer.apply_routing(x, routing, path)
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum() + routing.aux_loss
    loss.backward()
    return out.detach(), {"x": x.grad, **{n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}}


@pytest.mark.parametrize("name, options", ROUTER_CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_index_and_loop_equal_einsum_outputs_and_gradients(name, options, seed):
    torch.manual_seed(seed)
    G, T, d = 3, 24, 8
    layer = MoELayer(d, 16, 6, name, router_options=options).double().train()
    with torch.no_grad():  # nonzero biases: empty slots compute MLP(0) != 0 and must not leak
        layer.experts.b_in.normal_()
        layer.experts.b_out.normal_()
    x = torch.randn(G, T, d, dtype=torch.float64)
    out_e, g_e = grads(layer, x, "einsum", seed)
    for path in ("index", "slots", "grouped", "loop"):
        out_p, g_p = grads(layer, x, path, seed)
        torch.testing.assert_close(out_p, out_e, rtol=1e-10, atol=1e-12)
        assert g_p.keys() == g_e.keys() and "router.gate.weight" in g_e
        for key in g_e:
            torch.testing.assert_close(g_p[key], g_e[key], rtol=1e-9, atol=1e-11, msg=f"{path} grad {key}")


def test_dropped_tokens_output_exactly_zero():
    torch.manual_seed(0)
    layer = MoELayer(8, 16, 4, "softmax_topk", router_options={"k": 1, "capacity_factor": 0.25}).double()
    with torch.no_grad():
        layer.experts.b_out.fill_(3.0)  # an empty slot would output 3s
    x = torch.randn(1, 64, 8, dtype=torch.float64)
    out = layer(x)
    dropped = ~layer.last_routing.mask.any(-1)
    assert dropped.sum() >= 32  # capacity 4 x 4 experts = 16 slots for 64 tokens
    assert (out[dropped] == 0).all() and (out[~dropped] != 0).any(-1).all()


def test_no_drops_equals_equation_1_per_token():
    torch.manual_seed(1)
    T, d, E, k = 20, 6, 5, 2
    layer = MoELayer(d, 12, E, "softmax_topk", router_options={"k": k, "capacity_factor": 100.0}).double()
    x = torch.randn(T, d, dtype=torch.float64)
    out = layer(x)
    probs = torch.softmax(layer.router.gate(x), -1)
    gates = torch.zeros_like(probs).scatter(-1, probs.topk(k, -1).indices, probs.topk(k, -1).values)
    torch.testing.assert_close(out, moe_per_token(layer, x, gates), rtol=1e-10, atol=1e-12)
    assert layer.last_routing.capacity == T


def test_expert_choice_full_capacity_is_the_dense_mixture():
    torch.manual_seed(2)
    T, d, E = 12, 6, 4
    layer = MoELayer(d, 12, E, "expert_choice", router_options={"capacity_factor": E}).double()
    x = torch.randn(T, d, dtype=torch.float64)
    out = layer(x)
    probs = torch.softmax(layer.router.gate(x), -1)
    torch.testing.assert_close(out, moe_per_token(layer, x, probs), rtol=1e-10, atol=1e-12)


def test_unified_tensors_structure():
    torch.manual_seed(3)
    layer = MoELayer(8, 16, 4, "softmax_topk", router_options={"k": 2}, group_size=16)
    x = torch.randn(2, 16, 8)
    layer(x)
    r = layer.last_routing
    D, Cmb = r.dispatch_tensor(), r.combine_tensor()
    assert D.shape == Cmb.shape == (2, 16, 4, r.capacity)
    assert set(D.unique().tolist()) <= {0.0, 1.0}
    assert (D.sum(1) <= 1).all()  # a slot holds at most one token
    assert (D.sum(-1) <= 1).all()  # a (token, expert) pair uses at most one slot
    assert (D.sum((1, 3)) <= r.capacity).all()
    assert torch.equal(Cmb, D * r.probs.unsqueeze(-1))  # combine = dispatch * softmax, exactly
    assert (Cmb.sum((-2, -1)) <= 1 + 1e-6).all()


def test_group_size_routes_groups_independently():
    torch.manual_seed(4)
    layer = MoELayer(8, 16, 4, "expert_choice", group_size=10)
    x = torch.randn(3, 10, 8)
    full = layer(x)
    for g in range(3):
        torch.testing.assert_close(layer(x[g]), full[g])


def test_same_seed_same_routing_with_noise():
    layer = MoELayer(8, 16, 4, "softmax_topk", router_options={"k": 2, "noise": "vmoe"}).train()
    x = torch.randn(32, 8)
    torch.manual_seed(7)
    a = layer(x), layer.last_routing.position
    torch.manual_seed(7)
    b = layer(x), layer.last_routing.position
    torch.manual_seed(8)
    c = layer(x), layer.last_routing.position
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_noise_only_in_training():
    layer = MoELayer(8, 16, 4, "softmax_topk", router_options={"k": 2, "noise": "vmoe", "noise_std": 1.0})
    x = torch.randn(64, 8)
    layer.eval()
    torch.manual_seed(0)
    p0 = layer.router(x).probs
    torch.manual_seed(1)
    assert torch.equal(p0, layer.router(x).probs)
    layer.train()
    assert not torch.equal(p0, layer.router(x).probs)


def test_router_registry():
    assert {"softmax_topk", "expert_choice"} <= set(minimoe.routers.available())
    r = minimoe.routers.build("softmax_topk", 8, 4, k=2)
    assert isinstance(r, minimoe.routers.SoftmaxTopK) and r.k == 2
    layer = MoELayer(8, 16, 4, r)
    assert layer.router is r


@pytest.mark.parametrize(
    "name, options, causal",
    [
        ("softmax_topk", {"k": 1}, True),  # token order, capacity: slots decided before later tokens
        ("softmax_topk", {"k": 2, "capacity_factor": None}, True),  # dropless: no interaction at all
        ("softmax_topk", {"k": 2, "capacity_factor": 0.5, "min_capacity": 1}, False),  # 1st before 2nd choices
        ("softmax_topk", {"k": 1, "batch_priority": True}, False),  # priority by confidence
        ("expert_choice", {}, False),  # experts rank the whole group
    ],
)
def test_causality_of_each_allocation(name, options, causal):
    """Proposition 1.9: changing the last token of a group never changes an earlier token's
    output for the causal allocations, and does for some draws otherwise (100 random groups)."""
    torch.manual_seed(0)
    layer = MoELayer(8, 16, 4, name, router_options=options).double().eval()
    changed = 0
    with torch.no_grad():
        for _ in range(100):
            x = torch.randn(32, 8, dtype=torch.float64)
            x2 = x.clone()
            x2[-1] = torch.randn(8, dtype=torch.float64) * 3
            # A routing leak moves outputs by O(1); a tolerance ignores rounding from the dropless
            # buffer changing shape (its size is the largest load, which the last token can change).
            changed += bool((layer(x) - layer(x2))[:-1].abs().max() > 1e-9)
    assert (changed == 0) if causal else (changed > 0)


# --------------------------------------------------------------------------- the grouped (dropless) path
def _dropless_skewed(seed, G=2, T=32, d=8, E=6, k=2, dtype=torch.float64):
    """A dropless top-k layer whose gate sends most tokens to expert 0: loads far from balanced."""
    torch.manual_seed(seed)
    layer = MoELayer(d, 16, E, "softmax_topk", router_options={"k": k, "capacity_factor": None}).to(dtype).train()
    with torch.no_grad():
        layer.experts.b_in.normal_()
        layer.experts.b_out.normal_()
    x = torch.randn(G, T, d, dtype=dtype)
    x[..., 0] += 3.0
    with torch.no_grad():
        layer.router.gate.weight[0, 0] = 4.0  # expert 0 takes nearly every token
    return layer, x


@pytest.mark.parametrize("seed", [0, 1])
def test_grouped_path_equals_einsum_on_an_imbalanced_dropless_routing(seed):
    layer, x = _dropless_skewed(seed)
    out_e, g_e = grads(layer, x, "einsum", seed)
    loads = layer.router(x).tokens_per_expert()
    assert int(loads.max()) >= 2.5 * float(loads.float().mean()), "the routing must be imbalanced"
    out_g, g_g = grads(layer, x, "grouped", seed)
    torch.testing.assert_close(out_g, out_e, rtol=1e-10, atol=1e-12)
    assert g_g.keys() == g_e.keys()
    for key in g_e:
        torch.testing.assert_close(g_g[key], g_e[key], rtol=1e-9, atol=1e-11, msg=key)


def _rows_through_experts(layer, x, path, monkeypatch):
    """Rows each path multiplies: the index path's (E, rows, d) buffer, the grouped path's segments."""
    seen = []
    mlp, batched = layer.experts._mlp, type(layer.experts).forward

    def count_mlp(x_rows, *params):
        seen.append(x_rows.shape[0])
        return mlp(x_rows, *params)

    def count_batched(self, xin):
        seen.append(xin.shape[0] * xin.shape[1])
        return batched(self, xin)

    monkeypatch.setattr(layer.experts, "_mlp", count_mlp)
    monkeypatch.setattr(type(layer.experts), "forward", count_batched)
    with torch.no_grad():
        routing = layer.router(x)
        layer.apply_routing(x, routing, path)
    monkeypatch.undo()
    return sum(seen), routing


def test_grouped_path_multiplies_only_the_routed_pairs(monkeypatch):
    """No padding: the grouped path sends exactly the P = k*T routed pairs through the experts, while
    the slot path pads every expert's buffer to the busiest expert's load (E * max load rows)."""
    layer, x = _dropless_skewed(0, k=2)
    rows, routing = _rows_through_experts(layer, x, "grouped", monkeypatch)
    assert rows == int(routing.mask.sum()) == 2 * x.shape[0] * x.shape[1]
    padded, _ = _rows_through_experts(layer, x, "slots", monkeypatch)
    default, _ = _rows_through_experts(layer, x, "index", monkeypatch)
    assert default == rows  # the default path is the grouped one when there is no capacity
    assert padded == layer.n_experts * x.shape[0] * routing.num_slots > 2 * rows


def test_grouped_path_with_nothing_routed_and_with_empty_experts():
    torch.manual_seed(5)
    layer = MoELayer(8, 16, 4, "softmax_topk", router_options={"k": 1, "capacity_factor": 0.25}).double()
    with torch.no_grad():
        layer.experts.b_out.fill_(3.0)
    x = torch.randn(1, 16, 8, dtype=torch.float64, requires_grad=True)
    # both forms of a routing: its (T, E) tables, and each token's choices (what softmax_topk gives)
    def keep_only(routing, keep_expert):
        """The routing with every (token, expert) pair outside keep_expert(expert) dropped."""
        if routing.has_choices:
            routing.choice_slot = torch.where(keep_expert(routing.choice_expert), routing.choice_slot, -1)
            routing.choice_weight = routing.choice_weight * (routing.choice_slot >= 0)
        else:
            experts = torch.arange(layer.n_experts)
            routing.position = torch.where(keep_expert(experts), routing.position, -1)
        return routing

    for tables in (False, True):
        routing = layer.router(x)
        assert routing.has_choices
        if tables:
            routing = routing.to_table()
            assert not routing.has_choices
        nothing = keep_only(routing, lambda e: e < 0)  # every token dropped
        out = layer.apply_routing(x, nothing, "grouped")
        assert out.shape == x.shape and (out == 0).all()
        out.sum().backward()  # no pair: still a graph to call backward on
        routing = layer.router(x)
        if tables:
            routing = routing.to_table()
        only_first = keep_only(routing, lambda e: e == 0)  # only expert 0 takes tokens (experts 1..3 empty)
        assert only_first.tokens_per_expert()[..., 1:].sum() == 0 < only_first.tokens_per_expert()[..., 0].sum()
        torch.testing.assert_close(layer.apply_routing(x, only_first, "grouped"),
                                   layer.apply_routing(x, only_first, "einsum"))


def test_the_default_path_picks_the_layout(monkeypatch):
    """path="index" runs the slot buffers for small balanced segments, the grouped path for large
    segments or heavy padding, and on an accelerator the layout that needs no host read."""
    from minimoe.layers import GROUPED_ROWS_PER_EXPERT
    from minimoe.ops import _checks

    def pick(T, E, options, skew=0.0):
        torch.manual_seed(0)
        layer = MoELayer(8, 16, E, "softmax_topk", router_options=options)
        x = torch.randn(1, T, 8)
        with torch.no_grad():
            routing = layer.router.route(layer.router.gate(x) + skew * torch.linspace(1, 0, E))
        return layer._fast_path(x, routing)

    assert pick(64, 8, {"k": 1}) == "slots"  # 8 rows per expert
    assert pick(2 * GROUPED_ROWS_PER_EXPERT * 4, 4, {"k": 1}) == "grouped"  # 512 rows per expert
    assert pick(1024, 8, {"k": 1, "capacity_factor": None}, skew=0.0) == "slots"  # dropless, little padding
    assert pick(1024, 8, {"k": 1, "capacity_factor": None}, skew=20.0) == "grouped"  # one expert takes all
    monkeypatch.setattr(_checks, "SIMULATE_ACCELERATOR", True)
    assert pick(64, 8, {"k": 1}) == "slots"
    assert pick(64, 8, {"k": 1, "capacity_factor": None}) == "grouped"


def test_a_statistic_given_as_a_function_is_computed_on_first_read():
    calls = []
    routing = minimoe.Routing(combine=torch.ones(1, 2, 2), position=torch.zeros(1, 2, 2, dtype=torch.long),
                              probs=torch.full((1, 2, 2), 0.5), extra_stats={"lazy": lambda: calls.append(1) or 7.0})
    assert calls == []
    assert routing.stats["lazy"] == 7.0 and routing.stats["lazy"] == 7.0
    assert calls == [1]


def test_grouped_path_per_segment_gives_the_bits_of_one_concatenated_matmul():
    """On a CPU the grouped path adds each expert's segment into the output as soon as it is computed
    (MoELayer._segments), to keep two (P, d) tensors out of memory. That is the same sums in the same
    order as the whole-list form (Experts.grouped, then one weighted index_add): equal to the last bit
    in the output, the input gradient and every expert gradient, on an imbalanced dropless routing."""
    torch.manual_seed(4)
    layer = MoELayer(16, 32, 5, "softmax_topk", router_options={"k": 2, "capacity_factor": None}, path="grouped")
    x = torch.randn(2, 60, 16)
    with torch.no_grad():
        routing = layer.router.route(layer.router.gate(x) + torch.linspace(2, 0, 5))  # unequal loads
    assert routing.tokens_per_expert().sum(0).max() > 2 * routing.tokens_per_expert().sum(0).min()
    results = []
    for form in ("segments", "whole list"):
        layer.zero_grad()
        xg = x.clone().requires_grad_(True)
        if form == "segments":
            out = layer.apply_routing(xg, routing)
        else:
            expert, token, weight, counts, _ = layer._sorted_choices(xg, routing, None)
            flat = xg.reshape(-1, 16)
            y = layer.experts.grouped(flat.index_select(0, token), expert, counts)
            out = flat.new_zeros(flat.shape).index_add(0, token, y * weight.unsqueeze(-1)).view_as(xg)
        out.pow(2).sum().backward()
        results.append([out.detach(), xg.grad] + [p.grad for p in layer.experts.parameters()])
    for got, want in zip(*results):
        assert torch.equal(got, want)


def _experts_by_autograd(experts, xin):
    """Experts.forward as autograd alone would differentiate it: the oracle of the test below."""
    act = minimoe.layers.ACTIVATIONS[experts.activation]
    if experts.b_in is None:
        return torch.bmm(act(torch.bmm(xin, experts.w_in)), experts.w_out)
    hidden = act(torch.baddbmm(experts.b_in.unsqueeze(1), xin, experts.w_in))
    return torch.baddbmm(experts.b_out.unsqueeze(1), hidden, experts.w_out)


@pytest.mark.parametrize("activation", ["gelu", "relu", "silu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_experts_backward_gives_autograds_bits(activation, bias, dtype, monkeypatch):
    """The batched experts' backward (layers._ExpertsOutput) writes the gradient of the pre-activation
    over that of the hidden units, one (E, N, h) tensor less at the peak of the layer's backward. It
    must give autograd's values to the last bit (output, input gradient, every parameter gradient),
    and the in-place write must really land in the hidden units' gradient."""
    torch.manual_seed(0)
    experts = minimoe.Experts(3, 16, 40, activation, bias).to(dtype)
    xin = torch.randn(3, 24, 16, dtype=dtype)
    grad_out = torch.randn(3, 24, 16, dtype=dtype)
    written = []
    backward = dict(minimoe.layers._ACTIVATION_BACKWARD)
    monkeypatch.setitem(minimoe.layers._ACTIVATION_BACKWARD, activation,
                        lambda grad, pre, out: written.append(out.data_ptr() == grad.data_ptr()) or
                        backward[activation](grad, pre, out))
    results = []
    for forward in (experts.forward, lambda x: _experts_by_autograd(experts, x)):
        experts.zero_grad(set_to_none=True)
        x = xin.clone().requires_grad_(True)
        out = forward(x)
        out.backward(grad_out)
        results.append([out.detach(), x.grad] + [p.grad for p in experts.parameters()])
    assert written == [True]
    for got, want in zip(*results):
        assert torch.equal(got, want)
    if dtype == torch.float64:  # create_graph takes the recomputed, differentiable branch
        small = minimoe.Experts(3, 5, 6, activation, bias).double()
        names = [n for n, _ in small.named_parameters()]
        params = tuple(p.detach().clone().requires_grad_() for p in small.parameters())

        def call(x, *ps):
            return torch.func.functional_call(small, dict(zip(names, ps)), (x,))
        x = torch.randn(3, 4, 5, dtype=dtype, requires_grad=True)
        assert torch.autograd.gradgradcheck(call, (x, *params))
