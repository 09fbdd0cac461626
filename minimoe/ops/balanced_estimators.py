"""Unbiased REINFORCE with capacity: the skip and Gumbel-Matching estimators of Kool et al.

Book: chapter 5 (Balanced assignments with unbiased gradients), sections "The objective and
off-policy REINFORCE", "The skip estimator", "The Gumbel-matching estimator" and "Balancing in
expectation: Sinkhorn". The router ``p(z | x)`` (``softmax(logits)``) is the distribution we
differentiate; the experts see a sample from a
*proposal* that respects capacity. Every estimator is eq. (2) of the paper with a per-token
coefficient ``w_t`` (always detached), used in the surrogate (K1)

    S = 1/T sum_t sg(w_t) [ f_t + sg(f_t - b) log p(z_t | x_t) ]

whose gradient is unbiased whenever ``E[w_t | z_t] = p(z_t | x_t) / q(z_t | x)``. The estimators
(``ESTIMATORS``; ``q_tau = softmax(logits / tau)``, ``P~`` its Sinkhorn balancing):

================  ==========================================  =====================================  ========
name              sample                                      ``w_t``                                unbiased
================  ==========================================  =====================================  ========
``sample``        independent from ``q_tau`` (no capacity)    ``p / q_tau``                          yes
``skip_iw``       independent, then a uniform subset of       ``keep * n_z / min(n_z, c) * p / q``   yes (eq. 3)
                  ``min(n_e, c)`` tokens of each expert kept
``skip``          the same                                    ``keep * p / q * T / #kept``           no
``gm_iw``         Gumbel-Matching at ``tau``                  ``p / q(z_t | G_-t)``                  yes (eq. 6)
``gm_sh``         Gumbel-Matching at ``tau``                  ``p / P~``                             no
``gm``            Gumbel-Matching at ``tau``                  ``p / q_tau``                          no
``*_no_iw``       as above                                    1 (``skip_no_iw``: ``keep T / #kept``)  no
================  ==========================================  =====================================  ========

With ``sinkhorn_proposal=True`` the independent samplers draw from ``P~`` instead of ``q_tau`` (and
the weights divide by ``P~``); Gumbel-Matching solves on ``log P~``, which changes nothing when
``E * capacity == T`` (the problem only shifts by a constant) and turns ``gm`` into ``gm_sh``.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._checks import check_bool, check_generator, check_int, check_positive_float, check_scores, reads_are_free
from .gumbel_matching import gumbel_matching_conditionals, gumbel_matching_sample
from .sinkhorn import sinkhorn

ESTIMATORS = ("sample", "skip_iw", "skip", "gm_iw", "gm_sh", "gm", "sample_no_iw", "skip_no_iw", "gm_no_iw")
UNBIASED = ("sample", "skip_iw", "gm_iw")
_RATIO = ("sample", "gm_iw", "gm_sh", "gm")  # w = p / (the proposal passed in)
_SKIP = ("skip_iw", "skip", "skip_no_iw")
_GM = ("gm_iw", "gm_sh", "gm", "gm_no_iw")


class EstimatorSample(NamedTuple):
    """One draw of an estimator (:func:`sample_estimator`).

    ``assignment (..., T)``: each token's sampled expert (before skipping); ``keep (..., T)``: the
    token is processed (all True except for the skip estimators); ``coef (..., T)``: the detached
    REINFORCE coefficient ``w_t`` (0 for skipped tokens); ``proposal_log_probs (..., T, E)``: the log
    of the probabilities in the weight's denominator (``q_tau``, ``P~`` or the GM conditionals)."""

    assignment: torch.Tensor
    keep: torch.Tensor
    coef: torch.Tensor
    proposal_log_probs: torch.Tensor


def _check_expert_indices(assignment: torch.Tensor, n_experts: int) -> None:
    """Every entry of ``assignment`` in ``[0, n_experts)``: asserted on the device where reading it
    would make the host wait, checked with a clear error where reading is free."""
    message = f"assignment values must be in [0, {n_experts})"
    if not reads_are_free(assignment):
        torch._assert_async(((assignment >= 0) & (assignment < n_experts)).all(), message)
    elif assignment.numel() and (int(assignment.min()) < 0 or int(assignment.max()) >= n_experts):
        raise ValueError(message)


