"""Split: a train/test pair of in-memory tensors with the shape facts models need."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Split:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    n_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def to(self, device: torch.device | str) -> Split:
        return Split(self.x_train.to(device), self.y_train.to(device),
                     self.x_test.to(device), self.y_test.to(device), self.n_classes)
