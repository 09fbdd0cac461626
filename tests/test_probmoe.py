"""The ProbMoE routers (chapter 7): exact sampling in training, MAP at evaluation, and the
straight-through gradient checked against its closed form with the covariance of the subset law."""
import pytest
import torch

from minimoe import MoELayer
from minimoe.ops import ksubset_marginals
from minimoe.ops.ksubset import ksubset_covariance, range_subset_covariance, range_subset_map
from minimoe.routers import ProbMoEDynamic, ProbMoEExact, available


def test_registered():
    assert {"probmoe_exact", "probmoe_dynamic"} <= set(available())


def test_exact_k_sizes_and_eval_is_topk():
    router = ProbMoEExact(8, 6, k=2)
    logits = torch.randn(3, 10, 6)
    routing = router.route(logits)
    assert (routing.mask.sum(-1) == 2).all()
    assert torch.allclose(routing.combine, torch.softmax(logits, -1) * routing.mask)  # forward value
    router.eval()
    routing = router.route(logits)
    top = torch.zeros_like(routing.mask).scatter(-1, logits.topk(2, -1).indices, True)
    assert torch.equal(routing.mask, top)


def test_dynamic_sizes_and_eval_is_map():
    router = ProbMoEDynamic(8, 6, k_min=1, k_max=3)
    logits = torch.randn(4, 50, 6)
    sizes = router.route(logits).mask.sum(-1)
    assert sizes.min() >= 1 and sizes.max() <= 3 and len(sizes.unique()) > 1
    router.eval()
    assert torch.equal(router.route(logits).mask, range_subset_map(logits, 1, 3))


def test_training_draws_follow_the_marginals():
    """Monte Carlo: 20000 draws of one token; each inclusion frequency within 4.5 binomial standard
    errors (<= 0.016) of the exact marginal."""
    gen = torch.Generator().manual_seed(0)
    router = ProbMoEExact(4, 6, k=3, generator=gen)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    freq = router.route(logits.expand(20000, 6)).mask.double().mean(0)
    m = ksubset_marginals(logits.double(), 3)
    assert ((freq - m).abs() <= 4.5 * (m * (1 - m) / 20000).sqrt()).all()


@pytest.mark.parametrize("dynamic", [False, True])
def test_straight_through_gradient_closed_form(dynamic):
    """dL/dr_i = sum_{j in S} delta_j (dpi_j/dr_i + pi_j Cov(z_i, z_j)) for L = sum_{j in S} delta_j w_j."""
    torch.manual_seed(1)
    E = 6
    router = ProbMoEDynamic(4, E, k_min=1, k_max=3) if dynamic else ProbMoEExact(4, E, k=2)
    router = router.double()
    logits = torch.randn(5, E, dtype=torch.float64, requires_grad=True)
    delta = torch.randn(5, E, dtype=torch.float64)
    routing = router.route(logits)
    z = routing.mask.double()
    (routing.combine * z * delta).sum().backward()
    with torch.no_grad():
        pi = torch.softmax(logits, -1)
        softmax_jac = torch.diag_embed(pi) - pi[:, :, None] * pi[:, None, :]  # [t, j, i] = dpi_j / dr_i
        cov = range_subset_covariance(logits, 1, 3) if dynamic else ksubset_covariance(logits, 2)
        want = torch.einsum("tj,tji->ti", z * delta, softmax_jac) + torch.einsum("tj,tij->ti", z * delta * pi, cov)
    assert torch.allclose(logits.grad, want, atol=1e-10)
    # the covariance term reaches experts that were not run
    assert (logits.grad * (1 - z)).abs().sum() > 0


def test_in_a_layer():
    torch.manual_seed(2)
    layer = MoELayer(8, 16, 6, "probmoe_exact", router_options={"k": 2}, group_size=10)
    x = torch.randn(3, 10, 8)
    y = layer(x)
    routing = layer.last_routing
    manual = torch.zeros_like(x)
    for g in range(3):
        for t in range(10):
            for e in routing.mask[g, t].nonzero().flatten().tolist():
                manual[g, t] += routing.combine[g, t, e] * layer.experts.forward_one(e, x[g, t][None])[0]
    assert torch.allclose(y, manual, atol=1e-5)
    y.pow(2).sum().backward()
    grad = layer.router.gate.weight.grad
    assert grad is not None and (grad.abs().sum(-1) > 0).all(), "every expert's gate row learns"


def test_renormalize():
    router = ProbMoEExact(4, 5, k=2, renormalize=True)
    routing = router.route(torch.randn(7, 5))
    assert torch.allclose(routing.combine.sum(-1), torch.ones(7))


@pytest.mark.parametrize("make, match", [
    (lambda: ProbMoEExact(4, 5, k=0), "k must be >= 1"),
    (lambda: ProbMoEExact(4, 5, k=6), "k must be <= 5"),
    (lambda: ProbMoEDynamic(4, 5, k_min=3, k_max=2), "k_min must be <= 2"),
    (lambda: ProbMoEDynamic(4, 5, k_min=1, k_max=7), "k_max must be <= 5"),
])
def test_bad_options(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_densemixer_forward_is_topk_and_router_gradient_is_dense():
    """Forward = softmax top-k; router gradient = sum over ALL experts of delta_e dpi_e/dr, with
    delta_e = <dL/dy, f_e(x)>; expert weights get exactly the sparse top-k layer's gradient."""
    torch.manual_seed(3)
    d, E, k = 6, 5, 2
    dense = MoELayer(d, 12, E, "densemixer", router_options={"k": k}, group_size=7).double()
    sparse = MoELayer(d, 12, E, "softmax_topk", router_options={"k": k, "capacity_factor": None},
                      group_size=7).double()
    sparse.load_state_dict(dense.state_dict())
    x = torch.randn(2, 7, d, dtype=torch.float64)
    target = torch.randn(2, 7, d, dtype=torch.float64)
    y_dense, y_sparse = dense(x), sparse(x)
    assert torch.allclose(y_dense, y_sparse, atol=1e-14), "the forward value is the sparse top-k output (to rounding)"
    ((y_dense - target) ** 2).sum().backward()
    ((y_sparse - target) ** 2).sum().backward()
    for name in ("w_in", "w_out", "b_in", "b_out"):
        assert torch.allclose(getattr(dense.experts, name).grad, getattr(sparse.experts, name).grad, atol=1e-12)
    # the router gradient by hand: delta_e for every expert, through the softmax Jacobian
    with torch.no_grad():
        g_out = 2 * (y_sparse - target)  # dL/dy
        tokens = x.reshape(-1, d)
        outs = torch.stack([dense.experts.forward_one(e, tokens) for e in range(E)], 1)  # (N, E, d)
        delta = torch.einsum("nd,ned->ne", g_out.reshape(-1, d), outs)
        pi = torch.softmax(tokens @ dense.router.gate.weight.T, -1)
        dlogits = pi * (delta - (pi * delta).sum(-1, keepdim=True))  # softmax backward
        want = dlogits.T @ tokens
    assert torch.allclose(dense.router.gate.weight.grad, want, atol=1e-10)
    assert not torch.allclose(sparse.router.gate.weight.grad, want, atol=1e-6), "top-k's own gradient differs"
    dense.eval()  # at evaluation the dense pass is off: the output is top-k's (the hook returns it as it is)
    x = torch.randn(7, d, dtype=torch.float64)
    routing = dense.router(x[None])
    out = dense.apply_routing(x[None], routing)
    assert dense.router.adjust_output(dense, x[None], routing, out) is out
