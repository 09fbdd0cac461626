"""The production router's details as router options, each checked against an independent oracle:
the anchor's own code path in Hugging Face ``transformers`` where it has one (DeepSeek-V2/V3's
group-limited routers, Mixtral's jitter and float32 softmax, ``load_balancing_loss_func`` with an
attention mask, Qwen2-MoE's gated shared expert), else a loop over tokens written from the paper's
formula (DeepSeek-V3's sequence-wise balance loss) or ported from the anchor (DeepSpeed's TopKGate capacity rule
with its evaluation capacity factor).

Every option is off by default; the router digests (tests/test_router_digests.py) show that the
defaults compute what they computed before.
"""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from minimoe import MoELayer
from minimoe.ops import compute_capacity, group_limited_scores
from minimoe.routers import build

try:
    import transformers
except ImportError:  # the hf extra is not installed: the HF anchors are skipped, the hand oracles run
    transformers = None
needs_hf = pytest.mark.skipif(transformers is None, reason="needs the hf extra (transformers)")


def sorted_choices(index, weight):
    """Each token's (expert, weight) pairs sorted by expert: HF's top-k is unsorted."""
    order = index.argsort(-1)
    return index.gather(-1, order), weight.gather(-1, order)


# -- group-limited selection and routed scaling ----------------------------------------------------------

def loop_group_limited_topk(scores, n_group, topk_group, k, group_score):
    """Per token, in plain Python: score the groups, keep the best topk_group, take the top k inside."""
    E = scores.shape[-1]
    per = E // n_group
    out = []
    for row in scores.tolist():
        groups = [row[g * per:(g + 1) * per] for g in range(n_group)]
        value = [max(g) if group_score == "max" else sum(sorted(g)[-2:]) for g in groups]
        best = sorted(range(n_group), key=lambda g: -value[g])[:topk_group]
        allowed = [e for g in best for e in range(g * per, (g + 1) * per)]
        out.append(sorted(sorted(allowed, key=lambda e: -row[e])[:k]))
    return torch.tensor(out)


@pytest.mark.parametrize("group_score", ["max", "top2"])
def test_group_limited_scores_equal_the_per_token_rule(group_score):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(200, 12, generator=g, dtype=torch.float64)
    for n_group, topk_group, k in [(4, 2, 3), (3, 1, 2), (6, 3, 4), (4, 4, 2)]:
        masked = group_limited_scores(scores, n_group, topk_group, group_score)
        got = masked.topk(k, dim=-1).indices.sort(-1).values
        assert torch.equal(got, loop_group_limited_topk(scores, n_group, topk_group, k, group_score))
        groups_used = (got // (12 // n_group)).tolist()
        assert all(len(set(row)) <= topk_group for row in groups_used)
    assert group_limited_scores(scores, 1, 1) is scores


def test_group_limit_never_binds_with_max_scores_and_topk_group_at_least_k():
    """Chapter 10, "When the limit binds": with the group score "max" and topk_group >= k the
    selection is the plain top-k; with "top2" it can differ already at k = topk_group = 1."""
    scores = torch.randn(500, 16, generator=torch.Generator().manual_seed(1))
    for k, topk_group in [(1, 1), (2, 2), (3, 4), (2, 3)]:
        limited = group_limited_scores(scores, 8, topk_group, "max").topk(k, -1).indices.sort(-1).values
        assert torch.equal(limited, scores.topk(k, -1).indices.sort(-1).values)
    example = torch.tensor([[1.0, 0.0, 0.9, 0.9]])
    assert int(group_limited_scores(example, 2, 1, "top2").argmax()) in (2, 3)
    assert int(group_limited_scores(example, 2, 1, "max").argmax()) == 0
    assert not torch.equal(group_limited_scores(scores, 8, 2, "top2").topk(2, -1).indices.sort(-1).values,
                           scores.topk(2, -1).indices.sort(-1).values)


@needs_hf
def test_softmax_topk_group_limited_equals_deepseek_v2s_router():
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = transformers.DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=4,
                                           topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=2.5)
    torch.manual_seed(0)
    anchor = DeepseekV2TopkRouter(config)
    torch.nn.init.normal_(anchor.weight, std=0.5)
    hidden = torch.randn(64, 32)
    _, hf_weight, hf_index = anchor(hidden)
    router = build("softmax_topk", 32, 16, k=3, capacity_factor=None, n_group=4, topk_group=2, group_score="max",
                   routed_scaling=2.5)
    with torch.no_grad():
        router.gate.weight.copy_(anchor.weight)
    for mode in ("train", "eval"):
        routing = getattr(router, mode)()(hidden)
        index, weight = sorted_choices(routing.choice_expert, routing.choice_weight)
        want_index, want_weight = sorted_choices(hf_index, hf_weight)
        assert torch.equal(index, want_index)
        torch.testing.assert_close(weight, want_weight, rtol=0, atol=0)
    # the limit binds: without it some tokens choose outside their two best groups
    free = build("softmax_topk", 32, 16, k=3, capacity_factor=None, routed_scaling=2.5)
    free.gate.weight.data.copy_(anchor.weight)
    assert not torch.equal(sorted_choices(free(hidden).choice_expert, free(hidden).choice_weight)[0], want_index)


