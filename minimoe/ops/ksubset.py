"""Distributions over subsets of experts: the exact-k law and the range-constrained law (ProbMoE).

Book: chapter 7 (Probabilistic routing over expert subsets), sections "The k-subset law", "The normaliser is
an elementary symmetric polynomial" (with "Working in floating point"), "Marginals are the gradient
of the log-partition" (Proposition 7.2: the forward and backward tables and the covariance), "Exact
sampling", "The range-constrained law" and "The MAP subset".

For the router logits ``r`` of one token (the last dimension, E experts) the **k-subset law** is

    P(S) = exp(sum_{j in S} r_j) / Z_k,    |S| = k,    Z_k = e_k(exp(r)),

where ``e_c(y) = sum_{|S| = c} prod_{j in S} y_j`` is the elementary symmetric polynomial of degree c.
It equals ProbMoE's "independent Bernoulli(sigmoid(r_j)) conditioned on |S| = k" (the factor
``prod_i sigmoid(-r_i)`` cancels), and it is *not* the law of Gumbel-top-k sampling. The **range law**
of dynamic-k routing keeps the same weights on every S with ``k_min <= |S| <= k_max``; its normaliser
is ``sum_{c=k_min}^{k_max} e_c(exp(r))``. Exact-k is the range ``[k, k]``, and every function below
is written once for a range.

The chain dynamic program. With ``x_j = exp(r_j - s)`` (``s`` = the row's largest logit, see below)
the prefix table ``alpha`` and the suffix table ``beta``, each (E+1, k_max+1) per row, are

    alpha[i, c] = e_c(x_0, ..., x_{i-1}),                    alpha[i+1, c] = alpha[i, c] + x_i alpha[i, c-1],
    beta[i, c]  = sum_c' w_c' e_{c'-c}(x_i, ..., x_{E-1}),   beta[i, c]    = beta[i+1, c] + x_i beta[i+1, c+1].

``alpha[i, c]`` is the weight of all ways to pick c of the first i experts; ``beta[i, c]`` the weight
of all ways to finish from "c picked before expert i" at an allowed size, ``w_c`` being the weight
of size c (1 for exact-k; ``exp(c s)``, up to a common factor, for the range law, which is not
invariant to a shift of the logits). ``Z = beta[0, 0] = sum_c w_c alpha[E, c]``, and expert i is in
S on the paths that take it:

    P(i in S) = x_i sum_c alpha[i, c] beta[i+1, c+1] / Z             (forward-backward)

which is also ``d log Z / d r_i``. The loop over experts is the only Python loop; each step is one
vectorised operation over all tokens. The marginals' own Jacobian is the covariance
``Cov(1[i in S], 1[j in S])``; its product with a vector is computed exactly by differentiating
this forward-backward pass in forward mode (:func:`_cov_vjp_rows`). Neither gradient goes through
autograd over the loop, so the -inf of impossible states never meets a gradient (autograd through
``logaddexp(-inf, -inf)`` gives NaN; that is why the paper's code needs a finite sentinel, and its
-300 is wrong for logits below about -300 / k).

Two domains, one answer. In the *linear* domain a step is one multiply-add (``addcmul``); in the
*log* domain (the tables hold logarithms, impossible states are ``-inf``) it is a ``logaddexp``,
about five times slower on a CPU. A row uses the linear domain whenever every number its tables can
hold lies within the dtype's normal range: every nonzero entry is between
``exp(-k_max R - (k_max - k_min) |s|)`` and ``sum_{c <= k_max} C(E, c)``, where
``R = max(r) - min(r)`` (the shift makes every ``x_j <= 1``). Float32 rows that fit float64's range
but not float32's are computed in float64. The other rows (logits spread over hundreds of nats,
such as +-1e4) go to the log domain, in float64: a float32 sum of logits of size 1e4 is only good
to about 1e-3. Both domains compute the same quantities and are tested against each other and
against enumeration.
"""
from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from ._checks import check_generator, check_int, check_scores

__all__ = [
    "ksubset_log_partition",
    "ksubset_marginals",
    "ksubset_covariance",
    "ksubset_sample",
    "range_subset_log_partition",
    "range_subset_marginals",
    "range_subset_covariance",
    "range_subset_size_probs",
    "range_subset_sample",
    "range_subset_map",
]

# Headroom (in nats) kept between the tables' range and the dtype's normal range.
_MARGIN = 4.0
# On the CPU, rows are processed in blocks whose prefix table takes at most this many bytes.
_BLOCK_BYTES = 24 * 2**20
# The exact sampler turns its table into step decisions in chunks of rows of about this size.
_CHUNK_BYTES = 2 * 2**20


# --------------------------------------------------------------------------- argument checks
def _check_logits(logits) -> torch.Tensor:
    if isinstance(logits, torch.Tensor) and logits.dim() < 1:
        raise ValueError(f"logits must have shape (..., E) with at least 1 dim, got shape {tuple(logits.shape)}")
    return check_scores(logits, "logits", min_dim=1)


def _check_size(value, name: str, E: int, low: int = 1) -> int:
    value = check_int(value, name)
    if not low <= value <= E:
        raise ValueError(f"{name} must be in [{low}, E] = [{low}, {E}] (E = logits.shape[-1], the number "
                         f"of experts), got {name}={value}")
    return value


