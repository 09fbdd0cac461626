"""The cost of USMoE's routing (paper section 4.4; chapter 6, Proposition 6.9), as operation counts,
never wall-clock time.

Oracles: torch's FlopCounterMode for the gate, a log of the aten operators (and numpy selections)
that ``global_topc`` runs, a heap selection that counts its comparisons (checked against
``global_topc``), and the rows the experts actually receive in a ``MoELayer``.
"""
import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from minimoe import MoELayer
from minimoe.exercises.oracles import heap_top
from minimoe.ops import _checks, global_topc, selection_budget
from minimoe.ops import selection as selection_module
from minimoe.routers import build


def heap_bound(m, n):
    """Proposition 6.9(b): at most 2n + (m - n)(1 + 2 floor(log2 n)) comparisons."""
    return 2 * n + (m - n) * (1 + 2 * int(math.log2(n)))


@pytest.mark.parametrize("B, L, D, E", [(2, 16, 32, 8), (3, 10, 64, 16), (1, 64, 16, 4)])
def test_gate_flops_are_the_same_for_usmoe_and_token_choice(B, L, D, E):
    """(a) Scoring costs 2 B L D E flops for both routers; the selection adds no matmul."""
    x = torch.randn(B, L, D)
    for name, options in (("usmoe", {"k": 1.5, "grouping": "sequence"}), ("usmoe", {"k": 2}),
                          ("softmax_topk", {"k": 2})):
        router = build(name, D, E, **options).eval()
        with FlopCounterMode(display=False) as counter:
            router(x)
        assert counter.get_total_flops() == 2 * B * L * D * E, (name, options)


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args))
        return out


@pytest.mark.parametrize("accelerator", [False, True])
def test_global_topc_is_one_selection_per_group_and_linear_work(monkeypatch, accelerator):
    """What minimoe runs: one selection of the c-th largest value over the T*E entries of each group
    (on a CPU one ``np.partition`` of all groups, numpy's introselect; on an accelerator one
    ``torch.topk``), plus a fixed number of elementwise operations on at most G*T*E entries, whatever
    T (no loop over tokens)."""
    monkeypatch.setattr(_checks, "SIMULATE_ACCELERATOR", accelerator)
    partitions = []
    real_partition = np.partition

    def logged_partition(a, kth, axis=-1):
        partitions.append((a.shape, kth, axis))
        return real_partition(a, kth, axis=axis)

    monkeypatch.setattr(selection_module.np, "partition", logged_partition)
    E, G = 8, 3
    sequences = {}
    for T in (4, 32, 256):
        scores = torch.randn(G, T, E)
        c = selection_budget(1.5, T, E)
        partitions.clear()
        with OpLog() as log:
            mask = global_topc(scores, c)
        assert (mask.sum((-1, -2)) == c).all()
        sequences[T] = [func for func, _ in log.calls]
        topks = [args for func, args in log.calls if func.overloadpacket is torch.ops.aten.topk]
        if accelerator:
            assert len(topks) == 1 and not partitions
            flat, k = topks[0][0], topks[0][1]
            assert tuple(flat.shape) == (G, T * E) and k == c
        else:  # the c-th largest of n = T*E is the (n - c)-th smallest
            assert not topks and partitions == [((G, T * E), T * E - c, -1)]
        for func, args in log.calls:
            for a in args:
                if isinstance(a, torch.Tensor):
                    assert a.numel() <= G * T * E, func
    assert sequences[4] == sequences[32] == sequences[256], "the same operators for every T"


@pytest.mark.parametrize("L, E, k", [(16, 8, 2), (64, 16, 2), (40, 8, 1.5), (10, 4, 1)])
def test_heap_selection_comparison_count(L, E, k):
    """(b) Selecting n = floor(kL) of LE entries with a heap takes O(LE log(kL)) comparisons, within the
    stated bound, and selects exactly what global_topc selects; token choice's per-token top-k takes
    O(LE log k) comparisons."""
    gen = torch.Generator().manual_seed(L + E)
    scores = torch.randn(L, E, generator=gen, dtype=torch.float64)
    n = selection_budget(k, L, E)
    values = scores.flatten().tolist()
    chosen, count = heap_top(values, n)
    mask = global_topc(scores, n).flatten()
    assert chosen == set(mask.nonzero().flatten().tolist())
    assert count <= heap_bound(L * E, n)
    assert count >= L * E - n, "every entry outside the first n is compared at least once"
    if float(k).is_integer():
        tc = 0
        for row in scores.tolist():
            picked, cnt = heap_top(row, int(k))
            assert picked == set(torch.tensor(row).topk(int(k)).indices.tolist())
            tc += cnt
        assert tc <= L * heap_bound(E, int(k))