@needs_hf
def test_loss_free_group_limited_equals_deepseek_v3s_router():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=4,
                                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    torch.manual_seed(1)
    anchor = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(anchor.weight, std=0.5)
    anchor.e_score_correction_bias.normal_(0, 0.1)
    hidden = torch.randn(64, 32)
    _, hf_weight, hf_index = anchor(hidden)
    router = build("loss_free", 32, 16, k=3, score="sigmoid", bias_on="scores", bias_rate=0.0, n_group=4,
                   topk_group=2, routed_scaling=2.5, router_dtype="float32").eval()
    with torch.no_grad():
        router.gate.weight.copy_(anchor.weight)
        router.expert_bias.copy_(anchor.e_score_correction_bias)
    routing = router(hidden)
    index, weight = sorted_choices(routing.choice_expert, routing.choice_weight)
    want_index, want_weight = sorted_choices(hf_index, hf_weight)
    assert torch.equal(index, want_index)
    torch.testing.assert_close(weight, want_weight, rtol=1e-6, atol=1e-7)  # HF adds 1e-20 to the denominator


def test_group_limited_and_scaling_options_refuse_bad_values():
    for options, match in [({"n_group": 3}, "n_group=3 must divide"), ({"n_group": 4, "topk_group": 5}, "topk_group"),
                           ({"k": 3, "n_group": 4, "topk_group": 1}, "fewer than k=3"),
                           ({"n_group": 8, "group_score": "top2"}, "two best"), ({"group_score": "sum"}, "group_score"),
                           ({"routed_scaling": 0.0}, "routed_scaling"), ({"n_group": 0}, "n_group")]:
        for name in ("softmax_topk", "loss_free"):
            with pytest.raises(ValueError, match=match):
                build(name, 8, 8, **options)
    build("softmax_topk", 8, 8, n_group=8, topk_group=2, group_score="max")  # one expert per group: max is fine


def test_routed_scaling_multiplies_the_combine_weights_only():
    x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(3))
    for name, extra in [("softmax_topk", {"capacity_factor": 1.0}), ("loss_free", {"score": "sigmoid"})]:
        torch.manual_seed(0)
        plain = build(name, 8, 8, k=2, **extra).eval()
        torch.manual_seed(0)
        scaled = build(name, 8, 8, k=2, routed_scaling=2.5, **extra).eval()
        a, b = plain(x), scaled(x)
        assert torch.equal(a.choice_expert, b.choice_expert) and torch.equal(a.choice_slot, b.choice_slot)
        torch.testing.assert_close(b.choice_weight, 2.5 * a.choice_weight)


# -- float32 router probabilities --------------------------------------------------------------------------

