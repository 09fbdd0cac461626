"""The four baselines that do not learn (minimoe/routers/controls.py): each against an independent
statement of what it is. Dense layers against hand-written feed-forward networks, the hashes against
their formulas evaluated in Python integers and by brute force, the random router by Monte Carlo."""
import math

import pytest
import torch
import torch.nn.functional as F

from minimoe import MoELayer, routers
from minimoe.models import MoERegressor, TinyLM, TinyViT
from minimoe.routers.controls import HASH_PRIME

D, H, E = 12, 10, 4


def _layer(router, **options):
    torch.manual_seed(0)
    layer = MoELayer(D, H, E, router, router_options=options or None, group_size=8)
    with torch.no_grad():  # non-zero biases, so a bias handled wrongly shows
        layer.experts.b_in.normal_()
        layer.experts.b_out.normal_()
    return layer


def test_registered_as_baselines_not_routers():
    assert routers.baselines() == ["dense", "dense_wide", "hash", "random"]
    assert not set(routers.baselines()) & set(routers.available())
    for name in routers.baselines():
        router = routers.build(name, D, E)
        assert router.gate is None and not list(router.parameters())


@pytest.mark.parametrize("path", ["index", "slots", "grouped", "einsum", "loop"])
def test_dense_is_one_feed_forward_network(path):
    layer = _layer("dense")
    layer.path = path
    x = torch.randn(3, 8, D)
    w1, b1, w2, b2 = layer.experts.w_in[0], layer.experts.b_in[0], layer.experts.w_out[0], layer.experts.b_out[0]
    expected = F.gelu(x @ w1 + b1) @ w2 + b2
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["index", "slots", "grouped", "einsum", "loop"])
def test_dense_wide_is_one_network_of_width_E_times_d_hidden(path):
    layer = _layer("dense_wide")
    layer.path = path
    x = torch.randn(2, 8, D)
    ex = layer.experts
    w1 = torch.cat(list(ex.w_in), dim=1)      # (D, E*H): the experts' first layers side by side
    b1 = ex.b_in.reshape(-1)
    w2 = torch.cat(list(ex.w_out), dim=0)     # (E*H, D)
    b2 = ex.b_out.sum(0)                      # E output biases add up to one
    torch.testing.assert_close(layer(x), F.gelu(x @ w1 + b1) @ w2 + b2, rtol=1e-5, atol=1e-5)
    routing = layer.last_routing
    assert routing.mask.all() and float(routing.stats["mean_experts_per_token"]) == E


def _hash_python(router, key: int) -> int:  # the formula in Python's unbounded integers
    return (router.hash_a * key + router.hash_b) % HASH_PRIME % router.n_experts


def test_hash_of_ids_is_the_universal_hash_and_ignores_x():
    router = routers.build("hash", D, 8, seed=3)
    ids = torch.tensor([[0, 1, 2, 97, 2**31 - 2, 2**32 - 1, 5, 5]])
    first = router(torch.randn(1, 8, D), token_keys=ids)
    again = router(torch.randn(1, 8, D) * 100, token_keys=ids)  # other tokens, same ids
    expected = torch.tensor([[_hash_python(router, int(i)) for i in ids[0]]])
    assert torch.equal(first.choice_expert[..., 0], expected)
    assert torch.equal(again.choice_expert, first.choice_expert)
    assert torch.equal(first.choice_weight, torch.ones(1, 8, 1))
    # another seed is another hash
    other = routers.build("hash", D, 8, seed=4)
    assert (other.hash_a, other.hash_b) != (router.hash_a, router.hash_b)


def test_hash_spreads_a_vocabulary_evenly():
    # 8192 ids on 8 experts: a chi-square test of uniformity over the vocabulary (p > 1e-3)
    from scipy.stats import chisquare

    router = routers.build("hash", D, 8)
    counts = torch.bincount(router.hash_keys(torch.arange(8192)), minlength=8)
    assert chisquare(counts.numpy()).pvalue > 1e-3


