"""VGG-16 (Simonyan & Zisserman 2014, configuration D: 13 convolutions, 3 linear layers) as pieces.

A `VGG16` is an `nn.Sequential` of 16 pieces (one per convolution, with its ReLU and any max-pool
after it, then three classifier pieces) so pipeline stages are slices of it. Small images keep
every convolution: a max-pool that would shrink the map below 1x1 is skipped, the map is average
pooled to at most 7x7 (torchvision's size), and the classifier is 512 wide instead of 4096 for
images under 64x64. At 224x224 with 1000 classes it has torchvision's 138.4M parameters.
No dropout: runs are deterministic.
"""

from __future__ import annotations

from torch import nn

from paraloom.config.errors import UserError

CONFIG_D = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
POOLED_SIZE = 7  # the feature map is average pooled to at most this size, as in torchvision
WIDE_CLASSIFIER_MIN_SIZE = 64  # images at least this high and wide get the 4096-wide classifier


class VGG16(nn.Sequential):
    """`VGG16((C, H, W), n_classes, width=, fc_width=, batch_norm=)`: logits (B, n_classes)."""

    shard_units = ("Sequential",)  # parallel.shard's units: each convolution stage and classifier layer

    def __init__(self, input_shape: tuple[int, ...], n_classes: int, *, width: int = 64,
                 fc_width: int | None = None, batch_norm: bool = False, **_: object) -> None:
        if len(input_shape) != 3:
            raise UserError(f"the vgg16 needs images shaped (channels, height, width), got {input_shape}: "
                            "use image data such as data.name=digits")
        if width < 1 or (fc_width is not None and fc_width < 1):
            raise UserError(f"the vgg16 width={width} and fc_width={fc_width} must be positive")
        c, h, w = input_shape
        if fc_width is None:
            fc_width = 4096 if min(h, w) >= WIDE_CLASSIFIER_MIN_SIZE else 512
        pieces: list[nn.Sequential] = []
        for item in CONFIG_D:
            if item == "M":
                if h >= 2 and w >= 2:  # a pool below 1x1 is skipped
                    pieces[-1].append(nn.MaxPool2d(2))
                    h, w = h // 2, w // 2
                continue
            c_out = int(item) * width // 64
            layers: list[nn.Module] = [nn.Conv2d(c, c_out, 3, padding=1)]
            if batch_norm:
                layers.append(nn.BatchNorm2d(c_out))
            pieces.append(nn.Sequential(*layers, nn.ReLU()))
            c = c_out
        ph, pw = min(h, POOLED_SIZE), min(w, POOLED_SIZE)
        pieces += [
            nn.Sequential(nn.AdaptiveAvgPool2d((ph, pw)), nn.Flatten(), nn.Linear(c * ph * pw, fc_width),
                          nn.ReLU()),
            nn.Sequential(nn.Linear(fc_width, fc_width), nn.ReLU()),
            nn.Sequential(nn.Linear(fc_width, n_classes)),
        ]
        super().__init__(*pieces)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)


__all__ = ["CONFIG_D", "VGG16"]
