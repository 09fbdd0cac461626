"""Auxiliary losses that push a router towards balanced expert usage.

Book: chapter 1, section "Auxiliary losses". Each function takes router tensors of shape
(..., T, E), averages over the leading (group) dimensions and returns a scalar.

``token_mask`` (``(..., T)`` bool, False for padding; chapter 1, "Padding"): where a loss takes it,
its token sums and means run over the real tokens only, so that padding neither dilutes nor skews
the balance statistics (Hugging Face's ``load_balancing_loss_func`` with an ``attention_mask``).
``None`` computes exactly what the loss computed without the option.
"""
from __future__ import annotations

import torch


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """float16/bfloat16 promoted to float32 (sums of squares overflow float16); float64 kept."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def cv_squared(values: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """Squared coefficient of variation over the last dim, ``var / mean^2`` (population variance)."""
    values = _wide(values)
    mean = values.mean(-1)
    var = values.var(-1, unbiased=False)
    return var / (mean.pow(2) + eps)


def _masked(values: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """``values (..., T, E)`` with the rows of padding tokens set to 0."""
    return values if token_mask is None else values * token_mask.unsqueeze(-1).to(values.dtype)


def importance_loss(probs: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """V-MoE importance loss (Liu et al. App. A; Riquelme et al. 2021; Shazeer et al. 2017).

    ``importance_e = sum_t probs[t, e]``, loss = CV(importance)^2. Zero exactly when every expert
    receives the same total gate mass; invariant to rescaling the importances. With ``token_mask``
    the sums run over the real tokens.
    """
    return cv_squared(_masked(probs, token_mask).sum(-2)).mean()


def load_loss(
    clean_logits: torch.Tensor,
    noisy_logits: torch.Tensor,
    noise_std: torch.Tensor | float,
    k: int,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """V-MoE load loss, eqs. (12)-(15) of Liu et al.

    ``load_e(x) = P_delta(clean_e + delta > kth_max(noisy))`` with ``delta ~ N(0, noise_std^2)``,
    i.e. ``Phi((clean_e - threshold) / noise_std)``: the probability, over a fresh draw of the
    noise on expert e alone, that e would be among the top k. Summed over tokens it is a smooth
    estimate of the number of tokens each expert receives; the loss is CV(load)^2. As in V-MoE's
    code, the gradient also flows through the threshold (the k-th largest noisy logit). The
    threshold includes expert e's own noise, so the estimate is biased low for selected experts
    (see the errata page); we implement the paper's formula as written. With ``token_mask`` the
    sums run over the real tokens.
    """
    threshold = _wide(noisy_logits).topk(k, dim=-1).values[..., -1:]
    noise_std = _wide(noise_std) if isinstance(noise_std, torch.Tensor) else noise_std
    prob_in_topk = torch.special.ndtr((_wide(clean_logits) - threshold) / noise_std)
    return cv_squared(_masked(prob_in_topk, token_mask).sum(-2)).mean()


def switch_balance_loss(probs: torch.Tensor, mask: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch Transformer / GShard load-balancing loss (Fedus et al. 2022, eq. 4; Lepikhin et al. 2021).

    ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of routed (token, expert) pairs that chose
    expert e (``mask``, counted before capacity drops) and ``P_e`` the mean router probability.
    ``f`` is piecewise constant, so the gradient flows through ``P`` only: it lowers the probability
    of experts that receive many tokens. Equals 1 for a uniform router.

    With ``token_mask`` (padding False), ``f_e`` counts the real tokens' pairs and ``P_e`` averages
    over the real tokens of each group; groups without a real token are left out of the mean over
    groups. Hugging Face's ``load_balancing_loss_func(..., attention_mask)`` normalises ``f_e`` by the
    tokens rather than the pairs, so it equals ``k`` times this loss of all tokens pooled (chapter 1).
    """
    if token_mask is not None:
        mask = mask & token_mask.unsqueeze(-1)
    return switch_balance_loss_from_counts(probs, mask.sum(-2), token_mask=token_mask)


