"""CNN for small images: two 3x3 convolutions, a 2x2 max-pool, one hidden linear layer."""

from __future__ import annotations

from torch import nn

from paraloom.config.errors import UserError


class CNN(nn.Sequential):
    def __init__(self, input_shape: tuple[int, ...], n_classes: int, *, channels: int = 32,
                 hidden: int = 128, **_: object) -> None:
        if len(input_shape) != 3:
            raise UserError(f"the cnn needs images shaped (channels, height, width), got {input_shape}")
        c, h, w = input_shape
        super().__init__(
            nn.Conv2d(c, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * channels * (h // 2) * (w // 2), hidden), nn.ReLU(),
            nn.Linear(hidden, n_classes),
        )
