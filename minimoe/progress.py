"""Progress reporting that suits where the output goes.

In a terminal, a loop gets a live ``tqdm`` bar. Anywhere else (a notebook, a rendered book page, a
CI log) a live bar is hundreds of carriage-return fragments, so the loop runs silently and, when it
was asked to leave a trace (``leave=True``), prints one line at the end: what ran, how many steps,
how long, and the last postfix. ``tqdm.auto`` is not used: in a Jupyter kernel without ipywidgets
it warns (``TqdmWarning: IProgress not found``) into every page that trains something.

Used by :func:`minimoe.train.train` and :mod:`minimoe.experiments`; tested in
``tests/test_progress.py``.
"""
from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator

from tqdm.std import tqdm


def live_terminal(stream=None) -> bool:
    """True when ``stream`` (default ``sys.stderr``) is an interactive terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


class _Summary:
    """A stand-in for a tqdm bar: iterates silently, then prints one summary line if ``leave``."""

    def __init__(self, iterable: Iterable, desc: str, total: int | None, initial: int, leave: bool, file):
        self.iterable, self.desc, self.initial, self.leave, self.file = iterable, desc, initial, leave, file
        self.total = total if total is not None else _length(iterable, initial)
        self.postfix: dict = {}

    def set_postfix(self, **values) -> None:
        self.postfix = values

    def __iter__(self) -> Iterator:
        start, done = time.perf_counter(), 0
        for item in self.iterable:
            yield item
            done += 1
        if self.leave and done:
            seconds = time.perf_counter() - start
            where = f"{self.initial + done}/{self.total}" if self.total is not None else f"{done}"
            extra = "".join(f", {k}={v}" for k, v in self.postfix.items())
            print(f"{self.desc}: {where} in {seconds:.1f} s{extra}", file=self.file or sys.stdout)


def _length(iterable, initial: int) -> int | None:
    try:
        return initial + len(iterable)
    except TypeError:
        return None


def progress(iterable: Iterable, *, desc: str = "", enabled: bool = True, leave: bool = True,
             total: int | None = None, initial: int = 0, file=None):
    """``iterable`` with progress reporting: a tqdm bar in a terminal, at most one line elsewhere.

    ``enabled=False`` returns a silent wrapper (``set_postfix`` still works). ``leave=False``
    loops (inner loops) print nothing outside a terminal.
    """
    if enabled and live_terminal(file):
        return tqdm(iterable, desc=desc, leave=leave, total=total, initial=initial, file=file)
    return _Summary(iterable, desc, total, initial, leave=enabled and leave, file=file)