def test_router_dtype_float32_gives_float32_probabilities_from_a_bfloat16_model():
    torch.manual_seed(0)
    router = build("softmax_topk", 16, 8, k=2, capacity_factor=None, renormalize=True, router_dtype="float32",
                   balance_loss="switch", z_loss_weight=1e-3).to(torch.bfloat16)
    x = torch.randn(3, 20, 16).to(torch.bfloat16)
    routing = router.train()(x)
    assert routing.probs.dtype == torch.float32 and routing.choice_weight.dtype == torch.float32
    # Switch's selective precision: the gate's matmul itself in float32
    want = torch.softmax(F.linear(x.float(), router.gate.weight.float()), dim=-1)
    torch.testing.assert_close(routing.probs, want, rtol=0, atol=0)
    assert routing.aux_loss.dtype == torch.float32
    routing.aux_loss.backward()
    assert router.gate.weight.grad.dtype == torch.bfloat16 and router.gate.weight.grad.abs().sum() > 0
    # the default keeps the model's dtype
    plain = build("softmax_topk", 16, 8, k=2).to(torch.bfloat16)
    assert plain(x).probs.dtype == torch.bfloat16
    # under autocast the router still computes in float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert router.float()(x.float()).probs.dtype == torch.float32


@needs_hf
def test_router_dtype_float32_equals_mixtrals_float32_softmax_of_bfloat16_logits():
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    config = transformers.MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    anchor = MixtralTopKRouter(config)
    torch.nn.init.normal_(anchor.weight)
    anchor.to(torch.bfloat16)
    hidden = torch.randn(40, 16).to(torch.bfloat16)
    logits, hf_weight, hf_index = anchor(hidden)
    assert logits.dtype == torch.bfloat16 and hf_weight.dtype == torch.float32
    router = build("softmax_topk", 16, 8, k=2, capacity_factor=None, renormalize=True, router_dtype="float32")
    routing = router.route(logits)        # the model's bfloat16 logits, routed in float32
    index, weight = sorted_choices(routing.choice_expert, routing.choice_weight)
    want_index, want_weight = sorted_choices(hf_index, hf_weight)
    assert torch.equal(index, want_index)
    torch.testing.assert_close(weight, want_weight, rtol=0, atol=0)
    torch.testing.assert_close(routing.probs, torch.softmax(logits.float(), -1), rtol=0, atol=0)


@needs_hf
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_swapped_bfloat16_model_reproduces_its_float32_softmax_router(family):
    from minimoe import hf

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0)
    if family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, num_local_experts=4,
                                                                           num_experts_per_tok=2))
    else:
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, norm_topk_prob=True))
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            torch.nn.init.normal_(p, std=0.5)
    model = model.to(torch.bfloat16).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        hf.swap_router(model)
        got = model(ids).logits
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_router_dtype_refuses_other_dtypes():
    for bad in ("bfloat16", torch.float16, "fp32", 32):
        with pytest.raises(ValueError, match="router_dtype must be None, 'float32' or 'float64'"):
            build("softmax_topk", 8, 4, router_dtype=bad)
    assert build("loss_free", 8, 4, router_dtype=torch.float64).router_dtype == torch.float64


# -- multiplicative jitter ------------------------------------------------------------------------------------

@needs_hf
def test_jitter_draws_what_mixtrals_block_draws():
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=32, num_local_experts=8,
                                        num_experts_per_tok=2, router_jitter_noise=0.2)
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config).train()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    seen = {}
    block.gate.register_forward_hook(lambda module, args, out: seen.update(input=args[0], out=out))
    x = torch.randn(3, 10, 16)
    torch.manual_seed(7)
    block(x.clone())                                   # (the block multiplies its input in place)
    _, hf_weight, hf_index = seen["out"]
    router = build("softmax_topk", 16, 8, k=2, capacity_factor=None, renormalize=True, jitter_noise=0.2).train()
    with torch.no_grad():
        router.gate.weight.copy_(block.gate.weight)
    torch.manual_seed(7)
    jittered = router.router_input(x)
    torch.testing.assert_close(jittered.reshape(-1, 16), seen["input"], rtol=0, atol=0)
    torch.manual_seed(7)
    routing = router(x)
    index, weight = sorted_choices(routing.choice_expert.reshape(-1, 2), routing.choice_weight.reshape(-1, 2))
    want_index, want_weight = sorted_choices(hf_index, hf_weight)
    assert torch.equal(index, want_index)
    torch.testing.assert_close(weight, want_weight, rtol=0, atol=0)


