"""ProbMoE's pseudocode (Zhao et al., App. G and H), reproduced as printed, against the mathematics of
chapter 7: the four errata of book/errata.md (MarginalsBand without a stop-gradient, PrUpToK's
wrap-around at j = 0, TopKIndices padding, Alg. 6 indexing past its table), each with the corrected
version, and the tree DP of App. H (Thm. 4.1's vectorised form, Alg. 4-6) against the chain DP.

Oracle: enumeration of every subset (float64), the package's chain DP, and a chi-square test with a
fixed seed for the tree sampler.
"""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import chisquare

from minimoe.exercises.oracles import circuit_upward, compile_exactly_k, marginals_band, pr_up_to_k
from minimoe.ops import (ksubset_log_partition, ksubset_marginals, range_subset_covariance,
                         range_subset_marginals, range_subset_sample)

F64 = torch.float64


def bernoulli_enumeration(r):
    """All 2^E subsets with their independent-Bernoulli probabilities prod p prod (1 - p), p = sigmoid(r)."""
    E = r.shape[-1]
    Z = torch.tensor(list(itertools.product([0.0, 1.0], repeat=E)), dtype=F64)
    log_w = Z @ F.logsigmoid(r) + (1 - Z) @ F.logsigmoid(-r)
    return Z, log_w.exp()


def exact_k_enumeration(r, k):
    Z = torch.zeros(math.comb(len(r), k), len(r), dtype=F64)
    for n, S in enumerate(itertools.combinations(range(len(r)), k)):
        Z[n, list(S)] = 1.0
    score = Z @ r
    P = torch.softmax(score, 0)
    return Z, P, torch.logsumexp(score, 0), P @ Z


# --------------------------------------------------------------------------- Alg. 2, PrUpToK
# pr_up_to_k, marginals_band, compile_exactly_k and circuit_upward: minimoe.exercises.oracles
def test_pruptok_as_printed_wraps_around_at_j_equal_0():
    """Literal: a[n, c] = log P(|S| = c mod (k_max + 1)), not log P(|S| = c), as soon as n > k_max."""
    torch.manual_seed(0)
    r = torch.randn(6, dtype=F64)
    k_max = 2
    Z, w = bernoulli_enumeration(r)
    sizes = Z.sum(1).long()
    exact = torch.stack([w[sizes == c].sum() for c in range(k_max + 1)])
    cyclic = torch.stack([w[sizes % (k_max + 1) == c].sum() for c in range(k_max + 1)])
    log_p, log_q = F.logsigmoid(r), F.logsigmoid(-r)
    literal = pr_up_to_k(log_p, log_q, k_max, literal=True)[-1].exp()
    fixed = pr_up_to_k(log_p, log_q, k_max, literal=False)[-1].exp()
    assert torch.allclose(fixed, exact, atol=1e-14), "guarded at j = 0, the table is P(|S| = c) (App. B)"
    assert torch.allclose(literal, cyclic, atol=1e-14), "as printed, sizes are counted modulo k_max + 1"
    assert (literal - exact).abs().max() > 1e-2, "... which is wrong for E = 6 > k_max = 2"
    # with E <= k_max the wrapped column is still log 0 and the printed version happens to be right
    short = pr_up_to_k(log_p[:2], log_q[:2], k_max, literal=True)[-1].exp()
    assert torch.allclose(short, pr_up_to_k(log_p[:2], log_q[:2], k_max, literal=False)[-1].exp(), atol=1e-15)
    # the corrected table gives the package's normaliser: Z_c = e_c(e^r) prod (1 - p)
    for c in (1, 2):
        assert torch.allclose(fixed[c].log(), ksubset_log_partition(r, c) + log_q.sum(), atol=1e-12)