def _check_range(logits, k_min, k_max) -> tuple[int, int]:
    E = logits.shape[-1]
    k_min, k_max = _check_size(k_min, "k_min", E), _check_size(k_max, "k_max", E)
    if k_min > k_max:
        raise ValueError(f"k_min must be <= k_max, got k_min={k_min}, k_max={k_max}")
    return k_min, k_max


# --------------------------------------------------------------------------- which rows go where
def _log_largest_count(E: int, k_max: int) -> float:
    """log sum_{c <= k_max} C(E, c): no table entry exceeds the number of subsets it counts."""
    logs = [math.lgamma(E + 1) - math.lgamma(c + 1) - math.lgamma(E - c + 1) for c in range(k_max + 1)]
    top = max(logs)
    return top + math.log(sum(math.exp(v - top) for v in logs))


def _route(r: torch.Tensor, k_min: int, k_max: int) -> list[tuple[torch.Tensor | None, bool, torch.dtype]]:
    """Split the rows of ``r`` (B, E) into groups ``(rows, log, dtype)``: linear domain in r's dtype,
    linear domain in float64 (float32 input only), log domain in float64. ``rows=None`` is all rows.
    Compiled (``torch.compile``): every row in the log domain in float64, the domain that is safe for
    any logits, since choosing by the logits' range would read the host."""
    if torch.compiler.is_compiling():
        return [(None, True, torch.float64)]
    s = r.amax(-1)
    # -log of the smallest nonzero number in the linear tables (see the module docstring)
    need = k_max * (s - r.amin(-1)) + (k_max - k_min) * s.abs()
    largest = _log_largest_count(r.shape[-1], k_max)
    todo = torch.ones_like(need, dtype=torch.bool)
    groups = []
    dtypes = (r.dtype, torch.float64) if r.dtype == torch.float32 else (r.dtype,)
    for dtype in dtypes:
        info = torch.finfo(dtype)
        if largest > math.log(info.max) - _MARGIN:
            continue
        ok = todo & (need <= -math.log(info.tiny) - _MARGIN)
        if bool(ok.all()):
            return groups + [(None, False, dtype)]
        if bool(ok.any()):
            groups.append((ok.nonzero().squeeze(1), False, dtype))
            todo = todo & ~ok
    # The log domain runs in float64 even for float32 input: at logits of size 1e4 a float32 sum of
    # logits is only good to ~1e-3, which would be an error of ~1e-4 in the marginals.
    if not groups:
        return [(None, True, torch.float64)]
    return groups + [(todo.nonzero().squeeze(1), True, torch.float64)]


def _in_blocks(fn, r, k_min, k_max, log, *args):
    """``fn`` on blocks of rows whose DP table takes at most _BLOCK_BYTES (on the CPU only).

    Not for speed of the arithmetic (each step is vectorised over the block either way) but for
    memory: a table that small stays in cache, and the allocator reuses it from block to block
    instead of mapping fresh pages (about 10 ms per call for a 40 MB table). On a GPU one block.
    """
    B, E = r.shape
    per_row = _table_rows(fn, E, log) * (k_max + 1) * r.element_size()
    blocks = math.ceil(B * per_row / _BLOCK_BYTES) if r.device.type == "cpu" else 1
    if blocks <= 1:
        return fn(r, k_min, k_max, log, *args)
    size = math.ceil(B / blocks)
    return torch.cat([fn(r[i:i + size], k_min, k_max, log, *[a[i:i + size] for a in args])
                      for i in range(0, B, size)])


def _table_rows(fn, E: int, log: bool) -> int:
    """How many rows of (k_max+1) numbers per token ``fn`` needs at least: a whole table of E+1,
    except the linear marginals (:func:`_marginals_linear`), which checkpoint it, about 2 sqrt(E)."""
    if fn is _marginals_rows and not log:
        S = _segment_length(E)
        return math.ceil(E / S) + S + 1
    return E + 1


def _by_rows(fn, logits: torch.Tensor, k_min: int, k_max: int, *row_args: torch.Tensor) -> torch.Tensor:
    """Run ``fn(r, k_min, k_max, log, *row_args)`` on the rows of ``logits`` (..., E) group by group
    (see :func:`_route`) and reassemble its row-first output into shape (..., *rest)."""
    *batch, E = logits.shape
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    r = logits.detach().reshape(-1, E).to(dtype)
    args = [a.detach().reshape(r.shape[0], *a.shape[len(batch):]) for a in row_args]
    out = None
    for rows, log, gdtype in _route(r, k_min, k_max) if r.shape[0] else [(None, False, dtype)]:
        mine = [r, *args] if rows is None else [t[rows] for t in (r, *args)]
        res = _in_blocks(fn, mine[0].to(gdtype), k_min, k_max, log, *mine[1:])
        if res.is_floating_point():
            res = res.to(dtype)
        if rows is None:
            out = res
            break
        if out is None:
            out = res.new_empty((r.shape[0], *res.shape[1:]))
        out[rows] = res
    return out.reshape((*batch, *out.shape[1:]))


