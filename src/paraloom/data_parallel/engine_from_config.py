"""The data-parallel engine a run's `comm.*` asks for, over a rank grid's data-parallel group."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from paraloom.comm.collectives import CommStats
from paraloom.compress.dgc import dgc_options
from paraloom.config import CommConfig, OptimConfig
from paraloom.data_parallel.engine import DataParallel
from paraloom.data_parallel.naive import DataParallelNaive
from paraloom.topology import RankGroups


def make_engine(model: nn.Module, comm: CommConfig, groups: RankGroups, stats: CommStats, timeline=None,
                optim: OptimConfig | None = None,
                comm_group: dist.ProcessGroup | None = None) -> DataParallel | DataParallelNaive:
    """The engine `comm.*` asks for (`optim` sets DGC's momentum correction, see `dgc_options`)."""
    if comm.engine == "naive":
        return DataParallelNaive(model, group=groups.dp_group, algorithm=comm.algorithm, stats=stats)
    options = dgc_options(comm, optim) if optim is not None else None
    return DataParallel(model, topology=groups, comm=comm, stats=stats, timeline=timeline,
                        compressor_options=options, comm_group=comm_group)