def test_selection_count_grows_like_m_log_n():
    """(b) Doubling L at fixed E and k: the comparisons per entry grow by at most about 2 per doubling
    of n (the log2 n term), far below the gate's 2D flops per entry at D = 256."""
    E, k, D = 16, 2, 256
    per_entry = []
    for L in (16, 32, 64, 128):
        gen = torch.Generator().manual_seed(L)
        values = torch.randn(L * E, generator=gen, dtype=torch.float64).tolist()
        n = selection_budget(k, L, E)
        _, count = heap_top(values, n)
        per_entry.append(count / (L * E))
        assert count / (L * E) <= 1 + 2 * math.log2(n) + 2 * n / (L * E)
        assert count < 2 * L * D * E / 10, "selection is lower order than the gate at D = 256"
    increments = [b - a for a, b in zip(per_entry, per_entry[1:])]
    assert all(-0.5 < inc < 2.5 for inc in increments), per_entry


@pytest.mark.parametrize("k", [1.5, 2])
def test_expert_evaluations_are_floor_k_L(k):
    """(c) The experts run on exactly floor(k L) token rows per group: as token choice for integer k,
    25% fewer at k = 1.5 than at k = 2."""
    B, L, D, E = 4, 10, 8, 4
    rows = {}
    for name in ("usmoe", "softmax_topk"):
        if name == "softmax_topk" and not float(k).is_integer():
            continue
        options = {"k": k, "grouping": "sequence"} if name == "usmoe" else {"k": int(k), "capacity_factor": None}
        layer = MoELayer(D, 16, E, name, router_options=options, path="loop")
        seen = []
        original = layer.experts._mlp  # the loop path runs each expert once on its rows

        def counting(x, *params, original=original, seen=seen):
            seen.append(x.shape[0])
            return original(x, *params)

        layer.experts._mlp = counting
        layer(torch.randn(B, L, D), group_size=L)
        rows[name] = sum(seen)
        assert rows[name] == B * selection_budget(k, L, E) == int(layer.last_routing.mask.sum())
    if k == 2:
        assert rows["usmoe"] == rows["softmax_topk"] == B * L * 2
    else:
        assert rows["usmoe"] == B * 15 == 0.75 * B * L * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_global_topc_selects_the_same_on_the_cpu_and_an_accelerator(monkeypatch, dtype):
    """numpy's introselect (CPU) and torch.topk (accelerator path) find the same threshold, so the
    same mask, also with many ties and signed zeros (infinite scores are refused)."""
    gen = torch.Generator().manual_seed(0)
    cases = [torch.randn(3, 50, 8, generator=gen, dtype=dtype),
             torch.randint(-2, 3, (4, 20, 6), generator=gen).to(dtype),           # ties everywhere
             torch.tensor([[[0.0, -0.0], [-0.0, 0.0], [1.0, -1.0]]], dtype=dtype),
             torch.tensor([[[-1e30, 1.0], [1e30, -1e30], [0.5, 0.5]]], dtype=dtype)]
    for scores in cases:
        n = scores.shape[-1] * scores.shape[-2]
        for c in sorted({1, 2, n // 3, n // 2, n - 1, n}):
            monkeypatch.setattr(_checks, "SIMULATE_ACCELERATOR", False)
            cpu = global_topc(scores, c)
            monkeypatch.setattr(_checks, "SIMULATE_ACCELERATOR", True)
            assert torch.equal(cpu, global_topc(scores, c)), (scores, c)
            assert (cpu.sum((-1, -2)) == c).all()
