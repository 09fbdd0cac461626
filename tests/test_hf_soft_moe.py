"""minimoe.hf with Soft MoE: ``swap_router(model, "soft_moe")`` replaces each MoE block's routing by
Soft MoE (chapter 4, eqs. 10-11) and keeps the block's own experts and shared experts.

For every family: the swapped model trains (finite loss, a gradient on the slot parameters and on the
experts); the block's output equals a hand computation (the einsum dispatch, each expert on its slots
through the block's own expert weights, the einsum combine, the family's shared path); routing by
position is causal and by sequence is not; a checkpoint of the unswapped model loads; swapping back
restores the model; an option Soft MoE does not take is a clear error that changes nothing.
"""
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", minversion="5.0")

from minimoe import hf  # noqa: E402
from test_hf import FAMILIES, VOCAB, tiny  # noqa: E402


def moe_blocks(model):
    return [layer.mlp for layer in model.model.layers]


@pytest.mark.parametrize("family", FAMILIES)
def test_soft_moe_trains_inside_every_family(family):
    model = tiny(family).train()
    gates = hf.swap_router(model, "soft_moe")
    blocks = moe_blocks(model)
    assert len(gates) == 2 and all(isinstance(b, hf.SoftMoEBlock) for b in blocks)
    assert [b.gate for b in blocks] == gates == hf.swapped_gates(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    before = gates[0].router.slot_embed.detach().clone()
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (8, 12), generator=generator)
        out = model(ids, labels=ids)
        aux = hf.router_losses(model)
        assert float(aux) == 0.0   # Soft MoE has no auxiliary loss
        loss = out.loss + aux
        optimizer.zero_grad()
        loss.backward()
        assert torch.isfinite(loss)
        for block in blocks:
            router = block.gate.router
            assert router.slot_embed.grad.abs().sum() > 0 and router.scale.grad.abs() > 0
            assert block.experts.gate_up_proj.grad.abs().sum() > 0 and block.experts.down_proj.grad.abs().sum() > 0
        optimizer.step()
    assert (gates[0].router.slot_embed - before).abs().max() > 0   # the optimizer found the slot parameters


def hand_soft_moe_block(block, h, grouping):
    """The Soft MoE block by hand: eqs. (10)-(11) on the groups of ``h (B, S, d)``, each expert on its
    slots through the block's expert weights (gate_up_proj, down_proj, act_fn), then the shared path."""
    router, experts = block.gate.router, block.experts
    x = h.transpose(0, 1) if grouping == "position" else h                    # (G, T, d)
    phi = router.slot_embed                                                   # (d, E, S)
    d, E, S = phi.shape
    x_unit = x / x.norm(dim=-1, keepdim=True)
    phi_unit = phi / phi.norm(dim=0, keepdim=True)
    Z = torch.einsum("gtd,des->gtes", x_unit, phi_unit) * router.scale       # eq. (10), normalised
    D = torch.softmax(Z, dim=1)                                               # over the group's tokens
    C = torch.softmax(Z.flatten(2), dim=-1).view_as(Z)                        # over all E * S slots
    slots = torch.einsum("gtes,gtd->gesd", D, x)
    Y = torch.empty_like(slots)
    for e in range(E):
        gate, up = F.linear(slots[:, e], experts.gate_up_proj[e]).chunk(2, dim=-1)
        Y[:, e] = F.linear(experts.act_fn(gate) * up, experts.down_proj[e])
    out = torch.einsum("gtes,gesd->gtd", C, Y)
    out = out.transpose(0, 1) if grouping == "position" else out
    if hasattr(block, "shared_expert"):      # Qwen2-MoE: the sigmoid-gated shared expert
        out = out + torch.sigmoid(block.shared_expert_gate(h)) * block.shared_expert(h)
    if hasattr(block, "shared_experts"):     # DeepSeek-V3: the shared experts
        out = out + block.shared_experts(h)
    return out


