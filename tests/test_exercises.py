"""The coursework checkers accept the reference and reject typical wrong answers."""
import math

import torch

from minimoe.exercises import check_capacity, check_token_choice_allocation
from minimoe.ops import compute_capacity, token_choice_allocation
from reference import algorithm1_token_choice


def test_checkers_accept_correct_solutions(capsys):
    assert check_token_choice_allocation(lambda s, k, c: token_choice_allocation(s, k, c))
    # An independent correct solution: the literal loop, converted to a slot table.
    def loop_solution(scores, k, C):
        D = algorithm1_token_choice(scores, k, C)
        return torch.where(D.any(-1), D.argmax(-1), torch.full(D.shape[:2], -1))
    assert check_token_choice_allocation(loop_solution)
    assert check_capacity(lambda t, e, f: compute_capacity(t, e, f))
    assert "PASS" in capsys.readouterr().out


def test_checkers_reject_wrong_solutions(capsys):
    # Token-major order (a token's second choice before the next token's first) is the classic bug.
    def token_major(scores, k, C):
        T, E = scores.shape
        position = torch.full((T, E), -1)
        fill = [0] * E
        for t in range(T):
            for r in scores[t].topk(k).indices.tolist():
                if fill[r] < C:
                    position[t, r] = fill[r]
                    fill[r] += 1
        return position
    assert not check_token_choice_allocation(token_major)
    assert not check_token_choice_allocation(lambda s, k, c: torch.zeros(3))
    assert not check_capacity(lambda t, e, f: max(1, round(f * t / e)))  # banker's rounding, no error
    assert not check_capacity(lambda t, e, f: math.ceil(f * t / e))
    out = capsys.readouterr().out
    assert out.count("FAIL") == 4 and "round" in out


def test_ot_checkers_accept_independent_solutions_and_reject_wrong_ones(capsys):
    from scipy.stats import norm

    from minimoe.exercises import check_gaussian_top1, check_kl_projection, check_sinkhorn_step, check_two_by_two_plan

    def step(L, f, g, b):
        f = -torch.logsumexp(L + g, dim=1)
        return f, b.log() - torch.logsumexp(L + f[:, None], dim=0)

    def step_stale_f(L, f, g, b):  # uses the old f in the column update
        f_new = -torch.logsumexp(L + g, dim=1)
        return f_new, b.log() - torch.logsumexp(L + f[:, None], dim=0)

    def step_naive(L, f, g, b):  # log(sum(exp)) overflows at large scores
        f = -torch.log(torch.exp(L + g).sum(1))
        return f, b.log() - torch.log(torch.exp(L + f[:, None]).sum(0))

    assert check_sinkhorn_step(step)
    assert not check_sinkhorn_step(step_stale_f)
    assert not check_sinkhorn_step(step_naive)

    def plan(S, eps):
        p = torch.sigmoid((S[0, 0] + S[1, 1] - S[0, 1] - S[1, 0]) / (2 * eps))
        return torch.stack([torch.stack([p, 1 - p]), torch.stack([1 - p, p])])

    assert check_two_by_two_plan(plan)
    assert not check_two_by_two_plan(lambda S, eps: torch.softmax(S / eps, -1))  # no column constraint

    def projection(q, k):
        keep = q.topk(k).indices
        alpha = torch.zeros_like(q)
        alpha[keep] = q[keep] / q[keep].sum()
        return alpha

    assert check_kl_projection(projection)
    assert not check_kl_projection(lambda q, k: torch.zeros_like(q).scatter(0, q.topk(k).indices, 1.0 / k))

    def top1(s, std):  # independent quadrature with scipy
        import numpy as np
        z = np.linspace(-12, 12, 20001)
        s = s.numpy()
        out = [np.trapezoid(norm.pdf(z) * np.prod([norm.cdf((s[i] - s[j]) / std + z) for j in range(len(s)) if j != i],
                                                   axis=0), z) for i in range(len(s))]
        return torch.tensor(out)

    def product(s, std):  # the paper's formula
        d = (s[:, None] - s[None, :]) / (math.sqrt(2) * std)
        return torch.special.ndtr(d).masked_fill(torch.eye(len(s), dtype=torch.bool), 1.0).prod(-1)

    assert check_gaussian_top1(top1)
    assert not check_gaussian_top1(product)
    out = capsys.readouterr().out
    assert out.count("PASS") == 4 and out.count("FAIL") == 5


