"""Loss-free balancing (chapter 10): the bias ops, the ``loss_free`` router, shared experts, and the
expert-parallel all-reduce of the loads.

Oracles: the update formulas written out by hand; brute-force counting for the loads; scipy's
``linprog`` (HiGHS) for the balanced selection LP of chapter 6 and its dual; a single-device router
on all ranks' tokens for the expert-parallel bias; a layer without shared experts plus a hand-written
MLP for the shared ones.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from scipy.optimize import linprog

from minimoe import MoELayer
from minimoe.models import TinyLM
from minimoe.ops import bias_update, expert_loads, max_violation
from minimoe.parallel import ExpertParallelMoELayer, run_local
from minimoe.routers import LossFreeBalancing, build


def skewed_logits(T=256, E=8, seed=0, skew=2.0):
    """One group of logits whose experts are far from balanced: expert 0 is preferred by most tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, E, generator=g, dtype=torch.float64).float() + torch.linspace(skew, -skew, E)


def run_to_fixed_point(router, logits, steps):
    """Route the same logits ``steps`` times in training mode; the max violation of each call."""
    router.train()
    return [float(router.route(logits).stats["max_violation"]) for _ in range(steps)]


# -- the pure ops ---------------------------------------------------------------------------------------


def test_expert_loads_count_pairs_over_every_leading_dim():
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(3, 5, 7, 4, generator=g) < 0.4
    brute = [sum(bool(mask[a, b, c, e]) for a in range(3) for b in range(5) for c in range(7)) for e in range(4)]
    assert expert_loads(mask).tolist() == brute
    assert expert_loads(mask).dtype == torch.float32 and expert_loads(mask).shape == (4,)


def test_bias_update_formulas_by_hand():
    bias = torch.tensor([0.5, 0.0, -0.5, 0.0])
    loads = torch.tensor([10.0, 2.0, 4.0, 4.0])  # mean 5
    sign = bias_update(bias, loads, 0.1, "sign")
    assert torch.allclose(sign, torch.tensor([0.4, 0.1, -0.4, 0.1]))
    prop = bias_update(bias, loads, 0.1, "proportional")
    assert torch.allclose(prop, torch.tensor([0.5 - 0.1, 0.0 + 0.06, -0.5 + 0.02, 0.02]))
    # balanced loads and empty loads leave the bias where it is
    assert torch.equal(bias_update(bias, torch.full((4,), 3.0), 0.1, "sign"), bias)
    assert torch.equal(bias_update(bias, torch.zeros(4), 0.1, "proportional"), bias)
    # proportional is scale free: doubling every load gives the same step
    assert torch.allclose(bias_update(bias, 2 * loads, 0.1, "proportional"), prop)
    # the dtype of the bias is kept; integer loads are accepted
    assert bias_update(bias.double(), torch.tensor([1, 2, 3, 4]), 0.1).dtype == torch.float64


def test_max_violation():
    assert float(max_violation(torch.tensor([10.0, 2.0, 4.0, 4.0]))) == pytest.approx(1.0)
    assert float(max_violation(torch.full((5,), 7.0))) == 0.0
    assert float(max_violation(torch.zeros(3))) == 0.0


# -- convergence and the LP ----------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
def test_proportional_update_reaches_exact_balance_and_stays(k):
    """Tolerance: exact. On fixed logits (T = 256, E = 8, the first expert favoured by 2 logits) the
    proportional update reaches loads of exactly kT/E within 400 steps; there every step is zero."""
    logits = skewed_logits()
    router = build("loss_free", 4, 8, k=k, update="proportional", bias_rate=0.05)
    violations = run_to_fixed_point(router, logits, 500)
    assert violations[0] > 1.0  # far from balanced without the bias
    assert max(violations[-100:]) == 0.0
    bias = router.expert_bias.clone()
    router.route(logits)
    assert torch.equal(router.expert_bias, bias)  # a fixed point


@pytest.mark.parametrize("k, rate", [(1, 0.01), (2, 0.01)])
def test_sign_update_keeps_the_imbalance_in_a_band(k, rate):
    """Tolerance: after a burn-in of 800 steps, every call's max violation stays below 0.15 (a load at
    most 15% above the mean; at the start it is above 100%), and the bias stays bounded."""
    logits = skewed_logits()
    router = build("loss_free", 4, 8, k=k, update="sign", bias_rate=rate)
    violations = run_to_fixed_point(router, logits, 1400)
    assert violations[0] > 1.0
    assert max(violations[800:]) < 0.15
    spread = router.expert_bias.max() - router.expert_bias.min()
    assert spread < 2 * (logits.max() - logits.min())


