"""The usmoe router and training-free re-routing (chapter 6): budgets, groupings, causality, the layer."""
import pytest
import torch

from minimoe import MoELayer
from minimoe.models import TinyLM
from minimoe.ops import global_topc, unified_score
from minimoe import reroute
from minimoe.routers import USMoE, available, build


def test_registered():
    assert "usmoe" in available()
    assert isinstance(build("usmoe", 8, 4, k=1.5), USMoE)


@pytest.mark.parametrize("grouping", ["position", "sequence"])
@pytest.mark.parametrize("k, G, T, E", [(2, 4, 10, 8), (1.5, 4, 10, 8), (1.5, 3, 7, 4), (0.5, 6, 5, 4)])
def test_budgets_exact(grouping, k, G, T, E):
    router = USMoE(16, E, k=k, grouping=grouping)
    logits = torch.randn(G, T, E)
    mask = router.route(logits).mask
    if grouping == "sequence":
        assert (mask.sum((-2, -1)) == int(k * T)).all()  # e.g. k = 1.5, T = 10: 15 pairs per sequence
    else:
        assert (mask.sum((0, -1)) == int(k * G)).all()  # per position, across the G sequences


@pytest.mark.parametrize("grouping", ["position", "sequence"])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_one_token_per_group_is_token_choice(grouping, alpha):
    router = USMoE(16, 8, k=2, alpha=alpha, grouping=grouping).eval()  # eval: no single-group warning
    logits = torch.randn(5, 8)
    # sequence grouping: five one-token sequences; position grouping: one five-token sequence
    shaped = logits[:, None, :] if grouping == "sequence" else logits[None]
    mask = router.route(shaped).mask.reshape(5, 8)
    topk = torch.zeros(5, 8, dtype=torch.bool).scatter(-1, logits.topk(2, -1).indices, True)
    assert torch.equal(mask, topk)


def test_selection_is_global_topc_of_unified_score():
    router = USMoE(16, 8, k=1.5, alpha=0.3, grouping="sequence")
    logits = torch.randn(3, 12, 8)
    routing = router.route(logits)
    U = unified_score(logits, 0.3)
    assert torch.equal(routing.mask, global_topc(U, 18))
    assert torch.allclose(routing.combine, U * routing.mask)
    renorm = USMoE(16, 8, k=1.5, alpha=0.3, grouping="sequence", renormalize=True).route(logits)
    kept = renorm.mask.any(-1)
    assert torch.allclose(renorm.combine.sum(-1)[kept], torch.ones(int(kept.sum())))


def test_position_grouping_is_causal_and_sequence_grouping_is_not():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 16, 8, generator=gen)
    changed = logits.clone()
    changed[:, -1] = 5 * torch.randn(6, 8, generator=gen)  # a different last token in every sequence
    position = USMoE(16, 8, k=1.5, grouping="position")
    assert torch.equal(position.route(logits).mask[:, :-1], position.route(changed).mask[:, :-1])
    sequence = USMoE(16, 8, k=1.5, grouping="sequence")
    assert not torch.equal(sequence.route(logits).mask[:, :-1], sequence.route(changed).mask[:, :-1])


def test_position_grouping_in_a_causal_lm():
    """The causality probe of notebook 02 on an untrained TinyLM: with grouping='position' a change of
    the last character changes no routing decision of an earlier position, and moves earlier logits
    by float rounding at most; with grouping='sequence' it moves them. (The rounding: the changed
    token joins other experts' batches, and a matrix product over a different number of rows may
    round the other rows differently when split over threads: 6e-8 seen with 2 threads.)"""
    torch.manual_seed(1)
    x = torch.randint(0, 20, (8, 12))
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 7) % 20
    leaks, masks_moved = {}, {}
    for grouping in ("position", "sequence"):
        torch.manual_seed(2)
        model = TinyLM(vocab_size=20, d_model=32, n_layers=2, n_heads=2, n_experts=8, block_size=12,
                       router="usmoe", router_options={"k": 1.5, "grouping": grouping}).eval()
        with torch.no_grad():
            out = model(x)
            masks = [m.last_routing.mask.reshape(8, 12, -1)[:, :-1] for m in model.moe_layers()]
            out2 = model(x2)
            masks2 = [m.last_routing.mask.reshape(8, 12, -1)[:, :-1] for m in model.moe_layers()]
        leaks[grouping] = (out - out2)[:, :-1].abs().max().item()
        masks_moved[grouping] = any(not torch.equal(a, b) for a, b in zip(masks, masks2))
    assert not masks_moved["position"] and leaks["position"] < 1e-5
    assert masks_moved["sequence"] and leaks["sequence"] > 1e-4