def test_lp_checkers_accept_independent_solutions_and_reject_wrong_ones(capsys):
    from minimoe.exercises import check_drop_probability, check_global_topc

    def topc(S, c):  # independent: a full sort
        order = S.flatten().argsort(descending=True)[:c]
        return torch.zeros(S.numel(), dtype=torch.bool).index_fill(0, order, True).view(S.shape)

    def topc_positive_only(S, c):  # the "<= c" optimum: skips negative scores
        return topc(S, c) & (S > 0)

    def topc_per_row(S, c):  # token choice with k = c // T is not the global optimum
        k = c // S.shape[0]
        mask = torch.zeros_like(S, dtype=torch.bool)
        return mask.scatter(1, S.topk(k, dim=1).indices, True) if k else mask

    assert check_global_topc(topc)
    assert not check_global_topc(topc_positive_only)
    assert not check_global_topc(topc_per_row)

    def drop(T, E, n):  # independent: the binomial-coefficient ratio
        return math.comb(T * E - E, n) / math.comb(T * E, n)

    assert check_drop_probability(drop)
    assert not check_drop_probability(lambda T, E, n: (1 - n / (T * E)) ** E)  # the independence approximation
    out = capsys.readouterr().out
    assert out.count("PASS") == 2 and out.count("FAIL") == 3


def test_subset_checkers_accept_independent_solutions_and_reject_wrong_ones(capsys):
    import itertools

    from minimoe.exercises import check_ksubset_log_partition, check_ksubset_sample

    def log_partition(r, k):  # independent: the log-domain chain DP with -inf
        a = torch.full((k + 1,), float("-inf"), dtype=r.dtype)
        a[0] = 0.0
        for x in r:
            a = torch.cat([a[:1], torch.logaddexp(a[1:], a[:-1] + x)])
        return a[k]

    def log_partition_sentinel(r, k):  # the reference code's -300
        a = torch.full((k + 1,), -300.0, dtype=r.dtype)
        a[0] = 0.0
        for x in r:
            a = torch.cat([a[:1], torch.logaddexp(a[1:], a[:-1] + x)])
        return a[k]

    assert check_ksubset_log_partition(log_partition)
    assert not check_ksubset_log_partition(log_partition_sentinel)

    def sample(r, k, gen):  # independent: enumerate and draw
        subsets = list(itertools.combinations(range(len(r)), k))
        w = torch.stack([r[list(s)].sum() for s in subsets]).softmax(0)
        s = subsets[int(torch.multinomial(w, 1, generator=gen))]
        return torch.zeros(len(r), dtype=torch.bool).index_fill(0, torch.tensor(s), True)

    def gumbel_topk(r, k, gen):  # a different law
        g = -torch.log(-torch.log(torch.rand(len(r), generator=gen, dtype=r.dtype)))
        return torch.zeros(len(r), dtype=torch.bool).index_fill(0, (r + g).topk(k).indices, True)

    assert check_ksubset_sample(sample, draws=4000)
    assert not check_ksubset_sample(gumbel_topk, draws=4000)
    out = capsys.readouterr().out
    assert out.count("PASS") == 2 and out.count("FAIL") == 2