def test_jitter_is_multiplicative_training_only_and_reproducible_with_a_generator():
    x = torch.randn(4, 50, 8, generator=torch.Generator().manual_seed(0))
    router = build("softmax_topk", 8, 4, jitter_noise=0.1, generator=torch.Generator().manual_seed(5))
    u = router.train().router_input(x) / x
    assert float(u.min()) >= 0.9 - 1e-6 and float(u.max()) <= 1.1 + 1e-6 and float(u.std()) > 0.03
    assert router.eval().router_input(x) is x
    # a generator: the same draws for the same seed, the global stream untouched
    a = build("softmax_topk", 8, 4, jitter_noise=0.1, generator=torch.Generator().manual_seed(5)).train()
    b = build("softmax_topk", 8, 4, jitter_noise=0.1, generator=torch.Generator().manual_seed(5)).train()
    state = torch.get_rng_state()
    assert torch.equal(a.router_input(x), b.router_input(x))
    assert torch.equal(torch.get_rng_state(), state)
    # the routing sees the jittered input
    b.gate.weight.data.copy_(a.gate.weight)
    a.generator.manual_seed(9), b.generator.manual_seed(9)
    want = torch.softmax(b.gate(b.router_input(x)), -1)
    torch.testing.assert_close(a(x).probs, want, rtol=0, atol=0)
    assert build("softmax_topk", 8, 4).train().router_input(x) is x  # default: off
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="jitter_noise"):
            build("softmax_topk", 8, 4, jitter_noise=bad)


# -- the padding-masked auxiliary loss -----------------------------------------------------------------------

def padded_batch(B=3, S=10, E=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S, E, generator=g) * 2
    lengths = torch.tensor([S, 6, 3])[:B]
    mask = torch.arange(S).unsqueeze(0) < lengths.unsqueeze(1)   # right padding
    return logits, mask


@needs_hf
@pytest.mark.parametrize("k", [1, 2])
def test_masked_switch_loss_equals_hfs_load_balancing_loss_with_an_attention_mask(k):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits, mask = padded_batch()
    B, S, E = logits.shape
    want = load_balancing_loss_func((logits.reshape(B * S, E),), E, k, attention_mask=mask.long())
    router = build("softmax_topk", 8, E, k=k, capacity_factor=None, balance_loss="switch", balance_loss_weight=1.0,
                   balance_scope="batch").train()
    got = router.route(logits, token_mask=mask.long()).aux_loss
    # HF divides f_e by the real tokens, the Switch loss by the real (token, choice) pairs: a factor k
    torch.testing.assert_close(k * got, want, rtol=1e-6, atol=0)
    # without the mask HF counts the padding, and so does the unmasked loss
    unmasked = load_balancing_loss_func((logits.reshape(B * S, E),), E, k)
    torch.testing.assert_close(k * router.route(logits).aux_loss, unmasked, rtol=1e-6, atol=0)
    assert not torch.allclose(want, unmasked)


def test_masked_losses_ignore_padding_tokens_per_group():
    logits, mask = padded_batch()
    B, S, E = logits.shape
    k = 2
    router = build("softmax_topk", 8, E, k=k, capacity_factor=None, balance_loss="switch", balance_loss_weight=1.0,
                   z_loss_weight=0.5).train()
    got = router.route(logits, token_mask=mask).aux_loss
    # by hand: per sequence, f and P over its real tokens; then the mean over sequences; the z-loss over real tokens
    per_sequence, squares = [], []
    for b in range(B):
        real = logits[b, mask[b]]
        p = torch.softmax(real, -1)
        f = torch.zeros(E).index_add_(0, p.topk(k, -1).indices.reshape(-1), torch.ones(k * len(real))) / (k * len(real))
        per_sequence.append(E * (f * p.mean(0)).sum())
        squares.append(torch.logsumexp(real, -1).pow(2))
    want = torch.stack(per_sequence).mean() + 0.5 * torch.cat(squares).mean()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # what the padding holds does not matter; an all-True mask is the unmasked loss
    noisy = torch.where(mask.unsqueeze(-1), logits, torch.randn_like(logits) * 5)
    torch.testing.assert_close(router.route(noisy, token_mask=mask).aux_loss, got, rtol=1e-6, atol=0)
    torch.testing.assert_close(router.route(logits, token_mask=torch.ones(B, S, dtype=torch.bool)).aux_loss,
                               router.route(logits).aux_loss, rtol=1e-6, atol=0)
    # the routing itself is the same with and without the mask
    assert torch.equal(router.route(logits, token_mask=mask).choice_expert, router.route(logits).choice_expert)


