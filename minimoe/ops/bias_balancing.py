"""Auxiliary-loss-free balancing: one bias per expert, moved by the load error (Wang et al. 2024).

Book: chapter 10, "Loss-free balancing is dual ascent". A router adds a bias ``b_e`` to expert e's
routing score *for selection only* and, after each step, moves it towards the experts that got
fewer tokens than the mean:

* sign update (Wang et al., DeepSeek-V3):  ``b_e <- b_e + rate * sign(mean(n) - n_e)``;
* proportional update:                     ``b_e <- b_e + rate * (mean(n) - n_e) / mean(n)``,

where ``n_e`` is expert e's load (selected (token, expert) pairs). Both are (sign-)subgradient
*descent* steps on the dual ``D(b)`` of the balanced selection LP of chapter 6, which is minimised:
its subgradient in ``b_e`` is ``n_e - mean(n)``, and the step goes against it (written as the
maximisation of ``-D``, the same step is the "dual ascent" of the chapter's title; chapter 10, "The
sign convention"). ``-b`` plays the role of the per-expert thresholds of Prop. 6.3 (and, as
eps -> 0, of Sinkhorn's column potentials, Prop. 2.10).
"""
from __future__ import annotations

import torch

from ._checks import check_choice, check_nonnegative_float, check_tensor, reads_are_free

BIAS_UPDATES = ("sign", "proportional")


def expert_loads(mask: torch.Tensor) -> torch.Tensor:
    """Load of each expert: the number of selected (token, expert) pairs of ``mask (..., E)``, summed
    over every leading dimension (groups and tokens). Returns a float32 tensor of shape ``(E,)``
    (exact for counts below 2**24)."""
    check_tensor(mask, "mask", floating=False, min_dim=1, shape_hint="(..., experts)")
    return mask.reshape(-1, mask.shape[-1]).to(torch.float32).sum(0)


def _check_loads(loads: torch.Tensor, name: str = "loads") -> torch.Tensor:
    check_tensor(loads, name, floating=False, min_dim=1, max_dim=1, shape_hint="(experts,)")
    if loads.numel() == 0:
        raise ValueError(f"{name} must have at least one expert, got shape {tuple(loads.shape)}")
    loads = loads.to(torch.float32) if not loads.is_floating_point() else loads
    if not reads_are_free(loads):  # asserted on the device: no synchronisation
        torch._assert_async((torch.isfinite(loads) & (loads >= 0)).all(),
                            f"{name} must be finite and >= 0 (token counts)")
    elif not torch.isfinite(loads).all() or (loads < 0).any():
        raise ValueError(f"{name} must be finite and >= 0 (token counts), got {loads.tolist()}")
    return loads


def bias_update(bias: torch.Tensor, loads: torch.Tensor, rate: float, update: str = "sign") -> torch.Tensor:
    """One step of loss-free balancing (chapter 10, eq. "bias update"); returns the new bias.

    ``update="sign"``: ``b + rate * sign(mean(loads) - loads)`` (Wang et al. 2024, Alg. 1).
    ``update="proportional"``: ``b + rate * (mean(loads) - loads) / mean(loads)``, the relative load
    error, so the step does not depend on the batch size; when no expert has a token (mean 0) the
    bias does not move. ``bias`` and ``loads`` have shape ``(E,)``; the result has ``bias``'s dtype.
    """
    check_tensor(bias, "bias", min_dim=1, max_dim=1, shape_hint="(experts,)")
    loads = _check_loads(loads)
    if loads.shape != bias.shape:
        raise ValueError(f"loads must have the shape of bias {tuple(bias.shape)}, got {tuple(loads.shape)}")
    rate = check_nonnegative_float(rate, "rate")
    update = check_choice(update, "update", BIAS_UPDATES)
    # the step in the bias's own precision (at least float32): a float64 bias stays exact
    dtype = torch.promote_types(bias.dtype, torch.float32)
    loads = loads.to(device=bias.device, dtype=dtype)
    mean = loads.mean()
    if update == "sign":
        step = torch.sign(mean - loads)
    else:
        step = torch.where(mean > 0, (mean - loads) / mean.clamp_min(torch.finfo(dtype).tiny),
                           torch.zeros_like(loads))
    return (bias.to(dtype) + rate * step).to(bias.dtype)


def max_violation(loads: torch.Tensor) -> torch.Tensor:
    """Maximal violation of balance, ``max(loads) / mean(loads) - 1`` (Wang et al. 2024, "MaxVio"):
    0 for a perfectly balanced selection; 0 as well when no expert has a token. A float32 scalar."""
    loads = _check_loads(loads)
    loads = loads.to(torch.float32)
    mean = loads.mean()
    # no Python branch on the mean: that would read it on the host
    return torch.where(mean > 0, loads.max() / mean.clamp_min(torch.finfo(mean.dtype).tiny) - 1, 0.0)
