"""The scikit-learn digits set (1,797 real 8x8 handwritten digits, bundled with the package)."""

from __future__ import annotations

import numpy as np
import torch

from paraloom.data.split import Split


def load_digits(*, test_fraction: float = 0.2, split_seed: int = 0, **_: object) -> Split:
    """Images scaled to [0, 1], shaped (1, 8, 8); a stratified split fixed by `split_seed`."""
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    x, y = sk_load_digits(return_X_y=True)
    x = (x.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=split_seed, stratify=y)
    as_x, as_y = torch.from_numpy, lambda a: torch.from_numpy(a.astype(np.int64))
    return Split(as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te), n_classes=10)