# --------------------------------------------------------------------------- the tables
def _prepare(r: torch.Tensor, k_min: int, k_max: int, log: bool):
    """Expert weights ``x`` (E, B) and size weights ``w`` (k_max+1, B), in the chosen domain.

    The shift ``s`` (each row's largest logit) makes ``x_j = exp(r_j - s) <= 1``. The weight of S is
    ``exp(sum_S r) = exp(|S| s) prod_S x_j``; the ``exp(c s)`` goes into the size weights, divided by
    their largest value ``exp(M)`` (a common factor of every subset, so it cancels everywhere).
    For exact-k this leaves ``w_k = 1``: the k-subset law does not depend on a common shift.
    """
    s = r.amax(-1)
    # (E, B): the loops read x[i], a contiguous row of B numbers (one pass: subtract while transposing)
    x = torch.sub(r.T, s, out=r.new_empty(r.shape[::-1]))
    c = torch.arange(k_max + 1, device=r.device, dtype=r.dtype)[:, None]
    M = torch.maximum(k_min * s, k_max * s)
    log_w = torch.where((c >= k_min), c * s - M, -math.inf)  # (k_max+1, B)
    if log:
        return x, log_w, M
    return x.exp_(), log_w.exp(), M


def _prefix_table(x: torch.Tensor, K: int, log: bool) -> torch.Tensor:
    """``alpha[i, c] = e_c(x_0..x_{i-1})`` (or its log), shape (E+1, K+1, B)."""
    E, B = x.shape
    alpha = x.new_empty((E + 1, K + 1, B))
    alpha[0] = -math.inf if log else 0.0      # no expert seen: only c = 0 is possible ...
    alpha[:, 0] = 0.0 if log else 1.0         # ... and e_0 = 1 always
    # The loops below index views made once (unbind), not slices made at every step (see _loop_views).
    lo, hi, xs = _loop_views(alpha, x)
    if log:
        take = x.new_empty((K, B))
        for i in range(E):  # take expert i (count c-1 -> c) or skip it (count stays c)
            torch.add(lo[i], xs[i], out=take)
            torch.logaddexp(hi[i], take, out=hi[i + 1])  # logaddexp(-inf, -inf) = -inf
    else:
        for i in range(E):
            torch.addcmul(hi[i], lo[i], xs[i], out=hi[i + 1])
    return alpha


def _loop_views(table: torch.Tensor, x: torch.Tensor):
    """Per-step views of an (n+1, K+1, B) table (a whole table, or a segment of one):
    ``lo[i] = table[i, :-1]``, ``hi[i] = table[i, 1:]`` and ``xs[i] = x[i]``, made once per table.
    The sweeps run E dependent steps of 5-30 microseconds each; slicing ``table[i, 1:]`` inside the
    loop costs a slice or select of about a microsecond per operand per step (about 900 per call of
    the marginals at T = 8192, E = 64, k = 8, before this change)."""
    return table[:, :-1].unbind(0), table[:, 1:].unbind(0), x.unbind(0)


def _column_views(w: torch.Tensor):
    """Two buffers for a backward sweep that keeps one column of a table, starting from ``w``, with
    their views ``lo[b] = buffer[:-1]`` and ``hi[b] = buffer[1:]``; the sweep alternates b = 0, 1."""
    buffers = (w.clone(), w.clone())
    return buffers, tuple(b[:-1] for b in buffers), tuple(b[1:] for b in buffers)


def _suffix_table(x: torch.Tensor, w: torch.Tensor, log: bool) -> torch.Tensor:
    """``beta[i, c] = sum_{c'} w_{c'} e_{c'-c}(x_i..x_{E-1})`` (or its log), shape (E+1, K+1, B)."""
    E, B = x.shape
    K = w.shape[0] - 1
    beta = x.new_empty((E + 1, K + 1, B))
    beta[E] = w                      # after the last expert the size is final: its weight
    beta[:, K] = w[K]                # with k_max picked, the rest must be skipped
    lo, hi, xs = _loop_views(beta, x)
    for i in reversed(range(E)):
        if log:
            torch.logaddexp(lo[i + 1], hi[i + 1] + xs[i], out=lo[i])
        else:
            torch.addcmul(lo[i + 1], hi[i + 1], xs[i], out=lo[i])
    return beta


def _ratio(num: torch.Tensor, den: torch.Tensor, log: bool) -> torch.Tensor:
    """``num / den`` (or ``exp(num - den)``), and 0 where the state ``den`` is impossible."""
    if log:
        return torch.where(den > -math.inf, torch.exp(num - den), 0.0)
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)


# --------------------------------------------------------------------------- row functions
# Each takes r (B, E) and returns a row-first tensor (B, ...); _by_rows runs them per group.
def _log_partition_rows(r, k_min, k_max, log):
    """``log Z = M + log sum_c w_c alpha[E, c]``: one forward sweep."""
    x, w, M = _prepare(r, k_min, k_max, log)
    last = _prefix_table(x, k_max, log)[-1]  # (K+1, B)
    if log:
        return M + torch.logsumexp(w + last, 0)
    return M + torch.log((w * last).sum(0))


def _size_probs_rows(r, k_min, k_max, log):
    """``P(|S| = c) = w_c alpha[E, c] / Z`` for c = 0..k_max, shape (B, k_max+1)."""
    x, w, _ = _prepare(r, k_min, k_max, log)
    last = _prefix_table(x, k_max, log)[-1]
    if log:
        return torch.softmax(w + last, 0).T
    weight = w * last
    return (weight / weight.sum(0)).T