def _expert_counts(assignment: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Tokens drawn by each expert, ``(..., E)`` long, from ``assignment (..., T)``: a scatter-add,
    not ``one_hot``, which reads the largest index on the host."""
    counts = torch.zeros(*assignment.shape[:-1], n_experts, dtype=torch.long, device=assignment.device)
    return counts.scatter_add_(-1, assignment, torch.ones_like(assignment))


def skip_mask(assignment: torch.Tensor, n_experts: int, capacity: int | None, *,
              generator: torch.Generator | None = None):
    """Keep a uniformly random subset of ``min(n_e, capacity)`` of each expert's tokens (Kool et al.
    §2.1; chapter 5, "The skip estimator").

    Vectorised: sort the tokens by ``expert + U(0, 1)``, which groups them by expert in a uniformly
    random order, and keep the first ``capacity`` of each group: exactly Switch's "drop the
    overflow", done in a shuffled order (in token order the drops would depend on position).

    Args:
        assignment: ``LongTensor (..., T)`` in ``[0, n_experts)``.
        n_experts: number of experts E.
        capacity: slots per expert (>= 1), or ``None`` (keep everything).
        generator: for the random order.

    Returns:
        ``(keep (..., T) bool, expert_counts (..., E) long)``, the counts taken *before* dropping.
    """
    n_experts = check_int(n_experts, "n_experts", low=1)
    if capacity is not None:
        capacity = check_int(capacity, "capacity", low=1)
    if not isinstance(assignment, torch.Tensor) or assignment.dtype != torch.long:
        raise TypeError("assignment must be a LongTensor of expert indices")
    if assignment.dim() < 1:
        raise ValueError("assignment must have shape (..., T)")
    _check_expert_indices(assignment, n_experts)
    *batch, T = assignment.shape
    z = assignment.reshape(math.prod(batch), T)
    B = z.shape[0]
    counts = _expert_counts(z, n_experts)
    if capacity is None or T == 0:
        return torch.ones_like(assignment, dtype=torch.bool), counts.reshape(*batch, n_experts)
    check_generator(generator)
    noise = torch.rand(B, T, generator=generator, dtype=torch.float64,
                       device=generator.device if generator is not None else z.device).to(z.device)
    order = torch.argsort(z.double() + noise, dim=-1)
    sorted_expert = z.gather(1, order)
    start = counts.cumsum(-1) - counts
    rank_sorted = torch.arange(T, device=z.device) - start.gather(1, sorted_expert)
    keep = torch.empty_like(z, dtype=torch.bool).scatter_(1, order, rank_sorted < capacity)
    return keep.reshape(*batch, T), counts.reshape(*batch, n_experts)


def sample_categorical(log_probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw from each row of the categorical laws ``exp(log_probs) (..., E)`` (rows sum to 1),
    by the inverse of each row's distribution function: with ``U ~ U(0, F_E)``, the first j with
    ``F_j > U``, where ``F_j = q_1 + ... + q_j``. The same law as the Gumbel-max trick
    (Proposition 5.3), from one uniform per row instead of one per entry and no logarithm: about
    three times faster for E = 64. A category of probability 0 is never drawn (F does not rise there).
    """
    check_generator(generator)
    if not isinstance(log_probs, torch.Tensor) or not log_probs.is_floating_point() or log_probs.dim() < 1:
        raise TypeError("log_probs must be a floating-point tensor (..., E) of log-probabilities, got "
                        f"{type(log_probs).__name__}" + (f" of dtype {log_probs.dtype}, shape {tuple(log_probs.shape)}"
                                                         if isinstance(log_probs, torch.Tensor) else ""))
    cdf = log_probs.exp().cumsum(-1)
    if cdf.numel():
        # a row of all -inf (no category of positive probability), a NaN or a +inf has no draw: say so
        # rather than return the last category
        total = cdf[..., -1]
        usable = ((total > 0) & torch.isfinite(total)).all()
        message = ("log_probs has a row with no category of positive, finite probability (all -inf, or a "
                   "NaN or +inf entry): every row must be a distribution's log-probabilities")
        if reads_are_free(cdf):
            if not bool(usable):
                raise ValueError(message)
        else:
            torch._assert_async(usable, message)
    source = generator.device if generator is not None else log_probs.device
    u = torch.rand(cdf.shape[:-1] + (1,), generator=generator, dtype=cdf.dtype, device=source).to(cdf.device)
    draw = torch.searchsorted(cdf, u * cdf[..., -1:], right=True).squeeze(-1)
    return draw.clamp_max(log_probs.shape[-1] - 1)  # (u * F_E < F_E always; the clamp guards rounding)


