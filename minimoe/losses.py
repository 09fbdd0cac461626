"""Auxiliary losses that push a router towards balanced expert usage.

Book: chapter 1, section "Auxiliary losses". Each function takes router tensors of shape
(..., T, E), averages over the leading (group) dimensions and returns a scalar.
"""
from __future__ import annotations

import torch


def cv_squared(values: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """Squared coefficient of variation over the last dim, ``var / mean^2`` (population variance)."""
    mean = values.mean(-1)
    var = values.var(-1, unbiased=False)
    return var / (mean.pow(2) + eps)


def importance_loss(probs: torch.Tensor) -> torch.Tensor:
    """V-MoE importance loss (Liu et al. App. A; Riquelme et al. 2021; Shazeer et al. 2017).

    ``importance_e = sum_t probs[t, e]``, loss = CV(importance)^2. Zero exactly when every expert
    receives the same total gate mass; invariant to rescaling the importances.
    """
    return cv_squared(probs.sum(-2)).mean()


def load_loss(
    clean_logits: torch.Tensor,
    noisy_logits: torch.Tensor,
    noise_std: torch.Tensor | float,
    k: int,
) -> torch.Tensor:
    """V-MoE load loss, eqs. (12)-(15) of Liu et al.

    ``load_e(x) = P_delta(clean_e + delta > kth_max(noisy))`` with ``delta ~ N(0, noise_std^2)``,
    i.e. ``Phi((clean_e - threshold) / noise_std)``: the probability, over a fresh draw of the
    noise on expert e alone, that e would be among the top k. Summed over tokens it is a smooth
    estimate of the number of tokens each expert receives; the loss is CV(load)^2. As in V-MoE's
    code, the gradient also flows through the threshold (the k-th largest noisy logit). The
    threshold includes expert e's own noise, so the estimate is biased low for selected experts
    (see the errata page); we implement the paper's formula as written.
    """
    threshold = noisy_logits.topk(k, dim=-1).values[..., -1:]
    prob_in_topk = torch.special.ndtr((clean_logits - threshold) / noise_std)
    return cv_squared(prob_in_topk.sum(-2)).mean()


def switch_balance_loss(probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Switch Transformer / GShard load-balancing loss (Fedus et al. 2022, eq. 4; Lepikhin et al. 2021).

    ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of routed (token, expert) pairs that chose
    expert e (``mask``, counted before capacity drops) and ``P_e`` the mean router probability.
    ``f`` is piecewise constant, so the gradient flows through ``P`` only: it lowers the probability
    of experts that receive many tokens. Equals 1 for a uniform router.
    """
    E = probs.shape[-1]
    mask = mask.to(probs.dtype)
    fraction = mask.sum(-2) / mask.sum((-2, -1)).unsqueeze(-1).clamp_min(1)
    mean_prob = probs.mean(-2)
    return (E * (fraction * mean_prob).sum(-1)).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss (Zoph et al. 2022, ST-MoE eq. 5): mean over tokens of ``logsumexp(logits)^2``.

    Keeps the router logits small so the softmax stays in a well-conditioned range.
    """
    return torch.logsumexp(logits, dim=-1).pow(2).mean()
