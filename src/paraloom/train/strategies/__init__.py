"""The strategies: their registry, the one place a run's strategy is picked (`rules.strategy_for` decides
which); the base class in base.py, one module per strategy beside it.

The module that implements each name is its entry's in `paraloom.config.choices.STRATEGY_ENTRIES`;
importing this package imports those, whose `@register_strategy` classes (base.py) fill the registry."""

from __future__ import annotations

import importlib

import torch

from paraloom.config import Config
from paraloom.config.choices import STRATEGY_ENTRIES
from paraloom.data import DataSets
from paraloom.trace import Timeline
from paraloom.train.strategies.base import REGISTERED, Strategy

for _module in sorted({entry.module for entry in STRATEGY_ENTRIES.values()}):
    importlib.import_module(f"paraloom.train.strategies.{_module}")
STRATEGIES: dict[str, type[Strategy]] = {name: REGISTERED[name] for name in STRATEGY_ENTRIES}


def make_strategy(cfg: Config, data: DataSets, *, device: torch.device,
                  timeline: Timeline | None) -> Strategy:
    """The strategy the config asks for (parallel.mode, tp, pp, shard), placed on this rank."""
    name = cfg.strategy
    return STRATEGIES[name](cfg, data, device=device, timeline=timeline)