# --------------------------------------------------------------------------- Alg. 2, MarginalsBand
@pytest.mark.parametrize("k_min, k_max", [(2, 2), (1, 3)])
def test_marginalsband_without_stop_gradient_is_not_the_marginals(k_min, k_max):
    """As printed: mu_j = m_j - (1 - m_j) p_j / (1 - p_j); with log q detached: mu = m (enumeration)."""
    r = torch.tensor([1.5, 0.4, -0.3, -1.0, 0.1], dtype=F64)
    m = range_subset_marginals(r, k_min, k_max)
    Z, w = bernoulli_enumeration(r)
    keep = (Z.sum(1) >= k_min) & (Z.sum(1) <= k_max)
    m_enum = (w[keep] @ Z[keep]) / w[keep].sum()
    assert torch.allclose(m, m_enum, atol=1e-13)
    p = torch.sigmoid(r)
    printed = marginals_band(r, k_min, k_max, stop_gradient=False)
    detached = marginals_band(r, k_min, k_max, stop_gradient=True)
    assert torch.allclose(detached, m_enum, atol=1e-12), "with log q held fixed, eq. (6)/Prop. 5.2 hold"
    assert torch.allclose(printed, m - (1 - m) * p / (1 - p), atol=1e-12)
    assert (printed < 0).any() and (printed - m).abs().max() > 0.1, "not probabilities"
    # in logits no convention is needed: the gradient of the log-normaliser in r is the marginals
    rr = r.clone().requires_grad_(True)
    lz = torch.logsumexp(torch.stack([ksubset_log_partition(rr, c) for c in range(k_min, k_max + 1)]), 0)
    assert torch.allclose(torch.autograd.grad(lz, rr)[0], m_enum, atol=1e-12)


def test_marginalsband_numbers_quoted_in_the_errata():
    """The errata's example: logits (2, 0, -1, -0.5), k = 2."""
    r = torch.tensor([2.0, 0.0, -1.0, -0.5], dtype=F64)
    m = exact_k_enumeration(r, 2)[3]
    printed = marginals_band(r, 2, 2, stop_gradient=False)
    assert torch.allclose(m, torch.tensor([0.9241, 0.5298, 0.2096, 0.3364], dtype=F64), atol=5e-5)
    assert torch.allclose(printed, torch.tensor([0.3636, 0.0596, -0.0811, -0.0660], dtype=F64), atol=5e-5)
    assert abs(printed.sum() - 0.2761) < 1e-3, "sums to 0.28, not k = 2"


# --------------------------------------------------------------------------- Alg. 1, TopKIndices
def test_topkindices_pads_with_experts_that_were_not_sampled():
    """Alg. 1 as printed: I = TopKIndices(z, k_max) fills the k_max - |S| free slots with unsampled
    experts; they run, their forward weight is 0, but their straight-through weight m_j pi_j carries
    gradient delta_j pi_j Cov(., j) into the router. Multiplying by the gathered mask (the released
    code) removes exactly that term."""
    torch.manual_seed(1)
    T, E, k_min, k_max = 64, 6, 1, 3
    r = torch.randn(T, E, dtype=F64, requires_grad=True)
    delta = torch.randn(T, E, dtype=F64)  # <dL/dy, f_j(x_t)>: a loss linear in the combine weights
    z = range_subset_sample(r.detach(), k_min, k_max, generator=torch.Generator().manual_seed(2)).to(F64)
    assert (z.sum(-1) < k_max).any()

    def router_grad(corrected):
        mu = range_subset_marginals(r, k_min, k_max)
        w_full = ((z - mu).detach() + mu) * torch.softmax(r, -1)   # eq. (7)
        I = torch.topk(z, k_max, -1).indices                        # TopKIndices(z, k_max)
        w = w_full.gather(-1, I)
        if corrected:
            w = w * z.gather(-1, I)
        loss = (w * delta.gather(-1, I)).sum()                     # y = sum over the k_max slots
        return torch.autograd.grad(loss, r)[0], I, w.detach()

    g_printed, I, w = router_grad(False)
    g_fixed, _, w_fixed = router_grad(True)
    padded = z.gather(-1, I) == 0
    assert padded.sum() == (k_max - z.sum(-1)).sum(), "every free slot holds an expert that was not sampled"
    assert torch.equal(w, w_fixed) and (w[padded] == 0).all(), "same forward value"
    with torch.no_grad():
        pi = torch.softmax(r, -1)
        cov = range_subset_covariance(r, k_min, k_max)
        pad = torch.zeros_like(z).scatter(-1, I, padded.to(F64))           # 1 on padded experts
        extra = torch.einsum("tj,tij->ti", pad * delta * pi, cov)
        jac = torch.diag_embed(pi) - pi[:, :, None] * pi[:, None, :]
        want = torch.einsum("tj,tji->ti", z * delta, jac) + torch.einsum("tj,tij->ti", z * delta * pi, cov)
    assert torch.allclose(g_fixed, want, atol=1e-12), "corrected: Proposition 7.4 on the sampled set"
    assert torch.allclose(g_printed - g_fixed, extra, atol=1e-12)
    assert extra.abs().max() > 1e-2, "the padding changes the router gradient"


