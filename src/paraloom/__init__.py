"""paraloom: parallel deep-learning training on PyTorch."""

import os
from importlib import import_module
from typing import Any

from paraloom.config import Config, load_config
from paraloom.config.errors import UserError

__all__ = ["Config", "DataParallel", "DataParallelNaive", "DistributedOptimizer", "RankGroups", "Topology",
           "UserError", "load_config"]
__version__ = "0.1.0"

if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
    # a torchrun worker: the process group its script starts next gets keys of this attempt's own in
    # the agent's store, which outlives a restart (run/agent_store.py)
    from paraloom.run.agent_store import isolate_attempts

    isolate_attempts()

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
