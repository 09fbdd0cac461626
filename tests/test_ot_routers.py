"""The optimal-transport routers (Sinkhorn token/expert choice, BASE, SSR) and the facts of chapter 3."""
import itertools
import math
import warnings

import pytest
import torch

from minimoe import MoELayer
from minimoe.ops import (gaussian_top1_probability, gaussian_top1_product_bound, linear_assignment, sinkhorn,
                         top_k)
from minimoe.ops.allocation import expert_choice_allocation, token_choice_allocation
from minimoe.routers import (BaseLayerRouter, SelectiveSinkhorn, SinkhornExpertChoice, SinkhornTokenChoice,
                             available, build)


def skewed_logits(G, T, E, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(G, T, E, generator=gen, dtype=dtype)
    logits[..., 0] += 3  # a popular expert
    return logits


def test_registry_has_the_ot_routers():
    assert {"sinkhorn_token_choice", "sinkhorn_expert_choice", "base", "ssr"} <= set(available())


def test_sinkhorn_token_choice_is_topk_with_expert_bias():
    """Within a row the plan is exp((S + g) / eps) times the token's own factor: top-k of the plan is
    top-k of the logits shifted by one bias per expert (the column potential)."""
    logits = skewed_logits(3, 64, 8)
    router = SinkhornTokenChoice(4, 8, k=2, capacity_factor=None, sinkhorn_iters=5000, sinkhorn_tol=1e-12).eval()
    routing = router.route(logits)
    g = sinkhorn(logits, 1.0, tol=1e-12, max_iter=5000, return_potentials=True).g
    chosen = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, (logits + g[:, None, :]).topk(2, -1).indices, True)
    assert torch.equal(routing.mask, chosen)
    # and the bias balances: top-1 loads are much flatter than softmax top-1's
    top1_plan = torch.bincount((logits + g[:, None, :]).argmax(-1).flatten(), minlength=8).double()
    top1_soft = torch.bincount(logits.argmax(-1).flatten(), minlength=8).double()
    assert top1_plan.std() < 0.5 * top1_soft.std()


def test_sinkhorn_routers_dispatch_from_plan_combine_from_softmax():
    logits = skewed_logits(2, 32, 4)
    plan = sinkhorn(logits, 1.0, max_iter=20, tol=0, last_update="rows")  # the routers end on rows (V-MoE)
    probs = torch.softmax(logits, -1)
    tc = SinkhornTokenChoice(4, 4, k=2, capacity_factor=1.0).eval()
    r = tc.route(logits)
    assert torch.equal(r.position, token_choice_allocation(plan, 2, tc.capacity(32)))
    assert torch.allclose(r.combine, probs * r.mask)
    ec = SinkhornExpertChoice(4, 4, capacity_factor=1.0).eval()
    r = ec.route(logits)
    assert torch.equal(r.position, expert_choice_allocation(plan, ec.capacity(32)))
    assert torch.allclose(r.combine, probs * r.mask)
    assert (r.tokens_per_expert() == ec.capacity(32)).all()
    r = SinkhornTokenChoice(4, 4, k=1, combine="plan").eval().route(logits)
    assert torch.allclose(r.combine, plan * r.mask)
    # the gate learns through the softmax combine weights only
    layer = MoELayer(8, 16, 4, router="sinkhorn_token_choice", router_options=dict(k=2))
    layer(torch.randn(2, 16, 8)).square().sum().backward()
    assert layer.router.gate.weight.grad.abs().sum() > 0


def test_sinkhorn_expert_choice_leaves_fewer_tokens_unchosen():
    """The row potential demotes tokens every expert wants (Liu et al. App. A, strong skew, c = 1)."""
    logits = skewed_logits(20, 64, 8, seed=3)
    logits += 3 * torch.randn(20, 64, 1, generator=torch.Generator().manual_seed(4), dtype=logits.dtype)
    soft = build("expert_choice", 4, 8).eval().route(logits)
    sink = SinkhornExpertChoice(4, 8).eval().route(logits)
    unchosen = lambda r: (~r.mask.any(-1)).double().mean().item()  # noqa: E731
    assert unchosen(sink) < unchosen(soft)