# --------------------------------------------------------------------------- Alg. 6, CompileExactlyK
def test_alg6_as_printed_indexes_past_its_table():
    with pytest.raises(IndexError):
        compile_exactly_k(4, 2, corrected=False)  # first level: leaves have counts 0, 1; j = 2 asks for 2
    compile_exactly_k(4, 1, corrected=False)     # k = 1 never leaves the table


@pytest.mark.parametrize("n, k", [(4, 2), (8, 3), (8, 8), (16, 5)])
def test_alg6_corrected_compiles_exactly_k(n, k):
    """The corrected circuit: its models are exactly the k-subsets (evaluated at every 0/1 input for
    n = 8), its upward pass is log Z_k of eq. (4), and hash-consing keeps it O(n k) nodes."""
    root, unique = compile_exactly_k(n, k, corrected=True)
    torch.manual_seed(n + k)
    r = 2 * torch.randn(n, dtype=F64)
    log_p, log_q = F.logsigmoid(r), F.logsigmoid(-r)
    log_z = circuit_upward(root, log_p, log_q, {})
    assert torch.allclose(log_z, ksubset_log_partition(r, k) + log_q.sum(), atol=1e-10)
    assert len(unique) <= 2 * n * (k + 1)
    if n == 8:
        for bits in itertools.product([0, 1], repeat=n):
            x = torch.tensor(bits, dtype=F64)
            value = circuit_upward(root, torch.log(x), torch.log(1 - x), {}).exp()
            assert value == float(sum(bits) == k)


# --------------------------------------------------------------------------- App. H, the tree DP
def tree_tables(r, k):
    """Balanced tree of truncated polynomial products: levels[0] are the leaves log(1 + x_j t),
    levels[-1][0] the root's log e_c(e^r), c = 0..k. E is padded to a power of two with logits -1e4
    (weight exactly 0 in float64, and finite, so autograd through the tree has no NaN)."""
    E = r.shape[-1]
    size = 1 << max(0, (E - 1).bit_length())
    padded = torch.cat([r, torch.full((size - E,), -1e4, dtype=r.dtype)])  # exp(-1e4) = 0: never chosen
    levels = [torch.stack([torch.zeros_like(padded), padded], -1)]
    while levels[-1].shape[0] > 1:
        left, right = levels[-1][0::2], levels[-1][1::2]
        width = min(k, 2 * (left.shape[-1] - 1)) + 1
        cols = []
        for c in range(width):
            terms = [left[:, a] + right[:, c - a] for a in range(left.shape[-1]) if 0 <= c - a < right.shape[-1]]
            cols.append(torch.logsumexp(torch.stack(terms, -1), -1))
        levels.append(torch.stack(cols, -1))
    return levels


@pytest.mark.parametrize("E", [1, 5, 7, 8, 13, 60, 64])
def test_tree_dp_equals_the_chain_dp(E):
    """Thm. 4.1's vectorised form (App. H): the tree's root equals the chain DP for every c <= k."""
    torch.manual_seed(E)
    r = 2 * torch.randn(E, dtype=F64)
    k = min(E, 8)
    root = tree_tables(r, k)[-1][0]
    assert len(tree_tables(r, k)) - 1 == max(0, (E - 1).bit_length()), "log2 E levels"
    chain = torch.stack([ksubset_log_partition(r, c) for c in range(1, k + 1)])
    assert torch.allclose(root[1:k + 1], chain, atol=1e-10)
    if E <= 8:
        assert torch.allclose(root[k], exact_k_enumeration(r, k)[2], atol=1e-10)


