"""The kool_skip and kool_gumbel_matching routers in a MoE layer, and minimoe.losses.reinforce_loss.

Oracles: the einsum and loop paths of the layer (eq. 2) against the index path; the estimators of
minimoe.ops drawn with the same generator seed; hand-written gradients of the surrogate (K1) (gate:
1/n sum_t w_t (f_t - b) (onehot - p) x_t; experts: 1/n sum_t w_t grad f_t through a per-token
recomputation of the expert); the exact expected gradient of a separable loss by enumerating each
token's experts, against the Monte Carlo mean of the layer's gradient over 20000 independent
groups (4.5 standard errors).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from minimoe import MoELayer
from minimoe.losses import reinforce_loss
from minimoe.models import TinyLM
from minimoe.ops import sample_estimator
from minimoe.routers import KoolGumbelMatching, KoolSkip, available, build

ROUTERS = [("kool_skip", {"tau": 1.5, "capacity_factor": 1.0}),
           ("kool_skip", {"tau": 0.7, "capacity_factor": 1.25, "estimator": "skip", "sinkhorn_proposal": True}),
           ("kool_gumbel_matching", {"tau": 2.0}),
           ("kool_gumbel_matching", {"tau": 0.5, "capacity_factor": 1.5, "estimator": "gm_sh"})]


def test_registered():
    assert {"kool_skip", "kool_gumbel_matching"} <= set(available())
    assert isinstance(build("kool_skip", 4, 3), KoolSkip)
    assert isinstance(build("kool_gumbel_matching", 4, 3), KoolGumbelMatching)


@pytest.mark.parametrize("name,options", ROUTERS)
def test_paths_agree_and_capacity_is_respected(name, options):
    torch.manual_seed(0)
    layer = MoELayer(6, 10, 4, name, router_options=options, group_size=12).double()
    x = torch.randn(5, 12, 6, dtype=torch.float64)
    for mode in ("train", "eval"):
        getattr(layer, mode)()
        layer(x)
        routing = layer.last_routing
        index = layer.apply_routing(x, routing, path="index")
        assert torch.allclose(layer.apply_routing(x, routing, path="einsum"), index, atol=1e-12)
        assert torch.allclose(layer.apply_routing(x, routing, path="loop"), index, atol=1e-12)
        assert torch.allclose(layer.apply_routing(x, routing, path="grouped"), index, atol=1e-12)
        assert torch.allclose(layer.apply_routing(x, routing, path="slots"), index, atol=1e-12)
        mask = routing.mask
        assert (mask.sum(-1) <= 1).all() and torch.equal(routing.combine, mask.double())
        if mode == "train":
            C = routing.capacity
            assert (mask.sum(-2) <= C).all()
            if name == "kool_gumbel_matching":
                assert (mask.sum(-1) == 1).all(), "Gumbel-Matching places every token"
            w = routing.reinforce_weight
            assert w.shape == routing.log_prob.shape == (5, 12) and not w.requires_grad
            assert ((w == 0) == ~mask.any(-1)).all(), "skipped tokens (and only they) get weight 0"
        else:
            assert routing.capacity is None and routing.reinforce_weight is None
            assert torch.equal(mask, F.one_hot(layer.router.gate(x).argmax(-1), 4).bool())


@pytest.mark.parametrize("name,options", ROUTERS)
def test_routing_is_the_estimator_draw(name, options):
    """log_prob is log softmax at the drawn expert; the weights are those of minimoe.ops.sample_estimator
    drawn with the same generator seed."""
    router = build(name, 6, 4, generator=torch.Generator().manual_seed(3), **options).double()
    logits = torch.randn(2, 12, 4, dtype=torch.float64, requires_grad=True)
    routing = router.route(logits)
    capacity = router.capacity(12)
    estimator = options.get("estimator", "skip_iw" if name == "kool_skip" else "gm_iw")
    drawn = sample_estimator(logits.detach(), estimator, capacity, tau=options["tau"],
                             sinkhorn_proposal=options.get("sinkhorn_proposal", False),
                             generator=torch.Generator().manual_seed(3))
    assert torch.equal(routing.reinforce_weight, drawn.coef)
    assert torch.equal(routing.mask, F.one_hot(drawn.assignment, 4).bool() & drawn.keep[..., None])
    want = torch.log_softmax(logits, -1).gather(-1, drawn.assignment[..., None])[..., 0]
    assert torch.allclose(routing.log_prob, want) and routing.log_prob.requires_grad


def hand_gradients(layer, x, target, baseline):
    """The surrogate (K1) written out for the layer's last routing: (gate, b_out) gradients."""
    routing = layer.last_routing
    G, T, d = x.shape
    n = G * T
    w = routing.reinforce_weight
    z = routing.mask.double().argmax(-1)
    with torch.no_grad():
        p = torch.softmax(layer.router.gate(x), -1)
        y = torch.zeros_like(x)
        for e in range(layer.n_experts):
            out_e = layer.experts.forward_one(e, x.reshape(-1, d)).view_as(x)
            y = torch.where(routing.mask[..., e, None], out_e, y)
        f = ((y - target) ** 2).sum(-1)
        score = F.one_hot(z, layer.n_experts).double() - p
        gate = torch.einsum("gt,gte,gtd->ed", w * (f - baseline), score, x) / n
        b_out = torch.einsum("gt,gte,gtd->ed", w, routing.mask.double(), 2 * (y - target)) / n
    return gate, b_out, f