def test_sparse_projection_checker_accepts_independent_solutions_and_rejects_wrong_ones(capsys):
    from minimoe.exercises import check_sparse_simplex_projection

    def michelot(y, C):  # independent: keep the top C, then Michelot's elimination, row by row
        out = torch.zeros_like(y)
        for i, row in enumerate(y):
            support = row.topk(min(C, len(row))).indices.tolist()
            while True:
                theta = (row[support].sum() - 1) / len(support)
                kept = [j for j in support if row[j] > theta]
                if len(kept) == len(support):
                    break
                support = kept
            out[i, support] = row[support] - theta
        return out

    def project_then_truncate(y, C):  # the classic mistake: the kept entries no longer sum to 1
        p = michelot(y, y.shape[-1])
        return torch.zeros_like(p).scatter(-1, p.topk(C, -1).indices, p.topk(C, -1).values)

    def truncate_then_rescale(y, C):  # keeps the support but is not the closest point
        top = y.topk(C, -1)
        w = top.values.softmax(-1)
        return torch.zeros_like(y).scatter(-1, top.indices, w)

    assert check_sparse_simplex_projection(lambda y, C: minimoe_projection(y, C))
    assert check_sparse_simplex_projection(michelot)
    assert not check_sparse_simplex_projection(project_then_truncate)
    assert not check_sparse_simplex_projection(truncate_then_rescale)
    out = capsys.readouterr().out
    assert out.count("PASS") == 2 and out.count("FAIL") == 2 and "sum to 1" in out


def minimoe_projection(y, C):
    from minimoe.ops import sparse_simplex_projection

    return sparse_simplex_projection(y, C)


def test_kool_checkers_accept_independent_solutions_and_reject_wrong_ones(capsys):
    from minimoe.exercises import check_gumbel_max_sample, check_skip_weights
    from minimoe.ops import estimator_coefficients

    def reference(z, keep, E, c):  # the package: skip-IW with a proposal equal to the router (ratio 1)
        logits = torch.zeros(len(z), E, dtype=torch.float64)
        return estimator_coefficients("skip_iw", logits, z, proposal_log_probs=logits.log_softmax(-1), keep=keep,
                                      capacity=c)

    def loop(z, keep, E, c):  # independent: count by hand
        n = [int((z == e).sum()) for e in range(E)]
        return torch.tensor([float(k) * n[int(e)] / min(n[int(e)], c) for e, k in zip(z, keep)], dtype=torch.float64)

    def kept_counts(z, keep, E, c):  # counts after dropping: always 1 for the survivors
        n = torch.bincount(z[keep], minlength=E).double()
        return keep.double() * n[z] / n[z].clamp(min=1).clamp(max=c)

    def over_capacity(z, keep, E, c):  # n / c without the min: wrong when an expert is under capacity
        return keep.double() * torch.bincount(z, minlength=E).double()[z] / c

    assert check_skip_weights(reference)
    assert check_skip_weights(loop)
    assert not check_skip_weights(kept_counts)
    assert not check_skip_weights(over_capacity)
    assert not check_skip_weights(lambda z, keep, E, c: loop(z, torch.ones_like(keep), E, c))  # forgets keep

    def gumbel_max(logits, gen):
        u = torch.rand(logits.shape, generator=gen, dtype=logits.dtype).clamp(torch.finfo(logits.dtype).tiny, 1 - 1e-16)
        return (logits - torch.log(-torch.log(u))).argmax(-1)

    def multinomial(logits, gen):  # independent: inverse-CDF sampling
        return torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]

    def sign_error(logits, gen):  # minus a Gumbel: a different law
        u = torch.rand(logits.shape, generator=gen, dtype=logits.dtype)
        return (logits + torch.log(-torch.log(u))).argmax(-1)

    def shared_noise(logits, gen):  # one noise vector for every row: the rows are not independent
        u = torch.rand(logits.shape[-1], generator=gen, dtype=logits.dtype)
        return (logits - torch.log(-torch.log(u))).argmax(-1)

    assert check_gumbel_max_sample(gumbel_max)
    assert check_gumbel_max_sample(multinomial)
    assert not check_gumbel_max_sample(sign_error)
    assert not check_gumbel_max_sample(shared_noise)
    assert not check_gumbel_max_sample(lambda logits, gen: logits.argmax(-1))
    out = capsys.readouterr().out
    assert out.count("PASS") == 4 and out.count("FAIL") == 6


