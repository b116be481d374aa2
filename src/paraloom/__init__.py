"""paraloom: parallel deep-learning training on PyTorch."""

from importlib import import_module
from typing import Any

from paraloom.config import Config, load_config
from paraloom.config.errors import UserError

__all__ = ["Config", "DataParallel", "DataParallelNaive", "DistributedOptimizer", "RankGroups", "Topology",
           "UserError", "load_config"]
__version__ = "0.1.0"

_LAZY = {  # names that import torch load on first use, so the CLI starts fast
    "DataParallel": "paraloom.data_parallel",
    "DataParallelNaive": "paraloom.data_parallel",
    "DistributedOptimizer": "paraloom.data_parallel",
    "RankGroups": "paraloom.topology",
    "Topology": "paraloom.topology",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'paraloom' has no attribute {name!r}")
