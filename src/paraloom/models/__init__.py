"""Reference models, built by name: `build_model("cnn", input_shape, n_classes, ...)`."""

from __future__ import annotations

from torch import nn

from paraloom.errors import UserError
from paraloom.models.cnn import CNN
from paraloom.models.mlp import MLP

MODELS = {"cnn": CNN, "mlp": MLP}


def build_model(name: str, input_shape: tuple[int, ...], n_classes: int, **kwargs) -> nn.Module:
    if name not in MODELS:
        raise UserError(f"model {name!r} is not known; choose one of: {', '.join(MODELS)}")
    return MODELS[name](input_shape, n_classes, **kwargs)


__all__ = ["CNN", "MLP", "MODELS", "build_model"]
