"""Bad input: a clear error naming the argument, never a NaN or an index error from deep inside."""
import pytest
import torch

from minimoe import MoELayer
from minimoe.ops import expert_choice_allocation, token_choice_allocation
from minimoe.routers import build

x = torch.randn(2, 16, 8)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: build("softmax_topk", 8, 4, k=5), ValueError, "k must be <= 4"),
        (lambda: build("softmax_topk", 8, 4, k=0), ValueError, "k must be >= 1"),
        (lambda: build("softmax_topk", 8, 4, capacity_factor=0.0), ValueError, "capacity_factor"),
        (lambda: build("expert_choice", 8, 4, capacity_factor=-2.0), ValueError, "capacity_factor"),
        (lambda: build("no_such_router", 8, 4), ValueError, "unknown router name 'no_such_router'.*softmax_topk"),
        (lambda: build("softmax_topk", 8, 4, noise="gaussian"), ValueError, "noise must be one of"),
        (lambda: build("softmax_topk", 8, 4, balance_loss="vmoe"), ValueError, "needs noise"),
        (lambda: build("softmax_topk", 8, 4, balance_loss="gshard3"), ValueError, "balance_loss must be"),
        (lambda: build("softmax_topk", 8, 0), ValueError, "n_experts must be >= 1"),
        (lambda: MoELayer(8, 16, 4, path="fast"), ValueError, "path must be one of"),
        (lambda: MoELayer(8, 16, 4, router=build("softmax_topk", 6, 4)), ValueError, "d_model=6"),
        (lambda: MoELayer(8, 16, 4, router=3), TypeError, "router must be"),
        (lambda: MoELayer(8, 16, 4)(torch.randn(16, 7)), ValueError, r"d_model=8"),
        (lambda: MoELayer(8, 16, 4, group_size=5)(torch.randn(16, 8)), ValueError, "group_size=5"),
        (lambda: build("softmax_topk", 8, 4)(torch.randn(2, 2, 16, 8)), ValueError, "x must have shape"),
        (lambda: build("softmax_topk", 8, 4)(torch.randn(16, 6)), ValueError, "d_model=6"),
        (lambda: build("softmax_topk", 8, 4).route(torch.full((16, 4), float("nan"))), ValueError, "logits contains NaN"),
        (lambda: build("expert_choice", 8, 4).route(torch.full((16, 4), float("inf"))), ValueError, "logits contains inf"),
        (lambda: build("softmax_topk", 8, 4).route(torch.randn(16, 5)), ValueError, "n_experts=4"),
        (lambda: build("softmax_topk", 8, 64)(torch.randn(10, 8)), ValueError, "capacity_factor"),
        (lambda: token_choice_allocation(torch.randn(16), 1, 4), ValueError, "scores must have shape"),
        (lambda: token_choice_allocation(torch.randn(16, 4), 1, 0), ValueError, "capacity must be >= 1"),
        (lambda: token_choice_allocation(torch.randint(0, 3, (16, 4)), 1, 4), TypeError, "floating-point"),
        (lambda: expert_choice_allocation(torch.randn(16, 4), 17), ValueError, "capacity must be <= 16"),
        (lambda: token_choice_allocation([[0.1, 0.2]], 1, 1), TypeError, "torch.Tensor"),
        (lambda: build("softmax_topk", 8, 4, noise="shazeer").train().route(torch.randn(16, 4)), ValueError,
         "noise='shazeer'"),
    ],
)
def test_bad_input_raises_a_clear_error(make, error, match):
    with pytest.raises(error, match=match):
        make()
