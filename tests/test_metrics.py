"""Balance metrics on hand-made routings."""
import math

import torch

from minimoe import metrics

# 4 tokens, 3 experts: token 0 -> e0, token 1 -> e0 and e1, token 2 -> nothing, token 3 -> e0.
MASK = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)


def test_tokens_per_expert_and_drop_rate():
    assert metrics.tokens_per_expert(MASK).tolist() == [3, 1, 0]
    assert metrics.drop_rate(MASK).item() == 0.25


def test_imbalance_and_cv():
    assert math.isclose(metrics.load_imbalance(MASK).item(), 3 / (4 / 3), rel_tol=1e-6)
    load = torch.tensor([3.0, 1.0, 0.0])
    want = load.std(unbiased=False) / load.mean()
    assert math.isclose(metrics.coefficient_of_variation(MASK).item(), want.item(), rel_tol=1e-6)
    balanced = torch.eye(3, dtype=torch.bool).repeat(2, 1)
    assert metrics.load_imbalance(balanced).item() == 1.0 and metrics.coefficient_of_variation(balanced).item() == 0.0


def test_experts_per_token_histogram():
    hist = metrics.experts_per_token(MASK)
    assert hist.tolist() == [0.25, 0.5, 0.25, 0.0]
    assert math.isclose(hist.sum().item(), 1.0)


def test_routing_entropy():
    uniform = torch.full((5, 4), 0.25)
    assert math.isclose(metrics.routing_entropy(uniform).item(), math.log(4), rel_tol=1e-6)
    one_hot = torch.eye(4)
    assert metrics.routing_entropy(one_hot).item() == 0.0


def test_group_dims_are_averaged():
    stacked = torch.stack([MASK, torch.eye(3, dtype=torch.bool).repeat(2, 1)[:4]])
    assert math.isclose(metrics.drop_rate(stacked).item(), (0.25 + 0.0) / 2)