def test_masked_vmoe_losses_ignore_padding_tokens():
    logits, mask = padded_batch()
    router = build("softmax_topk", 8, 6, k=2, noise="vmoe", balance_loss="vmoe", generator=torch.Generator()).train()
    def loss(lg):
        router.generator.manual_seed(3)
        return router.route(lg, token_mask=mask).aux_loss
    noisy = torch.where(mask.unsqueeze(-1), logits, torch.randn_like(logits) * 5)
    torch.testing.assert_close(loss(noisy), loss(logits), rtol=1e-6, atol=0)


def test_token_mask_is_refused_where_it_would_be_ignored_and_checked():
    logits, mask = padded_batch()
    with pytest.raises(ValueError, match="does not take a token_mask"):
        build("expert_choice", 8, 6).route(logits, token_mask=mask)
    router = build("softmax_topk", 8, 6)
    with pytest.raises(ValueError, match="token_mask must have the shape"):
        router.route(logits, token_mask=mask[:, :4])
    with pytest.raises(TypeError, match="token_mask must be a torch.Tensor"):
        router.route(logits, token_mask=[1, 0])
    layer = MoELayer(8, 16, 6, router="softmax_topk", router_options={"balance_loss": "switch"}).train()
    x = torch.randn(3, 10, 8)
    layer(x, group_size=10, token_mask=mask)
    masked = layer.last_routing.aux_loss
    layer(x, group_size=10)
    assert not torch.allclose(masked, layer.last_routing.aux_loss)
    with pytest.raises(ValueError, match="token_mask must be a tensor"):
        layer(x, token_mask=mask[:, :3])


# -- DeepSeek-V3's sequence-wise balance loss ----------------------------------------------------------------

def deepseek_sequence_loss(logits, bias, k, alpha, mask=None):
    """DeepSeek-V3's eqs. (17)-(20), one sequence at a time, written from the paper, with one documented
    convention (chapter 10): f counts the experts each token was routed to, the top-k of the biased
    scores s + b, where eq. (18) as printed takes the top-k of s alone."""
    total, n = 0.0, 0
    E = logits.shape[-1]
    for b in range(logits.shape[0]):
        rows = logits[b] if mask is None else logits[b, mask[b]]
        T = rows.shape[0]
        s = torch.sigmoid(rows)
        chosen = (s + bias).topk(k, -1).indices
        f = torch.zeros(E)
        for t in range(T):
            for i in chosen[t].tolist():
                f[i] += E / (k * T)
        s_norm = s / s.sum(-1, keepdim=True)
        P = s_norm.mean(0)
        total = total + alpha * (f * P).sum()
        n += 1
    return total / n


def test_sequence_balance_loss_is_deepseek_v3s_formula_per_sequence():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, 8, generator=g, requires_grad=True)
    router = build("loss_free", 8, 8, k=2, score="sigmoid", bias_on="scores", bias_rate=0.0,
                   sequence_balance_weight=1e-2).train()
    router.expert_bias.copy_(torch.randn(8, generator=g) * 0.1)
    routing = router.route(logits)
    want = deepseek_sequence_loss(logits, router.expert_bias, 2, 1e-2)
    torch.testing.assert_close(routing.aux_loss, want, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(routing.stats["sequence_balance_loss"], want / 1e-2, rtol=1e-6, atol=1e-9)
    # the gradient flows through P alone (f counts choices): the same as the oracle's
    grad, = torch.autograd.grad(routing.aux_loss, logits)
    want_grad, = torch.autograd.grad(want, logits)
    # chapter 10's closed form: (alpha / T) s'(1 - s)(f_e - sum_j f_j s'_j) per sequence, mean over the 4
    s = torch.sigmoid(logits.detach())
    s_norm = s / s.sum(-1, keepdim=True)
    chosen = torch.zeros_like(s).scatter_(-1, (s + router.expert_bias).topk(2, -1).indices, 1.0)
    f = chosen.sum(1, keepdim=True) * 8 / (2 * 12)
    closed = 1e-2 / (4 * 12) * s_norm * (1 - s) * (f - (f * s_norm).sum(-1, keepdim=True))
    torch.testing.assert_close(want_grad, closed, rtol=1e-5, atol=1e-10)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-10)
    # with a padding mask, each sequence's real tokens only; in eval and by default, no loss
    mask = torch.arange(12).unsqueeze(0) < torch.tensor([[12], [7], [5], [9]])
    torch.testing.assert_close(router.route(logits, token_mask=mask).aux_loss,
                               deepseek_sequence_loss(logits, router.expert_bias, 2, 1e-2, mask), rtol=1e-6, atol=1e-9)
    assert float(router.eval().route(logits).aux_loss) == 0.0
    assert float(build("loss_free", 8, 8, k=2).train().route(logits).aux_loss) == 0.0
    with pytest.raises(ValueError, match="sequence_balance_weight"):
        build("loss_free", 8, 8, sequence_balance_weight=-1.0)