def test_tree_marginals_and_top_down_sampler():
    """Alg. 5 on the tree: the marginals are the gradient of the root (CircuitDownward's job), and
    the top-down sampler (CircuitSample: at each node draw the split j' of the count, prop. to
    exp(L[j'] + R[c - j'])) samples the k-subset law: chi-square over the 20 subsets of E = 6, k = 3,
    20,000 draws, fixed seed, p > 1e-3."""
    r = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=F64, requires_grad=True)
    E, k, N = 6, 3, 20_000
    levels = tree_tables(r, k)
    m_tree = torch.autograd.grad(levels[-1][0, k], r)[0]
    Zs, P, _, m_enum = exact_k_enumeration(r.detach(), k)
    assert torch.allclose(m_tree, m_enum, atol=1e-12)
    assert torch.allclose(ksubset_marginals(r.detach(), k), m_enum, atol=1e-12)

    gen = torch.Generator().manual_seed(0)
    levels = [lv.detach() for lv in levels]
    count = torch.full((N, 1), k)                    # the count each node of the current level must hold
    for depth in range(len(levels) - 1, 0, -1):
        left, right = levels[depth - 1][0::2], levels[depth - 1][1::2]   # (nodes, width)
        a = torch.arange(left.shape[-1])
        logw = left[None, :, :] + right[None, :, :].expand(N, -1, -1).gather(
            -1, (count[..., None] - a).clamp(0, right.shape[-1] - 1))
        logw = torch.where((count[..., None] - a >= 0) & (count[..., None] - a < right.shape[-1]),
                           logw, torch.tensor(-math.inf, dtype=F64))
        split = torch.multinomial(torch.softmax(logw, -1).reshape(-1, len(a)), 1, generator=gen).reshape(count.shape)
        count = torch.stack([split, count - split], -1).reshape(N, -1)
    masks = count[:, :E].to(F64)
    assert (masks.sum(1) == k).all() and (count[:, E:] == 0).all(), "padding is never chosen"
    index = {tuple(row.tolist()): n for n, row in enumerate(Zs)}
    counts = torch.zeros(len(Zs), dtype=F64)
    for key, c in zip(*torch.unique(masks, dim=0, return_counts=True)):
        counts[index[tuple(key.tolist())]] += c
    expected = (P * N).detach()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3


# --------------------------------------------------------------------------- Alg. 2 samplers, Alg. 3
def test_sample_band_k_and_sample_exact_k_dynamic_as_printed():
    """SampleBandK (softmax over a[n, k_min..k_max]) is eq. (9), exactly; SampleExactKDynamic as
    printed draws Bernoulli(sigmoid(log-probability)) and returns subsets of the wrong size (20,000
    draws, E = 6, k = 3: fewer than half have size 3), while Bernoulli(exp(log-probability)) always
    has size k."""
    r = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=F64)
    log_p, log_q = F.logsigmoid(r), F.logsigmoid(-r)
    a = pr_up_to_k(log_p, log_q, 4, literal=False)
    Z, w = bernoulli_enumeration(r)
    sizes = Z.sum(1).long()
    rho = torch.softmax(a[-1, 2:5], 0)
    want = torch.stack([w[sizes == c].sum() for c in (2, 3, 4)])
    assert torch.allclose(rho, want / want.sum(), atol=1e-14)

    def sample(k, literal, N=20_000, seed=0):
        gen = torch.Generator().manual_seed(seed)
        j = torch.full((N,), k)
        size = torch.zeros(N, dtype=torch.long)
        for i in range(len(r), 0, -1):
            pi_i = a[i - 1][(j - 1).clamp(min=0)] + log_p[i - 1] - a[i][j]
            prob = torch.sigmoid(pi_i) if literal else pi_i.exp()
            take = (torch.rand(N, generator=gen, dtype=F64) < prob) & (j > 0)
            j, size = j - take.long(), size + take.long()
        return size

    assert (sample(3, literal=False) == 3).all()
    printed = sample(3, literal=True)
    assert (printed == 3).double().mean() < 0.5 and (printed < 3).any()


def test_alg3_as_printed_always_picks_k_max():
    """Alg. 3: argmax over k in [k_min, k_max] of prefix sums of the sorted softmax is k_max for every
    logit vector (float64, 200 random tokens with distinct probabilities), while the MAP of the range
    law (brute force) has fewer experts for some."""
    gen = torch.Generator().manual_seed(3)
    r = 2 * torch.randn(200, 6, generator=gen, dtype=F64) - 1
    k_min, k_max = 1, 4
    C = torch.softmax(r, -1).sort(-1, descending=True).values.cumsum(-1)
    k_star = k_min + C[:, k_min - 1:k_max].argmax(-1)
    assert (k_star == k_max).all()
    Z = torch.tensor([S for S in itertools.product([0.0, 1.0], repeat=6) if k_min <= sum(S) <= k_max], dtype=F64)
    map_size = Z[(r @ Z.T).argmax(-1)].sum(-1)
    assert (map_size < k_max).any()
    assert torch.equal(map_size, (r > 0).sum(-1).clamp(k_min, k_max).to(F64))