def test_base_router_balanced_in_training_greedy_at_eval():
    logits = skewed_logits(3, 64, 8, dtype=torch.float32)
    router = BaseLayerRouter(4, 8).train()
    r = router.route(logits)
    assert torch.equal(r.tokens_per_expert(), torch.full((3, 8), 8))
    assert (r.mask.sum(-1) == 1).all()
    expert = r.mask.float().argmax(-1)
    assert torch.equal(expert, linear_assignment(logits, 8))
    assert torch.allclose(r.combine.sum(-1), torch.sigmoid(logits).gather(-1, expert[..., None])[..., 0])
    r = router.eval().route(logits)
    assert torch.equal(r.mask.float().argmax(-1), logits.argmax(-1))
    assert r.capacity is None
    layer = MoELayer(8, 16, 4, router="base")
    layer(torch.randn(2, 16, 8)).square().sum().backward()
    assert layer.router.gate.weight.grad.abs().sum() > 0  # through the sigmoid gate value


def test_ssr_coin_per_layer_per_forward():
    """Each layer draws its own coin on each training forward: Binomial counts, independent layers."""
    n = 10_000
    layers = [SelectiveSinkhorn(4, 4, k=2, p=0.1, seed=s).train() for s in (1, 2)]
    logits = torch.randn(1, 4, 4)
    draws = torch.tensor([[layer.flip_coin() for layer in layers] for _ in range(n)], dtype=torch.float64)
    mean, sd = n * 0.1, math.sqrt(n * 0.1 * 0.9)
    for column in draws.T:
        assert abs(column.sum().item() - mean) <= 4 * sd
    assert abs(torch.corrcoef(draws.T)[0, 1].item()) < 0.05
    # through route(): the counter and the stat follow the coin, and seeding makes it reproducible
    a, b = SelectiveSinkhorn(4, 4, p=0.3, seed=7).train(), SelectiveSinkhorn(4, 4, p=0.3, seed=7).train()
    used = [a.route(logits).stats["used_sinkhorn"] for _ in range(200)]
    assert used == [b.route(logits).stats["used_sinkhorn"] for _ in range(200)]
    assert a.sinkhorn_calls == sum(used) and 0 < sum(used) < 200
    assert SelectiveSinkhorn(4, 4, p=1.0).train().route(logits).stats["used_sinkhorn"] == 1.0
    assert SelectiveSinkhorn(4, 4, p=0.0).train().route(logits).stats["used_sinkhorn"] == 0.0


def test_ssr_never_sinkhorn_at_eval():
    router = SelectiveSinkhorn(4, 4, p=1.0, noise_scale=1.0).eval()
    logits = torch.randn(2, 8, 4)
    for _ in range(20):
        r = router.route(logits)
        assert r.stats["used_sinkhorn"] == 0.0
    assert router.sinkhorn_calls == 0
    expected = top_k(torch.softmax(logits, -1), 2, renormalize=True)
    dense = torch.zeros_like(logits).scatter(-1, expected[1], expected[0])
    assert torch.allclose(r.combine, dense, atol=1e-6)  # softmax top-k, deterministic
    ablation = SelectiveSinkhorn(4, 4, p=1.0, eval_mode="sinkhorn_p").eval()
    assert ablation.route(logits).stats["used_sinkhorn"] == 1.0


def test_ssr_plan_weights_are_prop_4_1():
    logits = skewed_logits(2, 32, 8, dtype=torch.float32)
    for cost in ("linear", "softmax"):
        r = SelectiveSinkhorn(4, 8, k=2, p=1.0, cost=cost).train().route(logits)
        c = logits if cost == "linear" else torch.softmax(logits, -1)
        plan = sinkhorn(c, 0.5, max_iter=100, tol=1e-4)
        values, indices = top_k(plan, 2, renormalize=True)
        assert torch.allclose(r.combine, torch.zeros_like(plan).scatter(-1, indices, values), atol=1e-5)
        assert torch.allclose(r.combine.sum(-1), torch.ones(2, 32), atol=1e-6)
        assert (r.mask.sum(-1) == 2).all()


