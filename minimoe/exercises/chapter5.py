"""Checkers for chapter 5 (Balanced assignments with unbiased gradients)."""
from __future__ import annotations

import math

import torch

from ._harness import CheckFailed, checker, assert_close, run_checks


@checker
def check_skip_weights(student_fn, *, seed: int = 0, verbose: bool = True) -> bool:
    """Exercise 5.1: ``student_fn(assignment (T,), keep (T,), n_experts, capacity)`` returns the skip
    estimator's correction ``keep_t * n_{z_t} / min(n_{z_t}, capacity)`` for every token, where
    ``n_e`` counts the tokens that *chose* expert e (before any was skipped)."""
    gen = torch.Generator().manual_seed(seed)
    cases = [
        ("no expert over capacity: every weight is 1", torch.tensor([0, 1, 2, 1]), None, 3, 2),
        ("5 tokens on expert 0, capacity 2: survivors weigh 5/2",
         torch.tensor([0, 0, 1, 0, 0, 0]), torch.tensor([True, False, True, False, True, False]), 2, 2),
        ("a skipped token gets 0", torch.tensor([1, 1, 1]), torch.tensor([True, False, True]), 2, 2),
        ("fewer tokens than capacity on one expert, more on another",
         torch.tensor([0, 1, 1, 1, 1, 2]), torch.tensor([True, True, False, True, True, True]), 3, 3),
        ("capacity larger than the batch", torch.tensor([0, 0, 0]), None, 2, 10),
    ]
    for i in range(15):
        T, E = int(torch.randint(1, 13, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
        c = int(torch.randint(1, 5, (1,), generator=gen))
        cases.append((f"random instance {i} (T={T}, E={E}, capacity={c})",
                      torch.randint(0, E, (T,), generator=gen), None, E, c))

    def make(z, keep, E, c):
        def check():
            kept = keep
            if kept is None:  # a uniform subsample, drawn here: visit the tokens in a random order
                kept = torch.zeros(len(z), dtype=torch.bool)
                taken = [0] * E
                for t in torch.randperm(len(z), generator=gen).tolist():
                    if taken[int(z[t])] < c:
                        kept[t] = True
                        taken[int(z[t])] += 1
            counts = torch.bincount(z, minlength=E).double()
            n = counts[z]
            want = kept.double() * n / n.clamp(max=c)
            got = student_fn(z.clone(), kept.clone(), E, c)
            assert_close(got, want, f"assignment={z.tolist()}, keep={kept.tolist()}, capacity={c}: weights",
                         atol=1e-12)
        return check

    return run_checks("skip_weights", [(d, make(z, k, E, c)) for d, z, k, E, c in cases], verbose)


@checker
def check_gumbel_max_sample(student_fn, *, draws: int = 20000, seed: int = 0, verbose: bool = True) -> bool:
    """Exercise 5.2: ``student_fn(logits (N, E), generator)`` returns a ``LongTensor (N,)``: one
    independent draw per row from ``softmax(logits[n])`` by the Gumbel-max trick. Checked by the
    frequencies of ``draws`` rows with equal logits (each within 4.5 binomial standard errors, plus
    1e-3), and at extreme logits, where a careless ``-log(-log u))`` returns inf or NaN."""
    gen = torch.Generator().manual_seed(seed)
    cases = [
        ("three experts", torch.tensor([1.0, 0.0, -1.0])),
        ("equal logits: uniform", torch.zeros(4)),
        ("one dominant expert", torch.tensor([4.0, 0.0, 0.0, 0.0, 0.0])),
        ("two experts, shifted logits (only differences matter)", torch.tensor([100.5, 100.0])),
        ("extreme logits: the best expert always", torch.tensor([0.0, -1e4, -1e4])),
    ]

    def make(logits):
        def check():
            E = len(logits)
            batch = logits.double().expand(draws, E).contiguous()
            got = torch.as_tensor(student_fn(batch.clone(), gen))
            if got.shape != (draws,) or got.dtype not in (torch.int64, torch.int32):
                raise CheckFailed(f"expected an integer tensor of shape ({draws},), got {got.dtype} {tuple(got.shape)}")
            if int(got.min()) < 0 or int(got.max()) >= E:
                raise CheckFailed(f"expert indices must be in [0, {E}), got [{int(got.min())}, {int(got.max())}]")
            freq = torch.bincount(got.long(), minlength=E).double() / draws
            p = torch.softmax(logits.double(), 0)
            bound = 4.5 * (p * (1 - p) / draws).sqrt() + 1e-3
            bad = (freq - p).abs() > bound
            if bad.any():
                raise CheckFailed(f"logits={logits.tolist()}: the frequencies {freq.tolist()} of {draws} draws "
                                  f"are too far from softmax(logits) = {p.tolist()}")
        return check

    def independent():
        got = torch.as_tensor(student_fn(torch.zeros(2000, 2, dtype=torch.float64), gen))
        share = float(got.double().mean())
        if abs(share - 0.5) > 4.5 * math.sqrt(0.25 / 2000):
            raise CheckFailed(f"rows with equal logits should each be a fair coin; expert 1 won {share:.3f} of them "
                              "(the same noise for every row?)")

    checks = [(d, make(logits)) for d, logits in cases] + [("rows are independent draws", independent)]
    return run_checks("gumbel_max_sample", checks, verbose)