def switch_balance_loss_from_counts(probs: torch.Tensor, counts: torch.Tensor,
                                    token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`switch_balance_loss` from the pairs each expert was chosen for, ``counts (..., E)``
    (what a token-choice allocation counts anyway), instead of the ``(..., T, E)`` mask. With
    ``token_mask`` the counts must be those of the real tokens (the mask is used for ``P_e``)."""
    E = probs.shape[-1]
    if token_mask is not None:
        probs = _wide(probs)
        counts = counts.to(probs.dtype)
        real = token_mask.to(probs.dtype)
        n_real = real.sum(-1)  # (...,) real tokens per group
        fraction = counts / counts.sum(-1, keepdim=True).clamp_min(1)
        mean_prob = _masked(probs, token_mask).sum(-2) / n_real.unsqueeze(-1).clamp_min(1)
        per_group = E * (fraction * mean_prob).sum(-1)
        has_tokens = (n_real > 0).to(probs.dtype)
        return (per_group * has_tokens).sum() / has_tokens.sum().clamp_min(1)
    probs = _wide(probs)
    counts = counts.to(probs.dtype)
    fraction = counts / counts.sum(-1, keepdim=True).clamp_min(1)
    mean_prob = probs.mean(-2)
    return (E * (fraction * mean_prob).sum(-1)).mean()


def z_loss(logits: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Router z-loss (Zoph et al. 2022, ST-MoE eq. 5): mean over tokens of ``logsumexp(logits)^2``.

    Keeps the router logits small so the softmax stays in a well-conditioned range. Computed in
    float32 at least: in float16 the square overflows once the logits reach 256. With
    ``token_mask``, the mean over the real tokens.
    """
    squares = torch.logsumexp(_wide(logits), dim=-1).pow(2)
    if token_mask is None:
        return squares.mean()
    real = token_mask.to(squares.dtype)
    return (squares * real).sum() / real.sum().clamp_min(1)


def reinforce_loss(model_or_layers, loss_per_token: torch.Tensor,
                   baseline: float | torch.Tensor | str = 0.0) -> torch.Tensor:
    """The REINFORCE term of Kool et al.'s surrogate (K1) for every MoE layer whose last routing
    carries REINFORCE coefficients (the ``kool_skip`` and ``kool_gumbel_matching`` routers; chapter 5,
    "The routers in a MoE layer"):

        sum over layers of  mean_t  sg(w_t) sg(f_t - b) log p(z_t | x_t).

    :func:`minimoe.train.train` adds it by itself, through the routers' ``extra_loss`` (the router
    protocol), with a moving average of the earlier losses as ``b``; this function is the same term
    for a loop of one's own. The layer already scales the gradient through each token's expert
    output by ``w_t`` (the pathwise term of (K1)), so ``task_loss + reinforce_loss(...)`` has the
    estimator's gradient for the experts and the routers alike. Only the gradient is meaningful, so
    the returned value is ``S - sg(S)``: exactly 0, with the gradient of ``S``.

    Args:
        model_or_layers: a model, a :class:`minimoe.MoELayer`, or an iterable of them; every MoE
            layer inside is used (layers without coefficients, e.g. in eval mode, add nothing).
        loss_per_token: ``f_t`` (detached here), see :func:`reinforce_term`.
        baseline: ``b``, see :func:`reinforce_term`.

    Returns:
        A scalar whose value is 0 and whose gradient is that of the sum above.
    """
    _advantage(loss_per_token, baseline)  # bad input is named here, even with no REINFORCE layer inside
    modules = [model_or_layers] if isinstance(model_or_layers, torch.nn.Module) else list(model_or_layers)
    total = loss_per_token.detach().new_zeros(())
    seen = set()
    for module in modules:
        for layer in module.modules():
            routing = getattr(layer, "last_routing", None)
            if id(layer) in seen or routing is None or getattr(routing, "reinforce_weight", None) is None:
                continue
            seen.add(id(layer))
            total = total + reinforce_term(routing, loss_per_token, baseline)
    return total


def _advantage(loss_per_token, baseline) -> torch.Tensor:
    """``sg(f_t - b)``, flattened, with clear errors for a bad ``loss_per_token`` or ``baseline``."""
    if not isinstance(loss_per_token, torch.Tensor) or not loss_per_token.is_floating_point():
        raise TypeError("loss_per_token must be a floating-point tensor")
    losses = loss_per_token.detach()
    if isinstance(baseline, str):
        if baseline != "mean":
            raise ValueError(f"baseline must be a number, a tensor or 'mean', got {baseline!r}")
        baseline = losses.mean()
    baseline = torch.as_tensor(baseline, dtype=losses.dtype, device=losses.device).detach()
    try:
        return (losses - baseline).reshape(-1)
    except RuntimeError:
        raise ValueError(f"baseline must broadcast to loss_per_token's shape {tuple(losses.shape)}, "
                         f"got shape {tuple(baseline.shape)}") from None


def reinforce_term(routing, loss_per_token: torch.Tensor, baseline: float | torch.Tensor | str = 0.0) -> torch.Tensor:
    """One layer's REINFORCE term of (K1), ``mean_t sg(w_t) sg(f_t - b) log p(z_t | x_t)``, from a
    routing that carries ``reinforce_weight`` (``w_t``) and ``log_prob``, as a value-free surrogate:
    the value is exactly 0, the gradient that of the mean (chapter 5).

    Args:
        routing: the :class:`~minimoe.routing.Routing` of the forward that produced the losses.
        loss_per_token: ``f_t`` (detached here), either one loss per routed token in the order of the
            layer's input tokens (the model's token grid ``(B, L)``, e.g. an LM's per-position losses),
            or one loss per example ``(B,)``, which is shared by all of that example's tokens (a
            classifier's per-example loss); a scalar is shared by every token.
        baseline: ``b``: a number or a tensor of ``loss_per_token``'s shape, e.g. a moving average of
            earlier batches' losses (unbiased); or ``"mean"``, this batch's mean loss, which is biased:
            it contains each token's own loss and, under skipping and Gumbel-Matching, the losses of
            tokens whose routing is coupled to it (chapter 5, "The objective and off-policy REINFORCE").
    """
    advantage = _advantage(loss_per_token, baseline)
    weight = routing.reinforce_weight.detach().reshape(-1)
    log_prob = routing.log_prob.reshape(-1)
    n = weight.numel()
    if advantage.numel() == n:
        per_token = advantage
    elif advantage.numel() and n % advantage.numel() == 0:
        per_token = advantage.repeat_interleave(n // advantage.numel())  # one loss per example
    else:
        raise ValueError(f"loss_per_token has {advantage.numel()} entries; the MoE layer routed {n} "
                         "tokens: pass one loss per token or one per example")
    term = (weight * per_token.to(weight.dtype) * log_prob).mean()
    return term - term.detach()
