"""Reference models, built by name: `build_model("cnn", input_shape, n_classes, ...)`."""

from __future__ import annotations

from torch import nn

from paraloom.config.errors import UserError
from paraloom.models.alexnet import AlexNet
from paraloom.models.bert import BERT
from paraloom.models.cnn import CNN
from paraloom.models.gpt import GPT
from paraloom.models.inception import GoogLeNet, InceptionV3
from paraloom.models.mlp import MLP
from paraloom.models.resnet import ResNet18, ResNet50, ResNet101, ResNet152
from paraloom.models.vgg import VGG16

MODELS = {"cnn": CNN, "mlp": MLP, "resnet18": ResNet18, "resnet50": ResNet50,
          "resnet101": ResNet101, "resnet152": ResNet152, "vgg16": VGG16, "alexnet": AlexNet,
          "googlenet": GoogLeNet, "inception_v3": InceptionV3, "gpt": GPT, "bert": BERT}


def build_model(name: str, input_shape: tuple[int, ...], n_classes: int, **kwargs) -> nn.Module:
    if name not in MODELS:
        raise UserError(f"model {name!r} is not known; choose one of: {', '.join(MODELS)}")
    return MODELS[name](input_shape, n_classes, **kwargs)


__all__ = ["BERT", "CNN", "GPT", "MLP", "MODELS", "AlexNet", "GoogLeNet", "InceptionV3", "ResNet18",
           "ResNet50", "ResNet101", "ResNet152", "VGG16", "build_model"]
