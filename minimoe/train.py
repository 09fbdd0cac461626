"""One training loop for every model and router: progress bars, evaluation, per-step balance
metrics, device choice (cuda > mps > cpu) and seeding. Returns a history a notebook can plot.
"""
from __future__ import annotations

import random
import time
from typing import Callable

import numpy as np
import torch

from .ops._checks import check_bool, check_float, check_int, check_nonnegative_float, check_positive_float
from .progress import progress as progress_bar


def pick_device(prefer: str | None = None) -> torch.device:
    """``prefer`` if given, else the best available: cuda, then mps, then cpu."""
    if prefer is not None:
        if not isinstance(prefer, (str, torch.device)):
            raise TypeError(f"device must be a string such as 'cpu' or 'cuda', a torch.device, or None; got {prefer!r}")
        try:
            device = torch.device(prefer)
        except RuntimeError:
            raise ValueError(f"device must name a torch device such as 'cpu', 'cuda', 'cuda:1' or 'mps'; "
                             f"got {prefer!r}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={prefer!r} but CUDA is not available here; use 'cpu' or device=None")
        if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ValueError(f"device={prefer!r} but MPS is not available here; use 'cpu' or device=None")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    seed = check_int(seed, "seed", low=0, high=2**32 - 1)  # NumPy's range
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def adamw_foreach(device: torch.device) -> bool | None:
    """AdamW's ``foreach`` for both training loops: True on a CPU, torch's own choice elsewhere (its
    multi-tensor form on CUDA, the loop on MPS, which has no multi-tensor operations).

    On a CPU torch defaults to a Python loop over the parameters. It has no multi-tensor CPU kernels
    either, so there each multi-tensor operation applies the loop's per-tensor kernel to every
    parameter from C++: the same bits, with less Python per step
    (tests/test_models_data.py::test_foreach_adamw_gives_the_loops_bits; book: appendix
    "Performance", "A training step of the notebooks' models"). ``clip_grad_norm_`` already takes
    its multi-tensor form on a CPU by default."""
    return True if torch.device(device).type == "cpu" else None


def _moe_stats(model) -> dict:
    stats = {}
    layers = model.moe_layers() if hasattr(model, "moe_layers") else []
    for i, layer in enumerate(layers):
        if layer.last_routing is None:
            continue
        for key, value in layer.last_routing.stats.items():
            # scalars as floats; a per-expert vector (loss-free balancing's bias) as a list
            value = torch.as_tensor(value)
            stats[f"moe{i}/{key}"] = float(value) if value.numel() == 1 else value.tolist()
        load = layer.last_routing.tokens_per_expert().sum(0).float()
        stats[f"moe{i}/load"] = (load / load.sum().clamp_min(1)).tolist()  # share of routed pairs
    return stats


def train(
    model: torch.nn.Module,
    get_batch: Callable[[int], tuple],
    loss_fn: Callable,
    *,
    steps: int,
    lr: float = 3e-3,
    weight_decay: float = 0.01,
    eval_fn: Callable[[torch.nn.Module], dict] | None = None,
    eval_every: int = 100,
    device: str | torch.device | None = None,
    seed: int = 0,
    grad_clip: float | None = 1.0,
    progress: bool = True,
    desc: str = "train",
) -> dict:
    """Train ``model`` for ``steps`` AdamW steps.

    ``get_batch(step)`` returns ``(inputs, targets)`` (moved to the device here); the objective is
    ``loss_fn(model(inputs), targets) + model.aux_loss()`` (the routers' auxiliary losses, already
    weighted). ``eval_fn(model)`` (run under ``torch.no_grad`` in eval mode every ``eval_every``
    steps and at the end) returns a dict of metrics.

    Returns a history ``{"train": [row, ...], "eval": [row, ...], "seconds": float}``; each row is a
    dict with ``step``, ``loss``, ``aux_loss`` and every MoE layer's routing stats
    (``moe{i}/drop_rate``, ``moe{i}/load_cv``, ..., and ``moe{i}/load``: each expert's share of the
    dispatched (token, expert) pairs).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for fn, fn_name in ((get_batch, "get_batch"), (loss_fn, "loss_fn")):
        if not callable(fn):
            raise TypeError(f"{fn_name} must be callable, got {fn!r}")
    if eval_fn is not None and not callable(eval_fn):
        raise TypeError(f"eval_fn must be callable or None, got {eval_fn!r}")
    steps = check_int(steps, "steps", low=1)
    lr = check_positive_float(lr, "lr")
    weight_decay = check_nonnegative_float(weight_decay, "weight_decay")
    eval_every = check_int(eval_every, "eval_every", low=0)
    grad_clip = check_float(grad_clip, "grad_clip (the largest gradient norm; None: no clipping)", low=0.0,
                            low_open=True, allow_none=True)
    progress = check_bool(progress, "progress")
    if not isinstance(desc, str):
        raise TypeError(f"desc must be a string, got {desc!r}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("model has no trainable parameters (requires_grad=True): there is nothing to train")
    seed_everything(seed)
    device = pick_device(device)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                                  foreach=adamw_foreach(device))
    history = {"train": [], "eval": [], "device": str(device)}

    def evaluate(step):
        if eval_fn is None:
            return
        model.eval()
        with torch.no_grad():
            metrics = eval_fn(model)
        if not isinstance(metrics, dict):
            raise TypeError(f"eval_fn must return a dict of metrics, got {type(metrics).__name__}")
        row = {"step": step, **metrics}
        model.train()
        history["eval"].append(row)

    start = time.perf_counter()
    bar = progress_bar(range(steps), desc=desc or "train", enabled=progress)
    model.train()
    for step in bar:
        inputs, targets = _batch(get_batch(step), device)
        task_loss = loss_fn(model(inputs), targets)
        if not isinstance(task_loss, torch.Tensor) or task_loss.dim() != 0 or not task_loss.is_floating_point():
            raise TypeError("loss_fn must return a scalar floating-point tensor (e.g. a mean over the batch), "
                            f"got {_describe(task_loss)}")
        aux = model.aux_loss().to(device) if hasattr(model, "aux_loss") else torch.zeros((), device=device)
        optimizer.zero_grad(set_to_none=True)
        (task_loss + aux).backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        row = {"step": step, "loss": task_loss.item(), "aux_loss": float(aux.detach()), **_moe_stats(model)}
        history["train"].append(row)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{row['loss']:.3f}")
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            evaluate(step + 1)
    evaluate(steps)
    history["seconds"] = time.perf_counter() - start
    return history


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"{type(value).__name__}"


def _batch(batch, device):
    """``get_batch(step)``'s ``(inputs, targets)`` on the device, or a clear error."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2 or not all(isinstance(t, torch.Tensor) for t in batch):
        raise TypeError(f"get_batch(step) must return a pair of tensors (inputs, targets), got {_describe(batch)}"
                        + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
    return batch[0].to(device), batch[1].to(device)


def series(rows: list[dict], key: str) -> tuple[list, list]:
    """``(steps, values)`` of one metric from a history's rows (rows lacking it are skipped)."""
    pairs = [(r["step"], r[key]) for r in rows if key in r]
    return [p[0] for p in pairs], [p[1] for p in pairs]
