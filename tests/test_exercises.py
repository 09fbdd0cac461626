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