def test_hash_of_vectors_is_the_sign_pattern_of_fixed_projections():
    router = routers.build("hash", D, 8, seed=1)
    keys = torch.randn(2, 8, 5)
    got = router(torch.randn(2, 8, D), token_keys=keys).choice_expert[..., 0]
    r = router.directions(5)
    assert r.shape == (5, 3)  # ceil(log2 8) bits
    for g in range(2):
        for t in range(8):
            bits = [float(keys[g, t].double() @ r[:, j]) > 0 for j in range(3)]
            assert int(got[g, t]) == sum(2**j for j, b in enumerate(bits) if b) % 8
    # a sign pattern does not see the scale, and the directions are fixed by the seed alone
    assert torch.equal(router.hash_keys(3.0 * keys), router.hash_keys(keys))
    assert torch.equal(routers.build("hash", D, 8, seed=1).directions(5), r)


def test_random_router_is_uniform_and_drawn_anew():
    from scipy.stats import chisquare

    router = routers.build("random", D, E, generator=torch.Generator().manual_seed(0))
    x = torch.randn(50, 64, D)
    first = router(x).choice_expert[..., 0]
    counts = torch.bincount(first.flatten(), minlength=E)
    assert chisquare(counts.numpy()).pvalue > 1e-3  # 3200 draws, uniform
    second = router(x).choice_expert[..., 0]
    # independent draws disagree with probability 3/4; over 3200 tokens its sd is 0.0077, so 0.05 is 6.5 sd
    assert abs(float((first != second).float().mean()) - 0.75) < 0.05
    router.eval()
    assert not torch.equal(router(x).choice_expert[..., 0], second)  # random in evaluation too
    again = routers.build("random", D, E, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again(x).choice_expert[..., 0], first)  # reproducible from its generator
    assert torch.allclose(router(x).probs, torch.full((50, 64, E), 1 / E))


def test_lm_hashes_each_token_by_its_id_in_position_major_groups():
    torch.manual_seed(0)
    model = TinyLM(30, d_model=16, n_layers=2, n_heads=2, block_size=6, n_experts=E, d_hidden=16, router="hash",
                   routing_groups="position")
    idx = torch.randint(0, 30, (5, 6))
    model(idx)
    for block in model.blocks:
        routing = block.ffn.last_routing  # groups are positions: (L, B)
        assert torch.equal(routing.choice_expert[..., 0], block.ffn.router.hash_keys(idx.t()))


def test_vit_and_regressor_hash_their_raw_inputs():
    torch.manual_seed(0)
    vit = TinyViT(3, image_size=8, patch_size=4, d_model=8, n_layers=2, n_heads=2, n_experts=E, d_hidden=8,
                  router="hash", channels=1)
    images = torch.rand(2, 1, 8, 8)
    vit(images)
    patches = images.unfold(2, 4, 4).unfold(3, 4, 4).reshape(2, 4, 16)
    moe = vit.blocks[-1].ffn
    assert torch.equal(moe.last_routing.choice_expert[..., 0], moe.router.hash_keys(patches))
    reg = MoERegressor(6, 3, d_model=8, d_hidden=8, n_experts=E, router="hash", group_size=4)
    x = torch.randn(8, 6)
    reg(x)
    assert torch.equal(reg.moe.last_routing.choice_expert[..., 0].flatten(), reg.moe.router.hash_keys(x))


def test_a_hash_model_trains_and_its_routing_never_moves():
    torch.manual_seed(0)
    model = TinyLM(30, d_model=16, n_layers=1, n_heads=2, block_size=6, n_experts=E, d_hidden=16, router="hash",
                   routing_groups="position")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 30, (8, 6))
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(idx[:, :-1].contiguous()).flatten(0, 1), idx[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]  # the experts learn
    router = model.blocks[0].ffn.router
    assert torch.equal(model.blocks[0].ffn.last_routing.choice_expert[..., 0], router.hash_keys(idx[:, :-1].t()))


