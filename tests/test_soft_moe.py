"""Soft MoE's two softmaxes computed in one autograd Function, the combine weights over the logits'
memory (minimoe/routers/soft_moe.py, ``_DispatchCombine``): same bits as two ``torch.softmax`` calls,
values and gradients, and an exact gradient (gradcheck)."""
import pytest
import torch

from minimoe.routers.soft_moe import SoftMoE, _DispatchCombine


def _two_softmaxes(Z):
    return torch.softmax(Z, dim=-2), torch.softmax(Z, dim=-1)


def test_dispatch_combine_passes_gradcheck():
    Z = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    # Z.clone(): the Function writes the combine weights over its input
    assert torch.autograd.gradcheck(lambda z: _DispatchCombine.apply(z.clone()), (Z,))
    assert torch.autograd.gradcheck(lambda z: _DispatchCombine.apply(z.clone())[0], (Z,))  # combine unused
    assert torch.autograd.gradcheck(lambda z: _DispatchCombine.apply(z.clone())[1], (Z,))  # dispatch unused


@pytest.mark.parametrize("use", ["both", "dispatch", "combine"])
def test_dispatch_combine_has_the_bits_of_two_softmaxes(use):
    gen = torch.Generator().manual_seed(0)
    Z = 3 * torch.randn(3, 17, 12, generator=gen, requires_grad=True)
    weights = [torch.randn(3, 17, 12, generator=gen) for _ in range(2)]
    results = []
    for fn in (_two_softmaxes, lambda z: _DispatchCombine.apply(z.clone())):
        dispatch, combine = fn(Z)
        loss = sum((w * out).sum() for w, out, name in zip(weights, (dispatch, combine), ("dispatch", "combine"))
                   if use in ("both", name))
        results.append((dispatch, combine, torch.autograd.grad(loss, Z)[0]))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert torch.allclose(results[0][0].sum(-2), torch.ones(3, 12)) and torch.allclose(results[0][1].sum(-1),
                                                                                         torch.ones(3, 17))


def test_soft_moe_writes_the_combine_weights_over_its_logits():
    torch.manual_seed(0)
    router = SoftMoE(16, 4, slots_per_expert=3)
    x = torch.randn(2, 10, 16)
    captured = {}
    flat = router._flat_slot_logits

    def spy(x):
        captured["Z"] = flat(x)
        return captured["Z"]

    router._flat_slot_logits = spy
    routing = router(x)
    assert routing.slot_combine.data_ptr() == captured["Z"].data_ptr()  # no second T x E*S block
    assert routing.slot_dispatch.shape == routing.slot_combine.shape == (2, 10, 4, 3)
    # the slot logits of eq. (10), normalised twice (eq. 11)
    Z = router.slot_logits(x)
    assert torch.equal(routing.slot_dispatch, torch.softmax(Z, dim=-3))
    assert torch.equal(routing.slot_combine, torch.softmax(Z.flatten(-2), dim=-1).view_as(Z))


def test_soft_moe_under_autocast_keeps_the_softmaxes_dtype():
    """Under autocast the softmax may run in another dtype than the logits; the router then uses
    two torch.softmax calls, as before the in-place Function."""
    torch.manual_seed(0)
    router = SoftMoE(16, 4, slots_per_expert=2)
    x = torch.randn(1, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = router(x)
        Z = router.slot_logits(x)
        assert routing.slot_combine.dtype == torch.softmax(Z, dim=-1).dtype
        assert torch.equal(routing.slot_dispatch, torch.softmax(Z, dim=-3))


def test_a_token_mask_keeps_padding_out_of_the_slots():
    """With token_mask, each slot mixes the group's real tokens only: the real tokens' dispatch weights
    are those of the group without its padding, the padding's are 0, a group of padding only
    dispatches nothing (no NaN), and the combine weights are unchanged."""
    from minimoe.routers import build
    torch.manual_seed(0)
    router = build("soft_moe", 8, 4, slots_per_expert=2)
    x = torch.randn(3, 6, 8)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    routing = router.route(None, x, token_mask=mask)
    alone = router.route(None, x[0:1, :4])
    torch.testing.assert_close(routing.slot_dispatch[0, :4], alone.slot_dispatch[0], rtol=1e-6, atol=1e-7)
    assert torch.equal(routing.slot_dispatch[0, 4:], torch.zeros_like(routing.slot_dispatch[0, 4:]))
    torch.testing.assert_close(routing.slot_dispatch[1], router.route(None, x[1:2]).slot_dispatch[0])
    assert torch.equal(routing.slot_dispatch[2], torch.zeros_like(routing.slot_dispatch[2]))
    torch.testing.assert_close(routing.slot_combine, router.route(None, x).slot_combine)
