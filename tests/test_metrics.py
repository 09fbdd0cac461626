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


def test_slot_accounting_identity():
    """Prop. 9.5: n_0 = (1 - F/T) + sum_{j>=2} (j-1) n_j for any routing into E*C = T slots, and
    its two special cases: top-1 token choice (experts/token = 1 - drop rate) and expert choice."""
    from minimoe.ops import expert_choice_allocation, token_choice_allocation
    gen = torch.Generator().manual_seed(0)
    T, E = 48, 6
    C = T // E
    for trial in range(60):
        probs = torch.softmax(3 * torch.randn(T, E, generator=gen), -1)
        k = 1 + trial % 3
        for mask in (token_choice_allocation(probs, k, C) >= 0, expert_choice_allocation(probs, C) >= 0):
            assert (mask.sum(0) <= C).all()
            hist = metrics.experts_per_token(mask).double()
            filled = mask.sum().item()
            j = torch.arange(E + 1, dtype=torch.float64)
            identity = (1 - filled / T) + ((j - 1).clamp_min(0) * hist).sum()
            assert torch.isclose(hist[0], identity, atol=1e-12)
            assert torch.isclose(metrics.drop_rate(mask).double(), hist[0], atol=1e-12)
        top1 = token_choice_allocation(probs, 1, C) >= 0
        assert torch.isclose(1 - metrics.drop_rate(top1), (j * metrics.experts_per_token(top1)).sum().float())
        chosen = expert_choice_allocation(probs, C) >= 0
        assert torch.isclose((j * metrics.experts_per_token(chosen).double()).sum(), torch.tensor(1.0, dtype=torch.float64))
