"""minimoe.ops.ksubset against the mathematics of chapter 7 (Probabilistic routing over expert subsets).

Oracle: brute-force enumeration of every subset (itertools.combinations, E <= 10, float64). Also
finite differences (gradcheck), chi-square tests of the samplers, float64 against float32 at
extreme logits, and the two numerical domains (linear and log) against each other.
"""
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

import minimoe.ops.ksubset as ks
from minimoe.ops import (
    ksubset_covariance,
    ksubset_log_partition,
    ksubset_marginals,
    ksubset_sample,
    range_subset_covariance,
    range_subset_log_partition,
    range_subset_map,
    range_subset_marginals,
    range_subset_sample,
    range_subset_size_probs,
)

F64 = torch.float64


# --------------------------------------------------------------------------- the oracle
def subsets(E, k_min, k_max):
    """All subsets with k_min <= |S| <= k_max, as a (n, E) 0/1 float64 matrix."""
    rows = [S for c in range(k_min, k_max + 1) for S in itertools.combinations(range(E), c)]
    Z = torch.zeros(len(rows), E, dtype=F64)
    for n, S in enumerate(rows):
        Z[n, list(S)] = 1.0
    return Z


def enumerate_law(r, k_min, k_max):
    """log-partition, subset probabilities, marginals, covariance and size law by enumeration."""
    r = r.to(F64)
    Z = subsets(r.shape[-1], k_min, k_max)
    score = r @ Z.T                                        # (..., n): sum of the logits in S
    log_z = torch.logsumexp(score, -1)
    P = torch.exp(score - log_z[..., None])
    m = P @ Z
    cov = torch.einsum("...n,ni,nj->...ij", P, Z, Z) - m[..., :, None] * m[..., None, :]
    sizes = Z.sum(1).long()
    size_probs = torch.stack([P[..., sizes == c].sum(-1) for c in range(k_min, k_max + 1)], -1)
    return log_z, P, m, cov, size_probs


def chi_square_p(masks, probs, Z):
    """p-value of the observed subset counts against the exact probabilities (cells with expected
    count < 5 pooled into one)."""
    index = {tuple(row.tolist()): n for n, row in enumerate(Z.bool())}
    counts = torch.zeros(len(Z), dtype=F64)
    for key, c in zip(*torch.unique(masks, dim=0, return_counts=True)):
        counts[index[tuple(key.tolist())]] += c  # a KeyError would mean a subset of the wrong size
    expected = probs * masks.shape[0]
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    return chisquare(obs.numpy(), exp.numpy()).pvalue


CASES = [(E, k) for E in range(1, 9) for k in range(1, E + 1)]
RANGES = [(6, 1, 6), (6, 2, 4), (7, 3, 3), (5, 1, 1), (8, 2, 7), (4, 4, 4)]


# --------------------------------------------------------------------------- exact-k law
@pytest.mark.parametrize("scale", [0.1, 1.0, 3.0])
def test_log_partition_and_marginals_match_enumeration(scale):
    gen = torch.Generator().manual_seed(0)
    for E, k in CASES:
        r = scale * torch.randn(3, E, generator=gen, dtype=F64)
        log_z, _, m, _, _ = enumerate_law(r, k, k)
        assert torch.allclose(ksubset_log_partition(r, k), log_z, rtol=0, atol=1e-10), (E, k)
        got = ksubset_marginals(r, k)
        assert torch.allclose(got, m, rtol=0, atol=1e-10), (E, k)
        assert torch.allclose(got.sum(-1), torch.full((3,), float(k), dtype=F64), atol=1e-10)
        assert (got >= 0).all() and (got <= 1).all()
        # float32: its own precision
        assert torch.allclose(ksubset_marginals(r.float(), k).double(), m, atol=2e-6), (E, k)
        assert torch.allclose(ksubset_log_partition(r.float(), k).double(), log_z, atol=1e-5, rtol=1e-6)