class SkipSample(NamedTuple):
    """What :func:`skip_sample` returns: ``assignment (..., T)`` (sampled, before dropping), ``keep
    (..., T)``, ``expert_counts (..., E)`` (before dropping) and the proposal ``log q (..., T, E)``."""

    assignment: torch.Tensor
    keep: torch.Tensor
    expert_counts: torch.Tensor
    proposal_log_probs: torch.Tensor


def skip_sample(logits: torch.Tensor, capacity: int | None, *, tau: float = 1.0, sinkhorn_proposal: bool = False,
                generator: torch.Generator | None = None) -> SkipSample:
    """The skip estimator's sampler (Kool et al. §2.1; chapter 5, "The skip estimator"): every token
    draws its expert independently from ``q = softmax(logits / tau)`` (or from its Sinkhorn balancing
    ``P~`` with ``sinkhorn_proposal=True``) by :func:`sample_categorical`, then :func:`skip_mask` keeps a
    uniformly random ``min(n_e, capacity)`` of each expert's tokens. ``capacity=None`` keeps all.
    No gradient; pair it with :func:`estimator_coefficients` (``"skip_iw"``)."""
    check_scores(logits, "logits")
    tau = check_positive_float(tau, "tau")
    sinkhorn_proposal = check_bool(sinkhorn_proposal, "sinkhorn_proposal")
    E = logits.shape[-1]
    with torch.no_grad():
        base = logits.detach().double()
        # (at tau = 1 the division is skipped: x / 1 is x, bit for bit)
        proposal = (sinkhorn_balance(base, tau=tau, log=True) if sinkhorn_proposal
                    else torch.log_softmax(base if tau == 1.0 else base / tau, -1))
        assignment = sample_categorical(proposal, generator)
        keep, counts = skip_mask(assignment, E, capacity, generator=generator)
    return SkipSample(assignment, keep, counts, proposal.to(logits.dtype))


def sinkhorn_balance(logits: torch.Tensor, *, tau: float = 1.0, log: bool = False, tol: float = 1e-10,
                     max_iter: int = 1000) -> torch.Tensor:
    """``P~``, the Sinkhorn balancing of ``q_tau = softmax(logits / tau)`` (Kool et al. §2.3;
    chapter 5, "Balancing in expectation: Sinkhorn"). To balance a given row-stochastic ``P``, pass
    ``log P``.

    ``P~ = diag(r) q_tau diag(s)`` with rows summing to 1 and columns to ``T / E``. Its log is
    ``logits / tau + alpha_t + beta_e``: exactly the entropic plan of :func:`minimoe.ops.sinkhorn`
    for the scores ``logits / tau`` at ``eps = 1`` (the row shift of the log-softmax is absorbed into
    the row potential). With ``log=True`` the log is formed from the potentials, so it stays finite at
    any temperature. Float64 inside, returned in the dtype of ``logits``; no gradient (it only enters
    weights and proposals).

    Args:
        logits: ``(..., T, E)``.
        tau: temperature (> 0).
        log: return ``log P~``.
        tol, max_iter: passed to :func:`minimoe.ops.sinkhorn` (relative marginal error).
    """
    check_scores(logits, "logits")
    tau = check_positive_float(tau, "tau")
    with torch.no_grad():
        scores = logits.detach().double() / tau
        result = sinkhorn(scores, 1.0, tol=tol, max_iter=max_iter, return_potentials=True)
        # log P~ from the plan itself where it is representable (exact to its relative precision); from
        # the potentials only where it underflowed, capped there: at logits of 1e30 the sum
        # scores + f + g cancels to garbage (its terms are 1e30, float64 keeps 16 digits)
        from_potentials = scores + result.f[..., :, None] + result.g[..., None, :]
        tiny = math.log(torch.finfo(torch.float64).tiny)
        log_plan = torch.where(result.plan > 0, result.plan.clamp_min(torch.finfo(torch.float64).tiny).log(),
                               from_potentials.clamp_max(tiny))
    return (log_plan if log else log_plan.exp()).to(logits.dtype)