@pytest.mark.parametrize("name", ["kool_skip", "kool_gumbel_matching"])
def test_layer_gradient_is_the_surrogate(name):
    """task loss + reinforce_loss: the gate gets 1/n sum w (f - b) grad log p, the experts
    1/n sum w grad f (the layer's gradient-only scaling); 1e-12."""
    torch.manual_seed(1)
    layer = MoELayer(5, 7, 3, name, router_options={"tau": 1.3}, group_size=6).double()
    x = torch.randn(4, 6, 5, dtype=torch.float64)
    target = torch.randn(4, 6, 5, dtype=torch.float64)
    y = layer(x)
    per_token = ((y - target) ** 2).sum(-1)
    (per_token.mean() + reinforce_loss(layer, per_token, baseline=0.4)).backward()
    gate, b_out, f = hand_gradients(layer, x, target, 0.4)
    assert torch.allclose(per_token, f, atol=1e-12), "the forward value is the hard routed output"
    assert torch.allclose(layer.router.gate.weight.grad, gate, atol=1e-12)
    assert torch.allclose(layer.experts.b_out.grad, b_out, atol=1e-12)


@pytest.mark.parametrize("name", ["kool_skip", "kool_gumbel_matching"])
def test_layer_gradient_is_unbiased(name):
    """The layer's gate and expert-bias gradients, averaged over 20000 independent groups of the same
    6 tokens (one batched forward), are within 4.5 standard errors of the exact gradient of
    E_p[1/T sum_t ||expert_z(x_t) - y_t||^2], obtained by enumerating each token's experts (the loss
    is separable). The per-group standard errors come from the hand formula checked above."""
    torch.manual_seed(2)
    T, E, d, groups = 6, 3, 3, 20000
    layer = MoELayer(d, 4, E, name, router_options={"tau": 1.0, "generator": torch.Generator().manual_seed(0)},
                     group_size=T).double()
    x1 = torch.randn(1, T, d, dtype=torch.float64)
    y1 = torch.randn(1, T, d, dtype=torch.float64)
    x, target = x1.expand(groups, T, d).contiguous(), y1.expand(groups, T, d)
    y = layer(x)
    per_token = ((y - target) ** 2).sum(-1)
    (per_token.mean() + reinforce_loss(layer, per_token)).backward()
    got = torch.cat([layer.router.gate.weight.grad.flatten(), layer.experts.b_out.grad.flatten()])
    # per-group estimates (hand formula with n = T) for the standard errors
    routing = layer.last_routing
    w, mask = routing.reinforce_weight, routing.mask.double()
    with torch.no_grad():
        p = torch.softmax(layer.router.gate(x1), -1)[0]
        outs = torch.stack([layer.experts.forward_one(e, x1[0]) for e in range(E)], 1)  # (T, E, d)
        f_table = ((outs - y1[0][:, None]) ** 2).sum(-1)  # (T, E)
        f = (mask * f_table).sum(-1)
        z = mask.argmax(-1)
        gate = torch.einsum("gt,gte,td->ged", w * f, F.one_hot(z, E).double() - p, x1[0]) / T
        b_out = torch.einsum("gt,gte,ted->ged", w, mask, 2 * (outs - y1[0][:, None])) / T
        per_group = torch.cat([gate.flatten(1), b_out.flatten(1)], 1)
        assert torch.allclose(per_group.mean(0), got, atol=1e-10)
        exact_gate = torch.einsum("te,td->ed", p * (f_table - (p * f_table).sum(-1, keepdim=True)), x1[0]) / T
        exact_b_out = torch.einsum("te,ted->ed", p, 2 * (outs - y1[0][:, None])) / T
        exact = torch.cat([exact_gate.flatten(), exact_b_out.flatten()])
    se = per_group.std(0) / math.sqrt(groups)
    assert (se > 0).all()
    assert float(((got - exact) / se).abs().max()) < 4.5


