"""No host synchronisation in a training forward (issue 19, "Ready for a GPU").

Reading a device tensor's values on the host (``.item()``, ``bool(t)``, ``float(t)``, ``.tolist()``,
``nonzero`` whose output length is data) makes the host wait for the device. The code reads values
only where :func:`minimoe.ops._checks.reads_are_free` says so (CPU tensors). Here the flag
``SIMULATE_ACCELERATOR`` makes CPU tensors take the accelerator's branches, and a dispatch mode
fails every operator that reads values or sizes its output by them: the CPU proof that a CUDA run
would not synchronise. With a GPU present the same forward runs under
``torch.cuda.set_sync_debug_mode("error")``.
"""
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minimoe import MoELayer
from minimoe.experiments.configs import router_options, task_config
from minimoe.ops import _checks
from minimoe.routers import available

# operators that copy values to the host or whose output size is data
READS = {"_local_scalar_dense", "nonzero", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
         "masked_select", "repeat_interleave", "item", "equal", "is_nonzero"}


class NoHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in READS:
            raise AssertionError(f"host read: aten::{name}")
        # x[mask] and x[mask] = v with a boolean mask: the selected count is data
        if name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
            raise AssertionError(f"host read: aten::{name} with a boolean mask")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def accelerator(monkeypatch):
    """CPU tensors take the accelerator's branches; ``tolist`` (which bypasses the dispatcher) fails."""
    monkeypatch.setattr(_checks, "SIMULATE_ACCELERATOR", True)

    def no_tolist(self):
        raise AssertionError("host read: Tensor.tolist")
    monkeypatch.setattr(torch.Tensor, "tolist", no_tolist)


#: Routers whose training forward reads routing values on the host, and why (each is a property of
#: the algorithm or of a solver that runs on the CPU, not an oversight; the test below fails when one
#: of them stops reading, so that this list stays true).
READS_BY_DESIGN = {
    "base": "the balanced assignment is solved on the CPU (scipy or the exact solver of chapter 2)",
    "kool_gumbel_matching": "the Gumbel-matching sample is an assignment solved on the CPU",
    "sinkhorn_token_choice": "balance_tol: whether the fixed iterations balanced the plan decides a second solve",
    "sinkhorn_expert_choice": "balance_tol: whether the fixed iterations balanced the plan decides a second solve",
    "ssr": "its Sinkhorn branch stops at a tolerance (and the coin that picks the branch is drawn on the host)",
    "probmoe_exact": "the k-subset DP picks each row's number domain (linear, float64, log) from its logits' range",
    "probmoe_dynamic": "the k-subset DP picks each row's number domain (linear, float64, log) from its logits' range",
}
SYNC_FREE = [name for name in available() if name not in READS_BY_DESIGN]


def _layer(name, **extra):
    """The layer on its default path: slot buffers with a capacity, sorted segments without."""
    options = {**router_options(name, task_config("clustered", "toy", n_experts=4, group_size=8)), **extra}
    torch.manual_seed(0)
    layer = MoELayer(16, 32, 4, name, router_options=options, group_size=8).train()
    layer.dropless = getattr(layer.router, "capacity_factor", None) is None and name != "soft_moe"
    return layer


@pytest.mark.parametrize("name", SYNC_FREE)
def test_training_forward_reads_nothing_on_the_host(name, accelerator):
    layer = _layer(name)
    x = torch.randn(2, 8, 16)
    with NoHostReads():
        out = layer(x)
        (out.square().mean() + layer.aux_loss).backward()  # and the backward pass reads nothing either
    # the accelerator's branches compute what the CPU's do
    routing = layer.last_routing
    assert out.shape == (2, 8, 16)
    torch.testing.assert_close(out, layer.apply_routing(x.view(2, 8, 16), routing, "einsum"))


def test_the_detector_catches_each_pattern(accelerator):
    """The test above can fail: every pattern it forbids is caught."""
    t = torch.ones(3)
    for read in (lambda: t.sum().item(), lambda: bool(t.sum() > 0), lambda: float(t.max()), lambda: int(t[0]),
                 lambda: t.nonzero(), lambda: t.unique(), lambda: t[t > 0]):
        with pytest.raises(AssertionError, match="host read"), NoHostReads():
            read()
    with pytest.raises(AssertionError, match="host read"):
        t.tolist()
    # the layer's dropless slot path reads the largest load (its buffer size): caught
    layer = _layer("softmax_topk", capacity_factor=None)
    layer.path = "slots"
    with pytest.raises(AssertionError, match="host read"), NoHostReads():
        layer(torch.randn(2, 8, 16))


@pytest.mark.parametrize("name", sorted(READS_BY_DESIGN))
def test_the_routers_that_read_by_design_do_read(name, accelerator):
    layer = _layer(name, **({"p": 1.0} if name == "ssr" else {}))
    with pytest.raises(AssertionError, match="host read"), NoHostReads():
        layer(torch.randn(2, 8, 16))


@pytest.mark.parametrize("options", [{}, {"ot_method": "annealed", "gamma": 0.5},
                                     {"capacity_factor": 2.0, "ot_iters": 5, "ot_lr": 0.05}])
def test_sparsity_constrained_ec_routes_the_same_without_its_host_reads(options, monkeypatch):
    """On an accelerator the router skips the solver's row-error read (and its warning): the same
    slots, weights and row error as the CPU branch, which reads it, with the router's options passed
    on alike. With method "adam" nothing is read at all; "annealed" still reads its stage count."""
    torch.manual_seed(3)
    router = _layer("sparsity_constrained_ec", **options).router
    logits = torch.randn(3, 40, 4) * 2
    cpu = router.route(logits)
    monkeypatch.setattr(_checks, "SIMULATE_ACCELERATOR", True)
    with NoHostReads() if router.ot_method == "adam" else contextlib.nullcontext():
        accelerator = router.route(logits)
    assert torch.equal(accelerator.position, cpu.position) and torch.equal(accelerator.combine, cpu.combine)
    assert torch.equal(accelerator.stats["plan_row_error"], cpu.stats["plan_row_error"])


def test_nan_logits_still_stop_the_forward_without_a_host_read(accelerator):
    layer = _layer("softmax_topk")
    x = torch.randn(2, 8, 16)
    x[0, 0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="finite"):
        layer(x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", SYNC_FREE)
def test_no_synchronisation_on_cuda(name):
    layer = _layer(name).cuda()
    x = torch.randn(2, 8, 16, device="cuda")
    if layer.dropless:  # CUDA's grouped matmul takes bfloat16; in float32 the segments are a loop
        layer, x = layer.to(torch.bfloat16), x.to(torch.bfloat16)
    layer(x)  # first call: lazy initialisation may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