def test_layer_output_and_drops():
    torch.manual_seed(3)
    layer = MoELayer(16, 32, 8, "usmoe", router_options={"k": 1.0, "grouping": "sequence"}, group_size=20)
    x = torch.randn(3, 20, 16)
    y = layer(x)
    routing = layer.last_routing
    manual = torch.zeros_like(x)
    for g in range(3):
        for t in range(20):
            for e in routing.mask[g, t].nonzero().flatten().tolist():
                manual[g, t] += routing.combine[g, t, e] * layer.experts.forward_one(e, x[g, t][None])[0]
    assert torch.allclose(y, manual, atol=1e-5, rtol=1e-4)
    dropped = ~routing.mask.any(-1)
    assert dropped.any(), "global selection leaves some tokens without an expert here"
    assert (y[dropped] == 0).all()
    assert routing.stats["drop_rate"] == pytest.approx(dropped.float().mean().item())
    y.sum().backward()
    assert layer.router.gate.weight.grad.abs().sum() > 0, "the gate learns through the unified-score weights"


def test_gate_path_gradcheck():
    router = USMoE(4, 5, k=1.5, alpha=0.4, grouping="sequence").double()
    logits = torch.randn(2, 6, 5, dtype=torch.float64)
    mask = router.route(logits).mask

    def combine(lg):
        out = router.route(lg)
        assert torch.equal(out.mask, mask)  # small steps keep the selection
        return out.combine
    assert torch.autograd.gradcheck(combine, (logits.requires_grad_(),), eps=1e-7)


def test_reroute_keeps_trained_weights():
    torch.manual_seed(4)
    model = TinyLM(vocab_size=20, d_model=32, n_layers=2, n_heads=2, n_experts=8, block_size=12,
                   router="softmax_topk", router_options={"k": 2, "capacity_factor": None}).eval()
    x = torch.randint(0, 20, (4, 12))
    before = model(x).detach()
    rerouted = reroute(model, "usmoe", k=2, alpha=0.5, grouping="position")
    assert all(isinstance(m.router, USMoE) for m in rerouted.moe_layers())
    assert all(isinstance(m.router, type(model.moe_layers()[0].router)) for m in model.moe_layers()), "original kept"
    for old, new in zip(model.moe_layers(), rerouted.moe_layers()):
        assert torch.equal(old.router.gate.weight, new.router.gate.weight)
        assert torch.equal(old.experts.w_in, new.experts.w_in) and torch.equal(old.experts.w_out, new.experts.w_out)
    assert torch.equal(model(x), before)
    same = reroute(model, "softmax_topk", k=2, capacity_factor=None)
    assert torch.allclose(same(x), before), "re-routing to the same router changes nothing"
    assert not torch.allclose(rerouted(x), before), "usmoe routes differently"
    assert not rerouted.training
    with pytest.raises(ValueError, match="no MoELayer"):
        reroute(torch.nn.Linear(2, 2), "usmoe")


@pytest.mark.parametrize("options, match", [
    (dict(k=0), "k"), (dict(k=9), "k"), (dict(alpha=-0.1), "alpha"), (dict(grouping="batch"), "grouping"),
    (dict(ec_score="softmax"), "ec_score"), (dict(balance_loss="vmoe"), "balance_loss"),
])
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        USMoE(16, 8, **options)


def test_position_grouping_warns_on_a_single_group_in_training():
    router = USMoE(16, 8, k=1.5)
    with pytest.warns(RuntimeWarning, match="single group"):
        mask = router.route(torch.randn(1, 10, 8)).mask
    assert (mask.sum(-1) == 1).all(), "floor(1.5) = 1 expert per token"
    router.eval()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        router.route(torch.randn(1, 10, 8))  # serving one sequence is legitimate: no warning
