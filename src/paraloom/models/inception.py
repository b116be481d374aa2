"""GoogLeNet (Szegedy et al. 2015) and Inception-v3 (Szegedy et al. 2016) as sequences of pieces.

Built as torchvision builds them, without the auxiliary classifiers (their losses are for training
the original ImageNet recipe, and paraloom trains one output): each convolution is bias-free with a
batch norm (eps 0.001) and a ReLU after it. At 1000 classes that is torchvision's 6,624,904
parameters for GoogLeNet (its `aux_logits=False`; its 3x3 convolution in the "5x5" branch kept) and
23,834,568 for Inception-v3 (its 27,161,264 less the auxiliary head's 3,326,696). Each inception
block is one piece, so a pipeline may cut between any two. No dropout: runs are deterministic.
"""

from __future__ import annotations

import torch
from torch import nn

from paraloom.config.errors import UserError


def conv(cin: int, cout: int, kernel: int | tuple[int, int], stride: int = 1,
         padding: int | tuple[int, int] = 0) -> nn.Sequential:
    """A bias-free convolution, batch norm and ReLU (torchvision's BasicConv2d)."""
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, padding, bias=False),
                         nn.BatchNorm2d(cout, eps=0.001), nn.ReLU())


class Branches(nn.Module):
    """Branches run on the same input, their outputs concatenated along the channels."""

    def __init__(self, *branches: nn.Module) -> None:
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([branch(x) for branch in self.branches], 1)


class Split(nn.Module):
    """One stem, then two convolutions on its output side by side, concatenated (Inception-v3's
    E blocks: 1x3 beside 3x1)."""

    def __init__(self, stem: nn.Module, left: nn.Module, right: nn.Module) -> None:
        super().__init__()
        self.stem, self.left, self.right = stem, left, right

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        return torch.cat([self.left(y), self.right(y)], 1)


def _check(name: str, input_shape: tuple[int, ...], smallest: int) -> tuple[int, int, int]:
    if len(input_shape) != 3 or min(input_shape[1:]) < smallest:
        raise UserError(f"the {name} needs images shaped (channels, height, width) of at least "
                        f"{smallest}x{smallest}, got {input_shape}")
    return input_shape


def _head(channels: int, n_classes: int) -> nn.Sequential:
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, n_classes))


def googlenet_block(cin: int, c1: int, c3r: int, c3: int, c5r: int, c5: int, pool: int) -> Branches:
    return Branches(conv(cin, c1, 1),
                    nn.Sequential(conv(cin, c3r, 1), conv(c3r, c3, 3, padding=1)),
                    nn.Sequential(conv(cin, c5r, 1), conv(c5r, c5, 3, padding=1)),  # 3x3, as torchvision
                    nn.Sequential(nn.MaxPool2d(3, 1, 1, ceil_mode=True), conv(cin, pool, 1)))


class GoogLeNet(nn.Sequential):
    """`GoogLeNet((C, H, W), n_classes)`: logits (B, n_classes); images of 32x32 and more."""

    def __init__(self, input_shape: tuple[int, ...], n_classes: int, **_: object) -> None:
        c, _, _ = _check("googlenet", input_shape, 32)
        pool = lambda: nn.MaxPool2d(3, 2, ceil_mode=True)  # noqa: E731
        super().__init__(
            nn.Sequential(conv(c, 64, 7, 2, 3), pool(), conv(64, 64, 1), conv(64, 192, 3, padding=1), pool()),
            googlenet_block(192, 64, 96, 128, 16, 32, 32),
            nn.Sequential(googlenet_block(256, 128, 128, 192, 32, 96, 64), pool()),
            googlenet_block(480, 192, 96, 208, 16, 48, 64),
            googlenet_block(512, 160, 112, 224, 24, 64, 64),
            googlenet_block(512, 128, 128, 256, 24, 64, 64),
            googlenet_block(512, 112, 144, 288, 32, 64, 64),
            nn.Sequential(googlenet_block(528, 256, 160, 320, 32, 128, 128),
                          nn.MaxPool2d(2, 2, ceil_mode=True)),
            googlenet_block(832, 256, 160, 320, 32, 128, 128),
            googlenet_block(832, 384, 192, 384, 48, 128, 128),
            _head(1024, n_classes),
        )