def _marginals_rows(r, k_min, k_max, log):
    """``P(i in S)`` by the forward-backward formula of the module docstring, shape (B, E)."""
    if k_min == r.shape[-1]:  # S = every expert, surely (exactly 1, not 1 up to rounding)
        return torch.ones_like(r)
    x, w, _ = _prepare(r, k_min, k_max, log)
    if not log:
        return _marginals_linear(x, w)
    alpha = _prefix_table(x, k_max, log)
    beta = _suffix_table(x, w, log)
    # Both sides: the log weight of the paths that take i and of those that skip i. Then
    # m = sigmoid(take - skip) lies in [0, 1] and keeps its relative accuracy near 0 *and* near 1,
    # where exp(take - log Z) would carry the absolute rounding of numbers of size |log Z|.
    take = x + torch.logsumexp(alpha[:-1, :-1] + beta[1:, 1:], 1)
    skip = torch.logsumexp(alpha[:-1] + beta[1:], 1)
    return torch.sigmoid(take - skip).T


def _segment_length(E: int, K: int | None = None, B: int | None = None, element_size: int = 4) -> int:
    """Experts per segment of :func:`_marginals_linear`: all E (one segment, the whole prefix table)
    when its workspace, E+2 rows of (K+1, B) numbers and the (E, B) sums, fits in _BLOCK_BYTES; else
    (and without sizes) ``ceil(sqrt(E))``, the checkpoints."""
    if K is not None and ((E + 2) * (K + 1) + E) * B * element_size <= _BLOCK_BYTES:
        return E
    return math.isqrt(E - 1) + 1


def _marginals_linear(x, w):
    """The linear-domain forward-backward pass, with the prefix table checkpointed when it is large;
    shape (B, E).

    The backward sweep reads the rows of ``alpha`` in reverse, row i at step i. When the whole table
    (E+1 rows of (K+1, B) numbers) fits in _BLOCK_BYTES it is computed once and kept: 3E steps.
    Otherwise the forward sweep keeps every S-th row, S = ceil(sqrt(E)) (the checkpoints), and the
    backward sweep recomputes one segment of S rows at a time from its checkpoint and consumes it
    backwards: memory about 2 sqrt(E) rows instead of E+1, for about E more steps. Both give the
    same numbers bit for bit. At T = 8192, E = 64, k = 8 the whole float64 table is 38 MB, more than
    glibc's 32 MiB ceiling for reusing freed memory (it would be mapped and faulted in afresh on every
    call); split into two blocks of tokens, each step had K B = 32768 numbers, too few for PyTorch to
    use a second thread. The checkpoints and the segment take 10 MB, and every step runs on all the
    tokens (performance appendix, "k-subset marginals"). Where the table fits, the extra steps would
    only cost time: in slow stretches of the 2-core machine of the benchmarks each step of a
    two-thread loop cost about 25 microseconds more (performance appendix, "Slow stretches").

    The backward sweep keeps only the current column of beta. Row alpha[i] is not read again after
    step i, so the products alpha[i, c] beta[i+1, c+1] are written in its place, summed over c at the
    end of each segment, and multiplied into x_i, which no later step reads.

    The checkpoints, the segment and the sums share one allocation: glibc keeps freed memory for the
    next call only while the free space at the top of its heap stays below twice the largest block
    it has had to map, so three blocks of a few MB each would go back to the kernel at the end of
    every call in a fresh process, to be faulted in again on the next.
    """
    E, B = x.shape
    K = w.shape[0] - 1
    S = _segment_length(E, K, B, x.element_size())
    starts = range(0, E, S)
    checkpoints, segment, sums = _carve(x, [(len(starts), K + 1, B),  # alpha[s] for every segment start s
                                            (S + 1, K + 1, B),        # alpha[s], ..., alpha[s + S]
                                            (S, B)])                  # sum_c alpha[i, c] beta[i+1, c+1]
    checkpoints[0] = 0.0
    checkpoints[0, 0] = 1.0  # alpha[0]: no expert seen, only c = 0 (e_0 = 1)
    lo, hi, xs = _loop_views(segment, x)

    def recompute(j):
        """Rows s..s+n of alpha (segment j) into ``segment[0..n]``; returns (s, n)."""
        s = starts[j]
        n = min(S, E - s)
        segment[0] = checkpoints[j]
        segment[1:, 0] = 1.0  # e_0 = 1 (the backward sweep overwrites this column with products)
        for i in range(n):
            torch.addcmul(hi[i], lo[i], xs[s + i], out=hi[i + 1])
        return s, n

    for j in range(len(starts) - 1):  # forward sweep: only the checkpoints are kept
        _, n = recompute(j)
        checkpoints[j + 1] = segment[n]
    betas, b_lo, b_hi = _column_views(w)
    now = 0  # betas[now] holds the current column of beta
    for j in reversed(range(len(starts))):
        s, n = recompute(j)
        for i in reversed(range(n)):
            lo[i].mul_(b_hi[now])
            torch.addcmul(b_lo[now], b_hi[now], xs[s + i], out=b_lo[1 - now])
            now = 1 - now
        x[s:s + n].mul_(torch.sum(segment[:n, :-1], 1, out=sums[:n]))  # T_i = x_i sum_c ...
    # beta[0] is now Z (the weights of all subsets). Rounding can push m a few ulp above 1.
    return x.div_(betas[now][0]).clamp_(max=1.0).T


