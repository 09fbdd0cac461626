"""The router gradients of chapter 7 against the exact gradient of the expected loss (ProbMoE eq. 3),
computed by enumerating every k-subset (float64): eq. (8) and the sampled straight-through estimator
for a linear loss (Proposition 7.4 and the errata entry on eq. 8), and App. F's gradient-quality
comparison (cosine similarity with the exact gradient) on a tiny layer.
"""
import itertools
import math

import torch

from minimoe.ops import ksubset_covariance, ksubset_log_partition, ksubset_marginals, ksubset_sample

F64 = torch.float64


def subsets(E, k):
    Z = torch.zeros(math.comb(E, k), E, dtype=F64)
    for n, S in enumerate(itertools.combinations(range(E), k)):
        Z[n, list(S)] = 1.0
    return Z


def instance(seed, T, E, d):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(T, E, generator=g, dtype=F64)
    f = torch.randn(T, E, d, generator=g, dtype=F64)        # expert outputs f_j(x_t)
    c = torch.randn(T, d, generator=g, dtype=F64)            # linear loss <c_t, y> / quadratic target
    return r, f, c


def exact_gradient(r, f, loss, k):
    """grad_r of J = sum_t sum_S P(S) L_t(y_S), y_S = sum_{j in S} pi_j f_j, by enumeration."""
    Z = subsets(r.shape[-1], k)
    r = r.clone().requires_grad_(True)
    log_p = r @ Z.T - ksubset_log_partition(r, k)[:, None]                     # (T, C)
    y = torch.einsum("ce,te,ted->ctd", Z, torch.softmax(r, -1), f)
    return torch.autograd.grad((log_p.exp().T * loss(y)).sum(), r)[0]


def straight_through(r, f, loss, masks, k):
    """ProbMoE's estimate for each row of masks (N, T, E): autograd through w = (z + m - sg(m)) pi with
    the package's marginals, only the experts in S contributing (Proposition 7.4)."""
    rr = r.expand(masks.shape[0], -1, -1).clone().requires_grad_(True)
    m = ksubset_marginals(rr, k)
    w = masks * (masks + m - m.detach()) * torch.softmax(rr, -1)
    y = torch.einsum("nte,ted->ntd", w, f)
    return torch.autograd.grad(loss(y).sum(), rr)[0]


def test_linear_loss_eq8_is_exact_and_the_sampled_estimator_is_biased():
    """L_t = <c_t, y_t>, E = 5, k = 2: eq. (8), sum_j delta_j (m_j dpi_j + pi_j dm_j), is the exact
    gradient; the sampled estimator's mean sum_j m_j delta_j (dpi_j + pi_j Cov(., j)) is not: it
    misses sum_j delta_j pi_j (1 - m_j) Cov(., j)."""
    T, E, k = 4, 5, 2
    r, f, c = instance(0, T, E, 3)
    loss = lambda y: (y * c).sum(-1)  # noqa: E731
    g_star = exact_gradient(r, f, loss, k)
    delta = torch.einsum("ted,td->te", f, c)
    pi, m, cov = torch.softmax(r, -1), ksubset_marginals(r, k), ksubset_covariance(r, k)
    jac = torch.diag_embed(pi) - pi[:, :, None] * pi[:, None, :]                # [t, j, i] = dpi_j/dr_i
    eq8 = torch.einsum("tj,tji->ti", delta * m, jac) + torch.einsum("tj,tij->ti", delta * pi, cov)
    assert torch.allclose(eq8, g_star, atol=1e-12)
    Z = subsets(E, k)
    law = torch.exp(r @ Z.T - ksubset_log_partition(r, k)[:, None])           # (T, C)
    per_subset = straight_through(r, f, loss, Z[:, None, :].expand(-1, T, -1), k)  # (C, T, E)
    mean = (law.T[..., None] * per_subset).sum(0)
    gap = torch.einsum("tj,tij->ti", delta * pi * (1 - m), cov)
    assert torch.allclose(g_star - mean, gap, atol=1e-12)
    assert (mean - g_star).abs().max() > 5e-3, "biased even for a linear loss"


def test_app_f_gradient_quality_by_enumeration():
    """App. F's question on a layer small enough to enumerate (T = 3 tokens, E = 5, k = 2, quadratic
    loss): cosine of each estimator with the exact gradient g*. REINFORCE (score function of the
    k-subset law plus the pathwise term) is unbiased: E[g] = g* to 1e-12. ProbMoE is biased but
    close: 0.9 < cos(E[g], g*) < 1 - 1e-6. DenseMixer (sum over all experts of delta_j dpi_j at
    the top-k output) is deterministic. Monte Carlo (20,000 draws, fixed seed) agrees with the
    enumerated mean of the ProbMoE estimate: every component within 5 standard errors."""
    T, E, k = 3, 5, 2
    r, f, target = instance(1, T, E, 4)
    loss = lambda y: 0.5 * ((y - target) ** 2).sum(-1)  # noqa: E731
    g_star = exact_gradient(r, f, loss, k)
    Z = subsets(E, k)
    law = torch.exp(r @ Z.T - ksubset_log_partition(r, k)[:, None])           # (T, C)
    masks = Z[:, None, :].expand(-1, T, -1)
    probmoe = straight_through(r, f, loss, masks, k)                          # (C, T, E)
    # REINFORCE: pathwise (top-k style) gradient on S plus (z - m) L_t(y_S)
    rr = r.expand(len(Z), -1, -1).clone().requires_grad_(True)
    losses = loss(torch.einsum("nte,ted->ntd", masks * torch.softmax(rr, -1), f))
    reinforce = torch.autograd.grad(losses.sum(), rr)[0] + (masks - ksubset_marginals(r, k)) * losses.detach()[..., None]
    # DenseMixer at the top-k set: delta_j at the sparse output, for every expert j
    top = torch.zeros(T, E, dtype=F64).scatter(-1, r.topk(k, -1).indices, 1.0)
    rr = r.clone().requires_grad_(True)
    pi = torch.softmax(rr, -1)
    sparse = torch.einsum("te,ted->td", top * pi, f)
    dense = torch.einsum("te,ted->td", pi, f)
    densemixer = torch.autograd.grad(loss(sparse.detach() + dense - dense.detach()).sum(), rr)[0]

    def cos(a, b):
        return float((a * b).sum() / (a.norm() * b.norm()))

    mean = lambda g: (law.T[..., None] * g).sum(0)  # noqa: E731
    assert torch.allclose(mean(reinforce), g_star, atol=1e-12)
    assert 0.9 < cos(mean(probmoe), g_star) < 1 - 1e-6
    assert cos(densemixer, g_star) < 1 - 1e-6
    # Monte Carlo with the package's sampler agrees with the enumeration
    N = 20_000
    draws = ksubset_sample(r.expand(N, -1, -1), k, generator=torch.Generator().manual_seed(0)).to(F64)
    g = straight_through(r, f, loss, draws, k)
    se = g.std(0) / math.sqrt(N)
    assert ((g.mean(0) - mean(probmoe)).abs() <= 5 * se + 1e-12).all()
    assert ((g.mean(0) - g_star).abs() > 5 * se).any(), "the bias is visible at this sample size"
