"""Argument checks shared by every public entry of the package (ops, routers, the layer, the models,
``train`` and the experiments): a bad input becomes a ``ValueError``/``TypeError`` that names the
argument, shows the value received and says what is allowed, instead of a NaN, a silently wrong
result, or an error from deep inside torch.

Conventions: ``check_*`` returns the value converted to its canonical type (``int``, ``float``,
``bool``) so callers store what was checked; ``None`` is accepted only where ``allow_none=True``.
"""
from __future__ import annotations

import math
import numbers

import torch


def _show(value) -> str:
    """The value as an error message shows it: its repr, cut short, and its type when not obvious."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    if isinstance(value, (bool, int, float, str)) or value is None:
        return text
    return f"{text} ({type(value).__name__})"


def check_int(value, name: str, low: int | None = None, high: int | None = None, *,
              allow_none: bool = False) -> int | None:
    """An integer in [low, high] (either bound may be None). Booleans and floats are refused, even
    ``2.0``: a count given as a float is usually a bug upstream (``T / E`` instead of ``T // E``)."""
    if value is None and allow_none:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype != torch.bool and value.device.type != "meta":
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        extra = " or None" if allow_none else ""
        raise TypeError(f"{name} must be an int{extra}, got {_show(value)}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value


def check_float(value, name: str, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False, allow_none: bool = False) -> float | None:
    """A finite real number in the interval given by ``low``/``high`` (open ends with ``*_open``).
    NaN and infinities are always refused: no option of this package means anything at inf."""
    if value is None and allow_none:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type != "meta" \
            and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        extra = " or None" if allow_none else ""
        raise TypeError(f"{name} must be a real number{extra}, got {_show(value)}")
    value = float(value)
    lo = "" if low is None else (f"> {low:g}" if low_open else f">= {low:g}")
    hi = "" if high is None else (f"< {high:g}" if high_open else f"<= {high:g}")
    allowed = " and ".join(["a finite number" + (f" {lo}" if lo else ""), *([hi] if hi else [])])
    if not math.isfinite(value):
        raise ValueError(f"{name} must be {allowed}, got {value}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name} must be {allowed}, got {value:g}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"{name} must be {allowed}, got {value:g}")
    return value


def check_positive_float(value, name: str, *, allow_none: bool = False) -> float | None:
    """A finite number > 0."""
    return check_float(value, name, low=0.0, low_open=True, allow_none=allow_none)


def check_nonnegative_float(value, name: str, *, allow_none: bool = False) -> float | None:
    """A finite number >= 0 (loss weights, noise scales, tolerances)."""
    return check_float(value, name, low=0.0, allow_none=allow_none)


def check_probability(value, name: str) -> float:
    """A number in [0, 1]."""
    return check_float(value, name, low=0.0, high=1.0)


def check_bool(value, name: str) -> bool:
    """``True`` or ``False`` (or a NumPy bool): not a string, where ``"False"`` would mean True."""
    if isinstance(value, bool):
        return value
    if type(value).__name__ == "bool_":  # numpy.bool_
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {_show(value)}")


def check_choice(value, name: str, choices) -> object:
    """One of ``choices`` (compared with ``==``; strings must match exactly, case included)."""
    choices = tuple(choices)
    for choice in choices:
        if type(value) is type(choice) and value == choice:
            return value
    shown = ", ".join(repr(c) for c in choices)
    raise ValueError(f"{name} must be one of {shown}; got {_show(value)}")


def check_generator(generator, name: str = "generator") -> torch.Generator | None:
    """A ``torch.Generator`` or None. An int is refused with the one-line fix, since torch's own
    message for it is a dump of its argument parser."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    hint = (f"; for a seed, pass torch.Generator().manual_seed({generator})"
            if isinstance(generator, numbers.Integral) and not isinstance(generator, bool) else "")
    raise TypeError(f"{name} must be a torch.Generator or None, got {_show(generator)}{hint}")


def generator_from_seed(seed, name: str = "seed") -> torch.Generator | None:
    """A CPU generator seeded with ``seed`` (an int >= 0), or None for ``seed=None``."""
    seed = check_int(seed, name, low=0, allow_none=True)
    return None if seed is None else torch.Generator().manual_seed(seed)


def randn_like(tensor: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Standard normal noise shaped like ``tensor``, drawn from ``generator`` when given (on the
    generator's device, then moved), else from torch's global generator."""
    if generator is None:
        return torch.randn_like(tensor)
    noise = torch.randn(tensor.shape, generator=generator, device=generator.device,
                        dtype=tensor.dtype if tensor.is_floating_point() else torch.float32)
    return noise.to(tensor.device)


def rand(shape, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """Uniform [0, 1) samples from ``generator`` (on its device, then moved) or the global one."""
    if generator is None:
        return torch.rand(shape, device=device)
    return torch.rand(shape, generator=generator, device=generator.device).to(device)


def check_tensor(value, name: str, *, floating: bool = True, min_dim: int = 0, max_dim: int | None = None,
                 last_dim: int | None = None, last_dim_name: str = "d_model", shape_hint: str = "") -> torch.Tensor:
    """A tensor with values (not on the meta device), floating when asked, of the given rank, whose
    last dimension is ``last_dim`` when given. Finiteness is not checked here (it costs a pass)."""
    hint = f" {shape_hint}" if shape_hint else ""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{hint}, got {_show(value)}")
    if value.device.type == "meta":
        raise ValueError(f"{name} is on the meta device: it has a shape but no values, and routing needs "
                         "values; materialise it (e.g. model.to_empty(device='cpu') then initialise) first")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
    if value.dim() < min_dim or (max_dim is not None and value.dim() > max_dim):
        raise ValueError(f"{name} must have shape{hint or ' with at least ' + str(min_dim) + ' dims'}, "
                         f"got shape {tuple(value.shape)}")
    if last_dim is not None and value.shape[-1] != last_dim:
        raise ValueError(f"{name} must have shape{hint} with {last_dim_name}={last_dim} in the last "
                         f"dimension, got shape {tuple(value.shape)}")
    return value


#: Reading a tensor's values on the host (``.item()``, ``bool(t)``, ``.tolist()``, a ``nonzero``
#: whose length is data) is free for a CPU tensor and a synchronisation for an accelerator's: the
#: host waits until the device has finished everything queued before it. Code that reads values
#: only where that is free asks :func:`reads_are_free`. The tests set this flag to run the
#: accelerator's branches on CPU tensors (tests/test_host_sync.py).
SIMULATE_ACCELERATOR = False


def autocast_on(device_type: str) -> bool:
    """Whether ``torch.autocast`` is active for ``device_type`` (``"cpu"``, ``"cuda"``, ...)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4: no device argument
        return torch.is_autocast_enabled() if device_type == "cuda" else torch.is_autocast_cpu_enabled()


def reads_are_free(tensor: torch.Tensor) -> bool:
    """Whether reading ``tensor``'s values on the host costs no synchronisation (a CPU tensor, in eager
    mode). Under ``torch.compile`` a host read breaks the graph, as on an accelerator it makes the
    host wait, so compiled code takes the accelerator's branches: checks asserted on the device,
    static shapes, no reads."""
    return tensor.device.type == "cpu" and not SIMULATE_ACCELERATOR and not torch.compiler.is_compiling()


def check_finite(value: torch.Tensor, name: str) -> torch.Tensor:
    """Raise when ``value`` has a NaN or inf entry (one fused reduction; free for empty tensors). On
    an accelerator, asserted on the device, as in :func:`check_scores`."""
    return check_scores(value, name, min_dim=0)


def check_scores(scores, name: str = "scores", min_dim: int = 2) -> torch.Tensor:
    """A floating tensor of rank >= ``min_dim`` with only finite entries.

    On an accelerator the finiteness is asserted on the device (``torch._assert_async``): the check
    does not make the host wait, and a NaN or inf still stops the program, with this message."""
    if isinstance(scores, torch.Tensor) and not reads_are_free(scores):
        _check_score_shape(scores, name, min_dim)
        if scores.numel():
            torch._assert_async(torch.isfinite(scores.detach()).all(),
                                f"{name} contains NaN or inf values; all entries must be finite")
        return scores
    score_range(scores, name, min_dim)
    return scores


def _check_score_shape(scores, name: str, min_dim: int) -> None:
    check_tensor(scores, name)
    if scores.dim() < min_dim:
        raise ValueError(
            f"{name} must have shape (..., tokens, experts) with at least {min_dim} dims, "
            f"got shape {tuple(scores.shape)}"
        )


def score_range(scores, name: str = "scores", min_dim: int = 2) -> tuple[float, float]:
    """:func:`check_scores`, returning the smallest and largest entry (0, 0 when empty)."""
    _check_score_shape(scores, name, min_dim)
    if not scores.numel():
        return 0.0, 0.0
    # min and max propagate NaN and reach +-inf: one fused reduction instead of isfinite().all()
    low, high = torch.aminmax(scores.detach())
    low, high = float(low), float(high)
    if not (math.isfinite(low) and math.isfinite(high)):
        bad = "NaN" if torch.isnan(scores).any() else "inf"
        raise ValueError(f"{name} contains {bad} values; all entries must be finite")
    return low, high


def unknown_options(cls_name: str, given, valid) -> str:
    """The message for options a router (or config) does not take: the typos and the valid names."""
    import difflib

    parts = []
    for option in given:
        close = difflib.get_close_matches(option, valid, n=1)
        parts.append(f"{option!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (f"{cls_name} got unknown option{'s' if len(parts) > 1 else ''} {', '.join(parts)}; "
            f"valid options: {', '.join(sorted(valid))}")