def _avg_pool_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.AvgPool2d(3, 1, 1), conv(cin, cout, 1))


def inception_a(cin: int, pool: int) -> Branches:
    return Branches(conv(cin, 64, 1),
                    nn.Sequential(conv(cin, 48, 1), conv(48, 64, 5, padding=2)),
                    nn.Sequential(conv(cin, 64, 1), conv(64, 96, 3, padding=1), conv(96, 96, 3, padding=1)),
                    _avg_pool_conv(cin, pool))


def inception_b(cin: int) -> Branches:
    return Branches(conv(cin, 384, 3, 2),
                    nn.Sequential(conv(cin, 64, 1), conv(64, 96, 3, padding=1), conv(96, 96, 3, 2)),
                    nn.MaxPool2d(3, 2))


def inception_c(cin: int, c7: int) -> Branches:
    row, col = ((1, 7), (0, 3)), ((7, 1), (3, 0))  # (kernel, padding) of a 1x7 and a 7x1 convolution
    return Branches(conv(cin, 192, 1),
                    nn.Sequential(conv(cin, c7, 1), conv(c7, c7, row[0], padding=row[1]),
                                  conv(c7, 192, col[0], padding=col[1])),
                    nn.Sequential(conv(cin, c7, 1), conv(c7, c7, col[0], padding=col[1]),
                                  conv(c7, c7, row[0], padding=row[1]), conv(c7, c7, col[0], padding=col[1]),
                                  conv(c7, 192, row[0], padding=row[1])),
                    _avg_pool_conv(cin, 192))


def inception_d(cin: int) -> Branches:
    return Branches(nn.Sequential(conv(cin, 192, 1), conv(192, 320, 3, 2)),
                    nn.Sequential(conv(cin, 192, 1), conv(192, 192, (1, 7), padding=(0, 3)),
                                  conv(192, 192, (7, 1), padding=(3, 0)), conv(192, 192, 3, 2)),
                    nn.MaxPool2d(3, 2))


def inception_e(cin: int) -> Branches:
    def pair(c: int) -> tuple[nn.Module, nn.Module]:
        return conv(c, 384, (1, 3), padding=(0, 1)), conv(c, 384, (3, 1), padding=(1, 0))

    return Branches(conv(cin, 320, 1),
                    Split(conv(cin, 384, 1), *pair(384)),
                    Split(nn.Sequential(conv(cin, 448, 1), conv(448, 384, 3, padding=1)), *pair(384)),
                    _avg_pool_conv(cin, 192))


class InceptionV3(nn.Sequential):
    """`InceptionV3((C, H, W), n_classes)`: logits (B, n_classes); images of 75x75 and more (299x299
    as published)."""

    def __init__(self, input_shape: tuple[int, ...], n_classes: int, **_: object) -> None:
        c, _, _ = _check("inception_v3", input_shape, 75)
        super().__init__(
            nn.Sequential(conv(c, 32, 3, 2), conv(32, 32, 3), conv(32, 64, 3, padding=1), nn.MaxPool2d(3, 2),
                          conv(64, 80, 1), conv(80, 192, 3), nn.MaxPool2d(3, 2)),
            inception_a(192, 32), inception_a(256, 64), inception_a(288, 64),
            inception_b(288),
            inception_c(768, 128), inception_c(768, 160), inception_c(768, 160), inception_c(768, 192),
            inception_d(768),
            inception_e(1280), inception_e(2048),
            _head(2048, n_classes),
        )


__all__ = ["GoogLeNet", "InceptionV3"]