def test_chapter8_checkers(capsys):
    from scipy.stats import binom

    from minimoe.exercises import check_expected_overflow, check_send_counts
    from minimoe.parallel import send_counts

    def loop_counts(position, W):  # independent: one pair at a time
        E = position.shape[-1]
        counts = [0] * W
        for row in position.reshape(-1, E).tolist():
            for e, slot in enumerate(row):
                if slot >= 0:
                    counts[e // (E // W)] += 1
        return torch.tensor(counts)

    def round_robin(position, W):  # expert e on rank e % W: a different layout
        E = position.shape[-1]
        return (position >= 0).reshape(-1, E).sum(0).view(E // W, W).sum(0)

    def tokens_not_pairs(position, W):  # counts a token once per rank, not once per expert
        E = position.shape[-1]
        routed = (position >= 0).reshape(-1, W, E // W).any(-1)
        return routed.sum(0)

    assert check_send_counts(send_counts)
    assert check_send_counts(loop_counts)
    assert not check_send_counts(round_robin)
    assert not check_send_counts(tokens_not_pairs)

    def with_scipy(T, E, C):  # independent: scipy's binomial law
        m = torch.arange(T + 1, dtype=torch.float64)
        pmf = torch.as_tensor(binom.pmf(m.numpy(), T, 1 / E))
        return float(E * (pmf * (m - C).clamp_min(0)).sum() / T)

    def normal_approximation(T, E, C):  # right for large T only
        mu, sd = T / E, math.sqrt(T / E * (1 - 1 / E))
        z = (C - mu) / sd
        tail = 0.5 * math.erfc(z / math.sqrt(2))
        return E * (sd * math.exp(-z * z / 2) / math.sqrt(2 * math.pi) - (C - mu) * tail) / T

    def per_expert_share(T, E, C):  # forgets to sum over the E experts
        return with_scipy(T, E, C) / E

    assert check_expected_overflow(with_scipy)
    assert not check_expected_overflow(normal_approximation)
    assert not check_expected_overflow(per_expert_share)
    out = capsys.readouterr().out
    assert out.count("PASS") == 3 and out.count("FAIL") == 4


def test_chapter9_checkers_accept_a_right_answer_and_reject_wrong_ones():
    import math
    import statistics

    from scipy import stats as scipy_stats

    from minimoe.exercises import check_holm, check_paired_interval

    def paired(a, b):
        d = [x - y for x, y in zip(a, b)]
        mean, n = statistics.fmean(d), len(d)
        half = scipy_stats.t.ppf(0.975, n - 1) * statistics.stdev(d) / math.sqrt(n)
        return mean, mean - half, mean + half

    def unpaired(a, b):        # Welch's interval: ignores the pairing
        mean = statistics.fmean(a) - statistics.fmean(b)
        se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
        return mean, mean - 1.96 * se, mean + 1.96 * se

    def normal_quantile(a, b):  # z instead of t: too narrow for few seeds
        mean, low, _ = paired(a, b)
        n = len(a)
        half = 1.96 * (mean - low) / scipy_stats.t.ppf(0.975, n - 1)
        return mean, mean - half, mean + half

    assert check_paired_interval(paired)
    assert not check_paired_interval(unpaired)
    assert not check_paired_interval(normal_quantile)

    def holm(p):
        order = sorted(range(len(p)), key=lambda i: p[i])
        out, running = [0.0] * len(p), 0.0
        for rank, i in enumerate(order):
            running = max(running, min(1.0, (len(p) - rank) * p[i]))
            out[i] = running
        return out

    def no_running_max(p):
        order = sorted(range(len(p)), key=lambda i: p[i])
        out = [0.0] * len(p)
        for rank, i in enumerate(order):
            out[i] = min(1.0, (len(p) - rank) * p[i])
        return out

    assert check_holm(holm)
    assert not check_holm(lambda p: [min(1.0, len(p) * x) for x in p])       # Bonferroni
    assert not check_holm(no_running_max)
    assert not check_holm(lambda p: sorted(holm(p)))                          # loses the input order
