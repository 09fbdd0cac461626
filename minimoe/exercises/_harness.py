"""The shared machinery of the exercise checkers."""
from __future__ import annotations

from typing import Callable, Iterable

import torch


class CheckFailed(AssertionError):
    pass


def run_checks(name: str, cases: Iterable[tuple[str, Callable[[], None]]], verbose: bool = True) -> bool:
    """Run ``(description, check)`` pairs; a check raises ``CheckFailed`` (or any error) to fail.

    Prints one line per case family and stops at the first failure with its explanation.
    """
    passed = 0
    for description, check in cases:
        try:
            check()
        except CheckFailed as err:
            if verbose:
                print(f"FAIL  {name}: {description}\n      {err}")
            return False
        except Exception as err:  # the student's code crashed: say where
            if verbose:
                print(f"FAIL  {name}: {description}\n      raised {type(err).__name__}: {err}")
            return False
        passed += 1
    if verbose:
        print(f"PASS  {name}: all {passed} cases agree with the reference")
    return True


def assert_close(got, want: torch.Tensor, what: str, atol: float = 1e-9) -> None:
    """Raise ``CheckFailed`` (saying ``what`` was compared) unless ``got`` has ``want``'s shape and values."""
    got = torch.as_tensor(got, dtype=want.dtype)
    if got.shape != want.shape:
        raise CheckFailed(f"{what}: expected shape {tuple(want.shape)}, got {tuple(got.shape)}")
    if not torch.allclose(got, want, atol=atol, rtol=1e-7):
        raise CheckFailed(f"{what}: expected\n{want}\ngot\n{got}")


def checker(fn):
    """Decorator of every public checker: the student's function must be callable, and the checker's own
    options (``seed``, ``n_random``, ``draws``, ``verbose``) are checked before any case runs, so a typo
    there gets a clear error instead of a confusing FAIL."""
    import functools

    from ..ops._checks import check_bool, check_int

    lows = {"seed": 0, "n_random": 0, "draws": 100}

    @functools.wraps(fn)
    def wrapper(student_fn, **options):
        if not callable(student_fn):
            raise TypeError(f"{fn.__name__} takes your function as its first argument, got {student_fn!r} "
                            f"({type(student_fn).__name__}), which cannot be called")
        for name, low in lows.items():
            if name in options:
                check_int(options[name], name, low=low)
        if "verbose" in options:
            check_bool(options["verbose"], "verbose")
        return fn(student_fn, **options)

    return wrapper