def test_padding_does_not_move_the_loss_free_bias():
    logits, mask = padded_batch(E=8)
    a = build("loss_free", 8, 8, k=2, bias_rate=0.1, update="proportional").train()
    a.route(logits, token_mask=mask)
    c = build("loss_free", 8, 8, k=2, bias_rate=0.1, update="proportional").train()
    real = torch.cat([logits[0], logits[1, :6], logits[2, :3]]).unsqueeze(0)
    c.route(real)
    torch.testing.assert_close(a.expert_bias, c.expert_bias)


# -- the evaluation capacity factor ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["softmax_topk", "loss_free"])
def test_eval_capacity_factor_sets_the_capacity_in_eval_mode_only(name):
    T, E, k = 40, 8, 2
    router = build(name, 8, E, k=k, capacity_factor=1.0, eval_capacity_factor=2.0)
    assert router.train().capacity(T) == compute_capacity(T, E, 1.0, k=k)
    assert router.eval().capacity(T) == compute_capacity(T, E, 2.0, k=k) == 20
    logits = torch.randn(2, T, E, generator=torch.Generator().manual_seed(0)) * 3
    routing = router.eval().route(logits)
    assert routing.capacity == 20 and int(routing.tokens_per_expert().max()) <= 20
    # more room at evaluation: fewer drops than the training capacity gives
    assert int(routing.mask.sum()) >= int(router.train().route(logits).mask.sum())
    # default: the training factor in eval too; a dropless router may still cap its evaluation
    assert build(name, 8, E, k=k, capacity_factor=1.0).eval().capacity(T) == compute_capacity(T, E, 1.0, k=k)
    dropless = build(name, 8, E, k=k, capacity_factor=None, eval_capacity_factor=1.5)
    assert dropless.train().capacity(T) is None and dropless.eval().capacity(T) == compute_capacity(T, E, 1.5, k=k)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="eval_capacity_factor"):
            build(name, 8, E, eval_capacity_factor=bad)


def _deepspeed_capacity(tokens, experts, k, factor, min_capacity):
    """DeepSpeed's TopKGate rule, ported: the slots per expert are ceil(k * tokens / experts * factor),
    raised to min_capacity, with ``capacity_factor`` in training and ``eval_capacity_factor`` in eval."""
    return max(math.ceil(tokens / experts * (factor * k)), min_capacity)


@pytest.mark.parametrize("name", ["softmax_topk", "loss_free"])
def test_eval_capacity_factor_follows_deepspeeds_topkgate(name):
    """With DeepSpeed's rounding (ceil) the capacity in training and in evaluation is the one its gate
    computes, over a grid of group sizes, expert counts, k, both factors and a minimum capacity."""
    for T, E, k, train_factor, eval_factor, least in itertools.product((7, 40, 100), (4, 8), (1, 2), (1.0, 1.25),
                                                                     (1.0, 2.0), (0, 4)):
        router = build(name, 8, E, k=k, capacity_factor=train_factor, eval_capacity_factor=eval_factor,
                       capacity_rounding="ceil", min_capacity=least)
        assert router.train().capacity(T) == _deepspeed_capacity(T, E, k, train_factor, least)
        assert router.eval().capacity(T) == _deepspeed_capacity(T, E, k, eval_factor, least)


