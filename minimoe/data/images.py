"""A small image classification task drawn procedurally: no download, any size, any seed.

Each image is one of eight shapes at a random position, size, brightness and rotation-free pose,
on a noisy background. Big enough to need a few layers, small enough to train on a laptop CPU.
"""
from __future__ import annotations

import torch

SHAPE_CLASSES = ("disk", "ring", "square", "frame", "cross", "plus", "h-bar", "v-bar")


def make_shapes(n: int, size: int = 16, *, noise: float = 0.15, seed: int = 0, size_classes: bool = False):
    """Images ``(n, 1, size, size)`` in [0, 1] and labels ``(n,)`` indexing :data:`SHAPE_CLASSES`.

    With ``size_classes=True`` there are 16 classes: label ``shape + 8 * large``, where a small shape
    has half-width 0.16-0.22 of the image and a large one 0.26-0.32 (a gap between them, so the label
    is a function of the image up to noise)."""
    if n < 1 or size < 8:
        raise ValueError(f"need n >= 1 and size >= 8, got n={n}, size={size}")
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(SHAPE_CLASSES), (n,), generator=gen)
    radius = (0.18 + 0.12 * torch.rand(n, generator=gen)) * size  # half-width of the shape
    if size_classes:
        large = torch.randint(0, 2, (n,), generator=gen)
        radius = (0.16 + 0.10 * large + 0.06 * torch.rand(n, generator=gen)) * size
    centre = size / 2 + (torch.rand(n, 2, generator=gen) - 0.5) * (size - 2 * radius[:, None]) * 0.8
    brightness = 0.6 + 0.4 * torch.rand(n, generator=gen)
    coords = torch.arange(size, dtype=torch.float32) + 0.5
    dy = (coords.view(1, size, 1) - centre[:, 0].view(n, 1, 1)) / radius.view(n, 1, 1)
    dx = (coords.view(1, 1, size) - centre[:, 1].view(n, 1, 1)) / radius.view(n, 1, 1)
    r = torch.sqrt(dx**2 + dy**2)
    box = torch.maximum(dx.abs(), dy.abs())
    thin = 0.35
    masks = torch.stack([
        r <= 1.0,  # disk
        (r <= 1.0) & (r >= 0.6),  # ring
        box <= 1.0,  # square
        (box <= 1.0) & (box >= 0.6),  # frame
        ((dx - dy).abs() <= thin * 1.4) & (box <= 1.0) | ((dx + dy).abs() <= thin * 1.4) & (box <= 1.0),  # cross
        ((dx.abs() <= thin) | (dy.abs() <= thin)) & (box <= 1.0),  # plus
        (dy.abs() <= thin) & (dx.abs() <= 1.0),  # horizontal bar
        (dx.abs() <= thin) & (dy.abs() <= 1.0),  # vertical bar
    ], dim=1)  # (n, 8, size, size)
    shape = masks[torch.arange(n), labels].float()
    images = shape * brightness.view(n, 1, 1) + noise * torch.randn(n, size, size, generator=gen)
    if size_classes:
        labels = labels + len(SHAPE_CLASSES) * large
    return images.clamp(0, 1).unsqueeze(1), labels