@pytest.mark.parametrize("grouping", ["position", "sequence"])
@pytest.mark.parametrize("family", FAMILIES)
def test_soft_moe_block_equals_the_hand_computation(family, grouping):
    model = tiny(family).eval()
    hf.swap_router(model, "soft_moe", grouping=grouping, slots_per_expert=2, scale_init=3.0)
    block = moe_blocks(model)[0]
    for module in (block.experts, block.gate.router):  # weights large enough that a mistake shows
        for p in module.parameters():
            if p.dim() > 0:
                torch.nn.init.normal_(p, std=0.5)
    h = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = block(h), hand_soft_moe_block(block, h, grouping)
    assert got.shape == h.shape and want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mixtrals_input_jitter_stays_with_the_block():
    """Mixtral's block multiplies its input by U(1 - eps, 1 + eps) noise in training, before routing and
    experts alike: the Soft MoE block draws the same noise (torch's global generator) and uses it the same way."""
    model = tiny("mixtral")
    hf.swap_router(model, "soft_moe")
    block = moe_blocks(model)[0]
    block.jitter_noise = 0.2     # what the config's router_jitter_noise gives the block
    h = torch.randn(4, 3, 32, generator=torch.Generator().manual_seed(4))
    block.train()
    torch.manual_seed(5)
    got = block(h)
    torch.manual_seed(5)
    jittered = h * torch.empty_like(h).uniform_(0.8, 1.2)
    torch.testing.assert_close(got, hand_soft_moe_block(block, jittered, "position"), rtol=1e-5, atol=1e-6)
    block.eval()
    torch.testing.assert_close(block(h), hand_soft_moe_block(block, h, "position"), rtol=1e-5, atol=1e-6)
    assert (got - block(h)).abs().max() > 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_position_groups_are_causal_and_sequence_groups_are_not(family):
    ids = torch.randint(3, VOCAB, (6, 9), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % VOCAB    # a later token of one sequence
    leaks = {}
    for grouping in ("position", "sequence"):
        model = tiny(family).eval()
        hf.swap_router(model, "soft_moe", grouping=grouping)
        with torch.no_grad():
            diff = (model(ids).logits - model(changed).logits).abs()
        leaks[grouping] = diff[:, :-1].max().item()
        assert diff[0, -1].max() > 1e-4    # the change itself shows
    assert leaks["position"] == 0.0 and leaks["sequence"] > 1e-5, leaks


def test_position_groups_decode_with_a_cache_as_they_train():
    """By position, the tokens decoded one step at a time with a cache form the same groups as in the
    full forward, so the logits agree."""
    model = tiny("mixtral").eval()
    hf.swap_router(model, "soft_moe")
    ids = torch.randint(3, VOCAB, (4, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids).logits
        cache, steps = None, []
        for t in range(ids.shape[1]):
            out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)


def test_a_checkpoint_loads_and_swapping_back_restores_the_model(tmp_path):
    for family in ("qwen2_moe", "deepseek_v3"):
        original = tiny(family, seed=5).eval()
        torch.save(original.state_dict(), tmp_path / f"{family}.pt")
        ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            want = original(ids).logits
        fresh = tiny(family, seed=7).eval()
        hf.swap_router(fresh, "soft_moe")
        slots = [g.router.slot_embed.detach().clone() for g in hf.swapped_gates(fresh)]
        hf.load_hf_state_dict(fresh, torch.load(tmp_path / f"{family}.pt"))   # strict: every key accounted for
        own = fresh.state_dict()
        for key, value in original.state_dict().items():
            if ".mlp.gate." not in key:
                torch.testing.assert_close(own[key], value, rtol=0, atol=0)
        for gate, before in zip(hf.swapped_gates(fresh), slots):
            torch.testing.assert_close(gate.router.slot_embed, before, rtol=0, atol=0)
        # swapping again starts from the original blocks: router=None is the model's own router again
        restored = tiny(family, seed=5).eval()
        hf.swap_router(restored, "soft_moe", slots_per_expert=3)
        hf.swap_router(restored, "soft_moe")
        assert hf.swapped_gates(restored)[0].router.slot_embed.shape[-1] == 1
        hf.swap_router(restored)
        assert not any(isinstance(m, hf.SoftMoEBlock) for m in restored.modules())
        with torch.no_grad():
            torch.testing.assert_close(restored(ids).logits, want, rtol=0, atol=1e-5)


def test_an_option_soft_moe_does_not_take_is_a_clear_error_and_changes_nothing():
    model = tiny("mixtral")
    with pytest.raises(TypeError, match="'soft_moe' does not take these options"):
        hf.swap_router(model, "soft_moe", k=2)
    with pytest.raises(TypeError, match="'soft_moe' does not take these options"):
        hf.swap_router(model, "soft_moe", capacity_factor=1.0)
    with pytest.raises(ValueError, match="slots_per_expert"):
        hf.swap_router(model, "soft_moe", slots_per_expert=0)
    with pytest.raises(ValueError, match="grouping"):
        hf.swap_router(model, "soft_moe", grouping="batch")
    assert not hf.swapped_gates(model) and not any(isinstance(m, hf.SoftMoEBlock) for m in model.modules())


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_padding_stays_out_of_the_slots_with_mask_padding(family):
    """Right-padded batch, groups by position: at a position where one sequence is padding, the real
    tokens of the other sequences share its slots. With mask_padding=True the padding is out of the
    slot mixtures, so changing the padding's token ids leaves every real token's logits unchanged;
    without it they move (the check has teeth)."""
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (3, 8), generator=torch.Generator().manual_seed(2))
    mask = (torch.arange(8).unsqueeze(0) < torch.tensor([[8], [5], [3]])).long()
    other = torch.where(mask.bool(), ids, torch.randint(3, VOCAB, ids.shape, generator=torch.Generator().manual_seed(5)))
    for mask_padding, moved in ((True, False), (False, True)):
        model = tiny(family).eval()
        hf.swap_router(model, "soft_moe", mask_padding=mask_padding)
        with torch.no_grad():
            a = model(ids, attention_mask=mask).logits[mask.bool()]
            b = model(other, attention_mask=mask).logits[mask.bool()]
        assert (not torch.equal(a, b)) == moved, (mask_padding, float((a - b).abs().max()))


@pytest.mark.parametrize("router", ["softmax_topk", "soft_moe"])
def test_output_router_logits_after_a_swap_is_a_clear_error(router):
    """HF collects router logits through its own router classes, which a swap removes: asking for them
    is refused with the replacement (router_losses), at the call or through the config."""
    model = tiny("mixtral")
    hf.swap_router(model, router)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="router_losses"):
        model(ids, output_router_logits=True)
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits=True does not work"):
        model(ids)
    assert torch.isfinite(model(ids, output_router_logits=False).logits).all()