def estimator_coefficients(estimator: str, logits: torch.Tensor, assignment: torch.Tensor, *,
                           proposal_log_probs: torch.Tensor | None = None, keep: torch.Tensor | None = None,
                           capacity: int | None = None, log_probs: torch.Tensor | None = None) -> torch.Tensor:
    """The per-token coefficient ``w_t`` of each estimator (chapter 5, "The skip estimator" and "The
    Gumbel-matching estimator"; the table of :mod:`minimoe.ops.balanced_estimators`). Detached, float64
    inside, returned in the dtype of ``logits``.

    Args:
        estimator: one of ``ESTIMATORS``.
        logits: router logits ``(..., T, E)``; ``p = softmax(logits)`` (a row shift changes nothing).
        assignment: ``LongTensor (..., T)``, the sampled experts (before skipping).
        proposal_log_probs: ``(..., T, E)``, the log of the denominator: ``log q_tau`` (``sample``,
            ``gm``, and the skip estimators' proposal), ``log P~`` (``gm_sh``, or a Sinkhorn proposal),
            the log GM conditionals (``gm_iw``). Not needed by the ``*_no_iw`` estimators.
        keep: bool ``(..., T)`` from :func:`skip_mask` (skip estimators).
        capacity: slots per expert (``skip_iw``); ``None`` = no limit.
        log_probs: ``log_softmax(logits)`` in float64, when the caller has it (it is then not
            computed again); ``None`` computes it.

    Returns:
        ``(..., T)``.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    check_scores(logits, "logits")
    *batch, T, E = logits.shape
    if not isinstance(assignment, torch.Tensor) or assignment.shape != tuple(batch) + (T,):
        raise ValueError(f"assignment must be a LongTensor of shape {tuple(batch) + (T,)}")
    _check_expert_indices(assignment, E)
    needs_ratio = not estimator.endswith("no_iw")
    if needs_ratio:
        if proposal_log_probs is None:
            raise ValueError(f"estimator={estimator!r} needs proposal_log_probs (the log of its denominator)")
        if proposal_log_probs.shape != logits.shape:
            raise ValueError(f"proposal_log_probs must have shape {tuple(logits.shape)}, "
                             f"got {tuple(proposal_log_probs.shape)}")
    if estimator in _SKIP and (keep is None or keep.shape != assignment.shape or keep.dtype != torch.bool):
        raise ValueError(f"estimator={estimator!r} needs keep, a bool tensor of shape {tuple(assignment.shape)}")
    with torch.no_grad():
        z = assignment.long()[..., None]
        coef = torch.ones(assignment.shape, dtype=torch.float64, device=logits.device)
        if needs_ratio:
            if log_probs is None:
                log_probs = torch.log_softmax(logits.detach().double(), -1)
            elif log_probs.shape != logits.shape or log_probs.dtype != torch.float64:
                raise ValueError(f"log_probs must be log_softmax(logits) in float64, of shape {tuple(logits.shape)}; "
                                 f"got {log_probs.dtype} of shape {tuple(log_probs.shape)}")
            log_p = log_probs.gather(-1, z)[..., 0]
            log_q = proposal_log_probs.detach().double().gather(-1, z)[..., 0]
            coef = torch.exp(log_p - log_q)
        if estimator in _SKIP:
            kept = keep.double()
            if estimator == "skip_iw":
                if capacity is not None:
                    capacity = check_int(capacity, "capacity", low=1)
                    counts = _expert_counts(assignment.long(), E)  # (..., E), before dropping
                    n_z = counts.gather(-1, assignment.long()).double()
                    coef = coef * n_z / n_z.clamp(max=capacity)
                coef = coef * kept
            else:  # average over the survivors instead of correcting each expert's drop probability
                coef = coef * kept * T / kept.sum(-1, keepdim=True).clamp_min(1)
    return coef.to(logits.dtype)


def sample_estimator(logits: torch.Tensor, estimator: str, capacity: int | None = None, *, tau: float = 1.0,
                     sinkhorn_proposal: bool = False, generator: torch.Generator | None = None,
                     method: str = "auto") -> EstimatorSample:
    """Draw one sample of an estimator's proposal and its coefficients (chapter 5, "The skip
    estimator" and "The Gumbel-matching estimator").

    Args:
        logits: router logits ``(..., T, E)``; ``p = softmax(logits)``.
        estimator: one of ``ESTIMATORS``.
        capacity: slots per expert: required by the Gumbel-Matching estimators (``E * capacity >= T``),
            optional for skip (``None``: nothing is dropped), ignored by ``sample``.
        tau: proposal temperature (> 0).
        sinkhorn_proposal: balance ``q_tau`` by Sinkhorn before sampling (Kool et al. App. E).
        generator: for all randomness (Gumbel noise, skip order).
        method: Gumbel-Matching solver (see :func:`minimoe.ops.gumbel_matching_sample`).

    Returns:
        An :class:`EstimatorSample`.

    Under ``torch.compile`` a Gumbel-Matching draw is one opaque operation of the graph (a custom op
    that draws from torch's generator); with a ``generator`` of your own it cannot be (an operation
    takes no generator), and the draw breaks the graph.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    check_scores(logits, "logits")
    tau = check_positive_float(tau, "tau")
    sinkhorn_proposal = check_bool(sinkhorn_proposal, "sinkhorn_proposal")
    if torch.compiler.is_compiling() and estimator in _GM and generator is None and isinstance(capacity, int):
        # compiled: the Gumbel-Matching draw and its coefficients as one opaque operation (the solver's
        # rounds and the conditionals' checks depend on the data); it draws from torch's generator
        return EstimatorSample(*torch.ops.minimoe.gumbel_matching_estimator(
            logits.detach(), capacity, tau, estimator, sinkhorn_proposal, method))
    *batch, T, _ = logits.shape
    with torch.no_grad():
        base = logits.detach().double()
        if estimator not in _GM:
            drawn = skip_sample(base, capacity if estimator in _SKIP else None, tau=tau,
                                sinkhorn_proposal=sinkhorn_proposal, generator=generator)
            assignment, keep, proposal = drawn.assignment, drawn.keep, drawn.proposal_log_probs
        else:
            if capacity is None:
                raise ValueError(f"estimator={estimator!r} samples balanced assignments: pass capacity")
            keep = torch.ones((*batch, T), dtype=torch.bool, device=logits.device)
            needs_balanced = sinkhorn_proposal or estimator == "gm_sh"
            balanced = sinkhorn_balance(base, tau=tau, log=True) if needs_balanced else None
            # Gumbel-Matching of log P~ at temperature 1 (Sinkhorn before sampling), or of logits at tau
            sample_logits, sample_tau = (balanced, 1.0) if sinkhorn_proposal else (base, tau)
            assignment, gumbels = gumbel_matching_sample(sample_logits, capacity, tau=sample_tau, generator=generator,
                                                         method=method, return_gumbels=True)
            if estimator == "gm_iw":
                proposal = gumbel_matching_conditionals(sample_logits, gumbels, assignment, tau=sample_tau,
                                                        capacity=capacity, log=True)
            elif estimator == "gm_sh" or sinkhorn_proposal:
                proposal = balanced
            else:
                proposal = torch.log_softmax(base / tau, -1)
        # the skip estimators' proposal at tau = 1 is log_softmax(logits) itself, computed the same way
        # (in float64, no division): the coefficients' log p is then that tensor, not a second pass
        same = estimator not in _GM and not sinkhorn_proposal and tau == 1.0
        coef = estimator_coefficients(estimator, base, assignment, proposal_log_probs=proposal, keep=keep,
                                      capacity=capacity, log_probs=proposal if same else None)
    dtype = logits.dtype
    return EstimatorSample(assignment, keep, coef.to(dtype), proposal.to(dtype))


