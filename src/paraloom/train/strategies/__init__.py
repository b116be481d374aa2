"""The strategies: their registry, the one place a run's strategy is picked (`rules.strategy_for` decides
which); the base class in base.py, one module per strategy beside it."""

from __future__ import annotations

import torch

from paraloom.config import Config
from paraloom.config.rules import strategy_for
from paraloom.data import DataSets
from paraloom.trace import Timeline
from paraloom.train.strategies.base import Strategy
from paraloom.train.strategies.data_parallel import DataParallelStrategy
from paraloom.train.strategies.model_parallel import ModelParallelStrategy
from paraloom.train.strategies.parameter_server import ParameterServerStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    "data_parallel": DataParallelStrategy,
    "model_parallel": ModelParallelStrategy,
    "parameter_server": ParameterServerStrategy,
}


def make_strategy(cfg: Config, data: DataSets, *, device: torch.device,
                  timeline: Timeline | None) -> Strategy:
    """The strategy the config asks for (parallel.mode, tp, pp), placed on this rank."""
    name = strategy_for(mode=cfg.parallel.mode, tp=cfg.parallel.tp, pp=cfg.parallel.pp)
    return STRATEGIES[name](cfg, data, device=device, timeline=timeline)