def test_token_keys_errors_name_the_argument():
    router = routers.build("hash", D, E)
    x = torch.randn(2, 8, D)
    with pytest.raises(ValueError, match="pass token_keys"):
        router(x)
    with pytest.raises(ValueError, match="one id per token"):
        router(x, token_keys=torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="ids >= 0"):
        router(x, token_keys=-torch.ones(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="one vector per token"):
        router(x, token_keys=torch.zeros(2, 8))
    with pytest.raises(ValueError, match="token_keys must not hold NaN|finite|NaN"):
        router(x, token_keys=torch.full((2, 8, 3), math.nan))
    with pytest.raises(TypeError, match="integer ids or float vectors"):
        router(x, token_keys=torch.zeros(2, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="not by token_keys"):
        routers.build("softmax_topk", D, E)(x, token_keys=torch.zeros(2, 8, dtype=torch.long))
    layer = MoELayer(D, H, E, "hash", group_size=8)
    with pytest.raises(ValueError, match=r"MoELayer\(x, token_keys=...\)"):
        layer(x)
    with pytest.raises(ValueError, match="tokens' shape"):
        layer(x, token_keys=torch.zeros(16, dtype=torch.long))
    # a router that does not read keys ignores what a model offers it
    plain = MoELayer(D, H, E, "softmax_topk", group_size=8)
    torch.testing.assert_close(plain(x, token_keys=torch.zeros(2, 8, dtype=torch.long)), plain(x))


def test_empty_group():
    for name in routers.baselines():
        router = routers.build(name, D, E)
        keys = {"token_keys": torch.zeros(0, 0, dtype=torch.long)} if router.takes_token_keys else {}
        routing = router(torch.randn(0, 0, D), **keys)
        assert routing.mask.shape == (0, 0, E)


def test_a_feed_forward_module_that_takes_no_keys_is_called_as_before():
    """Block passes token_keys only to a layer that asks (MoELayer.takes_token_keys): a layer whose
    forward was replaced by one without the argument, or a dense MLP, still runs."""
    torch.manual_seed(0)
    model = TinyLM(30, d_model=16, n_layers=2, n_heads=2, block_size=6, n_experts=E, d_hidden=16,
                   router="softmax_topk", router_options={"capacity_factor": None}, routing_groups="position")
    layer = model.blocks[0].ffn
    assert not layer.takes_token_keys and MoELayer(D, H, E, "hash").takes_token_keys
    layer.forward = lambda x, group_size=None: MoELayer.forward(layer, x, group_size=1)
    idx = torch.randint(0, 30, (4, 6))
    assert model(idx).shape == (4, 6, 30)
    dense = MoERegressor(6, 3, d_model=8, d_hidden=8, n_experts=0, group_size=4)
    assert dense(torch.randn(8, 6)).shape == (8, 3)


def test_edge_cases_of_the_baselines():
    """Ids of any size hash by the formula (no int64 overflow); an empty input needs no keys, in the
    layer and in a model; a baseline without x says so."""
    router = routers.build("hash", D, 8, seed=5)
    big = torch.tensor([[2**32, 2**40 + 7, 2**62, 2**63 - 1]])
    assert router.hash_keys(big).tolist() == [[_hash_python(router, int(i)) for i in big[0]]]
    layer = MoELayer(D, H, E, "hash")
    assert layer(torch.randn(0, D)).shape == (0, D)
    assert layer(torch.randn(0, D), token_keys=torch.zeros(0, dtype=torch.long)).shape == (0, D)
    model = TinyLM(30, d_model=16, n_layers=1, n_heads=2, block_size=6, n_experts=E, d_hidden=16, router="hash",
                   routing_groups="sequence")
    assert model(torch.zeros(0, 6, dtype=torch.long)).shape == (0, 6, 30)
    for name in ("dense", "dense_wide", "random"):
        with pytest.raises(ValueError, match="call it on x"):
            routers.build(name, D, E).route(torch.randn(8, E))