def _carve(like: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """New tensors of the given shapes (dtype and device of ``like``) as views of one allocation."""
    numels = [math.prod(shape) for shape in shapes]
    block = like.new_empty(sum(numels))
    return [part.view(shape) for part, shape in zip(block.split(numels), shapes)]


def _cov_vjp_rows(r, k_min, k_max, log, v):
    """``Cov(z) v`` for the indicator vector z of S: the Jacobian of the marginals times v, exactly.

    It is the derivative of the marginals along v, ``d/dt m(r + t v)`` at t = 0, obtained by
    forward-mode differentiation of the forward-backward pass ("dual numbers"), O(E K) per row.
    Along v, ``dx_i = v_i x_i``; differentiating the two recurrences gives two more:

        dalpha[i+1, c] = dalpha[i, c] + x_i (dalpha[i, c-1] + v_i alpha[i, c-1])
        dbeta[i, c]    = dbeta[i+1, c] + x_i (dbeta[i+1, c+1] + v_i beta[i+1, c+1])

    and with ``T_i = x_i sum_c alpha[i, c] beta[i+1, c+1]`` (so ``m_i = T_i / Z``) the quotient rule
    ``dm_i = (dT_i - m_i dZ) / Z``, ``dZ = dbeta[0, 0]``. In the log domain the tangent tables are
    kept divided by the tables, ``F = dalpha / alpha`` and ``G = dbeta / beta``, which are
    conditional expectations (see :func:`_cov_vjp_log`).
    """
    if log:
        return _cov_vjp_log(r, k_min, k_max, v)
    x, w, _ = _prepare(r, k_min, k_max, log)
    E, B = x.shape
    K = k_max
    vt = v.to(x.dtype).T.contiguous()  # (E, B)
    alpha = _prefix_table(x, K, log)
    dalpha = x.new_zeros((E + 1, K + 1, B))  # dalpha[:, 0] = 0: e_0 = 1 does not move
    a_lo, _, xs = _loop_views(alpha, x)
    d_lo, d_hi, vs = _loop_views(dalpha, vt)
    tmp = x.new_empty((K, B))
    for i in range(E):
        torch.addcmul(d_lo[i], a_lo[i], vs[i], out=tmp)
        torch.addcmul(d_hi[i], tmp, xs[i], out=d_hi[i + 1])
    # Backward sweep with the current column of beta and dbeta only (as in _marginals_rows). Rows
    # alpha[i] and dalpha[i] are not read again after step i: their places keep the products whose
    # sums over c are T_i / x_i and dT_i / x_i, summed for all experts after the sweep.
    betas, b_lo, b_hi = _column_views(w)
    dbetas, db_lo, db_hi = _column_views(torch.zeros_like(w))  # the size weights do not move
    du = x.new_empty((K, B))
    prod = x.new_empty((K, B))
    now = 0  # betas[now] and dbetas[now] hold the current columns
    for i in reversed(range(E)):
        torch.addcmul(db_hi[now], b_hi[now], vs[i], out=du)  # d(x_i beta[i+1, c+1]) / x_i
        torch.mul(a_lo[i], du, out=prod)
        torch.addcmul(prod, d_lo[i], b_hi[now], out=d_lo[i])
        a_lo[i].mul_(b_hi[now])
        torch.addcmul(db_lo[now], du, xs[i], out=db_lo[1 - now])
        torch.addcmul(b_lo[now], b_hi[now], xs[i], out=b_lo[1 - now])
        now = 1 - now
    through, dthrough = alpha[:-1, :-1].sum(1), dalpha[:-1, :-1].sum(1)  # T_i / x_i and dT_i / x_i
    Z, dZ = betas[now][0], dbetas[now][0]
    return (x * (dthrough - through * (dZ / Z)) / Z).T


def _cov_vjp_log(r, k_min, k_max, v):
    """:func:`_cov_vjp_rows` in the log domain, through conditional expectations.

    The law is a Markov chain over the count ``C_i`` of experts picked before expert i, with
    ``back[i, c] = P(i in S | C_{i+1} = c)``, ``fwd[i, c] = P(i in S | C_i = c)`` and
    ``occ[i, c] = P(C_i = c)``. With ``X = v . z``, ``F[i, c] = E[sum_{j<i} v_j z_j | C_i = c]`` and
    ``G[i, c] = E[sum_{j>=i} v_j z_j | C_i = c]`` (given C_i the two halves are independent):

        F[i+1, c] = (1 - back[i, c]) F[i, c] + back[i, c] (F[i, c-1] + v_i)
        G[i, c]   = (1 - fwd[i, c]) G[i+1, c] + fwd[i, c] (G[i+1, c+1] + v_i)

    ``Cov(z_i, X) = E[z_i X] - m_i E[X]`` is assembled as ``m_out E[z_i X] - m_in E[(1 - z_i) X]``
    with ``m_in = P(i in S)`` and ``m_out = P(i not in S)`` summed separately: accurate for m near
    0 and near 1. Every quantity is a probability or an average of v, so nothing overflows.
    """
    x, w, _ = _prepare(r, k_min, k_max, True)
    E, B = x.shape
    K = k_max
    alpha = _prefix_table(x, K, True)
    beta = _suffix_table(x, w, True)
    xi = x[:, None, :]
    back = x.new_zeros((E, K + 1, B))
    fwd = x.new_zeros((E, K + 1, B))
    back[:, 1:] = _ratio(xi + alpha[:-1, :-1], alpha[1:, 1:], True)
    fwd[:, :-1] = _ratio(xi + beta[1:, 1:], beta[:-1, :-1], True)
    occ = _ratio(alpha[:-1] + beta[:-1], beta[0, 0], True)
    vt = v.to(x.dtype).T.contiguous()
    F = x.new_zeros((E + 1, K + 1, B))
    for i in range(E):
        torch.lerp(F[i, 1:], F[i, :-1] + vt[i], back[i, 1:], out=F[i + 1, 1:])  # F[., 0] = 0: nothing taken
    G = x.new_zeros((E + 1, K + 1, B))
    for i in reversed(range(E)):
        torch.lerp(G[i + 1, :K], G[i + 1, 1:] + vt[i], fwd[i, :K], out=G[i, :K])  # G[., K] = 0: no room left
    p_in = occ * fwd            # P(C_i = c, i in S)
    p_out = occ - p_in          # P(C_i = c, i not in S)
    m_in, m_out = p_in.sum(1), p_out.sum(1)
    x_in = (p_in[:, :K] * (F[:-1, :K] + vt[:, None] + G[1:, 1:])).sum(1)  # E[z_i X]
    x_out = (p_out * (F[:-1] + G[1:])).sum(1)                               # E[(1 - z_i) X]
    return (m_out * x_in - m_in * x_out).T


def _sample_rows(r, k_min, k_max, log, u):
    """Exact samples, (B, E) bool: draw the size from ``P(|S| = c)`` (range law), then walk the
    experts from last to first through the prefix table: with c experts still to pick among
    experts 0..i, take expert i with probability ``x_i alpha[i, c-1] / alpha[i+1, c]`` (the weight
    of the ways that take it over the weight of all ways).

    ``u`` (B, E+1) are uniforms on [0, 1): column 0 picks the size, column 1+i decides expert i.
    Multiplying the step probabilities along a path telescopes to ``w(S) / Z`` (chapter 7, "Exact
    sampling").
    """
    x, w, _ = _prepare(r, k_min, k_max, log)
    alpha = _prefix_table(x, k_max, log)
    E, B = x.shape
    u = u.T  # (E+1, B) float64, a transposed view (read once, by the comparisons)
    if k_min == k_max:
        left = torch.full((B,), k_max, dtype=torch.long, device=r.device)
    else:
        weight = torch.softmax(w + alpha[-1], 0) if log else w * alpha[-1]
        cdf = weight.T.cumsum(-1).to(torch.float64)  # (B, K+1)
        left = torch.searchsorted(cdf, u[0, :, None] * cdf[:, -1:], right=True)[:, 0]
        left = left.clamp_(k_min, k_max)  # guards the rounding of the last cdf entry
    if log:
        mask = torch.empty((E, B), dtype=torch.bool, device=r.device)
        for i in reversed(range(E)):
            with_i = alpha[i].gather(0, (left - 1).clamp(min=0)[None])[0]   # alpha[i, c-1]
            all_ = alpha[i + 1].gather(0, left[None])[0]                      # alpha[i+1, c] > 0 on every path
            p = torch.exp(x[i] + with_i - all_)
            # c = 0: nothing left to take; c = i+1: every remaining expert is needed (p = 1 up to rounding)
            take = ((u[1 + i] < p) & (left > 0)) | (left == i + 1)
            mask[i] = take
            left = left - take.long()
        return mask.T
    # Linear domain: every step's decision is computed for every count c still to pick, in a few
    # batched operations, and the walk only looks them up. The probability of taking expert i with
    # c experts left is p[i, c] = x_i alpha[i, c-1] / alpha[i+1, c], with p[i, 0] = 0 (nothing left
    # to take) and p[i, c] = 1 for c >= i+1 (every remaining expert is needed); the decision is
    # u[1+i] < p[i, c]. The walk is then a gather and a subtraction per expert.
    K = k_max
    if K == 1:
        # One expert to pick (c = 1 until it is taken): the walk takes the last expert i with
        # u[1+i] < p[i, 1] = x_i alpha[i, 0] / alpha[i+1, 1], where alpha[i, 0] = 1 (so the product is
        # x_i exactly). The same decisions, in three batched operations instead of E steps. Expert 0
        # is always a take: p[0, 1] = x_0 / x_0 = 1 exactly (alpha[1, 1] = 0 + 1 * x_0, and x_0 > 0 in
        # the linear domain), so every row has a last take.
        take = torch.lt(u[1:], x / alpha[1:, 1])
        # the last take, as the largest of (i+1) * take[i] (a max over int32: 7x faster on the CPU than
        # an argmax of the flipped uint8 decisions)
        numbers = torch.arange(1, E + 1, dtype=torch.int32, device=r.device)[:, None]
        last = (take * numbers).amax(0).long() - 1
        return torch.zeros((B, E), dtype=torch.bool, device=r.device).scatter_(1, last[:, None], True)
    decide = _take_decisions(x, alpha, u[1:], K)  # (E, K+1, B) uint8
    take = torch.empty((E, B), dtype=torch.uint8, device=r.device)
    for i in reversed(range(E)):
        torch.gather(decide[i], 0, left[None], out=take[i][None])
        left.sub_(take[i])
    return take.T.bool()


def _take_decisions(x, alpha, u, K):
    """``decide[i, c] = u[i] < p[i, c]`` (uint8, (E, K+1, B)) for the exact sampler's walk, with
    ``p[i, c] = x_i alpha[i, c-1] / alpha[i+1, c]`` (see :func:`_sample_rows`); overwrites rows
    1..E of the linear table ``alpha`` with p."""
    E, B = x.shape
    decide = torch.empty((E, K + 1, B), dtype=torch.bool, device=x.device)
    # p[i] goes in place of alpha[i+1], in chunks of rows from the last (a chunk reads the rows
    # before the ones it writes), so that every temporary stays near _CHUNK_BYTES
    rows = max(1, _CHUNK_BYTES // max(1, (K + 1) * B * 8))
    for hi in range(E, 0, -rows):
        lo = max(0, hi - rows)
        p = alpha[lo + 1:hi + 1]
        torch.div(x[lo:hi, None] * alpha[lo:hi, :-1], p[:, 1:], out=p[:, 1:])
        p[:, 0] = 0.0
        for i in range(lo, min(hi, K)):
            p[i - lo, i + 1:] = 1.0
        torch.lt(u[lo:hi, None], p, out=decide[lo:hi])  # u is float64: exact against p of any dtype
    return decide.view(torch.uint8)  # the same bytes as 0/1 integers, which the walk subtracts


# --------------------------------------------------------------------------- autograd
class _LogPartition(torch.autograd.Function):
    """log Z with the exact gradient d log Z / d r = marginals (itself differentiable)."""

    @staticmethod
    def forward(ctx, logits, k_min, k_max):
        ctx.save_for_backward(logits)
        ctx.sizes = (k_min, k_max)
        return _by_rows(_log_partition_rows, logits, k_min, k_max).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        return grad.unsqueeze(-1) * _Marginals.apply(logits, *ctx.sizes), None, None


class _Marginals(torch.autograd.Function):
    """Marginals from the forward-backward pass; backward: v -> Cov(z) v (the Jacobian is symmetric).
    The tables are recomputed in the backward instead of stored (O(T E k) memory saved)."""

    @staticmethod
    def forward(ctx, logits, k_min, k_max):
        ctx.save_for_backward(logits)
        ctx.sizes = (k_min, k_max)
        return _by_rows(_marginals_rows, logits, k_min, k_max).to(logits.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        out = _by_rows(_cov_vjp_rows, logits, *ctx.sizes, grad)
        return out.to(logits.dtype), None, None


def _covariance(logits, k_min, k_max):
    """Cov(z) (..., E, E) by E vector products with the unit vectors (O(E^2 k) per row)."""
    *batch, E = logits.shape
    rows = logits.detach().reshape(-1, 1, E).expand(-1, E, E)
    eye = torch.eye(E, dtype=logits.dtype, device=logits.device).expand_as(rows)
    cov = _by_rows(_cov_vjp_rows, rows, k_min, k_max, eye)
    return cov.reshape(*batch, E, E).to(logits.dtype)


def _draw(logits, k_min, k_max, generator):
    check_generator(generator)
    *batch, E = logits.shape
    # drawn where the generator lives (a CPU generator may serve CUDA logits), then moved
    u = torch.rand((*batch, E + 1), generator=generator, device=generator.device if generator is not None else
                   logits.device, dtype=torch.float64).to(logits.device)
    return _by_rows(_sample_rows, logits, k_min, k_max, u)


# --------------------------------------------------------------------------- exact-k, public
def ksubset_log_partition(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``log Z_k = log e_k(exp(logits))``, the log-normaliser of the k-subset law, shape (...).

    Chapter 7, "The normaliser is an elementary symmetric polynomial": ``e_k`` by the chain DP
    ``alpha[i+1, c] = alpha[i, c] + x_i alpha[i, c-1]``. Differentiable: its gradient is
    :func:`ksubset_marginals` (exact, not autograd through the loop), and that is differentiable again.

    Args:
        logits: ``(..., E)`` finite floating tensor; every leading index is an independent row.
        k: subset size, ``1 <= k <= E``.
    """
    _check_logits(logits)
    k = _check_size(k, "k", logits.shape[-1])
    return _LogPartition.apply(logits, k, k)


def ksubset_marginals(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``P(j in S)`` under ``P(S) ∝ exp(sum_{j in S} logits_j)``, ``|S| = k``; shape (..., E), sums to k.

    Chapter 7, "Marginals are the gradient of the log-partition": the forward-backward formula
    ``m_i = x_i sum_c alpha[i, c] beta[i+1, c+1] / Z``. Differentiable: the backward multiplies by
    the Jacobian ``dm_i / dr_j = Cov(1[i in S], 1[j in S])`` exactly (chapter 7, Proposition 7.2(b)), as the straight-through estimator of ProbMoE needs. Invariant to
    adding a constant to a row.
    """
    _check_logits(logits)
    k = _check_size(k, "k", logits.shape[-1])
    if k == 1:
        return _singleton_marginals(logits)
    return _Marginals.apply(logits, k, k)


def _singleton_marginals(logits: torch.Tensor) -> torch.Tensor:
    """The marginals of subsets of size exactly 1: ``P({j}) ∝ exp(r_j)`` is the softmax, and its
    Jacobian ``diag(m) - m m^T`` is ``Cov(z)`` (chapter 7, Proposition 7.2(b) at k = 1), so autograd's
    softmax gives the same values and gradients as the DP, rounded differently, without its E steps.
    Computed in the DP's working precision (float32 for half-precision logits)."""
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return torch.softmax(logits.to(work), dim=-1).to(logits.dtype)


def ksubset_covariance(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``Cov(1[i in S], 1[j in S]) = P(i, j in S) - m_i m_j`` (``m_i (1 - m_i)`` on the diagonal),
    shape (..., E, E): the Jacobian of :func:`ksubset_marginals`. Symmetric, rows sum to 0,
    off-diagonal entries <= 0; the pairwise inclusion probabilities are ``cov + m m^T``. Computed as
    E exact vector products (:func:`_cov_vjp_rows`), O(E^2 k) per row; not differentiable."""
    _check_logits(logits)
    k = _check_size(k, "k", logits.shape[-1])
    return _covariance(logits, k, k)


def ksubset_sample(logits: torch.Tensor, k: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """One exact sample of the k-subset law per row: a bool mask (..., E) with exactly k Trues.

    Chapter 7, "Exact sampling": walk the experts from the last to the first through the prefix
    table, taking expert i with probability ``exp(r_i + log alpha[i, c-1] - log alpha[i+1, c])``
    while c experts are still to be picked (the paper's pseudocode feeds this log-probability to a
    sigmoid; see the errata). All rows at once; E sequential steps (one batched step when k = 1).

    Args:
        generator: a ``torch.Generator`` on the device of ``logits`` (for reproducible draws).
    """
    _check_logits(logits)
    k = _check_size(k, "k", logits.shape[-1])
    return _draw(logits, k, k, generator)


# --------------------------------------------------------------------------- range law, public
def range_subset_log_partition(logits: torch.Tensor, k_min: int, k_max: int) -> torch.Tensor:
    """``log sum_{c=k_min}^{k_max} e_c(exp(logits))``, shape (...): the normaliser of the range law
    ``P(S) ∝ exp(sum_{j in S} logits_j)``, ``k_min <= |S| <= k_max`` (chapter 7, "The range-constrained
    law"). Its gradient is :func:`range_subset_marginals`. Adding c to a row adds
    ``log E[exp(c |S|)]`` here, not a constant times the size: the law depends on the logits' level.
    """
    _check_logits(logits)
    k_min, k_max = _check_range(logits, k_min, k_max)
    return _LogPartition.apply(logits, k_min, k_max)


def range_subset_marginals(logits: torch.Tensor, k_min: int, k_max: int) -> torch.Tensor:
    """``P(j in S)`` under the range law, shape (..., E); the row sums are ``E|S|``, the expected size.

    Same forward-backward formula as exact-k with the size weights ``w_c`` at the end of the suffix
    table. Differentiable, with Jacobian ``Cov(z)`` under the range law (rows sum to
    ``Cov(z_i, |S|)``, not 0). Not invariant to a shift: adding c to every logit multiplies
    ``P(S)`` by ``exp(c |S|)`` (before renormalising), which moves mass to larger sets when c > 0.
    """
    _check_logits(logits)
    k_min, k_max = _check_range(logits, k_min, k_max)
    if k_max == 1:  # only singletons: the softmax (see _singleton_marginals)
        return _singleton_marginals(logits)
    return _Marginals.apply(logits, k_min, k_max)


def range_subset_covariance(logits: torch.Tensor, k_min: int, k_max: int) -> torch.Tensor:
    """``Cov(z)`` under the range law, (..., E, E): the Jacobian of :func:`range_subset_marginals`."""
    _check_logits(logits)
    k_min, k_max = _check_range(logits, k_min, k_max)
    return _covariance(logits, k_min, k_max)


def range_subset_size_probs(logits: torch.Tensor, k_min: int, k_max: int) -> torch.Tensor:
    """``P(|S| = c)`` for ``c = k_min..k_max`` under the range law, shape (..., k_max - k_min + 1):
    ``e_c(exp(r)) / sum_{c'} e_{c'}(exp(r))`` (ProbMoE's Eq. 9)."""
    _check_logits(logits)
    k_min, k_max = _check_range(logits, k_min, k_max)
    return _by_rows(_size_probs_rows, logits, k_min, k_max)[..., k_min:].to(logits.dtype)


def range_subset_sample(logits: torch.Tensor, k_min: int, k_max: int, *,
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """One exact sample of the range law per row: bool mask (..., E) with ``k_min..k_max`` Trues.
    Two stages, both exact: the size from :func:`range_subset_size_probs`, then the subset given
    the size by the backward walk of :func:`ksubset_sample`."""
    _check_logits(logits)
    k_min, k_max = _check_range(logits, k_min, k_max)
    return _draw(logits, k_min, k_max, generator)


def range_subset_map(logits: torch.Tensor, k_min: int, k_max: int) -> torch.Tensor:
    """The most probable subset of the range law, a bool mask (..., E).

    Chapter 7, "The MAP subset" (Proposition 7.6): ``log P(S) = sum_{j in S} r_j - log Z``. For each
    size c the best set is the top-c logits, and ``F(c) = sum of the c largest logits`` has
    non-increasing increments, so the best size is ``clip(#{j : r_j > 0}, k_min, k_max)``: the top
    k_min experts, then every further expert with a positive logit, up to k_max. (The paper's Alg. 3
    takes prefix sums of softmax probabilities, which always picks k_max; see the errata.) A logit
    exactly 0 is left out (both choices are MAP); ties in value are broken towards lower indices.
    """
    _check_logits(logits)
    k_min, k_max = _check_range(logits, k_min, k_max)
    size = (logits > 0).sum(-1, keepdim=True).clamp(k_min, k_max)
    order = logits.detach().argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(logits.shape[-1], device=logits.device)
                                            .expand_as(order))
    return rank < size
