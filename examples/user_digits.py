"""Your own model and data set, trained by paraloom: a small convolutional net on handwritten digits.

Nothing here is registered with paraloom. A config names the two factories as module:function and
paraloom imports this file (put its folder on PYTHONPATH), calls them with `model.options` and
`data.options`, and trains what they return under any strategy:

    PYTHONPATH=examples paraloom train examples/user_digits.yaml --nproc 2
    PYTHONPATH=examples paraloom train examples/user_digits.yaml --nproc 2 --set parallel.pp=2
    PYTHONPATH=examples paraloom train examples/user_digits.yaml --set model.options.channels=32

The model is an nn.Sequential, so pipeline and layer parallelism can cut it between any two layers.
"""

import torch
from torch import nn
from torch.utils.data import Dataset

from paraloom.data import DataSets, load_digits


def make_model(channels: int = 16, hidden: int = 128, n_classes: int = 10) -> nn.Sequential:
    """8x8 grey images (B, 1, 8, 8) -> class logits (B, n_classes)."""
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        nn.Conv2d(2 * channels, 2 * channels, 3, padding=1), nn.ReLU(),
        nn.Flatten(),
        nn.Linear(2 * channels * 4 * 4, hidden), nn.ReLU(),
        nn.Linear(hidden, n_classes),
    )


class Digits(Dataset):
    """A map-style data set: sample i is (image (1, 8, 8) float32, label int64), standardised with
    the training set's mean and standard deviation."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: float, std: float) -> None:
        self.images = ((images - mean) / std).float()
        self.labels = labels.long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def make_data(test_fraction: float = 0.2, split_seed: int = 0) -> DataSets:
    """Training and test sets of scikit-learn's 1,797 digits (a stratified split fixed by split_seed)."""
    split = load_digits(test_fraction=test_fraction, split_seed=split_seed)
    mean, std = float(split.x_train.mean()), float(split.x_train.std())
    return DataSets(Digits(split.x_train, split.y_train, mean, std),
                    Digits(split.x_test, split.y_test, mean, std),
                    loss="classification", n_classes=10)
