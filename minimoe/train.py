"""One training loop for every model and router: progress bars, evaluation, per-step balance
metrics, device choice (cuda > mps > cpu) and seeding. Returns a history a notebook can plot.
"""
from __future__ import annotations

import random
import time
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm


def pick_device(prefer: str | None = None) -> torch.device:
    """``prefer`` if given, else the best available: cuda, then mps, then cpu."""
    if prefer is not None:
        return torch.device(prefer)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _moe_stats(model) -> dict:
    stats = {}
    layers = model.moe_layers() if hasattr(model, "moe_layers") else []
    for i, layer in enumerate(layers):
        if layer.last_routing is None:
            continue
        for key, value in layer.last_routing.stats.items():
            stats[f"moe{i}/{key}"] = float(value)
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
    seed_everything(seed)
    device = pick_device(device if device is None else str(device))
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    history = {"train": [], "eval": [], "device": str(device)}

    def evaluate(step):
        if eval_fn is None:
            return
        model.eval()
        with torch.no_grad():
            row = {"step": step, **eval_fn(model)}
        model.train()
        history["eval"].append(row)

    start = time.perf_counter()
    bar = tqdm(range(steps), desc=desc, disable=not progress, leave=False)
    model.train()
    for step in bar:
        inputs, targets = (t.to(device) for t in get_batch(step))
        task_loss = loss_fn(model(inputs), targets)
        aux = model.aux_loss().to(device) if hasattr(model, "aux_loss") else torch.zeros((), device=device)
        optimizer.zero_grad(set_to_none=True)
        (task_loss + aux).backward()
        if grad_clip:
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


def series(rows: list[dict], key: str) -> tuple[list, list]:
    """``(steps, values)`` of one metric from a history's rows (rows lacking it are skipped)."""
    pairs = [(r["step"], r[key]) for r in rows if key in r]
    return [p[0] for p in pairs], [p[1] for p in pairs]