def test_log_partition_at_ten_experts_and_the_sentinel_trap():
    gen = torch.Generator().manual_seed(1)
    r = 2 * torch.randn(4, 10, generator=gen, dtype=F64)
    for k in (1, 4, 7, 10):
        assert torch.allclose(ksubset_log_partition(r, k), enumerate_law(r, k, k)[0], atol=1e-10)
    # The reference code's -300 "impossible" sentinel returns -300 here (brief T17); -inf does not.
    low = torch.full((16,), -100.0)
    assert abs(ksubset_log_partition(low, 4).item() - (-400 + math.log(math.comb(16, 4)))) < 1e-3
    assert abs(ksubset_log_partition(low.double(), 4).item() - (-400 + math.log(math.comb(16, 4)))) < 1e-9


def test_covariance_is_the_jacobian_of_the_marginals():
    gen = torch.Generator().manual_seed(2)
    for E, k in [(1, 1), (4, 2), (6, 3), (7, 1), (7, 6), (8, 4), (5, 5)]:
        r = 1.5 * torch.randn(E, generator=gen, dtype=F64)
        cov = enumerate_law(r, k, k)[3]
        got = ksubset_covariance(r, k)
        assert torch.allclose(got, cov, atol=1e-10), (E, k)
        # torch's Jacobian calls the custom backward of ksubset_marginals once per output
        jac = torch.autograd.functional.jacobian(lambda t: ksubset_marginals(t, k), r)
        assert torch.allclose(jac, cov, atol=1e-10), (E, k)
        assert torch.allclose(got, got.T, atol=1e-12)
        assert got.sum(-1).abs().max() < 1e-10                   # sum_j z_j = k is constant
        m = ksubset_marginals(r, k)
        assert torch.allclose(got.diagonal(), m * (1 - m), atol=1e-12)
        assert (got - torch.diag(got.diagonal())).max() <= 1e-12  # negatively associated
    # batched: (2, 3, E) rows give (2, 3, E, E)
    r = torch.randn(2, 3, 6, generator=gen, dtype=F64)
    assert torch.allclose(ksubset_covariance(r, 2), enumerate_law(r, 2, 2)[3], atol=1e-10)


def test_gradients_gradcheck():
    gen = torch.Generator().manual_seed(3)
    r = torch.randn(2, 3, 6, generator=gen, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: ksubset_log_partition(t, 3), (r,))
    assert torch.autograd.gradgradcheck(lambda t: ksubset_log_partition(t, 3), (r,))
    assert torch.autograd.gradcheck(lambda t: ksubset_marginals(t, 2), (r,))
    assert torch.autograd.gradcheck(lambda t: range_subset_log_partition(t, 2, 5), (r,))
    assert torch.autograd.gradgradcheck(lambda t: range_subset_log_partition(t, 2, 5), (r,))
    assert torch.autograd.gradcheck(lambda t: range_subset_marginals(t, 1, 4), (r,))
    # the gradient of log Z is the marginal vector, to rounding
    (g,) = torch.autograd.grad(ksubset_log_partition(r, 3).sum(), r)
    assert torch.allclose(g, ksubset_marginals(r, 3), atol=1e-14)


def test_k_equal_to_E_is_deterministic_and_has_zero_gradient():
    r = torch.randn(3, 5, dtype=F64, requires_grad=True)
    m = ksubset_marginals(r, 5)
    assert torch.equal(m, torch.ones_like(m))
    (g,) = torch.autograd.grad((m * torch.randn_like(m)).sum(), r)
    assert torch.isfinite(g).all() and g.abs().max() < 1e-12  # no NaN from the impossible -inf states
    assert ksubset_covariance(r, 5).abs().max() < 1e-12
    assert ksubset_sample(r, 5).all()
    assert torch.allclose(ksubset_log_partition(r, 5), r.sum(-1))


def test_shift_invariance_of_the_exact_k_law():
    gen = torch.Generator().manual_seed(4)
    r = torch.randn(5, 7, generator=gen, dtype=F64)
    for c in (-50.0, -3.0, 2.5, 40.0):
        assert torch.allclose(ksubset_marginals(r + c, 3), ksubset_marginals(r, 3), atol=1e-10)
        assert torch.allclose(ksubset_log_partition(r + c, 3), ksubset_log_partition(r, 3) + 3 * c, atol=1e-9)
    # one constant per row, too
    c = torch.randn(5, 1, generator=gen, dtype=F64) * 10
    assert torch.allclose(ksubset_covariance(r + c, 3), ksubset_covariance(r, 3), atol=1e-10)