def test_prop_4_1_brute_force_kl():
    """Among distributions with at most k nonzeros, KL(alpha || q) is smallest for the renormalised
    top-k of q, and equals -log(sum of the top-k)."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(30):
        E = int(torch.randint(2, 8, (1,), generator=gen))
        k = int(torch.randint(1, min(3, E) + 1, (1,), generator=gen))
        q = torch.softmax(2 * torch.randn(E, generator=gen, dtype=torch.float64), -1)
        values, indices = top_k(q, k, renormalize=True)
        kl_topk = (values * (values / q[indices]).log()).sum().item()
        assert abs(kl_topk + math.log(q.topk(k).values.sum().item())) < 1e-12
        for size in range(1, k + 1):
            for support in itertools.combinations(range(E), size):
                qs = q[list(support)]
                alpha = qs / qs.sum()  # the best weights on a fixed support (Lagrange)
                assert (alpha * (alpha / qs).log()).sum().item() >= kl_topk - 1e-12
                # and on that support, random other weights do no better
                other = torch.distributions.Dirichlet(torch.ones(size, dtype=torch.float64)).sample()
                assert (other * (other / qs).log()).sum().item() >= kl_topk - 1e-12


def test_ssr_bias_form():
    """A Sinkhorn step is softmax top-k at temperature eps on the cost shifted by the column potential."""
    logits = skewed_logits(1, 48, 6)[0]
    for cost in (logits, torch.softmax(logits, -1)):
        out = sinkhorn(cost, 0.5, tol=1e-12, max_iter=10000, return_potentials=True)
        values, indices = top_k(out.plan, 2, renormalize=True)
        shifted = (cost + out.g) / 0.5
        assert torch.equal(indices, shifted.topk(2, -1).indices)
        assert torch.allclose(values, torch.softmax(shifted.gather(-1, indices), -1), atol=1e-10)


def test_ssr_gradient_flow():
    x = torch.randn(2, 16, 8)
    for p, detach, gate_grad in [(0.0, True, True), (1.0, True, False), (1.0, False, True)]:
        layer = MoELayer(8, 16, 4, router="ssr", router_options=dict(k=2, p=p, detach_plan=detach))
        layer(x).square().sum().backward()
        g = layer.router.gate.weight.grad
        assert (g is not None and g.abs().sum() > 0) == gate_grad, (p, detach)
        assert layer.experts.w_in.grad.abs().sum() > 0  # the experts always learn


def test_ssr_noise_only_in_training():
    logits = torch.randn(2, 16, 4)
    quiet = SelectiveSinkhorn(4, 4, p=0.0, noise_scale=0.0).train()
    torch.manual_seed(0)
    a = quiet.route(logits).combine
    torch.manual_seed(1)
    assert torch.equal(a, quiet.route(logits).combine)  # noise_scale=0: deterministic
    noisy = SelectiveSinkhorn(4, 4, p=0.0, noise_scale=2.0).train()
    masks = {tuple(noisy.route(logits).mask.flatten().tolist()) for _ in range(5)}
    assert len(masks) > 1
    noisy.eval()
    assert len({tuple(noisy.route(logits).mask.flatten().tolist()) for _ in range(5)}) == 1
    # selection by the noisy cost, weights from the clean logits over the chosen pair
    torch.manual_seed(3)
    r = noisy.train().route(logits)
    chosen = r.mask
    clean = torch.softmax(logits.masked_fill(~chosen, -float("inf")), -1)
    assert torch.allclose(r.combine, clean, atol=1e-6)


def test_eval_routing_is_batch_independent():
    """At eval, a token's routing does not depend on the other tokens; a Sinkhorn step does."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(1, 16, 4, generator=gen)
    others = torch.randn(1, 16, 4, generator=gen) * 3
    router = SelectiveSinkhorn(4, 4, p=1.0).eval()
    a = router.route(logits).combine[0, 0]
    b = router.route(torch.cat([logits[:, :1], others[:, 1:]], 1)).combine[0, 0]
    assert torch.allclose(a, b, atol=1e-6)
    router.train()
    a = router.route(logits).combine[0, 0]
    others[..., 0] += 4  # the other tokens now crowd expert 0
    b = router.route(torch.cat([logits[:, :1], others[:, 1:]], 1)).combine[0, 0]
    assert (a - b).abs().max() > 1e-4


