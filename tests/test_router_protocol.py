"""The router protocol (chapter 1, "A router carries its own rules"): what is special about a router is
a method of :class:`minimoe.routers.Router`, and the layer, the expert-parallel layer, the training
loop and the study call the protocol without asking which router they hold."""
import ast
import copy
from pathlib import Path

import pytest
import torch

import minimoe
from minimoe import MoELayer
from minimoe.losses import reinforce_loss
from minimoe.models import MoERegressor, TinyLM
from minimoe.ops import compute_capacity
from minimoe.routers import Router, available, build, register, router_class
from minimoe.routers.base import _REGISTRY
from minimoe.routing import Routing
from minimoe.train import train

PACKAGE = Path(minimoe.__file__).resolve().parent
# The modules that run any router: none may name one, ask for a router's attribute with hasattr, or
# read a router-specific flag of the routing. The papers' claims (experiments/claims.py: which study
# entries a paper compares) and the expert-parallel demo's choice of routers to show name routers as
# data, not as rules.
GENERIC = sorted([PACKAGE / "layers.py", PACKAGE / "train.py",
                  *(p for p in (PACKAGE / "parallel").glob("*.py") if p.name != "demo.py"),
                  *(PACKAGE / "models").glob("*.py"),
                  *(p for p in (PACKAGE / "experiments").glob("*.py") if p.name != "claims.py")])
ROUTER_FLAGS = ("reinforce_weight", "log_prob", "dense_backward", "expert_bias", "reduce_loads")


