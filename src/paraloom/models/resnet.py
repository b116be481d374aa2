"""ResNet-18, -50, -101 and -152 (He et al. 2015, v1.5 strides), laid out as a sequence of pieces.

A `ResNet` is an `nn.Sequential` of `[stem, block, ..., block, head]` so pipeline stages are slices
of it. Images of at least 64x64 get the ImageNet stem (7x7 stride-2 convolution and a max-pool);
smaller ones (32x32, the 8x8 digits) get a 3x3 stride-1 stem and no pool, as for CIFAR. With the
ImageNet stem and 1000 classes the parameter counts match torchvision's (11.7M, 25.6M, 44.5M,
60.2M).
"""

from __future__ import annotations

import torch
from torch import nn

from paraloom.config.errors import UserError

IMAGENET_STEM_MIN_SIZE = 64  # images at least this high and wide get the 7x7 stride-2 stem


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, kernel, stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(c_out)]


def _shortcut(c_in: int, c_out: int, stride: int) -> nn.Module:
    """Identity, or a strided 1x1 convolution and batch norm where the shape changes."""
    if stride == 1 and c_in == c_out:
        return nn.Identity()
    return nn.Sequential(*_conv_bn(c_in, c_out, 1, stride))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions plus the shortcut (ResNet-18/34)."""

    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int = 1) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.branch = nn.Sequential(*_conv_bn(c_in, width, 3, stride), nn.ReLU(),
                                    *_conv_bn(width, c_out, 3))
        self.shortcut = _shortcut(c_in, c_out, stride)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.branch(x) + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, as in torchvision's v1.5), 1x1 expand by 4, plus shortcut."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int = 1) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.branch = nn.Sequential(*_conv_bn(c_in, width, 1), nn.ReLU(),
                                    *_conv_bn(width, width, 3, stride), nn.ReLU(),
                                    *_conv_bn(width, c_out, 1))
        self.shortcut = _shortcut(c_in, c_out, stride)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.branch(x) + self.shortcut(x))


class ResNet(nn.Sequential):
    """`ResNet((C, H, W), n_classes, block=, layers=, width=)`: logits (B, n_classes)."""

    name = "resnet"
    shard_units = ("BasicBlock", "Bottleneck")  # parallel.shard's units: the residual blocks

    def __init__(self, input_shape: tuple[int, ...], n_classes: int, *, block: type[nn.Module],
                 layers: tuple[int, ...], width: int = 64, **_: object) -> None:
        if len(input_shape) != 3:
            raise UserError(f"the {self.name} needs images shaped (channels, height, width), got "
                            f"{input_shape}: use image data such as data.name=digits")
        if width < 1:
            raise UserError(f"the {self.name} width must be positive, got {width}")
        c, h, w = input_shape
        if min(h, w) >= IMAGENET_STEM_MIN_SIZE:
            stem = nn.Sequential(*_conv_bn(c, width, 7, 2), nn.ReLU(),
                                 nn.MaxPool2d(3, stride=2, padding=1))
        else:
            stem = nn.Sequential(*_conv_bn(c, width, 3), nn.ReLU())
        pieces: list[nn.Module] = [stem]
        c_in = width
        for stage, n_blocks in enumerate(layers):
            stage_width = width * 2**stage
            for i in range(n_blocks):
                stride = 2 if stage > 0 and i == 0 else 1
                pieces.append(block(c_in, stage_width, stride))
                c_in = stage_width * block.expansion
        pieces.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, n_classes)))
        super().__init__(*pieces)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")


class ResNet18(ResNet):
    name = "resnet18"

    def __init__(self, input_shape: tuple[int, ...], n_classes: int, *, width: int = 64, **_: object) -> None:
        super().__init__(input_shape, n_classes, block=BasicBlock, layers=(2, 2, 2, 2), width=width)


class ResNet50(ResNet):
    name = "resnet50"

    def __init__(self, input_shape: tuple[int, ...], n_classes: int, *, width: int = 64, **_: object) -> None:
        super().__init__(input_shape, n_classes, block=Bottleneck, layers=(3, 4, 6, 3), width=width)


class ResNet101(ResNet):
    name = "resnet101"

    def __init__(self, input_shape: tuple[int, ...], n_classes: int, *, width: int = 64, **_: object) -> None:
        super().__init__(input_shape, n_classes, block=Bottleneck, layers=(3, 4, 23, 3), width=width)


class ResNet152(ResNet):
    name = "resnet152"

    def __init__(self, input_shape: tuple[int, ...], n_classes: int, *, width: int = 64, **_: object) -> None:
        super().__init__(input_shape, n_classes, block=Bottleneck, layers=(3, 8, 36, 3), width=width)


__all__ = ["BasicBlock", "Bottleneck", "ResNet", "ResNet18", "ResNet50", "ResNet101", "ResNet152"]