def test_gaussian_top1_exact_vs_monte_carlo():
    gen = torch.Generator().manual_seed(7)
    n = 200_000
    for scores, std in [(torch.tensor([0.5, 0.0, -1.0, 2.0]), 0.7), (torch.zeros(3), 1.0), (torch.randn(6, generator=gen), 0.5)]:
        exact = gaussian_top1_probability(scores.double(), std)
        assert abs(exact.sum().item() - 1) < 1e-9
        wins = (scores + std * torch.randn(n, scores.numel(), generator=gen)).argmax(-1)
        freq = torch.bincount(wins, minlength=scores.numel()).double() / n
        se = (exact * (1 - exact) / n).sqrt()
        assert ((freq - exact).abs() <= 4 * se + 1e-4).all()
    # two experts: the pairwise formula is exact
    s = torch.tensor([0.3, -0.4], dtype=torch.float64)
    assert torch.allclose(gaussian_top1_probability(s, 0.8), gaussian_top1_product_bound(s, 0.8), atol=1e-9)


def test_gaussian_top1_product_formula_is_only_a_bound():
    """SSR's Prop. 4.3 multiplies dependent events: for E equal experts 2^-(E-1) instead of 1/E."""
    for E in (3, 5, 8):
        exact = gaussian_top1_probability(torch.zeros(E, dtype=torch.float64), 1.0)
        product = gaussian_top1_product_bound(torch.zeros(E, dtype=torch.float64), 1.0)
        assert torch.allclose(exact, torch.full((E,), 1 / E, dtype=torch.float64), atol=1e-9)
        assert torch.allclose(product, torch.full((E,), 2.0 ** -(E - 1), dtype=torch.float64), atol=1e-12)
    gen = torch.Generator().manual_seed(8)
    for _ in range(20):  # Harris' inequality: always a lower bound
        s = torch.randn(int(torch.randint(2, 9, (1,), generator=gen)), generator=gen, dtype=torch.float64)
        assert (gaussian_top1_product_bound(s, 0.6) <= gaussian_top1_probability(s, 0.6) + 1e-9).all()


