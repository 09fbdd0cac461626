"""Nothing silent, nothing unbounded: inputs at the edge of the float range, parameters gone bad, mixed
dtypes. Each case either gives a correct result or a clear error that names what to change, in
bounded time (the hang cases run in a subprocess with a time limit)."""
import subprocess
import sys
import textwrap

import pytest
import torch

import minimoe
from minimoe import MoELayer
from minimoe.ops import count_balanced_assignments, sinkhorn
from minimoe.routers import build


def _bounded(code: str, seconds: float = 60.0) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter; a hang fails the test instead of hanging the suite."""
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                              timeout=seconds)
    except subprocess.TimeoutExpired:
        pytest.fail(f"did not finish within {seconds:.0f} s:\n{code}")


@pytest.mark.parametrize("magnitude, eps, dtype", [(3e38, 1.0, "float32"), (1.0, 1e-308, "float64"),
                                                   (1e300, 1e-5, "float64"), (3e38, 1.0, "float64")])
def test_sinkhorn_at_the_edge_of_the_float_range_ends(magnitude, eps, dtype):
    """scores near the largest float, or eps near the smallest, once looped for ever in the eps-scaling
    schedule (its list of stages growing without end); now a plan or a ValueError, in seconds."""
    result = _bounded(f"""
        import torch, warnings
        from minimoe.ops import sinkhorn
        warnings.simplefilter("ignore")
        uniform = torch.rand(16, 4, dtype=torch.{dtype}, generator=torch.Generator().manual_seed(0))
        scores = (2 * uniform - 1) * {magnitude}
        try:
            plan = sinkhorn(scores, {eps})
            assert torch.isfinite(plan).all(), "a non-finite plan"
            print("plan")
        except ValueError as error:
            assert "eps" in str(error), error
            print("error:", error)
        """)
    assert result.returncode == 0, result.stderr


def test_sinkhorn_router_with_huge_logits_ends():
    result = _bounded("""
        import torch, warnings
        import minimoe
        warnings.simplefilter("ignore")
        router = minimoe.routers.build("sinkhorn_token_choice", 4, 4).train()
        row = torch.tensor([3e38, -3e38, 0.0, 1.0])
        routing = router.route(torch.stack([row.roll(t) for t in range(8)]))  # two tokens want each expert
        assert routing.tokens_per_expert().tolist() == [2, 2, 2, 2]
        """)
    assert result.returncode == 0, result.stderr


def test_overflowing_scores_over_eps_is_a_clear_error():
    with pytest.raises(ValueError, match=r"scores / eps overflows torch.float64 .*raise eps"):
        sinkhorn(torch.full((4, 2), 2.0, dtype=torch.float64), 1e-308)


def test_counting_assignments_has_a_size_guard():
    assert count_balanced_assignments(12, 3, 4) == 34650
    with pytest.raises(ValueError, match=r"count_balanced_assignments\(10000, 100, 100\) would take"):
        count_balanced_assignments(10000, 100, 100)


def test_a_non_finite_parameter_or_buffer_is_named():
    soft = build("soft_moe", 8, 4)
    with torch.no_grad():
        soft.scale.fill_(float("nan"))
    with pytest.raises(ValueError, match="soft_moe's scale parameter contains NaN"):
        soft(torch.randn(1, 4, 8))
    free = build("loss_free", 8, 4)
    with torch.no_grad():
        free.expert_bias[1] = float("inf")
    with pytest.raises(ValueError, match="loss_free's expert_bias buffer contains inf"):
        free(torch.randn(1, 4, 8))


def test_the_loss_free_bias_stays_float32_and_moves_in_bfloat16():
    """Its docstring promises a float32 bias: .to(bfloat16) converted it, and steps of 1e-3 then never
    moved it. Now the router's weights convert and the bias does not, so it moves as in float32."""
    router = build("loss_free", 8, 4).train()
    with torch.no_grad():
        router.expert_bias.fill_(1.0)  # 1 +- 1e-3 rounds back to 1 in bfloat16: a bfloat16 bias could not move
    router.to(torch.bfloat16)
    assert router.expert_bias.dtype == torch.float32 and router.gate.weight.dtype == torch.bfloat16
    assert router.state_dict()["expert_bias"].dtype == torch.float32
    skew = torch.tensor([3.0, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bfloat16)
    for _ in range(5):
        router(torch.randn(1, 16, 8, dtype=torch.bfloat16) + skew)
    assert not torch.equal(router.expert_bias, torch.ones(4)), "the bias did not move"


def test_mixed_expert_and_router_dtypes_get_a_clear_error():
    layer = MoELayer(8, 16, 4)
    layer.experts.double()
    with pytest.raises(TypeError, match="experts' weights are torch.float64.*layer.to"):
        layer(torch.randn(2, 8))
    layer.double()
    assert layer(torch.randn(2, 8, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.parametrize("scale", [1e15, 1e30])
def test_sinkhorn_proposal_weights_stay_finite_and_proper_at_huge_logits(scale):
    """kool_skip with the Sinkhorn proposal gave non-finite REINFORCE weights at logits of 1e30 (log P~
    from potentials that cancel to garbage): now log P~ is the plan's own log where the plan is
    representable, its rows are distributions, and every weight is finite."""
    router = build("kool_skip", 4, 4, sinkhorn_proposal=True).train()
    logits = torch.randn(1, 16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * scale
    routing = router.route(logits)
    assert torch.isfinite(routing.reinforce_weight).all()
    log_plan = minimoe.ops.sinkhorn_balance(logits, log=True)
    torch.testing.assert_close(log_plan.logsumexp(-1), torch.zeros(1, 16, dtype=torch.float64), atol=1e-9, rtol=0)


def test_empty_inputs_follow_the_rule():
    """No token: an empty plan. Tokens but no expert: infeasible, and said so (it used to return an
    empty plan whose rows could not sum to 1)."""
    assert sinkhorn(torch.zeros(0, 3)).shape == (0, 3)
    with pytest.raises(ValueError, match="4 tokens and no expert"):
        sinkhorn(torch.zeros(4, 0))
