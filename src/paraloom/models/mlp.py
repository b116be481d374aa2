"""MLP: flatten, `depth` hidden ReLU layers of width `hidden`, linear classifier."""

from __future__ import annotations

import math

from torch import nn


class MLP(nn.Sequential):
    def __init__(self, input_shape: tuple[int, ...], n_classes: int, *, hidden: int = 128,
                 depth: int = 2, **_: object) -> None:
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for _layer in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, n_classes))
        super().__init__(*layers)