# --------------------------------------------------------------------------- the range law
@pytest.mark.parametrize("E, k_min, k_max", RANGES)
def test_range_law_matches_enumeration(E, k_min, k_max):
    gen = torch.Generator().manual_seed(5)
    r = 2 * torch.randn(4, E, generator=gen, dtype=F64)
    log_z, _, m, cov, size_probs = enumerate_law(r, k_min, k_max)
    assert torch.allclose(range_subset_log_partition(r, k_min, k_max), log_z, atol=1e-10)
    got = range_subset_marginals(r, k_min, k_max)
    assert torch.allclose(got, m, atol=1e-10)
    sizes = torch.arange(k_min, k_max + 1, dtype=F64)
    assert torch.allclose(range_subset_size_probs(r, k_min, k_max), size_probs, atol=1e-12)
    assert torch.allclose(got.sum(-1), (size_probs * sizes).sum(-1), atol=1e-10)  # = E|S|
    # the marginals are the mixture of the exact-k marginals with the size law as weights
    mix = sum(size_probs[:, n, None] * ksubset_marginals(r, int(c)) for n, c in enumerate(sizes))
    assert torch.allclose(got, mix, atol=1e-10)
    assert torch.allclose(range_subset_covariance(r, k_min, k_max), cov, atol=1e-10)
    jac = torch.autograd.functional.jacobian(lambda t: range_subset_marginals(t, k_min, k_max), r[0])
    assert torch.allclose(jac, cov[0], atol=1e-10)
    # rows of the covariance sum to Cov(z_i, |S|), which is not 0 when the size varies
    var_size = (size_probs * sizes**2).sum(-1) - (size_probs * sizes).sum(-1) ** 2
    assert torch.allclose(cov.sum((-1, -2)), var_size, atol=1e-10)


def test_range_law_with_equal_bounds_is_exact_k():
    r = torch.randn(4, 7, dtype=F64)
    assert torch.allclose(range_subset_marginals(r, 3, 3), ksubset_marginals(r, 3), atol=1e-14)
    assert torch.allclose(range_subset_log_partition(r, 3, 3), ksubset_log_partition(r, 3), atol=1e-13)


def test_range_law_depends_on_the_logit_level():
    """Adding c to every logit multiplies P(S) by exp(c |S|): the sizes move, d E|S| / dc = Var|S|."""
    gen = torch.Generator().manual_seed(6)
    r = torch.randn(6, generator=gen, dtype=F64)
    k_min, k_max = 2, 4
    sizes = torch.arange(k_min, k_max + 1, dtype=F64)
    base = range_subset_size_probs(r, k_min, k_max)
    means = []
    for c in (-2.0, -0.5, 0.0, 1.0, 2.0):
        got = range_subset_size_probs(r + c, k_min, k_max)
        want = base * torch.exp(c * sizes)
        assert torch.allclose(got, want / want.sum(), atol=1e-12)
        _, P, _, _, _ = enumerate_law(r + c, k_min, k_max)
        _, P0, _, _, _ = enumerate_law(r, k_min, k_max)
        Z = subsets(6, k_min, k_max)
        want_P = P0 * torch.exp(c * Z.sum(1))
        assert torch.allclose(P, want_P / want_P.sum(), atol=1e-12)
        means.append(range_subset_marginals(r + c, k_min, k_max).sum().item())
    assert all(a < b for a, b in itertools.pairwise(means))  # E|S| strictly increasing in c
    h = 1e-5
    slope = (range_subset_marginals(r + h, k_min, k_max).sum() - range_subset_marginals(r - h, k_min, k_max).sum()) / (2 * h)
    var = (base * sizes**2).sum() - (base * sizes).sum() ** 2
    assert abs(slope.item() - var.item()) < 1e-6
    # while the exact-k marginals do not move at all
    assert torch.allclose(ksubset_marginals(r + 2.0, 3), ksubset_marginals(r, 3), atol=1e-12)


