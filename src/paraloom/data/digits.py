"""The scikit-learn digits set: 1,797 real 8x8 handwritten digits, bundled with scikit-learn.

The bundled CSV is read directly, so a worker does not pay for importing scikit-learn
(seconds on a small machine); `sklearn.datasets.load_digits` is the fallback.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch

from paraloom.data.split import Split


def _read_bundled() -> tuple[np.ndarray, np.ndarray]:
    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    roots = spec.submodule_search_locations if spec else None
    path = Path(roots[0]) / "datasets" / "data" / "digits.csv.gz" if roots else None
    if path is not None and path.is_file():
        with gzip.open(path, "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.float32)
        return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sk_load_digits

    x, y = sk_load_digits(return_X_y=True)
    return x.astype(np.float32), y.astype(np.int64)


def stratified_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, test indices): each class split in the same proportion, order seeded."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for label in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == label))
        n_test = max(1, round(len(members) * test_fraction))
        test.append(members[:n_test])
        train.append(members[n_test:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def load_digits(*, test_fraction: float = 0.2, split_seed: int = 0, **_: object) -> Split:
    """Images scaled to [0, 1], shaped (1, 8, 8); a stratified split fixed by `split_seed`."""
    x, y = _read_bundled()
    x = torch.from_numpy(x / 16.0).reshape(-1, 1, 8, 8)
    y = torch.from_numpy(y)
    train, test = (torch.from_numpy(i) for i in stratified_split(y.numpy(), test_fraction, split_seed))
    return Split(x[train], y[train], x[test], y[test], n_classes=10)