@torch.library.custom_op("minimoe::gumbel_matching_estimator", mutates_args=())
def _gumbel_matching_op(logits: torch.Tensor, capacity: int, tau: float, estimator: str, sinkhorn_proposal: bool,
                        method: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sample_estimator` for a Gumbel-Matching estimator, as one operation of a compiled graph."""
    drawn = sample_estimator(logits, estimator, capacity, tau=tau, sinkhorn_proposal=sinkhorn_proposal, method=method)
    return tuple(t.clone() for t in drawn)


@_gumbel_matching_op.register_fake
def _(logits, capacity, tau, estimator, sinkhorn_proposal, method):
    tokens = logits.shape[:-1]
    return (logits.new_empty(tokens, dtype=torch.long), logits.new_empty(tokens, dtype=torch.bool),
            logits.new_empty(tokens), logits.new_empty(logits.shape))


def reinforce_surrogate(log_prob_chosen: torch.Tensor, loss_per_token: torch.Tensor, coef: torch.Tensor,
                        baseline: float | torch.Tensor = 0.0) -> torch.Tensor:
    """The surrogate (K1) of chapter 5 ("The objective and off-policy REINFORCE"), a scalar:

        mean_t  sg(w_t) [ f_t + sg(f_t - b) log p(z_t | x_t) ]

    Its gradient is the REINFORCE term for the router (through ``log_prob_chosen``) plus the
    pathwise term for whatever ``loss_per_token`` depends on (pass a detached loss for the REINFORCE
    term alone). Unbiased when ``E[w_t | z_t] = p / q`` and the baseline ``b`` does not depend on
    this sample (a constant, or an average of earlier batches: a batch mean is biased under
    skipping and Gumbel-Matching, whose tokens are coupled).

    Args:
        log_prob_chosen: ``log p(z_t | x_t)``, ``(..., T)``, with gradient.
        loss_per_token: ``f_t``, ``(..., T)``.
        coef: ``w_t``, ``(..., T)`` (detached here).
        baseline: ``b``, a number or a tensor broadcastable to ``(..., T)`` (detached here).
    """
    for name, value in (("log_prob_chosen", log_prob_chosen), ("loss_per_token", loss_per_token), ("coef", coef)):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor")
    if not (log_prob_chosen.shape == loss_per_token.shape == coef.shape):
        raise ValueError(f"log_prob_chosen, loss_per_token and coef must have the same shape, got "
                         f"{tuple(log_prob_chosen.shape)}, {tuple(loss_per_token.shape)}, {tuple(coef.shape)}")
    baseline = torch.as_tensor(baseline, dtype=loss_per_token.dtype, device=loss_per_token.device).detach()
    w = coef.detach()
    advantage = (loss_per_token.detach() - baseline)
    return (w * (loss_per_token + advantage * log_prob_chosen)).mean()


def expected_loss_gradient(logits: torch.Tensor, loss_table: torch.Tensor) -> torch.Tensor:
    """The exact gradient the estimators estimate, for a separable loss (chapter 5, "The objective and
    off-policy REINFORCE"): the gradient with respect to ``logits`` of ``1/T sum_t sum_e p_te f_te`` with
    ``p = softmax(logits)``, i.e. ``p_te (f_te - sum_e' p_te' f_te') / T``. Each leading index is its
    own problem. The test oracle of every estimator."""
    check_scores(logits, "logits")
    check_scores(loss_table, "loss_table")
    if loss_table.shape != logits.shape:
        raise ValueError(f"loss_table must have the shape of logits {tuple(logits.shape)}, "
                         f"got {tuple(loss_table.shape)}")
    p = torch.softmax(logits, -1)
    T = logits.shape[-2]
    return p * (loss_table - (p * loss_table).sum(-1, keepdim=True)) / max(T, 1)


__all__ = ["ESTIMATORS", "UNBIASED", "EstimatorSample", "SkipSample", "skip_mask", "skip_sample",
           "sinkhorn_balance", "estimator_coefficients", "sample_estimator", "reinforce_surrogate",
           "expected_loss_gradient"]