def test_range_map_is_the_most_probable_subset():
    gen = torch.Generator().manual_seed(7)
    differs_from_k_max = 0
    for E, k_min, k_max in RANGES + [(8, 1, 8), (9, 3, 6)]:
        r = 1.5 * torch.randn(50, E, generator=gen, dtype=F64) - 0.3
        Z = subsets(E, k_min, k_max)
        best = Z[(r @ Z.T).argmax(-1)].bool()         # brute-force argmax of P(S)
        got = range_subset_map(r, k_min, k_max)
        assert torch.equal(got, best), (E, k_min, k_max)
        assert torch.equal(got.sum(-1), (r > 0).sum(-1).clamp(k_min, k_max))
        differs_from_k_max += int((got.sum(-1) != k_max).sum())
    # the paper's Alg. 3 (prefix sums of sorted softmax probabilities) would always answer k_max
    assert differs_from_k_max > 0


# --------------------------------------------------------------------------- sampling
def test_exact_k_sampler_chi_square():
    """40,000 draws for E=6, k=3 (20 subsets); chi-square p > 1e-3 at a fixed seed (brief T7)."""
    r = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=F64)
    Z = subsets(6, 3, 3)
    probs = enumerate_law(r, 3, 3)[1]
    M = 40_000
    gen = torch.Generator().manual_seed(0)
    masks = ksubset_sample(r.expand(M, 6), 3, generator=gen)
    assert masks.dtype == torch.bool and (masks.sum(-1) == 3).all()
    assert chi_square_p(masks, probs, Z) > 1e-3
    freq = masks.double().mean(0)
    m = ksubset_marginals(r, 3)
    assert ((freq - m).abs() < 4.5 * torch.sqrt(m * (1 - m) / M)).all()
    # the test has power: Gumbel-top-k draws k-subsets from a different law (brief T18)
    g = torch.Generator().manual_seed(1)
    gumbel = -torch.log(-torch.log(torch.rand(M, 6, generator=g, dtype=F64)))
    top = torch.zeros(M, 6, dtype=torch.bool).scatter_(1, (r + gumbel).topk(3, dim=-1).indices, True)
    assert chi_square_p(top, probs, Z) < 1e-6


def test_range_sampler_chi_square():
    """40,000 draws for E=6, sizes 2..4 (50 subsets); chi-square p > 1e-3 at a fixed seed."""
    r = torch.tensor([1.5, 0.5, 0.2, -0.3, -1.0, -2.0], dtype=F64)
    Z = subsets(6, 2, 4)
    probs = enumerate_law(r, 2, 4)[1]
    gen = torch.Generator().manual_seed(0)
    masks = range_subset_sample(r.expand(40_000, 6), 2, 4, generator=gen)
    sizes = masks.sum(-1)
    assert ((sizes >= 2) & (sizes <= 4)).all()
    assert chi_square_p(masks, probs, Z) > 1e-3


def test_sampler_in_the_log_domain_and_float32():
    """Two experts at -1e4 send the row to the log domain; the law on the other six is unchanged."""
    r = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, -1e4, -1e4])
    assert ks._route(r[None], 3, 3)[0][1] is True  # the log domain, and the test checks it
    probs = enumerate_law(r[:6].double(), 3, 3)[1]
    masks = ksubset_sample(r.expand(40_000, 8), 3, generator=torch.Generator().manual_seed(2))
    assert not masks[:, 6:].any() and (masks.sum(-1) == 3).all()
    assert chi_square_p(masks[:, :6], probs, subsets(6, 3, 3)) > 1e-3
    masks = range_subset_sample(r.expand(40_000, 8), 1, 3, generator=torch.Generator().manual_seed(3))
    assert not masks[:, 6:].any()
    assert chi_square_p(masks[:, :6], enumerate_law(r[:6].double(), 1, 3)[1], subsets(6, 1, 3)) > 1e-3