def router_knowledge(source: str) -> list[str]:
    """Where a module's source names a registered router, asks ``hasattr`` of something, or reads a
    router-specific flag of a routing."""
    names = set(available())
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.append(f"line {node.lineno}: the router name {node.value!r}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr" \
                and "router" in ast.unparse(node):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr in ROUTER_FLAGS:
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


@pytest.mark.parametrize("path", GENERIC, ids=[str(p.relative_to(PACKAGE)) for p in GENERIC])
def test_no_module_that_runs_routers_knows_one(path):
    assert not router_knowledge(path.read_text()), router_knowledge(path.read_text())


def test_the_knowledge_check_can_fail():
    assert router_knowledge('if name == "kool_skip":\n    pass\n')
    assert router_knowledge("if hasattr(self.router, 'reduce_loads'):\n    pass\n")
    assert router_knowledge("if routing.dense_backward:\n    pass\n")
    assert not router_knowledge("layer = MoELayer(4, 8, 2, router=DEFAULT_ROUTER)\n")


# -- capacity: one rule on the base class --------------------------------------------------------------

CAPACITY_ROUTERS = [name for name in available()
                    if "capacity_rounding" in minimoe.routers.base.option_names(router_class(name))]


@pytest.mark.parametrize("name", CAPACITY_ROUTERS)
def test_every_capacity_router_honours_rounding_and_minimum(name):
    """capacity_rounding and min_capacity mean the same for every router that takes a capacity factor
    (Sinkhorn, SSR and loss-free balancing used to drop them)."""
    E, T = 4, 30
    for factor, rounding, minimum in [(0.3, "ceil", 0), (0.3, "round", 5), (1.0, "ceil", 2), (0.5, "round", 0)]:
        options = {"capacity_factor": factor, "capacity_rounding": rounding, "min_capacity": minimum}
        if name in ("kool_gumbel_matching", "sparsity_constrained_ec"):  # at least T/E slots: every token fits
            options["capacity_factor"] = 1.0 + factor
        router = build(name, 8, E, **options)
        k = router.choices_per_token
        want = compute_capacity(T, E, options["capacity_factor"], k=k, rounding=rounding, min_capacity=minimum)
        if name == "kool_gumbel_matching":  # its floor: every token must be placed
            want = max(want, compute_capacity(T, E, options["capacity_factor"], k=k, rounding=rounding,
                                              min_capacity=max(minimum, -(-T // E))))
        assert router.capacity(T) == want, (name, options)
        torch.manual_seed(0)
        routing = router.train().route(torch.randn(2, T, E))
        if routing.capacity is not None:
            assert routing.capacity == want and int(routing.tokens_per_expert().max()) <= want


def test_dropless_routers_have_no_capacity():
    for name in ("probmoe_exact", "usmoe", "soft_moe"):
        assert build(name, 8, 4).capacity(16) is None


# -- a router written in a few lines trains through everything unchanged --------------------------------

class _HashRouter(Router):
    """Hash routing's shape (Roller et al. 2021): token t of each group goes to expert t mod E with
    weight 1; a fixed rule, nothing learned. Written here as a reader would, with the base class alone."""

    def _route(self, logits, x=None):
        T, E = logits.shape[-2:]
        expert = (torch.arange(T, device=logits.device) % E).expand(logits.shape[:-1])
        chosen = torch.nn.functional.one_hot(expert, E).bool()
        position = chosen.long().cumsum(-2).mul(chosen).sub(1)
        return Routing(combine=chosen.to(logits.dtype), position=position, capacity=None,
                       probs=torch.softmax(logits, -1), aux_loss=logits.new_zeros(()))


@pytest.fixture
def hash_router():
    register("test_hash")(_HashRouter)
    yield "test_hash"
    del _REGISTRY["test_hash"]  # leave the registry as the other tests expect it


def test_a_new_router_is_one_class_and_trains_through_train(hash_router):
    torch.manual_seed(0)
    model = MoERegressor(6, 3, d_model=8, d_hidden=8, n_experts=4, router=hash_router, group_size=8)
    xs, ys = torch.randn(5, 16, 6), torch.randn(5, 16, 3)
    history = train(model, lambda s: (xs[s], ys[s]), lambda p, y: (p - y).pow(2).mean(), steps=5, progress=False)
    assert len(history["train"]) == 5 and all(torch.isfinite(torch.tensor(r["loss"])) for r in history["train"])
    assert history["train"][-1]["moe0/load"] == [0.25] * 4  # t mod E: every expert takes a quarter
    routing = model.moe.last_routing
    assert torch.equal(routing.position[0, :, 0], torch.tensor([0, -1, -1, -1, 1, -1, -1, -1]))
    # and in the study's runner, with the protocol's defaults (its own options, no extra loss)
    from minimoe.experiments import router_options, task_config
    assert router_options(hash_router, task_config("clustered", "toy")) == {}


# -- the hook on the output and the extra loss: Kool's REINFORCE through plain train() -------------------

def _kool_model(seed=0, router="kool_skip"):
    torch.manual_seed(seed)
    return MoERegressor(6, 3, d_model=8, d_hidden=8, n_experts=4, router=router, group_size=8)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, 16, 6, generator=g), torch.randn(3, 16, 3, generator=g)


def _per_example(pred, y):
    return (pred - y).pow(2).mean(-1)  # one loss per example: the REINFORCE term uses each one


@pytest.mark.parametrize("router", ["kool_skip", "kool_gumbel_matching"])
def test_a_kool_router_gets_its_reinforce_gradient_from_train(router):
    """train() adds the protocol's extra loss: the gate moves (with weight decay 0, only a gradient can
    move it), and the parameters after three steps are those of a loop that adds reinforce_loss with
    the same moving-average baseline by hand."""
    xs, ys = _data()
    model = _kool_model(router=router)
    gate0 = model.moe.router.gate.weight.detach().clone()
    train(model, lambda s: (xs[s], ys[s]), _per_example, steps=3, weight_decay=0.0, progress=False, seed=4)
    assert not torch.equal(model.moe.router.gate.weight, gate0), "the gate got no gradient"

    by_hand = _kool_model(router=router)
    minimoe.train.seed_everything(4)
    opt = torch.optim.AdamW(by_hand.parameters(), lr=3e-3, weight_decay=0.0, foreach=True)
    baseline = 0.0
    for step in range(3):
        per_example = _per_example(by_hand(xs[step]), ys[step])
        loss = per_example.mean()
        objective = loss + by_hand.aux_loss() + reinforce_loss(by_hand, per_example, baseline=baseline)
        opt.zero_grad(set_to_none=True)
        objective.backward()
        torch.nn.utils.clip_grad_norm_(by_hand.parameters(), 1.0)
        opt.step()
        baseline = loss.item() if step == 0 else 0.9 * baseline + 0.1 * loss.item()
    for got, want in zip(model.parameters(), by_hand.parameters()):
        assert torch.equal(got, want)

    without = _kool_model(router=router)  # the same loop without the term: the gate stays where it was
    minimoe.train.seed_everything(4)
    opt = torch.optim.AdamW(without.parameters(), lr=3e-3, weight_decay=0.0, foreach=True)
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        _per_example(without(xs[step]), ys[step]).mean().backward()
        opt.step()
    assert torch.equal(without.moe.router.gate.weight, gate0)


def test_extra_loss_is_value_free_and_absent_at_evaluation():
    xs, ys = _data()
    model = _kool_model().train()
    per_example = _per_example(model(xs[0]), ys[0])
    term = minimoe.layers.router_losses(model, per_example, baseline=0.5)
    assert term is not None and float(term.detach()) == 0.0 and term.requires_grad
    model.eval()
    _per_example(model(xs[0]), ys[0])
    assert minimoe.layers.router_losses(model, per_example) is None
    plain = MoERegressor(6, 3, d_model=8, d_hidden=8, n_experts=4, group_size=8)
    plain(xs[0])
    assert minimoe.layers.router_losses(plain, per_example) is None  # softmax top-k adds nothing


def test_densemixer_hook_asks_the_layer_for_every_expert():
    """DenseMixer's rule lives in the router: the layer's all_expert_outputs is what it asks for, and
    an expert-parallel layer (which cannot give it) refuses with a clear error."""
    torch.manual_seed(0)
    layer = MoELayer(6, 8, 4, "densemixer", router_options={"k": 1}).double()
    calls = []
    original = layer.all_expert_outputs
    layer.all_expert_outputs = lambda x, routing: calls.append(1) or original(x, routing)
    layer(torch.randn(2, 5, 6, dtype=torch.float64))
    assert calls == [1]
    with torch.no_grad():
        layer(torch.randn(2, 5, 6, dtype=torch.float64))
    layer.eval()(torch.randn(2, 5, 6, dtype=torch.float64))
    assert calls == [1], "no dense pass without gradients or at evaluation"


# -- loads across processes ------------------------------------------------------------------------------

def test_load_reducer_is_the_only_way_loads_leave_the_router():
    router = build("loss_free", 4, 4, update="proportional", bias_rate=0.1).train()
    seen = []
    other_rank = torch.tensor([0.0, 3.0, 1.0, 4.0])  # what a second rank routed
    router.set_load_reducer(lambda loads: seen.append(loads.clone()) or loads + other_rank)
    logits = torch.tensor([[[3.0, 0.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0]]])
    router.route(logits)
    assert len(seen) == 1 and seen[0].tolist() == [2.0, 1.0, 1.0, 0.0]
    # the step is the one of the global loads (2, 4, 2, 4), not of this rank's (2, 1, 1, 0)
    want = minimoe.ops.bias_update(torch.zeros(4), torch.tensor([2.0, 4.0, 2.0, 4.0]), 0.1, "proportional")
    assert torch.allclose(router.expert_bias, want)
    alone = build("loss_free", 4, 4, update="proportional", bias_rate=0.1).train()
    alone.route(logits)
    assert not torch.allclose(alone.expert_bias, want)
    router.set_load_reducer(None)
    assert torch.equal(router.reduce_loads(torch.ones(4)), torch.ones(4))
    with pytest.raises(TypeError, match="callable"):
        router.set_load_reducer(3)
    for name in available():  # every router accepts a reducer: the expert-parallel layer sets it blindly
        build(name, 4, 4).set_load_reducer(lambda loads: loads)


def test_expert_parallel_layer_is_a_moe_layer_built_by_moe_layer_init():
    from minimoe.parallel import ExpertParallelMoELayer

    assert issubclass(ExpertParallelMoELayer, MoELayer)
    init = ast.parse(Path(minimoe.parallel.layer.__file__).read_text())
    calls = [ast.unparse(n) for n in ast.walk(init) if isinstance(n, ast.Call) and "__init__" in ast.unparse(n.func)]
    assert any(c.startswith("super().__init__(d_model") for c in calls) and \
        not any(c.startswith("nn.Module.__init__") for c in calls)


# -- the study's options come from the routers -----------------------------------------------------------

def test_study_options_and_variants_are_declared_by_the_routers():
    from minimoe.experiments import base_router, router_options, study_entries, study_variants, task_config

    config = task_config("vision", "toy")
    assert router_options("soft_moe", config) == {"slots_per_expert": config.group_size // config.n_experts}
    assert router_options("usmoe", config) == {"k": 1.0, "grouping": "sequence"}
    assert router_options("densemixer", config) == {"k": 1}  # not softmax top-k's, which it subclasses
    assert study_variants() == {"ssr_p0": ("ssr", {"k": 1, "p": 0.0, "noise_scale": 0.5}),
                                "softmax_topk_dropless": ("softmax_topk", {"k": 1, "capacity_factor": None,
                                                                           "balance_loss": "switch"})}
    assert router_class("densemixer").study_variants() == {}  # a variant names one router: not inherited
    assert study_entries()[:len(available())] == available()
    assert base_router("ssr_p0") == "ssr" and base_router("usmoe") == "usmoe"
    options = router_options("ssr", config)
    options["p"] = 1.0  # a fresh dict each time
    assert router_options("ssr", config)["p"] == 0.05
    rules = {name: router_class(name).training_rule for name in available() if router_class(name).training_rule}
    assert set(rules) == {"densemixer", "kool_skip", "kool_gumbel_matching", "loss_free"}


# -- models pass the layer's options through ----------------------------------------------------------------

def test_models_pass_shared_experts_and_layer_options_through():
    lm = TinyLM(20, d_model=8, n_layers=2, n_heads=2, block_size=8, n_experts=4, d_hidden=8, n_shared_experts=1,
                moe_options={"activation": "relu"})
    assert all(layer.n_shared_experts == 1 and layer.shared_experts is not None for layer in lm.moe_layers())
    assert all(layer.experts.activation == "relu" for layer in lm.moe_layers())
    reg = MoERegressor(4, 2, n_experts=4, group_size=4, n_shared_experts=2, moe_options={"bias": False})
    assert reg.moe.n_shared_experts == 2 and reg.moe.experts.b_in is None
    with pytest.raises(ValueError, match="moe_options"):
        TinyLM(20, d_model=8, n_heads=2, block_size=8, n_experts=4, d_hidden=8, moe_options={"path": "loop"})


# -- explicit conversions of a routing ----------------------------------------------------------------------

def test_sinkhorn_renormalisation_converts_explicitly():
    torch.manual_seed(0)
    router = build("sinkhorn_token_choice", 4, 4, k=2, renormalize=True).eval()
    routing = router.route(torch.randn(10, 4))
    assert not routing.has_choices  # renormalised on the table, by with_combine
    sums = routing.combine.sum(-1)
    assert torch.allclose(sums[sums > 0], torch.ones_like(sums[sums > 0]))
    assert copy.copy(routing).capacity == routing.capacity


def test_the_router_written_in_chapter_1_runs_as_printed(capsys):
    """Chapter 1, "A router carries its own rules": the complete router of the page, run as a reader
    would paste it; it trains through train() and balances exactly."""
    text = (Path(__file__).resolve().parents[1] / "book" / "01-moe-layer.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    (code,) = [b for b in blocks if "class PositionHash" in b]
    try:
        exec(compile(code, "book/01-moe-layer.md", "exec"), {"__name__": "chapter1"})
        assert capsys.readouterr().out.strip() == "[0.25, 0.25, 0.25, 0.25]"
    finally:
        _REGISTRY.pop("position_hash", None)


@pytest.mark.parametrize("name", available())
def test_layers_and_models_copy_pickle_and_save_after_a_backward(name, tmp_path):
    """The usual ways to keep a model (copy.deepcopy for the best one, pickle, torch.save(model)) work at
    any point of training: the last routing, which holds the step's autograd graph, is not copied."""
    import pickle

    options = router_options_for(name)
    torch.manual_seed(0)
    model = TinyLM(12, d_model=8, n_layers=1, n_heads=2, block_size=8, n_experts=4, d_hidden=8, router=name,
                   router_options=options, routing_groups="position")
    model(torch.randint(0, 12, (4, 8))).sum().backward()
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert all(layer.last_routing is None for layer in copied.moe_layers())
        for a, b in zip(model.state_dict().values(), copied.state_dict().values()):
            assert torch.equal(a, b)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert model.moe_layers()[0].last_routing is not None  # the original keeps its own
    x = torch.randint(0, 12, (4, 8))
    model.eval(), loaded.eval()  # (evaluation draws nothing: the same outputs)
    assert torch.equal(model(x), loaded(x))


def router_options_for(name):
    return router_class(name).study_options(group_size=4, n_experts=4)
