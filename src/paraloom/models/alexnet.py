"""AlexNet (Krizhevsky et al. 2012, the one-GPU variant torchvision builds) as a sequence of pieces.

Five convolutions (11x11 stride 4, 5x5, then three 3x3; 64, 192, 384, 256 and 256 channels) with
max-pools after the first, second and fifth, the map average pooled to 6x6, and three linear layers
(4096, 4096, classes): at 224x224 with 1000 classes, torchvision's 61.1M parameters. Small images
keep every convolution: the stem becomes 3x3 stride 1 below 64x64 and a pool that would shrink the
map below 1x1 is skipped. No dropout: runs are deterministic.
"""

from __future__ import annotations

from torch import nn

from paraloom.config.errors import UserError

POOLED_SIZE = 6  # the feature map is average pooled to at most this size, as in torchvision
LARGE_IMAGE_MIN_SIZE = 64  # images at least this high and wide get the 11x11 stride-4 stem


class AlexNet(nn.Sequential):
    """`AlexNet((C, H, W), n_classes, width=, fc_width=)`: logits (B, n_classes)."""

    def __init__(self, input_shape: tuple[int, ...], n_classes: int, *, width: int = 64,
                 fc_width: int = 4096, **_: object) -> None:
        if len(input_shape) != 3:
            raise UserError(f"the alexnet needs images shaped (channels, height, width), got {input_shape}: "
                            "use image data such as data.name=digits")
        if width < 1 or fc_width < 1:
            raise UserError(f"the alexnet width={width} and fc_width={fc_width} must be positive")
        c, h, w = input_shape
        large = min(h, w) >= LARGE_IMAGE_MIN_SIZE
        channels = [c, *(k * width // 64 for k in (64, 192, 384, 256, 256))]
        kernels = [(11, 4, 2) if large else (3, 1, 1), (5, 1, 2), (3, 1, 1), (3, 1, 1), (3, 1, 1)]
        pieces: list[nn.Sequential] = []
        for i, (kernel, stride, padding) in enumerate(kernels):
            piece = nn.Sequential(nn.Conv2d(channels[i], channels[i + 1], kernel, stride, padding), nn.ReLU())
            h, w = (h + 2 * padding - kernel) // stride + 1, (w + 2 * padding - kernel) // stride + 1
            if i in (0, 1, 4) and h >= 3 and w >= 3:  # 3x3 stride-2 pools; none below a 1x1 map
                piece.append(nn.MaxPool2d(3, stride=2))
                h, w = (h - 3) // 2 + 1, (w - 3) // 2 + 1
            pieces.append(piece)
        ph, pw = min(h, POOLED_SIZE), min(w, POOLED_SIZE)
        pieces += [
            nn.Sequential(nn.AdaptiveAvgPool2d((ph, pw)), nn.Flatten(),
                          nn.Linear(channels[-1] * ph * pw, fc_width), nn.ReLU()),
            nn.Sequential(nn.Linear(fc_width, fc_width), nn.ReLU()),
            nn.Sequential(nn.Linear(fc_width, n_classes)),
        ]
        super().__init__(*pieces)


__all__ = ["AlexNet"]
