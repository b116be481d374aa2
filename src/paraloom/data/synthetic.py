"""A seeded synthetic classification set: Gaussian clusters, one per class, in n_features dims."""

from __future__ import annotations

import torch

from paraloom.data.split import Split


def make_synthetic(*, n_samples: int = 4096, n_features: int = 32, n_classes: int = 4,
                   test_fraction: float = 0.2, split_seed: int = 0, **_: object) -> Split:
    gen = torch.Generator().manual_seed(split_seed)
    centers = torch.randn(n_classes, n_features, generator=gen) * 1.5
    y = torch.arange(n_samples) % n_classes
    x = centers[y] + torch.randn(n_samples, n_features, generator=gen)
    order = torch.randperm(n_samples, generator=gen)
    x, y = x[order], y[order]
    n_test = max(1, round(n_samples * test_fraction))
    return Split(x[n_test:], y[n_test:], x[:n_test], y[:n_test], n_classes=n_classes)