# -- the gated shared expert -----------------------------------------------------------------------------------

def test_gated_shared_expert_is_sigmoid_gate_times_the_shared_output():
    torch.manual_seed(0)
    layer = MoELayer(8, 16, 4, router_options={"k": 2, "capacity_factor": None}, n_shared_experts=2,
                     shared_expert_gate=True).eval()
    x = torch.randn(2, 5, 8, requires_grad=True)
    out = layer(x)
    tokens = x.reshape(-1, 8)
    routed = layer.apply_routing(tokens.view(1, -1, 8), layer.last_routing).reshape(-1, 8)
    shared = sum(layer.shared_experts.forward_one(e, tokens) for e in range(2))
    gate = torch.sigmoid(tokens @ layer.shared_gate.weight.t())
    torch.testing.assert_close(out.reshape(-1, 8), routed + gate * shared, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert layer.shared_gate.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="needs n_shared_experts >= 1"):
        MoELayer(8, 16, 4, shared_expert_gate=True)
    with pytest.raises(TypeError, match="shared_expert_gate must be True or False"):
        MoELayer(8, 16, 4, n_shared_experts=1, shared_expert_gate="yes")
    assert MoELayer(8, 16, 4, n_shared_experts=1).shared_gate is None  # default: weight 1


@needs_hf
def test_gated_shared_expert_equals_qwen2_moes_block():
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = transformers.Qwen2MoeConfig(hidden_size=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=16)
    torch.manual_seed(0)
    block = Qwen2MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    layer = MoELayer(8, 16, 4, n_shared_experts=1, shared_expert_gate=True, activation="silu")
    with torch.no_grad():
        layer.shared_gate.weight.copy_(block.shared_expert_gate.weight)

    class Shared(torch.nn.Module):  # minimoe's shared expert in the block's place
        def forward(self, h):
            return layer.shared_experts.forward_one(0, h)

    block.shared_expert = Shared()
    x = torch.randn(2, 6, 8)
    with torch.no_grad():
        total = block(x).reshape(-1, 8)
        flat = x.reshape(-1, 8)
        _, weight, index = block.gate(flat)
        hf_shared = total - block.experts(flat, index, weight)
        ours = layer.shared_output(flat)
    torch.testing.assert_close(ours, hf_shared, rtol=1e-5, atol=1e-6)


def test_models_pass_the_shared_expert_gate_to_their_layers():
    from minimoe.layers import moe_layers
    from minimoe.models import TinyLM

    model = TinyLM(vocab_size=16, d_model=8, n_heads=2, n_layers=1, d_hidden=16, n_experts=4, n_shared_experts=1,
                   moe_options={"shared_expert_gate": True})
    assert all(layer.shared_gate is not None for layer in moe_layers(model))


def test_every_new_option_is_off_by_default_and_listed():
    from minimoe.routers.base import option_names
    from minimoe.routers import router_class

    for name, options in [("softmax_topk", ["eval_capacity_factor", "n_group", "topk_group", "group_score",
                                            "routed_scaling", "router_dtype", "jitter_noise"]),
                          ("loss_free", ["eval_capacity_factor", "group_score", "sequence_balance_weight",
                                         "router_dtype"])]:
        assert set(options) <= set(option_names(router_class(name)))
        r = build(name, 8, 8)
        assert (r.eval_capacity_factor, r.router_dtype, r.jitter_noise, r.n_group, r.routed_scaling) == \
            (None, None, 0.0, 1, 1.0)


def test_the_new_options_trace_as_one_graph():
    """Every router traces under torch.compile(fullgraph=True) (chapter "What routing costs"): the new
    options too, with a padding mask; compiled equals eager where nothing is drawn at random."""
    x = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(0))
    mask = torch.rand(2, 16, generator=torch.Generator().manual_seed(1)) > 0.3
    top = build("softmax_topk", 8, 8, k=2, n_group=4, topk_group=2, routed_scaling=2.0, router_dtype="float32",
                jitter_noise=0.1, eval_capacity_factor=2.0, balance_loss="switch", z_loss_weight=1e-3)
    free = build("loss_free", 8, 8, k=2, score="sigmoid", n_group=4, topk_group=2, sequence_balance_weight=1e-2,
                 router_dtype="float32", bias_rate=0.0)
    for router in (top, free):
        router.train()
        compiled = torch.compile(lambda x, m: router(x, token_mask=m).aux_loss, fullgraph=True)
        assert torch.isfinite(compiled(x, mask))
    free.train()
    want = free(x, token_mask=mask)
    got = torch.compile(lambda x, m: free(x, token_mask=m), fullgraph=True)(x, mask)
    torch.testing.assert_close(got.aux_loss, want.aux_loss)
    assert torch.equal(got.choice_expert, want.choice_expert)