def balanced_lp(scores: np.ndarray, k: int):
    """The balanced selection LP of chapter 6: max <s, x> s.t. each token picks k experts, each expert
    gets kT/E tokens, 0 <= x <= 1. Returns (optimum, column duals lambda) from HiGHS."""
    T, E = scores.shape
    rows = np.kron(np.eye(T), np.ones((1, E)))  # sum_e x_te = k
    cols = np.kron(np.ones((1, T)), np.eye(E))  # sum_t x_te = kT/E
    res = linprog(-scores.reshape(-1), A_eq=np.vstack([rows, cols]),
                  b_eq=np.concatenate([np.full(T, k), np.full(E, k * T / E)]), bounds=(0, 1), method="highs")
    assert res.status == 0
    lam = -res.eqlin.marginals[T:]  # prices of the expert constraints in the max problem
    return -res.fun, lam


def dual_objective(scores: np.ndarray, prices: np.ndarray, k: int) -> float:
    """D(lambda) = sum_t (sum of the k largest s_te - lambda_e) + (kT/E) sum_e lambda_e >= LP optimum."""
    T, E = scores.shape
    reduced = np.sort(scores - prices, axis=1)[:, -k:]
    return reduced.sum() + k * T / E * prices.sum()


@pytest.mark.parametrize("k, score, bias_on", [(1, "softmax", "logits"), (2, "softmax", "logits"),
                                                (2, "softmax", "scores"), (2, "sigmoid", "scores")])
def test_fixed_point_selection_is_lp_optimal_and_the_bias_is_a_dual(k, score, bias_on):
    """At the fixed point of the proportional update, top-k(score + bias) attains the optimum of the
    balanced LP (linprog), and -bias is an optimal dual price vector: D(-bias) = optimum (weak duality
    makes any other price vector worse or equal). The selection's score is the one the bias is added
    to (the logits, or the softmax/sigmoid scores)."""
    T, E = 96, 4
    logits = skewed_logits(T=T, E=E, seed=3, skew=1.0)
    router = build("loss_free", 4, E, k=k, score=score, bias_on=bias_on, update="proportional", bias_rate=0.02)
    violations = run_to_fixed_point(router, logits, 1500)
    assert violations[-1] == 0.0
    router.eval()
    routing = router.route(logits)
    base = logits if bias_on == "logits" else router.scores(logits)
    s = base[0].double().numpy()
    chosen = routing.mask[0].numpy()
    optimum, lam = balanced_lp(s, k)
    assert s[chosen].sum() == pytest.approx(optimum, rel=1e-9, abs=1e-9)
    bias = router.expert_bias.double().numpy()
    assert dual_objective(s, -bias, k) == pytest.approx(optimum, rel=1e-6, abs=1e-6)
    assert dual_objective(s, lam, k) == pytest.approx(optimum, rel=1e-6, abs=1e-6)  # linprog's own dual
    # and a price vector shifted by a constant is just as good: the dual is defined up to a constant
    assert dual_objective(s, -bias + 0.7, k) == pytest.approx(optimum, rel=1e-6, abs=1e-6)


# -- the router's contract -------------------------------------------------------------------------------


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("bias_on", ["logits", "scores"])
def test_combine_weights_are_the_unbiased_scores(score, bias_on):
    torch.manual_seed(0)
    logits = torch.randn(2, 40, 6, requires_grad=True)
    router = build("loss_free", 4, 6, k=2, score=score, bias_on=bias_on).eval()
    grads = []
    for bias in (torch.zeros(6), torch.tensor([3.0, -3.0, 0.5, 0.0, -0.2, 1.0])):
        router.expert_bias.copy_(bias)
        routing = router.route(logits)
        mask = routing.mask
        if score == "softmax":
            expected = torch.softmax(logits, -1) * mask
        else:
            sig = torch.sigmoid(logits) * mask
            expected = sig / sig.sum(-1, keepdim=True)
        assert torch.allclose(routing.combine, expected, atol=1e-6)
        assert (mask.sum(-1) == 2).all()  # dropless: every token keeps its k experts
        # the bias selects, but the gradient is that of the unbiased scores at the selection
        (g,) = torch.autograd.grad((routing.combine * torch.arange(6.0)).sum(), logits)
        (g_ref,) = torch.autograd.grad((expected * torch.arange(6.0)).sum(), logits)
        assert torch.allclose(g, g_ref, atol=1e-6)
        grads.append(mask)
    assert not torch.equal(grads[0], grads[1])  # the bias did move the selection


