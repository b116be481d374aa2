"""A user's model, `model.name=package.module:factory` with `model.options`: built and checked."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from paraloom.config.errors import UserError
from paraloom.factories import call_factory


def load_user_model(target: str, options: Mapping[str, Any] | None = None, *,
                    device: torch.device | str | None = None) -> nn.Module:
    """The `nn.Module` the factory returns, built on `device` (meta: shapes only, no memory)."""
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = call_factory("model.name", target, options, returns="a torch.nn.Module")
    if not isinstance(model, nn.Module):
        raise UserError(f"model.name={target!r} must return a torch.nn.Module, not {type(model).__name__}")
    return model

