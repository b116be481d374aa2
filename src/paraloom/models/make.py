"""The model a config names: a user's `package.module:factory`, or a zoo model shaped for the data."""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn

from paraloom.config import Config
from paraloom.config.errors import UserError
from paraloom.config.rules import is_factory
from paraloom.data import DataSets
from paraloom.models import MODELS, build_model
from paraloom.models.user import load_user_model
from paraloom.optim.groups import mark_no_decay


def make_model(cfg: Config, data: DataSets) -> nn.Module:
    """The model `model.*` names: a user's factory, or a zoo model shaped for `data`; the parameters
    `optim.no_decay` exempts from weight decay are marked (optim/groups.py)."""
    model = _build(cfg, data)
    mark_no_decay(model, cfg.optim.no_decay, model_name=f"model.name={cfg.model.name}")
    return model


def _build(cfg: Config, data: DataSets) -> nn.Module:
    name, options = cfg.model.name, cfg.model.options
    if is_factory(name):
        return load_user_model(name, options)
    if data.n_classes is None:
        raise UserError(f"model.name={name} needs the number of classes; give the data set's DataSets "
                        "n_classes=")
    fields = dataclasses.asdict(cfg.model)
    for key in ("name", "options", "tp_plan"):
        fields.pop(key)
    if name in MODELS:  # the zoo's constructors take (and ignore) any keyword: refuse a typo
        params = inspect.signature(MODELS[name]).parameters.values()
        takes = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
        unknown = sorted(set(options) - set(takes))
        if unknown:
            raise UserError(f"model.options {', '.join(unknown)}: model.name={name} does not take "
                            f"{'it' if len(unknown) == 1 else 'them'}; it takes: {', '.join(takes)}")
    input_shape = tuple(torch.as_tensor(data.train[0][0]).shape)  # the first training sample's
    return build_model(name, input_shape, data.n_classes, **{**fields, **options})  # options win