def test_the_bias_steps_once_per_call_from_the_loads_of_all_groups():
    """Global-batch statistics: one step from the loads summed over every group of the call."""
    torch.manual_seed(1)
    logits = torch.randn(5, 16, 4) + torch.tensor([1.0, 0.0, 0.0, -1.0])
    router = build("loss_free", 4, 4, k=1, update="proportional", bias_rate=0.1)
    routing = router.route(logits)
    expected = bias_update(torch.zeros(4), expert_loads(routing.mask), 0.1, "proportional")
    assert torch.allclose(router.expert_bias, expected)
    assert torch.equal(routing.stats["bias"], torch.zeros(4))  # the bias this call selected with
    assert float(routing.stats["max_violation"]) == pytest.approx(float(max_violation(expert_loads(routing.mask))))
    assert routing.aux_loss.item() == 0.0 and not routing.aux_loss.requires_grad


def test_no_gradient_and_no_parameter_in_the_bias():
    router = build("loss_free", 4, 4)
    assert "expert_bias" in dict(router.named_buffers())
    assert all(p is router.gate.weight for p in router.parameters())
    assert router.expert_bias.dtype == torch.float32 and not router.expert_bias.requires_grad


def test_bias_frozen_in_eval_and_restored_from_a_checkpoint():
    torch.manual_seed(2)
    logits = torch.randn(3, 32, 4) + torch.tensor([2.0, 0.0, 0.0, 0.0])
    router = build("loss_free", 4, 4, k=1, bias_rate=0.01)
    for _ in range(20):
        router.route(logits)  # training mode: the bias moves
    trained = router.expert_bias.clone()
    assert trained.abs().sum() > 0
    router.eval()
    for _ in range(5):
        router.route(logits)
    assert torch.equal(router.expert_bias, trained)  # frozen in eval

    assert torch.equal(router.state_dict()["expert_bias"], trained)
    buffer = io.BytesIO()
    torch.save(router.state_dict(), buffer)
    buffer.seek(0)
    fresh = build("loss_free", 4, 4, k=1, bias_rate=0.01).eval()
    assert not torch.equal(fresh.route(logits).position, router.route(logits).position)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(fresh.expert_bias, trained)
    assert torch.equal(fresh.route(logits).position, router.route(logits).position)
    # and inside a layer's state_dict (what a training checkpoint saves)
    layer = MoELayer(4, 8, 4, router)
    assert torch.equal(layer.state_dict()["router.expert_bias"], trained)


def test_capacity_factor_drops_and_dropless_default():
    torch.manual_seed(3)
    logits = torch.randn(2, 32, 4) + torch.tensor([3.0, 0.0, 0.0, 0.0])
    dropless = build("loss_free", 4, 4, k=1).eval().route(logits)
    assert dropless.capacity is None and (dropless.mask.sum(-1) == 1).all()
    capped = build("loss_free", 4, 4, k=1, capacity_factor=1.0).eval().route(logits)
    assert capped.capacity == 8 and (capped.mask.sum(-2) <= 8).all() and (capped.mask.sum(-1) == 0).any()


# -- causality ----------------------------------------------------------------------------------------------


def test_a_later_token_cannot_change_an_earlier_tokens_routing():
    """Token choice without capacity: token t's selection reads only row t and the bias."""
    g = torch.Generator().manual_seed(4)
    for mode in ("train", "eval"):
        for _ in range(20):
            logits = torch.randn(2, 24, 5, generator=g)
            other = logits.clone()
            other[:, 12:] = 4 * torch.randn(2, 12, 5, generator=g)
            a = build("loss_free", 4, 5, k=2, bias_rate=0.1)
            a.expert_bias.copy_(torch.randn(5, generator=g))
            b = build("loss_free", 4, 5, k=2, bias_rate=0.1)
            b.load_state_dict(a.state_dict())
            a.train(mode == "train")
            b.train(mode == "train")
            ra, rb = a.route(logits), b.route(other)
            assert torch.equal(ra.position[:, :12], rb.position[:, :12])
            assert torch.equal(ra.combine[:, :12], rb.combine[:, :12])


def test_the_bias_depends_only_on_earlier_calls():
    """Two routers see the same batches for 10 calls, then different ones: their biases (and so the
    routings of calls 1..11) agree; only the bias after the first differing call may differ."""
    g = torch.Generator().manual_seed(5)
    shared = [torch.randn(2, 16, 4, generator=g) + torch.tensor([1.0, 0, 0, 0]) for _ in range(10)]
    a, b = (build("loss_free", 4, 4, k=1, bias_rate=0.05) for _ in range(2))
    for logits in shared:
        assert torch.equal(a.route(logits).position, b.route(logits).position)
    assert torch.equal(a.expert_bias, b.expert_bias)
    ra = a.route(torch.randn(2, 16, 4, generator=g))
    rb = b.route(torch.randn(2, 16, 4, generator=g) - torch.tensor([2.0, 0, 0, 0]))
    assert torch.equal(ra.stats["bias"], rb.stats["bias"])  # this call selected with the past only
    assert not torch.equal(a.expert_bias, b.expert_bias)  # it shapes the next calls


