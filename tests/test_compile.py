"""Every router, and the layer with every router whose shapes are static, under
``torch.compile(fullgraph=True)``: one graph (no break), and the compiled result equal to eager.

The graphs are captured with dynamo and run with ``backend="aot_eager"`` (AOTAutograd traces the forward
and the backward; torch's own kernels run them): that is what fullgraph capture decides, without the
code generation, which takes 10-20 s a graph on a CPU. One router and one layer are compiled with
inductor as well. Compiled and eager agree to float32 rounding: slot tables and dispatched experts
exactly, weights to 1e-6 absolute plus 1e-5 relative, gradients to 1e-5 plus 1e-4 relative (the
compiled Sinkhorn runs its iterations in the log domain and the compiled k-subset DP always in the
log domain in float64, where eager picks by the logits' range; both are the same mathematics).
"""
import copy
import warnings

import pytest
import torch

from minimoe import MoELayer
from minimoe.routers import available, build, router_class

SIZES = {"small": (2, 16, 16, 4), "large": (3, 40, 16, 8)}  # groups, tokens, d_model, experts
# Dropless routing has data-dependent shapes (how many rows each expert gets): on a CPU the layer reads
# the segment lengths once, a graph break (on CUDA in bfloat16 the grouped matmul takes them on the device).
DROPLESS = {"densemixer", "loss_free", "probmoe_exact", "probmoe_dynamic", "usmoe", "ssr"}


def _options(name, T, E):
    options = router_class(name).study_options(group_size=T, n_experts=E)
    if name == "ssr":
        options["p"] = 0.5  # both branches of the coin get drawn
    return options


def _router(name, size, training):
    G, T, d, E = SIZES[size]
    torch.manual_seed(0)
    return build(name, d, E, **_options(name, T, E)).train(training), torch.randn(G, T, d, requires_grad=True)


def _outputs(router, x, seed):
    """The routing's tensors and the gradients of a loss on them, with the router's draws seeded."""
    torch.manual_seed(seed)
    routing = router(x)
    tables = (routing.slot_dispatch, routing.slot_combine) if routing.is_soft else (routing.position, routing.combine)
    weights = tables[1]
    loss = (weights * torch.linspace(-1, 1, weights.numel()).view_as(weights)).sum() + routing.aux_loss + \
        routing.probs.pow(2).sum()
    if routing.log_prob is not None:
        loss = loss + (routing.log_prob * routing.reinforce_weight).sum()
    params = [p for p in router.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [x, *params], allow_unused=True)
    return [*tables, routing.probs, *(b.clone() for b in router.buffers())], grads


