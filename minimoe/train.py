"""One training loop for every model and router, used by the notebooks and the study alike: progress
bars, evaluation, per-step balance metrics, the routers' own training rules (the router protocol),
a learning-rate schedule, checkpoint and resume, device choice (cuda > mps > cpu) and seeding.
Returns a history a notebook can plot.
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import random
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .layers import moe_layers, router_losses
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
    for i, layer in enumerate(moe_layers(model)):
        if layer.last_routing is None:
            continue
        for key, value in layer.last_routing.stats.items():
            # scalars as floats (a Python number as it is); a per-expert vector (loss-free balancing's
            # bias) as a list
            if isinstance(value, (int, float)):
                stats[f"moe{i}/{key}"] = float(value)
                continue
            value = torch.as_tensor(value)
            stats[f"moe{i}/{key}"] = float(value) if value.numel() == 1 else value.tolist()
        load = layer.last_routing.tokens_per_expert().sum(0).float()
        stats[f"moe{i}/load"] = (load / load.sum().clamp_min(1)).tolist()  # share of routed pairs
    return stats


def warmup_cosine(lr: float, steps: int, warmup_steps: int = 0) -> Callable[[int], float]:
    """The learning rate of step ``s`` (0-based) of a ``steps``-step run: a linear warm-up to ``lr``
    over ``warmup_steps`` steps, then half a cosine down to 0 at the last step. A function of the
    step alone, so a resumed run needs no scheduler state; pass it as ``train(..., lr=...)``."""
    lr = check_positive_float(lr, "lr")
    steps = check_int(steps, "steps", low=1)
    warmup_steps = check_int(warmup_steps, "warmup_steps", low=0)
    warmup = min(warmup_steps, steps - 1)  # a run shorter than its warm-up warms up throughout

    def schedule(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        return lr * 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / (steps - warmup)))

    return schedule


def rng_state() -> dict:
    """The state of Python's, NumPy's and torch's generators (CUDA's too where there is one)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore the generators from :func:`rng_state`."""
    torch.set_rng_state(state["torch"].cpu())  # (a checkpoint loaded with map_location moved it)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_TEMPORARY_SUFFIX = ".tmp"


def remove_write_leftovers(path: str | Path) -> None:
    """Remove the temporary files of :func:`atomic_write` for ``path`` that a killed writer left (a kill
    between the write and the rename cannot remove its own). Only for a caller that knows no other
    process is writing ``path`` now (e.g. one holding the run's claim)."""
    path = Path(path)
    for leftover in path.parent.glob(f".{path.name}.*{_TEMPORARY_SUFFIX}"):
        leftover.unlink(missing_ok=True)


def atomic_write(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a kill leaves either the old file or the new one, never half.

    The bytes go to a temporary file of a name no other process uses (two writers of one path never
    write into the same temporary file), are flushed to the disk, then renamed over ``path`` (atomic
    on POSIX and Windows); a failed write removes its temporary file and leaves ``path`` as it was."""
    import tempfile

    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=_TEMPORARY_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            with contextlib.suppress(OSError, AttributeError):  # mkstemp's 0600 -> the old file's mode or the umask's
                os.fchmod(f.fileno(), path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_umask())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if hasattr(os, "O_DIRECTORY"):  # the rename itself survives a power cut once the folder is synced
        with contextlib.suppress(OSError):
            dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


CHECKPOINT_KEYS = ("model", "optimizer", "rng", "state")


def set_aside(path: Path) -> Path:
    """Rename a damaged file (or a folder where a file belongs) ``<name>.damaged`` -- ``<name>.damaged.1``,
    ... when that is taken, so an earlier one is never overwritten -- and return the new path."""
    aside = path.with_name(path.name + ".damaged")
    n = 0
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.damaged.{n}")
    os.replace(path, aside)
    return aside


def _load_checkpoint(path: Path, device) -> dict | None:
    """The checkpoint at ``path``, or None when it cannot be used: a truncated, empty, garbled or
    foreign file is then renamed ``<name>.damaged`` (kept, not deleted), with a warning, and the run
    starts from its beginning, its last good state (checkpoints are written atomically, so a damaged
    one was damaged after it was written)."""
    problem = None
    try:
        saved = torch.load(path, map_location=device, weights_only=False)
    except Exception as error:  # noqa: BLE001 -- any unreadable file
        problem = f"cannot be read ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
    else:
        if not isinstance(saved, dict) or any(key not in saved for key in CHECKPOINT_KEYS) or \
                not isinstance(saved["state"], dict) or "history" not in saved["state"]:
            problem = f"is not a checkpoint of minimoe.train.train (it needs the keys {CHECKPOINT_KEYS} and a history)"
    if problem is None:
        return saved
    aside = set_aside(path)
    warnings.warn(f"checkpoint {path} {problem}: set aside as {aside.name}; the run starts from step 0",
                  RuntimeWarning, stacklevel=3)
    return None


def train(
    model: torch.nn.Module,
    get_batch: Callable[[int], tuple],
    loss_fn: Callable,
    *,
    steps: int,
    lr: float | Callable[[int], float] = 3e-3,
    weight_decay: float = 0.01,
    eval_fn: Callable[[torch.nn.Module], dict] | None = None,
    eval_every: int = 100,
    device: str | torch.device | None = None,
    seed: int | None = 0,
    grad_clip: float | None = 1.0,
    progress: bool = True,
    desc: str = "train",
    leave: bool = True,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 50,
    checkpoint_seconds: float = 120.0,
    stats_from: int = 0,
    baseline_momentum: float = 0.9,
    stop: Callable[[dict], bool] | None = None,
    ema_decay: float | None = None,
) -> dict:
    """Train ``model`` for ``steps`` AdamW steps: the one training loop of the notebooks and the study.

    ``get_batch(step)`` returns ``(inputs, targets)`` (moved to the device here). ``loss_fn(model(inputs),
    targets)`` returns the task loss: a scalar, or one loss per token or per example (then the task
    loss is their mean). The objective is the task loss, plus ``model.aux_loss()`` (the routers'
    auxiliary losses, already weighted) when the model has it, plus the routers' extra training
    losses (the router protocol's ``extra_loss``, e.g. Kool's REINFORCE term; a router that needs
    per-token losses gets them when ``loss_fn`` returns them, else the batch loss for every token),
    which see ``baseline``, the moving average of the earlier steps' task losses (momentum
    ``baseline_momentum``: step 0 sees 0, step t+1 the average up to step t). ``eval_fn(model)``
    (run under ``torch.no_grad`` in eval mode every ``eval_every`` steps and at the end; 0: at the
    end only) returns a dict of metrics; ``stop(row)``, called with each evaluation row before the
    last, may end the run early by returning True.

    ``ema_decay`` ``beta`` in (0, 1): also keep an exponential moving average of the weights,
    ``ema <- beta * ema + (1 - beta) * w`` after every step, started at the initial weights (Polyak
    averaging, as small-LM training scripts keep it for evaluation). Each evaluation then runs
    ``eval_fn`` twice, on the weights and on their average, and the average's metrics enter the row
    as ``ema/<metric>``. Buffers are not averaged. None (default): no average.

    ``lr`` is a number > 0 or a schedule ``step -> lr >= 0`` (e.g. :func:`warmup_cosine`). ``seed`` seeds
    every generator first (``None``: leave them as they are, for a caller that seeded before building
    the model). ``checkpoint``: a file to resume from when it exists, and to write every
    ``checkpoint_every`` steps and at least every ``checkpoint_seconds`` (model, optimiser,
    generators and history; written atomically, so a killed run resumes from the last one and
    computes what an uninterrupted run would). A non-finite task loss stops the run with
    ``FloatingPointError``.

    Returns a history ``{"train": [row, ...], "eval": [row, ...], "seconds": float, "train_seconds":
    float, "device": str}``; each training row is a dict with ``step``, ``loss`` and ``aux_loss``, and
    from step ``stats_from`` on every MoE layer's routing stats (``moe{i}/drop_rate``, ``moe{i}/load_cv``,
    ..., and ``moe{i}/load``: each expert's share of the dispatched (token, expert) pairs).
    ``seconds`` is the wall time of this call and the earlier ones it resumed (training and evaluation),
    ``train_seconds`` that of the training steps alone.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for fn, fn_name in ((get_batch, "get_batch"), (loss_fn, "loss_fn")):
        if not callable(fn):
            raise TypeError(f"{fn_name} must be callable, got {fn!r}")
    for fn, fn_name in ((eval_fn, "eval_fn"), (stop, "stop")):
        if fn is not None and not callable(fn):
            raise TypeError(f"{fn_name} must be callable or None, got {fn!r}")
    if stop is not None and (eval_fn is None or not eval_every):
        raise ValueError("stop is called with each evaluation row: it needs an eval_fn and eval_every >= 1")
    steps = check_int(steps, "steps", low=1)
    schedule = lr if callable(lr) else None
    # a constant rate must be > 0 (0 would train nothing); a schedule may pass through 0 (a warm-up
    # from 0, a decay to 0 at the last step), and AdamW then leaves the weights as they are
    lr = check_nonnegative_float(schedule(0), "lr (the schedule's value at step 0)") if schedule else \
        check_positive_float(lr, "lr")
    weight_decay = check_nonnegative_float(weight_decay, "weight_decay")
    eval_every = check_int(eval_every, "eval_every", low=0)
    grad_clip = check_float(grad_clip, "grad_clip (the largest gradient norm; None: no clipping)", low=0.0,
                            low_open=True, allow_none=True)
    progress, leave = check_bool(progress, "progress"), check_bool(leave, "leave")
    if not isinstance(desc, str):
        raise TypeError(f"desc must be a string, got {desc!r}")
    checkpoint_every = check_int(checkpoint_every, "checkpoint_every", low=1)
    checkpoint_seconds = check_positive_float(checkpoint_seconds, "checkpoint_seconds")
    stats_from = check_int(stats_from, "stats_from", low=0)
    baseline_momentum = check_float(baseline_momentum, "baseline_momentum", low=0.0, high=1.0)
    ema_decay = check_float(ema_decay, "ema_decay (the weight average's decay; None: no average)", low=0.0,
                            high=1.0, low_open=True, high_open=True, allow_none=True)
    if ema_decay is not None and eval_fn is None:
        raise ValueError("ema_decay keeps a weight average for evaluation: it needs an eval_fn")
    if checkpoint is not None and not isinstance(checkpoint, (str, Path)):
        raise TypeError(f"checkpoint must be a file path or None, got {checkpoint!r}")
    checkpoint = Path(checkpoint) if checkpoint is not None else None
    if checkpoint is not None:
        if checkpoint.is_dir():
            raise ValueError(f"checkpoint={str(checkpoint)!r} is a folder; give a file path in it, e.g. "
                             f"{str(checkpoint / 'run.pt')!r}")
        # made now, not at the first save: a missing folder must not cost the steps trained before it
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("model has no trainable parameters (requires_grad=True): there is nothing to train")
    if seed is not None:
        seed_everything(seed)
    device = pick_device(device)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                                  foreach=adamw_foreach(device))
    history = {"train": [], "eval": [], "device": str(device), "seconds": 0.0, "train_seconds": 0.0}
    state = {"step": 0, "baseline": 0.0, "history": history}
    params = [p for p in model.parameters() if p.requires_grad]
    if ema_decay is not None:
        state["ema"] = [p.detach().clone() for p in params]
    saved = _load_checkpoint(checkpoint, device) if checkpoint is not None and checkpoint.exists() else None
    if saved is not None:
        # every check before anything is loaded, and the model put back if its state does not fit:
        # a refused checkpoint leaves the model as the caller gave it
        if (ema_decay is not None) != ("ema" in saved["state"]):
            raise ValueError(f"checkpoint {checkpoint} was written {'without' if ema_decay is not None else 'with'} "
                             "a weight average (ema_decay): resume it with the ema_decay it was started with")
        if saved["state"]["step"] > steps:
            raise ValueError(f"checkpoint {checkpoint} is at step {saved['state']['step']}, past the {steps} steps "
                             f"asked for: its metrics would not be those of {steps} steps")
        # (kept on the host: a copy of the weights on the device could be what does not fit there)
        before = {name: value.detach().to("cpu", copy=True) for name, value in model.state_dict().items()}
        generators_before = rng_state()
        try:
            model.load_state_dict(saved["model"])  # (a strict load that fails has copied the keys that fit)
            optimizer.load_state_dict(saved["optimizer"])
            set_rng_state(saved["rng"])
        except (RuntimeError, ValueError, KeyError, TypeError) as error:
            model.load_state_dict(before)
            set_rng_state(generators_before)
            raise ValueError(f"checkpoint {checkpoint} holds the state of a different model or optimiser than this "
                             f"one ({str(error).strip().splitlines()[0][:200]}); it is kept as it is: delete or move "
                             "it to start afresh, or give this run another checkpoint path") from None
        for group in optimizer.param_groups:  # a checkpoint saved on another device brings back its foreach
            group["foreach"] = adamw_foreach(device)
        state = saved["state"]
        history = state["history"]
        history["device"] = str(device)

    def save():
        if checkpoint is not None:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng_state(),
                        "state": state}, buffer)
            atomic_write(checkpoint, buffer.getvalue())

    def evaluate(step):
        t0 = time.perf_counter()
        model.eval()
        with torch.no_grad():
            metrics = eval_fn(model)
        if not isinstance(metrics, dict):
            raise TypeError(f"eval_fn must return a dict of metrics, got {type(metrics).__name__}")
        row = {"step": step, **metrics}
        if ema_decay is not None:  # the same evaluation on the averaged weights, then the weights back
            current = [p.detach().clone() for p in params]
            try:
                with torch.no_grad():
                    torch._foreach_copy_(params, state["ema"])
                    averaged = eval_fn(model)
            finally:  # the trained weights come back even when eval_fn raises
                with torch.no_grad():
                    torch._foreach_copy_(params, current)
            if not isinstance(averaged, dict):
                raise TypeError(f"eval_fn must return a dict of metrics, got {type(averaged).__name__} "
                                "(on the averaged weights)")
            row.update({f"ema/{key}": value for key, value in averaged.items()})
        model.train()
        history["eval"].append(row)
        history["seconds"] += time.perf_counter() - t0
        return row

    bar = progress_bar(range(state["step"], steps), desc=desc or "train", enabled=progress, leave=leave,
                       initial=state["step"], total=steps)
    model.train()
    last_save = time.perf_counter()
    for step in bar:
        t0 = time.perf_counter()
        if schedule is not None:
            # every step's value is checked: a schedule that goes negative or NaN later would otherwise
            # climb the loss, or fill the weights with NaN, without a word
            step_lr = check_nonnegative_float(schedule(step), f"lr (the schedule's value at step {step})")
            for group in optimizer.param_groups:
                group["lr"] = step_lr
        inputs, targets = _batch(get_batch(step), device)
        per_token = loss_fn(model(inputs), targets)
        if not isinstance(per_token, torch.Tensor) or not per_token.is_floating_point() or per_token.numel() == 0:
            raise TypeError("loss_fn must return a floating-point tensor: a scalar (e.g. a mean over the batch) or "
                            f"one loss per token or per example, got {_describe(per_token)}")
        task_loss = per_token if per_token.dim() == 0 else per_token.mean()
        aux = model.aux_loss().to(device) if hasattr(model, "aux_loss") else torch.zeros((), device=device)
        objective = task_loss + aux
        extra = router_losses(model, per_token, baseline=state["baseline"])
        if extra is not None:
            objective = objective + extra
        optimizer.zero_grad(set_to_none=True)
        objective.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        if ema_decay is not None:
            with torch.no_grad():
                torch._foreach_lerp_(state["ema"], [p.detach() for p in params], 1.0 - ema_decay)
        loss_value = task_loss.item()
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"{desc}: the training loss is {loss_value} at step {step}")
        # the baseline of step t+1 uses batches <= t only, so a REINFORCE term that uses it stays unbiased
        state["baseline"] = (loss_value if step == 0 else
                             baseline_momentum * state["baseline"] + (1 - baseline_momentum) * loss_value)
        row = {"step": step, "loss": loss_value, "aux_loss": float(aux.detach())}
        if step >= stats_from:
            row.update(_moe_stats(model))
        history["train"].append(row)
        elapsed = time.perf_counter() - t0
        history["train_seconds"] += elapsed
        history["seconds"] += elapsed
        state["step"] = step + 1
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss_value:.3f}")
        if eval_fn is not None and eval_every and state["step"] % eval_every == 0 and state["step"] < steps:
            row = evaluate(state["step"])
            if stop is not None and stop(row):
                break
        if state["step"] < steps and (state["step"] % checkpoint_every == 0
                                      or time.perf_counter() - last_save > checkpoint_seconds):
            save()
            last_save = time.perf_counter()
    if eval_fn is not None and not (history["eval"] and history["eval"][-1]["step"] == state["step"]):
        evaluate(state["step"])  # (a run stopped early was just evaluated at its last step)
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