def _future_leak(model, vocab, seed=0):
    """Chapter 1's causality probe: change the last token of every sequence and measure how much the
    outputs at earlier positions move."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (4, 16), generator=g)
    idx2 = idx.clone()
    idx2[:, -1] = (idx2[:, -1] + 1) % vocab
    with torch.no_grad():
        return (model(idx) - model(idx2))[:, :-1].abs().max().item()


def test_language_model_with_loss_free_routing_is_causal():
    torch.manual_seed(0)
    lm = TinyLM(20, d_model=32, n_heads=2, block_size=32, n_experts=4, d_hidden=32, router="loss_free",
                router_options={"k": 1, "bias_rate": 0.1})
    g = torch.Generator().manual_seed(1)
    for _ in range(5):  # train-mode forwards move the bias away from 0
        lm(torch.randint(0, 20, (4, 16), generator=g))
    assert all(layer.router.expert_bias.abs().sum() > 0 for layer in lm.moe_layers())
    lm.eval()
    assert _future_leak(lm, 20) < 1e-6
    ec = TinyLM(20, d_model=32, n_heads=2, block_size=32, n_experts=4, d_hidden=32, router="expert_choice").eval()
    assert _future_leak(ec, 20) > 1e-4  # the probe does detect a leak when there is one


# -- bad options ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, error, words", [
    ({"k": 0}, ValueError, ["k", ">= 1"]),
    ({"k": 5}, ValueError, ["k", "<= 4"]),
    ({"score": "softmx"}, ValueError, ["score", "'softmax'", "'sigmoid'"]),
    ({"update": "adam"}, ValueError, ["update", "'sign'", "'proportional'"]),
    ({"bias_on": "gates"}, ValueError, ["bias_on", "'logits'", "'scores'"]),
    ({"bias_rate": -1e-3}, ValueError, ["bias_rate", ">= 0"]),
    ({"bias_rate": float("nan")}, ValueError, ["bias_rate"]),
    ({"bias_rate": "fast"}, TypeError, ["bias_rate"]),
    ({"capacity_factor": 0.0}, ValueError, ["capacity_factor", "> 0"]),
    ({"bias_lr": 0.1}, TypeError, ["bias_lr", "bias_rate"]),
])
def test_bad_options_get_clear_errors(options, error, words):
    with pytest.raises(error) as info:
        build("loss_free", 4, 4, **options)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_bad_inputs_to_the_ops_get_clear_errors():
    with pytest.raises(ValueError, match="update must be one of 'sign', 'proportional'"):
        bias_update(torch.zeros(3), torch.ones(3), 0.1, "momentum")
    with pytest.raises(ValueError, match="loads must have the shape of bias"):
        bias_update(torch.zeros(3), torch.ones(4), 0.1)
    with pytest.raises(ValueError, match="rate must be a finite number >= 0"):
        bias_update(torch.zeros(3), torch.ones(3), -1.0)
    with pytest.raises(ValueError, match="loads must be finite and >= 0"):
        max_violation(torch.tensor([1.0, -2.0]))
    with pytest.raises(TypeError, match="mask must be a torch.Tensor"):
        expert_loads([[True, False]])
    with pytest.raises(ValueError, match="n_shared_experts must be >= 0"):
        MoELayer(4, 8, 4, n_shared_experts=-1)


# -- shared experts ------------------------------------------------------------------------------------------


def test_shared_experts_add_to_the_routed_output_and_get_gradient():
    torch.manual_seed(6)
    layer = MoELayer(6, 10, 4, "loss_free", router_options={"k": 2}, n_shared_experts=2).double()
    plain = MoELayer(6, 10, 4, "loss_free", router_options={"k": 2}).double()
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("shared_experts")})
    x = torch.randn(3, 8, 6, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    routed = plain(x)
    sh = layer.shared_experts
    shared = sum(torch.nn.functional.linear(torch.nn.functional.gelu(x @ sh.w_in[i] + sh.b_in[i]),
                                            sh.w_out[i].t(), sh.b_out[i]) for i in range(2))
    assert torch.allclose(out, routed + shared, atol=1e-12)
    out.pow(2).sum().backward()
    for p in (sh.w_in, sh.w_out, layer.router.gate.weight, layer.experts.w_in):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert x.grad.abs().sum() > 0


def test_fine_grained_experts_at_equal_compute():
    """DeepSeekMoE's fine-grained experts are a configuration: m times more experts, m times narrower,
    m times larger k: the same parameters and the same expert FLOPs per token."""
    coarse = MoELayer(8, 32, 4, "loss_free", router_options={"k": 1}, bias=False)
    fine = MoELayer(8, 8, 16, "loss_free", router_options={"k": 4}, bias=False)
    count = lambda layer: sum(p.numel() for p in layer.experts.parameters())  # noqa: E731
    assert count(coarse) == count(fine)
    x = torch.randn(2, 8, 8)
    fine(x)
    active = lambda layer: layer.last_routing.mask.sum(-1).float().mean() * layer.d_hidden  # noqa: E731
    coarse(x)
    assert active(coarse) == active(fine)


# -- expert parallelism: every rank holds the same bias ---------------------------------------------------


def _ep_worker(rank, world):
    """Each rank routes its own tokens in training mode for 6 steps; the loads are all-reduced, so every
    rank takes the same step. The oracle: a single-device router on all ranks' tokens at once."""
    torch.manual_seed(0)  # the same layer on every rank
    ref = MoELayer(6, 5, 4, "loss_free", router_options={"k": 1, "bias_rate": 0.05, "update": "sign"},
                   group_size=8, n_shared_experts=1).double()
    ep = ExpertParallelMoELayer.from_single_device(ref, exchange="variable").train()
    ref.train()
    biases, outputs = [], []
    for step in range(6):
        g = torch.Generator().manual_seed(100 + step)
        x_all = torch.randn(world * 16, 6, generator=g, dtype=torch.float64) + torch.linspace(1, 0, 6).double()
        mine = x_all[rank * 16:(rank + 1) * 16]
        out_ref = ref(x_all)  # all ranks' groups in one call: the global batch
        out = ep(mine)
        outputs.append((out - out_ref[rank * 16:(rank + 1) * 16]).abs().max().item())
        biases.append((ep.router.expert_bias.clone(), ref.router.expert_bias.clone()))
    return {"biases": biases, "outputs": outputs}


