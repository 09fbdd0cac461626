"""Auxiliary losses: hand computations on tiny examples and their minima."""
import math

import torch

from minimoe import losses


def test_cv_squared_by_hand():
    v = torch.tensor([1.5, 0.5])  # mean 1, population variance 0.25
    assert math.isclose(losses.cv_squared(v).item(), 0.25, rel_tol=1e-6)


def test_importance_loss_by_hand_and_minimum():
    probs = torch.tensor([[0.5, 0.5], [1.0, 0.0]])  # importance (1.5, 0.5)
    assert math.isclose(losses.importance_loss(probs).item(), 0.25, rel_tol=1e-6)
    uniform = torch.full((7, 4), 0.25)
    assert losses.importance_loss(uniform).item() < 1e-12
    # Balanced importance with unbalanced rows is also a minimiser (the loss sees only column sums).
    assert losses.importance_loss(torch.tensor([[1.0, 0.0], [0.0, 1.0]])).item() < 1e-12
    # Positive elsewhere, and invariant to scaling the importances.
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        p = torch.softmax(torch.randn(16, 4, generator=gen), -1)
        assert losses.importance_loss(p) > 0
        torch.testing.assert_close(losses.cv_squared(3.7 * p.sum(0)), losses.cv_squared(p.sum(0)))


def test_load_loss_by_hand():
    clean = torch.tensor([[1.0, 0.0, -1.0]])
    noisy = torch.tensor([[1.2, 0.1, -0.5]])
    sigma = 0.5
    # k=1: threshold = 1.2; P(e) = Phi((clean_e - 1.2)/0.5)
    phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))
    load = [phi((c - 1.2) / sigma) for c in (1.0, 0.0, -1.0)]
    mean = sum(load) / 3
    want = sum((l - mean) ** 2 for l in load) / 3 / mean**2
    assert math.isclose(losses.load_loss(clean, noisy, sigma, 1).item(), want, rel_tol=1e-5)
    # k=2: threshold = 0.1
    load = [phi((c - 0.1) / sigma) for c in (1.0, 0.0, -1.0)]
    mean = sum(load) / 3
    want = sum((l - mean) ** 2 for l in load) / 3 / mean**2
    assert math.isclose(losses.load_loss(clean, noisy, sigma, 2).item(), want, rel_tol=1e-5)


def test_load_loss_zero_for_symmetric_router_and_has_gradient():
    # Two tokens that are mirror images of each other: expected loads equal -> loss 0.
    clean = torch.tensor([[1.0, -1.0], [-1.0, 1.0]])
    assert losses.load_loss(clean, clean, 0.3, 1).item() < 1e-12
    logits = torch.randn(32, 4, requires_grad=True)
    losses.load_loss(logits, logits + 0.1 * torch.randn(32, 4), 0.25, 2).backward()
    assert logits.grad.abs().sum() > 0


def test_switch_loss_by_hand_and_uniform_value():
    probs = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.2, 0.8]])
    chosen = torch.tensor([[True, False], [True, False], [False, True]])
    f = torch.tensor([2 / 3, 1 / 3])
    P = probs.mean(0)
    assert math.isclose(losses.switch_balance_loss(probs, chosen).item(), (2 * (f * P).sum()).item(), rel_tol=1e-6)
    uniform = torch.full((10, 5), 0.2)
    any_choice = torch.zeros(10, 5, dtype=torch.bool)
    any_choice[torch.arange(10), torch.arange(10) % 5] = True
    assert math.isclose(losses.switch_balance_loss(uniform, any_choice).item(), 1.0, rel_tol=1e-6)


def test_switch_loss_relaxation_is_minimised_by_the_uniform_router():
    # With f replaced by P, the loss is E * ||P||^2 >= 1 (Cauchy-Schwarz), equality iff P uniform.
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        probs = torch.softmax(torch.randn(20, 6, generator=gen) * 2, -1)
        P = probs.mean(0)
        assert 6 * (P * P).sum() >= 1 - 1e-6


def test_switch_loss_can_go_below_one():
    # The book's counterexample: f follows the argmax, P the mean, so concentrating many barely-
    # decided tokens on expert 0 and one certain token on expert 1 gives a value below 1.
    T = 10
    probs = torch.tensor([[0.51, 0.49]] * (T - 1) + [[0.0, 1.0]])
    chosen = torch.zeros(T, 2, dtype=torch.bool).scatter(-1, probs.argmax(-1, keepdim=True), True)
    value = losses.switch_balance_loss(probs, chosen).item()
    assert value < 1.0 and math.isclose(value, 2 * (0.9 * 0.459 + 0.1 * 0.541), rel_tol=1e-5)


def test_switch_loss_gradient_lowers_the_overloaded_expert():
    logits = torch.tensor([[2.0, 0.0, 0.0]] * 6 + [[0.0, 2.0, 0.0]] * 2, requires_grad=True)
    probs = torch.softmax(logits, -1)
    chosen = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, probs.argmax(-1, keepdim=True), True)
    losses.switch_balance_loss(probs, chosen).backward()
    # Gradient descent step lowers expert 0's logit on every token (it carries 75% of the load).
    assert (logits.grad[:, 0] > logits.grad[:, 1]).all() and (logits.grad[:, 0] > 0).all()


def test_z_loss_by_hand():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    want = (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
    assert math.isclose(losses.z_loss(logits).item(), want, rel_tol=1e-6)


def test_router_aux_loss_only_in_training():
    from minimoe.routers import build
    r = build("softmax_topk", 8, 4, k=2, noise="vmoe", balance_loss="vmoe", z_loss_weight=1e-3)
    x = torch.randn(32, 8)
    assert r.train()(x).aux_loss > 0
    assert r.eval()(x).aux_loss == 0
    assert build("expert_choice", 8, 4).train()(x).aux_loss == 0


def test_load_loss_gradient_flows_through_the_threshold():
    # k=1 with two experts: the threshold is the noisy logit of the winner, so the loss depends on
    # the noisy logits too (V-MoE's behaviour).
    clean = torch.tensor([[1.0, 0.0], [0.3, 0.2]])
    noisy = (clean + torch.tensor([[0.1, -0.2], [0.05, 0.0]])).requires_grad_(True)
    losses.load_loss(clean, noisy, 0.5, 1).backward()
    assert noisy.grad.abs().sum() > 0