@pytest.mark.parametrize("chunk_rows", [None, 1, 3])
@pytest.mark.parametrize("k_min,k_max", [(1, 1), (3, 3), (2, 5), (9, 9)])
def test_linear_sampler_walk_is_the_step_by_step_walk(monkeypatch, chunk_rows, k_min, k_max):
    """The linear-domain sampler decides every step for every count at once (ks._take_decisions)
    and then only looks the decisions up; with one expert to pick (k_max = 1) it takes the last
    expert whose decision is 'take' in one batched step. Same uniforms, same
    samples as deciding step by step in float64: take expert i with c left when
    u < x_i alpha[i, c-1] / alpha[i+1, c], never when c = 0, always when c = i+1. Also with the
    step probabilities computed in chunks of 1 and 3 rows."""
    gen = torch.Generator().manual_seed(13)
    B, E = 257, 9
    for dtype in (torch.float32, F64):
        r = 2 * torch.randn(B, E, generator=gen, dtype=dtype)
        u = torch.rand(B, E + 1, generator=gen, dtype=F64)
        if chunk_rows is not None:
            monkeypatch.setattr(ks, "_CHUNK_BYTES", chunk_rows * (k_max + 1) * B * 8)
        got = ks._sample_rows(r, k_min, k_max, False, u)
        # the step-by-step walk on a plain (E+1, K+1, B) table
        x, w, _ = ks._prepare(r, k_min, k_max, False)
        alpha = torch.zeros(E + 1, k_max + 1, B, dtype=dtype)
        alpha[:, 0] = 1.0
        for i in range(E):
            alpha[i + 1, 1:] = alpha[i, 1:] + alpha[i, :-1] * x[i]
        if k_min == k_max:
            left = torch.full((B,), k_max)
        else:
            cdf = (w * alpha[-1]).T.cumsum(-1).double()
            left = torch.searchsorted(cdf, u[:, :1] * cdf[:, -1:], right=True)[:, 0].clamp(k_min, k_max)
        want = torch.zeros(E, B, dtype=torch.bool)
        for i in reversed(range(E)):
            c = left
            p = x[i] * alpha[i].gather(0, (c - 1).clamp(min=0)[None])[0] / alpha[i + 1].gather(0, c[None])[0]
            want[i] = ((u[:, 1 + i] < p) & (c > 0)) | (c == i + 1)
            left = left - want[i].long()
        assert torch.equal(got, want.T)
        assert ((got.sum(-1) >= k_min) & (got.sum(-1) <= k_max)).all()


def test_sampler_is_reproducible_and_batched():
    r = torch.randn(4, 5, 10)
    a = ksubset_sample(r, 4, generator=torch.Generator().manual_seed(11))
    b = ksubset_sample(r, 4, generator=torch.Generator().manual_seed(11))
    c = ksubset_sample(r, 4, generator=torch.Generator().manual_seed(12))
    assert a.shape == (4, 5, 10) and torch.equal(a, b) and not torch.equal(a, c)
    assert (a.sum(-1) == 4).all()
    # k = E and k = 1 extremes; E = 1
    assert ksubset_sample(r, 10).all()
    assert (ksubset_sample(r, 1).sum(-1) == 1).all()
    assert ksubset_sample(torch.zeros(3, 1), 1).all()


# --------------------------------------------------------------------------- numerics
def test_linear_and_log_domains_agree():
    gen = torch.Generator().manual_seed(8)
    r = 3 * torch.randn(16, 9, generator=gen, dtype=F64)
    v = torch.randn(16, 9, generator=gen, dtype=F64)
    for k_min, k_max in [(4, 4), (2, 6), (1, 9)]:
        for fn in (ks._log_partition_rows, ks._marginals_rows, ks._size_probs_rows):
            assert torch.allclose(fn(r, k_min, k_max, False), fn(r, k_min, k_max, True), atol=1e-12)
        assert torch.allclose(ks._cov_vjp_rows(r, k_min, k_max, False, v),
                              ks._cov_vjp_rows(r, k_min, k_max, True, v), atol=1e-12)