def test_reinforce_loss_shapes_and_models():
    """Per-position losses (B, L) of a TinyLM; per-example losses (B,) broadcast to the example's tokens;
    nothing in eval mode; a wrong length is a ValueError."""
    torch.manual_seed(3)
    model = TinyLM(11, d_model=16, n_layers=2, n_heads=2, block_size=8, n_experts=4, d_hidden=16,
                   router="kool_gumbel_matching", router_options={"tau": 2.0})
    idx = torch.randint(0, 11, (3, 8))
    logits = model(idx)
    per_position = F.cross_entropy(logits.transpose(1, 2), idx, reduction="none")  # (3, 8)
    term = reinforce_loss(model, per_position, baseline="mean")
    (per_position.mean() + term).backward(retain_graph=True)
    for layer in model.moe_layers():
        assert layer.router.gate.weight.grad.abs().sum() > 0
    assert float(term.detach()) == 0.0, "the value is 0: adding it leaves the reported loss unchanged"
    gates = [layer.router.gate.weight for layer in model.moe_layers()]
    per_example = per_position.mean(1).detach()
    shared = torch.autograd.grad(reinforce_loss(model, per_example), gates, retain_graph=True)
    repeated = torch.autograd.grad(reinforce_loss(model, per_example.repeat_interleave(8)), gates, retain_graph=True)
    by_hand = torch.autograd.grad(sum((layer.last_routing.reinforce_weight * per_example[:, None]
                                       * layer.last_routing.log_prob).mean() for layer in model.moe_layers()),
                                  gates, retain_graph=True)
    for a, b, c in zip(shared, repeated, by_hand):
        assert torch.allclose(a, b) and torch.allclose(a, c) and a.abs().sum() > 0
    with pytest.raises(ValueError, match="one loss per token or one per example"):
        reinforce_loss(model, torch.zeros(5))
    with pytest.raises(ValueError, match="baseline must be"):
        reinforce_loss(model, per_example, baseline="median")
    model.eval()
    with torch.no_grad():
        model(idx)
    term = reinforce_loss(model, per_position)
    assert float(term) == 0.0 and not term.requires_grad


def test_bad_options():
    with pytest.raises(ValueError, match="estimator must be one of"):
        KoolSkip(4, 3, estimator="gm_iw")
    with pytest.raises(ValueError, match="estimator must be one of"):
        KoolGumbelMatching(4, 3, estimator="skip_iw")
    with pytest.raises(ValueError, match="capacity_factor must be >= 1"):
        KoolGumbelMatching(4, 3, capacity_factor=0.5)
    with pytest.raises(ValueError, match="tau must be"):
        KoolSkip(4, 3, tau=0.0)
    with pytest.raises(ValueError, match="method must be one of"):
        KoolGumbelMatching(4, 3, method="auction")
    # capacity: ceil(T / E) at least for Gumbel-Matching; None means no skipping
    assert KoolGumbelMatching(4, 3).capacity(10) == 4
    assert KoolSkip(4, 3, capacity_factor=None).capacity(10) is None


def test_trains_with_the_shared_loop():
    """minimoe.train.train needs no change: loss_fn closes over the model and adds reinforce_loss; the
    logged loss stays the task loss (the term's value is 0) and the gates learn."""
    from minimoe.train import train

    torch.manual_seed(4)
    model = TinyLM(11, d_model=16, n_layers=1, n_heads=2, block_size=8, n_experts=4, d_hidden=16,
                   router="kool_skip", router_options={"tau": 1.0})
    data = torch.randint(0, 11, (4, 9))
    gate = model.moe_layers()[0].router.gate.weight.detach().clone()
    seen = []

    def loss_fn(logits, targets):
        per_position = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        seen.append(float(per_position.mean().detach()))
        return per_position.mean() + reinforce_loss(model, per_position, baseline=2.4)

    history = train(model, lambda step: (data[:, :-1], data[:, 1:]), loss_fn, steps=3, progress=False, device="cpu")
    assert [row["loss"] for row in history["train"]] == pytest.approx(seen, abs=1e-6)
    assert not torch.equal(model.moe_layers()[0].router.gate.weight.detach(), gate)