@pytest.mark.parametrize("name, options, match", [
    ("ssr", dict(cost="cosine"), "cost"), ("ssr", dict(p=1.5), "p must"), ("ssr", dict(eps=0.0), "eps"),
    ("ssr", dict(noise_scale=-1.0), "noise_scale"), ("ssr", dict(cost="softmax", noisy_weights=True), "noisy_weights"),
    ("ssr", dict(eval_mode="greedy"), "eval_mode"), ("ssr", dict(k=5), "k must"),
    ("sinkhorn_token_choice", dict(combine="sum"), "combine"), ("sinkhorn_token_choice", dict(eps=-1.0), "eps"),
    ("sinkhorn_expert_choice", dict(sinkhorn_iters=0), "sinkhorn_iters"), ("base", dict(method="greedy"), "method"),
])
def test_bad_router_options(name, options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build(name, 4, 4, **options)


def test_sinkhorn_token_choice_renormalize_and_softmax_eval():
    logits = skewed_logits(2, 32, 4, dtype=torch.float32)
    r = SinkhornTokenChoice(4, 4, k=2, capacity_factor=None, renormalize=True).eval().route(logits)
    assert torch.allclose(r.combine.sum(-1), torch.ones(2, 32), atol=1e-6)
    router = SinkhornTokenChoice(4, 4, k=2, capacity_factor=None, eval_routing="softmax").eval()
    r = router.route(logits)
    assert torch.equal(r.mask, torch.zeros_like(r.mask).scatter(-1, logits.topk(2, -1).indices, True))
    # eval routing by softmax is causal: a token's routing ignores the later tokens
    later = logits.clone()
    later[:, 1:] = torch.randn_like(later[:, 1:]) * 5
    assert torch.equal(router.route(later).mask[:, 0], r.mask[:, 0])
    router.train()  # training still dispatches by the plan
    plan = sinkhorn(logits, 1.0, max_iter=20, tol=0, last_update="rows")
    assert torch.equal(router.route(logits).position, token_choice_allocation(plan, 2, None))
    with pytest.raises(ValueError, match="eval_routing"):
        SinkhornTokenChoice(4, 4, eval_routing="greedy")


# ---------------------------------------------------------------- the order of the updates, large logits

def test_sinkhorn_router_ends_on_the_row_update():
    """V-MoE (through OTT) ends Sinkhorn on the row update: every row of the plan sums to 1, the columns
    carry the error. The routers do the same by default; last_update="columns" gives the other order."""
    logits = skewed_logits(2, 32, 4) * 10  # large enough that 20 iterations leave a visible error
    router = SinkhornTokenChoice(4, 4, k=1, combine="plan", capacity_factor=None, balance_tol=None).train()
    routing = router.route(logits)
    plan = sinkhorn(logits, 1.0, max_iter=20, tol=0, method="sinkhorn", last_update="rows")
    assert torch.allclose(plan.sum(-1), torch.ones((), dtype=plan.dtype), atol=1e-6)
    assert (plan.sum(-2) - 8).abs().max() > 1e-3, "the columns carry the error"
    assert torch.allclose(routing.combine, plan * routing.mask)
    columns = sinkhorn(logits, 1.0, max_iter=20, tol=0, method="sinkhorn")
    assert torch.allclose(columns.sum(-2), torch.full((), 8.0, dtype=columns.dtype), atol=1e-5)
    # one more row update turns the column-ending plan into the row-ending one
    assert torch.allclose(columns / columns.sum(-1, keepdim=True), plan, atol=1e-6)
    assert float(routing.stats["plan_marginal_error"]) == pytest.approx(
        float(((plan.sum(-2) - 8).abs() / 8).max()), rel=1e-4)


@pytest.mark.parametrize("name", ["sinkhorn_token_choice", "sinkhorn_expert_choice"])
@pytest.mark.parametrize("scale", [30.0, 100.0, 1e4])
def test_sinkhorn_routers_balance_at_any_logit_scale(name, scale):
    """20 fixed iterations stop balancing at large logits (Sinkhorn's rate tends to 1): with
    balance_tol=None the plan's columns stay off by > 5%; by default the router goes on until the plan
    is within balance_tol, and reports the error it reached."""
    gen = torch.Generator().manual_seed(int(scale))
    logits = torch.randn(4, 256, 8, generator=gen) * scale
    fixed = build(name, 8, 8, balance_tol=None).train().route(logits)
    assert float(fixed.stats["plan_marginal_error"]) > 0.05
    balanced = build(name, 8, 8).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # converging is the normal case: no warning
        routing = balanced.route(logits)
    assert float(routing.stats["plan_marginal_error"]) <= 0.05
    plan = sinkhorn(logits, 1.0, tol=0.05, max_iter=1000, last_update="rows")
    assert ((plan.sum(-2) - 32).abs() / 32).max() <= 0.05
    if name == "sinkhorn_token_choice":  # fewer tokens dropped than by the unbalanced plan
        assert float(routing.stats["drop_rate"]) <= float(fixed.stats["drop_rate"])


@pytest.mark.parametrize("scale", [1e2, 1e3, 1e4])
def test_ssr_with_the_plans_gradient_trains_at_large_logits(scale):
    """ssr(detach_plan=False) backpropagates through the plan's implicit gradient; at |S| / eps of 1e3
    the plan has exact zeros and the old E x E solve was singular (LinAlgError). The gradient is finite
    (its values are checked against finite differences in test_sinkhorn.py)."""
    router = build("ssr", 8, 4, k=2, p=1.0, detach_plan=False, seed=0).train()
    logits = (torch.randn(2, 32, 4, generator=torch.Generator().manual_seed(1)) * scale).requires_grad_()
    routing = router.route(logits)
    assert routing.stats["used_sinkhorn"] == 1.0
    (routing.combine * torch.randn_like(routing.combine)).sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_prop_4_2_expert_offsets_move_the_softmax_dispatch_not_the_sinkhorn_dispatch():
    """Chapter 4, Proposition 4.2: adding a per-expert offset b to every token's logits leaves the converged
    Sinkhorn plan (and both Sinkhorn routers' dispatch) unchanged, with g' = g - b; softmax token choice picks
    the top-k of S + b, and softmax expert choice ranks column r by S_tr + b_r - LSE_j(S_tj + b_j) (oracles
    computed directly from these formulas)."""
    gen = torch.Generator().manual_seed(21)
    T, E, C = 64, 4, 16
    S = torch.randn(T, E, generator=gen, dtype=torch.float64)
    converged = dict(sinkhorn_iters=5000, sinkhorn_tol=1e-12, balance_tol=None)
    base_tc = SinkhornTokenChoice(1, E, k=2, capacity_factor=None, **converged).eval().route(S[None])
    base_ec = SinkhornExpertChoice(1, E, capacity_factor=1.0, **converged).eval().route(S[None])
    ref = sinkhorn(S, 1.0, tol=1e-12, max_iter=5000, return_potentials=True)
    for scale in (0.5, 2.0, 5.0):
        b = scale * torch.randn(E, generator=gen, dtype=torch.float64)
        shifted = S + b
        out = sinkhorn(shifted, 1.0, tol=1e-12, max_iter=5000, return_potentials=True)
        assert torch.allclose(out.plan, ref.plan, atol=1e-9)                      # (a) the plan
        shift = (out.g + b - ref.g)
        assert torch.allclose(shift, shift.mean().expand(E), atol=1e-7)           # g' = g - b up to a constant
        tc = SinkhornTokenChoice(1, E, k=2, capacity_factor=None, **converged).eval().route(shifted[None])
        ec = SinkhornExpertChoice(1, E, capacity_factor=1.0, **converged).eval().route(shifted[None])
        assert torch.equal(tc.mask, base_tc.mask) and torch.equal(ec.mask, base_ec.mask)
        assert not torch.allclose(tc.combine, base_tc.combine)                    # the softmax weights do move
        # (b) softmax token choice: the top-2 of S + b in every row
        soft_tc = build("softmax_topk", 1, E, k=2, capacity_factor=None).eval().route(shifted[None]).mask[0]
        oracle_tc = torch.zeros(T, E, dtype=torch.bool).scatter(-1, shifted.topk(2, -1).indices, True)
        assert torch.equal(soft_tc, oracle_tc)
        # (b) softmax expert choice: column r ranked by S_tr + b_r - LSE_j(S_tj + b_j)
        soft_ec = build("expert_choice", 1, E, capacity_factor=1.0).eval().route(shifted[None]).mask[0]
        key = shifted - torch.logsumexp(shifted, -1, keepdim=True)
        oracle_ec = torch.zeros(T, E, dtype=torch.bool).scatter(0, key.topk(C, 0).indices, True)
        assert torch.equal(soft_ec, oracle_ec)
        plain_ec = build("expert_choice", 1, E, capacity_factor=1.0).eval().route(S[None]).mask[0]
        assert not torch.equal(soft_ec, plain_ec)                                 # the offset changed who is chosen
    # a strongly popular expert overflows softmax token choice but not Sinkhorn token choice
    b = torch.tensor([4.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    capped = dict(k=1, capacity_factor=1.0)
    soft_drop = build("softmax_topk", 1, E, **capped).eval().route((S + b)[None]).stats["drop_rate"]
    sink_drop = SinkhornTokenChoice(1, E, **capped, **converged).eval().route((S + b)[None]).stats["drop_rate"]
    assert soft_drop > 0.5 > sink_drop