def test_expert_parallel_ranks_agree_on_the_bias():
    results = run_local(_ep_worker, 2, timeout_s=60)
    for step in range(6):
        rank_biases = [res["biases"][step][0] for res in results]
        assert torch.equal(rank_biases[0], rank_biases[1])  # bitwise: one all-reduce, same step
        assert torch.equal(rank_biases[0], results[0]["biases"][step][1])  # = the global-batch router
    assert results[0]["biases"][-1][0].abs().sum() > 0  # the bias did move
    for res in results:
        assert max(res["outputs"]) < 1e-12  # and the layer (shared expert included) matches


# -- global-batch statistics for the Switch loss -----------------------------------------------------------


def test_switch_loss_over_the_whole_batch():
    """balance_scope="batch": f_e and P_e over all groups pooled (E * sum_e f_e P_e written out); the
    default "group" scope averages the per-group losses, which differs when the groups differ."""
    torch.manual_seed(7)
    logits = torch.cat([torch.randn(1, 16, 4) + torch.tensor([2.0, 0, 0, 0]),
                        torch.randn(1, 16, 4) + torch.tensor([0, 0, 0, 2.0])])
    common = dict(k=1, capacity_factor=None, balance_loss="switch", balance_loss_weight=1.0)
    batch = build("softmax_topk", 4, 4, balance_scope="batch", **common).route(logits).aux_loss
    group = build("softmax_topk", 4, 4, **common).route(logits).aux_loss
    probs = torch.softmax(logits, -1).reshape(-1, 4)
    f = torch.bincount(probs.argmax(-1), minlength=4).float() / probs.shape[0]
    assert batch.item() == pytest.approx(4 * (f * probs.mean(0)).sum().item(), rel=1e-6)
    per_group = []
    for g in range(2):
        p = torch.softmax(logits[g], -1)
        fg = torch.bincount(p.argmax(-1), minlength=4).float() / 16
        per_group.append(4 * (fg * p.mean(0)).sum().item())
    assert group.item() == pytest.approx(sum(per_group) / 2, rel=1e-6)
    assert batch.item() < group.item()  # pooled, the two skews cancel
    with pytest.raises(ValueError, match="balance_scope must be one of 'group', 'batch'"):
        build("softmax_topk", 4, 4, balance_scope="global")
    with pytest.raises(ValueError, match="balance_scope='batch'.*balance_loss='switch'"):
        build("softmax_topk", 4, 4, balance_scope="batch")