@needs_hf
def test_swapped_model_masks_padding_in_its_router_losses_as_hf_does():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    from minimoe import hf

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, num_local_experts=4,
        num_experts_per_tok=2)).train()
    gates = hf.swap_router(model, "softmax_topk", k=2, capacity_factor=None, renormalize=True,
                           balance_loss="switch", balance_loss_weight=1.0, balance_scope="batch", mask_padding=True)
    logits = []
    for gate in gates:
        gate.register_forward_hook(lambda module, args, out: logits.append(out[0].detach()))
    ids = torch.randint(3, 64, (3, 8), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(8).unsqueeze(0) < torch.tensor([[8], [5], [2]])).long()
    model(ids, attention_mask=mask)
    want = sum(load_balancing_loss_func((lg,), 4, 2, attention_mask=mask) for lg in logits)
    torch.testing.assert_close(2 * hf.router_losses(model), want, rtol=1e-6, atol=0)
    # without mask_padding the padding is counted, as HF counts it without a mask
    logits.clear()
    for gate in gates:
        gate.mask_padding = False
    model(ids, attention_mask=mask)
    unmasked = sum(load_balancing_loss_func((lg,), 4, 2) for lg in logits)
    torch.testing.assert_close(2 * hf.router_losses(model), unmasked, rtol=1e-6, atol=0)
    # the mask given by position (forward(input_ids, attention_mask)) is the same mask
    for gate in gates:
        gate.mask_padding = True
    model(ids, mask)
    torch.testing.assert_close(2 * hf.router_losses(model), want, rtol=1e-6, atol=0)
    # a mask that cannot be read per token is refused, not ignored
    gates[0].batch_shape, gates[0].attention_mask = (3, 8), mask[:2]
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        gates[0]._token_mask()
    with pytest.raises(ValueError, match="does not take a token_mask"):
        hf.swap_router(model, "expert_choice", mask_padding=True)


@pytest.mark.parametrize("n_group, topk_group, group_score, match", [
    (5, 2, "top2", "n_group=5 must divide n_experts=12"), (4, 5, "top2", "topk_group"), (0, 1, "top2", "n_group"),
    (4, 2, "sum", "group_score"), (12, 2, "top2", "two best experts")])
def test_group_limited_scores_checks_its_arguments(n_group, topk_group, group_score, match):
    """The op is public: called directly, bad group options are named, not left to torch's unflatten or
    topk (a router checks them once at construction and passes checked=True)."""
    from minimoe.ops import group_limited_scores
    with pytest.raises(ValueError, match=match):
        group_limited_scores(torch.randn(4, 12), n_group, topk_group, group_score)


def test_densemixer_scales_its_dense_twin_with_routed_scaling():
    """With routed_scaling=g the layer's output is g times the unscaled one, and so must be every
    gradient, the dense straight-through term's included (a twin left unscaled would give the router
    g * sparse-value but a 1 * dense gradient)."""
    from minimoe import MoELayer
    x = torch.randn(2, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads, outs = {}, {}
    for g in (1.0, 2.5):
        torch.manual_seed(0)
        layer = MoELayer(6, 8, 4, "densemixer", router_options={"k": 1, "routed_scaling": g}).double().train()
        out = layer(x)
        (out * torch.linspace(-1, 1, 6, dtype=torch.float64)).sum().backward()  # linear in out
        outs[g], grads[g] = out.detach(), layer.router.gate.weight.grad.clone()
    torch.testing.assert_close(outs[2.5], 2.5 * outs[1.0])
    torch.testing.assert_close(grads[2.5], 2.5 * grads[1.0])
