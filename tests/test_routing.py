"""The two forms of a sparse Routing (minimoe/routing.py): (T, E) tables, or each token's k choices.

softmax_topk and DenseMixer give the choices ``(T, k)``; the layer's fast paths read them without
building the (T, E) tables. These tests check that the choices describe the dispatch of Algorithm 1
(the loop transcription in tests/reference.py), that the tables built from them are the table
form's, and that the layer gives the same bits from either form, in the output and every gradient.
"""
import itertools

import pytest
import torch

from minimoe import MoELayer
from minimoe.routing import Routing
from reference import algorithm1_token_choice, position_to_dispatch


def as_tables(routing: Routing) -> Routing:
    """The same routing in the table form: position and combine (built from the choices), no choices."""
    table = routing.to_table()
    assert not table.has_choices and table.reinforce_weight is routing.reinforce_weight
    return table


CASES = list(itertools.product([1, 2, 3], [None, 0.5, 1.0], [False, True], [False, True]))


@pytest.mark.parametrize("k, capacity_factor, batch_priority, renormalize", CASES)
def test_choices_are_algorithm_1(k, capacity_factor, batch_priority, renormalize):
    torch.manual_seed(k + 7 * batch_priority)
    layer = MoELayer(8, 16, 5, "softmax_topk", router_options=dict(
        k=k, capacity_factor=capacity_factor, batch_priority=batch_priority, renormalize=renormalize))
    x = torch.randn(3, 24, 8)
    routing = layer.router(x)
    assert routing.has_choices and routing.choice_expert.shape == (3, 24, k)
    probs = routing.probs.detach()
    for g in range(3):
        C = routing.capacity
        want = algorithm1_token_choice(probs[g], k, C, batch_priority=batch_priority)
        assert torch.equal(position_to_dispatch(routing.position[g], C or 24), want)
    # each token's choices are its k largest probabilities, distinct experts
    assert torch.equal(routing.choice_expert.sort(-1).values, probs.topk(k, -1).indices.sort(-1).values)
    # the combine table: the gate at the kept pairs, exactly 0 elsewhere
    gates = probs
    if renormalize:
        chosen = torch.zeros_like(probs).scatter(-1, probs.topk(k, -1).indices, 1.0)
        gates = probs * chosen / (probs * chosen).sum(-1, keepdim=True)
    assert torch.equal(routing.combine.detach(), torch.where(routing.mask, gates, 0.0))
    assert torch.equal(routing.mask, routing.position >= 0)
    assert int(routing.num_pairs()) == int(routing.mask.sum())
    assert routing.num_slots == (C if C is not None else int(routing.position.max()) + 1)


@pytest.mark.parametrize("path", ["slots", "grouped", "index"])
@pytest.mark.parametrize("router, options", [
    ("softmax_topk", {"k": 2, "capacity_factor": 1.0, "balance_loss": "switch"}),
    ("softmax_topk", {"k": 2, "capacity_factor": None, "batch_priority": True}),
    ("densemixer", {"k": 2}),
    ("ssr", {"k": 2, "p": 0.5, "seed": 3}),
    ("sinkhorn_token_choice", {"k": 2, "capacity_factor": 1.0}),
    ("sinkhorn_token_choice", {"k": 2, "capacity_factor": None, "combine": "plan"}),
    ("kool_skip", {"capacity_factor": 1.0}),
    ("kool_gumbel_matching", {"capacity_factor": 1.0}),
    ("loss_free", {"k": 2}),
    ("loss_free", {"k": 2, "capacity_factor": 1.0, "score": "sigmoid"}),
])
def test_layer_gives_the_same_bits_from_either_form(path, router, options):
    """Output, input gradient and every parameter's gradient (experts and gate) are equal to the last
    bit whether the layer reads the choices or the tables; and the fast paths never build a table."""
    results = []
    for form in ("choices", "tables"):
        torch.manual_seed(0)
        layer = MoELayer(16, 32, 6, router, router_options=options, path=path).train()
        x = torch.randn(2, 40, 16, requires_grad=True)
        routing = layer.router(x)
        if form == "tables":
            routing = as_tables(routing)
        out = layer.router.adjust_output(layer, x, routing, layer.apply_routing(x, routing))
        if form == "choices":  # neither table was built on the way
            assert routing.__dict__.get("_position") is None and routing.__dict__.get("_combine") is None
        (out.pow(2).sum() + routing.aux_loss).backward()
        results.append([out.detach(), x.grad] + [p.grad for p in layer.parameters()])
    for got, want in zip(*results):
        assert (got is None and want is None) or torch.equal(got, want)
    assert sum(grad is not None for grad in results[0]) >= 5  # the output, x and the experts' 4 tensors at least
    # and the fast paths agree with eq. (2) written out (the einsum)
    torch.manual_seed(0)
    layer = MoELayer(16, 32, 6, router, router_options=options, path=path).train()
    x = torch.randn(2, 40, 16)
    routing = layer.router(x)
    torch.testing.assert_close(layer.apply_routing(x, routing), layer.apply_routing(x, routing, "einsum"))


def test_the_choices_come_together_and_writing_a_table_replaces_them():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]])
    expert, slot, weight = torch.tensor([[0], [2]]), torch.tensor([[0], [-1]]), torch.tensor([[0.7], [0.0]])
    with pytest.raises(ValueError, match="choice_expert, choice_slot and choice_weight"):
        Routing(probs=probs, choice_expert=expert, choice_slot=slot)
    with pytest.raises(ValueError, match="needs probs"):
        Routing(choice_expert=expert, choice_slot=slot, choice_weight=weight).position
    routing = Routing(probs=probs, choice_expert=expert, choice_slot=slot, choice_weight=weight, capacity=1)
    assert torch.equal(routing.position, torch.tensor([[0, -1, -1], [-1, -1, -1]]))
    assert torch.equal(routing.combine, torch.tensor([[0.7, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(routing.tokens_per_expert(), torch.tensor([1, 0, 0])) and int(routing.num_pairs()) == 1
    with pytest.raises(AttributeError, match="to_table"):  # no silent conversion on assignment
        routing.position = torch.tensor([[-1, -1, -1], [-1, -1, 0]])
    table = routing.to_table()
    assert routing.has_choices and not table.has_choices and table.choice_slot is None
    assert torch.equal(table.position, routing.position) and torch.equal(table.combine, routing.combine)
    table.position = torch.tensor([[-1, -1, -1], [-1, -1, 0]])  # a table routing's tables can be written
    assert torch.equal(table.mask, torch.tensor([[False, False, False], [False, False, True]]))
    halved = routing.with_combine(routing.combine / 2)
    assert not halved.has_choices and torch.equal(halved.position, routing.position)
    assert torch.equal(halved.combine, torch.tensor([[0.35, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="shape"):
        routing.with_combine(torch.zeros(3))
