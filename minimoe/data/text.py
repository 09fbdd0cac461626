"""A character-level corpus that ships with every Python: the help topics of ``pydoc_data``.

About 700k characters of English technical prose (the Python language reference's topics),
enough for a tiny language model to learn words, indentation and punctuation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def _default_text() -> str:
    from pydoc_data.topics import topics  # standard library: always present, no download

    return "\n\n".join(topics[key] for key in sorted(topics))


@dataclass
class CharCorpus:
    """Text encoded as integer ids, with a train/validation split at ``train_fraction``."""

    text: str
    train_fraction: float = 0.9

    def __post_init__(self):
        if not self.text:
            raise ValueError("text must be a non-empty string")
        self.chars = sorted(set(self.text))
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        self.data = torch.tensor([self.stoi[ch] for ch in self.text], dtype=torch.long)
        cut = int(len(self.data) * self.train_fraction)
        self.splits = {"train": self.data[:cut], "val": self.data[cut:]}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        unknown = set(s) - set(self.stoi)
        if unknown:
            raise ValueError(f"characters not in the corpus vocabulary: {sorted(unknown)!r}")
        return torch.tensor([self.stoi[ch] for ch in s], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def batch(self, split: str, batch_size: int, block_size: int, generator: torch.Generator | None = None):
        """Random windows: inputs ``(B, L)`` and next-character targets ``(B, L)``."""
        if split not in self.splits:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        data = self.splits[split]
        if len(data) <= block_size + 1:
            raise ValueError(f"block_size={block_size} is too long for the {split} split ({len(data)} characters)")
        start = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=generator)
        offsets = torch.arange(block_size + 1)
        windows = data[start[:, None] + offsets]
        return windows[:, :-1], windows[:, 1:]


#: Standard-library modules whose source is the "code" source of :func:`mixed_sources_text`: plain
#: Python, present in every CPython, stable across releases.
CODE_MODULES = ("bisect", "heapq", "textwrap", "string", "fractions", "statistics", "difflib", "shlex", "csv",
                "calendar", "colorsys", "fnmatch", "glob", "graphlib", "numbers", "queue", "sched", "secrets")


def _code_text() -> str:
    import importlib
    import inspect

    return "\n\n".join(inspect.getsource(importlib.import_module(name)) for name in CODE_MODULES)


def mixed_sources_text(chunk: int = 2048) -> str:
    """English prose (the pydoc topics) and Python code (the source of :data:`CODE_MODULES`),
    interleaved in chunks of ``chunk`` characters in proportion to their lengths: the ``i``-th of a
    source's ``n`` chunks goes at the fraction ``(i + 1/2) / n`` of the text, so every stretch of it,
    the validation split included, holds both sources in the proportions of the whole (within a
    chunk). A language model then meets two kinds of sequence that want different experts, in
    training and in evaluation alike (book: chapter 9, the reference tasks). (Alternating one chunk
    of each would run out of code long before the end of the prose, leaving a validation split of
    prose alone.)"""
    sources = [_default_text(), _code_text()]
    pieces = [[s[i:i + chunk] for i in range(0, len(s), chunk)] for s in sources]
    placed = sorted(((i + 0.5) / len(p), k, i) for k, p in enumerate(pieces) for i in range(len(p)))
    return "".join(pieces[k][i] for _, k, i in placed)


def load_char_corpus(max_chars: int | None = None, text: str | None = None, *, source: str = "pydoc") -> CharCorpus:
    """The pydoc topics corpus (``source="pydoc"``), prose and code interleaved (``source="mixed"``,
    :func:`mixed_sources_text`) or ``text``, truncated to ``max_chars`` characters if given."""
    if source not in ("pydoc", "mixed"):
        raise ValueError(f"source must be 'pydoc' or 'mixed', got {source!r}")
    if text is None:
        text = _default_text() if source == "pydoc" else mixed_sources_text()
    if max_chars is not None:
        text = text[:max_chars]
    return CharCorpus(text)