def _assert_close(got, want):
    for a, b in zip(got, want):
        if a is None or b is None:  # no gradient: None in one, zeros in the other is the same answer
            assert all(t is None or not t.any() for t in (a, b))
        elif a.is_floating_point():
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        else:
            assert torch.equal(a, b)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (dynamo's notes on what it traces)
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", available())
def test_every_router_is_one_graph(name, training):
    router, x = _router(name, "small", training)
    explained = torch._dynamo.explain(router)(x)
    assert explained.graph_break_count == 0, [str(b.reason).split("\n")[0] for b in explained.break_reasons]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", available())
def test_compiled_router_equals_eager(name, training):
    for size in SIZES:
        router, x = _router(name, size, training)
        compiled = torch.compile(copy.deepcopy(router), fullgraph=True, backend="aot_eager", dynamic=False)
        for seed in (1, 2):  # two calls: the router's state (loss-free's bias, SSR's coin) moves alike
            (tables, grads), (tables_c, grads_c) = _outputs(router, x, seed), _outputs(compiled, x, seed)
            _assert_close(tables_c, tables)
            _assert_close(grads_c, grads)


STATIC = [name for name in available() if name not in DROPLESS]


def _layer_step(layer, x):
    y = layer(x, group_size=x.shape[1])
    return y, y.pow(2).sum() + layer.last_routing.aux_loss


@pytest.mark.parametrize("name", STATIC)
def test_layer_forward_and_backward_are_one_graph_and_equal_eager(name):
    G, T, d, E = SIZES["large"]
    torch.manual_seed(0)
    layer = MoELayer(d, 2 * d, E, name, router_options=_options(name, T, E)).train()
    x = torch.randn(G, T, d, requires_grad=True)
    twin = copy.deepcopy(layer)
    explained = torch._dynamo.explain(lambda x: _layer_step(copy.deepcopy(layer), x)[1])(x)
    assert explained.graph_break_count == 0, [str(b.reason).split("\n")[0] for b in explained.break_reasons]
    step = torch.compile(lambda x: _layer_step(twin, x), fullgraph=True, backend="aot_eager", dynamic=False)
    torch.manual_seed(3)
    y, loss = _layer_step(layer, x)
    torch.manual_seed(3)
    y_c, loss_c = step(x)
    torch.testing.assert_close(y_c, y, atol=1e-5, rtol=1e-4)
    params = [p for p in layer.parameters()]
    _assert_close(torch.autograd.grad(loss_c, [x, *twin.parameters()], allow_unused=True),
                  torch.autograd.grad(loss, [x, *params], allow_unused=True))


@pytest.mark.parametrize("name", sorted(DROPLESS))
def test_dropless_layers_break_only_at_the_segment_lengths(name):
    """The documented exception: the router itself is one graph (above); the layer's grouped path on a
    CPU reads how many rows each expert got."""
    G, T, d, E = SIZES["small"]
    torch.manual_seed(0)
    layer = MoELayer(d, 2 * d, E, name, router_options=_options(name, T, E)).train()
    x = torch.randn(G, T, d)
    explained = torch._dynamo.explain(lambda x: layer(x, group_size=T))(x)
    reasons = [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_break_count > 0
    assert all(any(why in reason for why in ("item()", "Data dependent", "Dynamic shape")) for reason in reasons), reasons


def test_inductor_compiles_the_top_k_layer_as_eager_computes_it():
    """Real code generation (inductor's C++ on a CPU), forward and backward, one graph."""
    torch.manual_seed(0)
    layer = MoELayer(16, 32, 4, "softmax_topk", router_options={"k": 2, "capacity_factor": 1.0}).train()
    x = torch.randn(2, 32, 16, requires_grad=True)
    twin = copy.deepcopy(layer)
    step = torch.compile(lambda x: _layer_step(twin, x), fullgraph=True, dynamic=False)
    y, loss = _layer_step(layer, x)
    y_c, loss_c = step(x)
    torch.testing.assert_close(y_c, y, atol=1e-5, rtol=1e-4)
    _assert_close(torch.autograd.grad(loss_c, [x, *twin.parameters()]), torch.autograd.grad(loss, [x, *layer.parameters()]))


def test_compiled_forms_keep_their_eager_checks():
    """Host checks stay in eager (a NaN logit names the argument); compiled, the same check is asserted on
    the device, so a NaN still stops the program instead of routing silently."""
    router = build("softmax_topk", 8, 4)
    bad = torch.full((1, 4, 8), float("nan"))
    with pytest.raises(ValueError, match="NaN"):
        router(bad)
    compiled = torch.compile(router, fullgraph=True, backend="aot_eager", dynamic=False)
    with pytest.raises(RuntimeError, match="NaN or inf"):
        compiled(bad)


def test_a_compiled_layer_copies_and_pickles_as_itself():
    """MoELayer.__getstate__ keeps nn.Module's own (which drops the compiled call bound to the original):
    a deep copy of a compiled layer runs its own weights, and the layer pickles."""
    import pickle

    torch.manual_seed(0)
    layer = MoELayer(8, 16, 4)
    layer.compile(fullgraph=True, backend="aot_eager", dynamic=False)
    x = torch.randn(2, 6, 8)
    layer(x)
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.experts.w_out.mul_(2.0)
    assert not torch.allclose(twin(x), layer(x))  # the copy computes with its own (doubled) weights
    restored = pickle.loads(pickle.dumps(layer))
    torch.testing.assert_close(restored(x), layer(x))