@pytest.mark.parametrize("whole_table", [True, False])
@pytest.mark.parametrize("E", range(2, 20))
def test_linear_marginals_with_and_without_checkpoints(E, whole_table, monkeypatch):
    """The linear marginals keep the whole prefix table when it fits in _BLOCK_BYTES; otherwise every
    ceil(sqrt(E))-th row, recomputing the rest segment by segment (the last segment shorter when S
    does not divide E). Both against the log domain, which keeps whole tables, for exact-k and range
    laws, and against each other bit for bit."""
    gen = torch.Generator().manual_seed(E)
    r = 2 * torch.randn(6, E, generator=gen, dtype=F64)
    sizes = {(1, 1), (E // 2, E // 2), (1, E - 1), (E - 1, E - 1), (max(1, E // 3), E)}
    whole = {size: ks._marginals_rows(r, *size, False) for size in sizes}
    if not whole_table:
        monkeypatch.setattr(ks, "_BLOCK_BYTES", 1)
    for size in sizes:
        m = ks._marginals_rows(r, *size, False)
        assert torch.allclose(m, ks._marginals_rows(r, *size, True), rtol=1e-12, atol=1e-14)
        assert torch.equal(m, whole[size])
    S = ks._segment_length(E, E, 6, 8)
    assert S == E if whole_table else (S - 1) ** 2 < E <= S ** 2  # S = ceil(sqrt(E))
    if whole_table:  # the whole table is kept only while its workspace, sums included, fits the budget
        K, B = E // 2, 10_000
        room = ((E + 2) * (K + 1) + E) * B * 4
        monkeypatch.setattr(ks, "_BLOCK_BYTES", room)
        assert ks._segment_length(E, K, B, 4) == E
        monkeypatch.setattr(ks, "_BLOCK_BYTES", room - 1)
        assert ks._segment_length(E, K, B, 4) == math.isqrt(E - 1) + 1
    assert ks._table_rows(ks._marginals_rows, E, False) == -(-E // ks._segment_length(E)) + ks._segment_length(E) + 1


def test_rows_are_routed_to_the_domain_that_can_hold_them():
    r = torch.stack([torch.linspace(-2, 2, 8), torch.linspace(-20, 20, 8), torch.linspace(-1e4, 1e4, 8)])
    groups = ks._route(r, 4, 4)
    assert [(g[0].tolist(), g[1], g[2]) for g in groups] == [
        ([0], False, torch.float32), ([1], False, torch.float64), ([2], True, torch.float64)]
    # the mixed batch gives the same answer as each row alone, and as enumeration
    m = ksubset_marginals(r, 4)
    for n in range(3):
        assert torch.equal(m[n], ksubset_marginals(r[n], 4))
        assert torch.allclose(m[n].double(), enumerate_law(r[n].double(), 4, 4)[2], atol=1e-6)


def test_blocks_of_rows_give_the_same_answer(monkeypatch):
    """On the CPU rows go through the DP in blocks of bounded memory; the answer must not change."""
    gen = torch.Generator().manual_seed(9)
    r = torch.randn(37, 9, generator=gen, dtype=F64, requires_grad=True)
    r.data[5] *= 200  # one row in the log domain
    v = torch.randn(37, 9, generator=gen, dtype=F64)

    def everything():
        m = range_subset_marginals(r, 2, 5)
        (g,) = torch.autograd.grad((m * v).sum(), r)
        return (m, g, ksubset_log_partition(r, 3), range_subset_size_probs(r, 2, 5),
                range_subset_sample(r, 2, 5, generator=torch.Generator().manual_seed(0)))

    whole = everything()
    monkeypatch.setattr(ks, "_BLOCK_BYTES", 2000)  # a few rows per block
    for a, b in zip(whole, everything()):
        assert torch.equal(a, b) if a.dtype == torch.bool else torch.allclose(a, b, atol=1e-14)


EXTREMES = {
    "halves at +-1e4": torch.tensor([1e4] * 4 + [-1e4] * 4),
    "1e4 + N(0, 1)": 1e4 + torch.randn(8, generator=torch.Generator().manual_seed(0)),
    "1e4 * N(0, 1)": 1e4 * torch.randn(8, generator=torch.Generator().manual_seed(1)),
    "30 * N(0, 1)": 30 * torch.randn(8, generator=torch.Generator().manual_seed(2)),
    "100 * N(0, 1)": 100 * torch.randn(8, generator=torch.Generator().manual_seed(3)),
    "mixed scales": torch.tensor([1e4, -1e4, 0.3, -0.2, 5e3, 1.0, -1.0, 0.0]),
    "all equal": torch.full((8,), 7.0),
}


@pytest.mark.parametrize("name", list(EXTREMES))
def test_float32_is_finite_and_accurate_at_extreme_logits(name):
    r32 = EXTREMES[name]
    r64 = r32.double()  # the same numbers, computed in float64
    for k_min, k_max in [(1, 1), (3, 3), (4, 4), (8, 8), (2, 6), (1, 8)]:
        log_z, _, m, cov, _ = enumerate_law(r64, k_min, k_max)
        got_z = range_subset_log_partition(r32, k_min, k_max)
        got_m = range_subset_marginals(r32, k_min, k_max)
        assert torch.isfinite(got_z) and torch.isfinite(got_m).all()
        assert abs(got_z.item() - log_z.item()) <= 1e-6 * abs(log_z.item()) + 1e-5
        assert (got_m.double() - m).abs().max() < 1e-5, (k_min, k_max)
        assert abs(got_m.sum().item() - m.sum().item()) < 1e-4
        assert torch.allclose(range_subset_marginals(r64, k_min, k_max), m, atol=1e-10)
        leaf = r32.clone().requires_grad_(True)
        (g,) = torch.autograd.grad((range_subset_marginals(leaf, k_min, k_max) * torch.arange(8.0)).sum(), leaf)
        assert torch.isfinite(g).all()
        assert (g.double() - cov @ torch.arange(8.0, dtype=F64)).abs().max() < 1e-4
    if name == "all equal":
        assert torch.allclose(ksubset_marginals(r32, 3), torch.full((8,), 3 / 8))


# --------------------------------------------------------------------------- shapes and dtypes
@settings(max_examples=40, deadline=None)
@given(batch=st.sampled_from([(), (1,), (3,), (2, 3), (0,), (2, 0, 4)]), E=st.integers(1, 9),
       data=st.data(), seed=st.integers(0, 10**6), scale=st.sampled_from([0.5, 3.0, 20.0]))
def test_shapes_and_sums(batch, E, data, seed, scale):
    k_min = data.draw(st.integers(1, E))
    k_max = data.draw(st.integers(k_min, E))
    gen = torch.Generator().manual_seed(seed)
    r = (scale * torch.randn(*batch, E, generator=gen, dtype=F64)).clamp(-20, 20)
    m = ksubset_marginals(r, k_max)
    assert m.shape == r.shape and ksubset_log_partition(r, k_max).shape == batch
    assert torch.allclose(m.sum(-1), torch.full(batch, float(k_max), dtype=F64), atol=1e-9)
    assert ((m >= 0) & (m <= 1)).all()
    mr = range_subset_marginals(r, k_min, k_max)
    sp = range_subset_size_probs(r, k_min, k_max)
    assert sp.shape == (*batch, k_max - k_min + 1)
    assert torch.allclose(sp.sum(-1), torch.ones(batch, dtype=F64), atol=1e-12)
    assert torch.allclose(mr.sum(-1), (sp * torch.arange(k_min, k_max + 1, dtype=F64)).sum(-1), atol=1e-9)
    assert range_subset_log_partition(r, k_min, k_max).shape == batch
    assert ksubset_covariance(r, k_max).shape == (*batch, E, E)
    s = range_subset_sample(r, k_min, k_max, generator=gen)
    assert s.shape == r.shape and s.dtype == torch.bool
    assert ((s.sum(-1) >= k_min) & (s.sum(-1) <= k_max)).all()
    assert (ksubset_sample(r, k_min, generator=gen).sum(-1) == k_min).all()
    assert range_subset_map(r, k_min, k_max).shape == r.shape
    if r.numel() and E <= 8:  # and the values, against enumeration
        assert torch.allclose(mr, enumerate_law(r, k_min, k_max)[2], atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_output_dtypes(dtype):
    r = torch.randn(3, 6).to(dtype)
    assert ksubset_marginals(r, 2).dtype == dtype
    assert ksubset_log_partition(r, 2).dtype == dtype
    assert range_subset_marginals(r, 1, 3).dtype == dtype
    assert ksubset_covariance(r, 2).dtype == dtype
    assert ksubset_sample(r, 2).dtype == torch.bool
    want = ksubset_marginals(r.double(), 2)
    assert torch.allclose(ksubset_marginals(r, 2).double(), want, atol=1e-2)


# --------------------------------------------------------------------------- bad input
r6 = torch.randn(4, 6)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: ksubset_marginals(r6, 0), ValueError, r"k must be in \[1, E\] = \[1, 6\].*k=0"),
        (lambda: ksubset_marginals(r6, 7), ValueError, r"k must be in \[1, E\] = \[1, 6\].*k=7"),
        (lambda: ksubset_log_partition(r6, -1), ValueError, r"k must be in \[1, E\]"),
        (lambda: ksubset_sample(r6, 9), ValueError, r"k must be in \[1, E\]"),
        (lambda: ksubset_covariance(r6, 0), ValueError, r"k must be in \[1, E\]"),
        (lambda: ksubset_marginals(r6, 2.0), TypeError, "k must be an int"),
        (lambda: ksubset_marginals(r6, True), TypeError, "k must be an int"),
        (lambda: range_subset_marginals(r6, 4, 3), ValueError, "k_min must be <= k_max, got k_min=4, k_max=3"),
        (lambda: range_subset_sample(r6, 0, 3), ValueError, r"k_min must be in \[1, E\]"),
        (lambda: range_subset_log_partition(r6, 1, 7), ValueError, r"k_max must be in \[1, E\] = \[1, 6\]"),
        (lambda: range_subset_map(r6, 2, 8), ValueError, "k_max must be in"),
        (lambda: range_subset_size_probs(r6, 3, 2), ValueError, "k_min must be <= k_max"),
        (lambda: range_subset_covariance(r6, 1, None), TypeError, "k_max must be an int"),
        (lambda: ksubset_marginals(torch.full((4, 6), float("nan")), 2), ValueError, "logits contains NaN"),
        (lambda: range_subset_marginals(torch.full((4, 6), float("inf")), 1, 2), ValueError, "logits contains inf"),
        (lambda: ksubset_sample(torch.tensor(1.0), 1), ValueError, r"logits must have shape \(\.\.\., E\)"),
        (lambda: ksubset_marginals(torch.ones(4, 6, dtype=torch.long), 2), TypeError, "logits must be a floating"),
        (lambda: ksubset_marginals([[0.1, 0.2]], 1), TypeError, "logits must be a torch.Tensor"),
        (lambda: ksubset_sample(r6, 2, generator=0), TypeError, "generator must be a torch.Generator"),
        (lambda: ksubset_marginals(torch.zeros(3, 0), 1), ValueError, r"k must be in \[1, E\] = \[1, 0\]"),
    ],
)
def test_bad_input_raises_a_clear_error(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 30.0, 1e4])
def test_singleton_marginals_are_the_dp_s(dtype, scale):
    """At k = 1 (and k_max = 1 for the range law) the marginals are the softmax and their Jacobian
    diag(m) - m m^T: the shortcut must give the DP's values and vector-Jacobian products to rounding,
    in the linear domain (scale 1) and where the DP needs its log domain (scale 1e4)."""
    gen = torch.Generator().manual_seed(21)
    r = (scale * torch.randn(6, 5, 12, generator=gen, dtype=F64)).to(dtype).requires_grad_(True)
    v = torch.randn(6, 5, 12, generator=gen, dtype=F64).to(dtype)
    rtol = 1e-5 if dtype == torch.float32 else 1e-12
    want = ks._Marginals.apply(r, 1, 1)
    (want_grad,) = torch.autograd.grad(want, r, v)
    for got in (ksubset_marginals(r, 1), range_subset_marginals(r, 1, 1)):
        (got_grad,) = torch.autograd.grad(got, r, v)
        assert got.dtype == dtype
        assert torch.allclose(got, want, rtol=rtol, atol=rtol * 1e-3)
        assert torch.allclose(got_grad, want_grad, rtol=rtol, atol=rtol * float(v.abs().max()) * 1e-2)
    if dtype == torch.float64 and scale == 1.0:
        assert torch.autograd.gradcheck(lambda x: ksubset_marginals(x, 1), (r[0, :2].detach().requires_grad_(),))
