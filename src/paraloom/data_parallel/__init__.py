"""Data parallelism: the bucketed engine (a DDP drop-in), DistributedOptimizer, the naive reference."""

from paraloom.data_parallel.engine import DataParallel
from paraloom.data_parallel.naive import DataParallelNaive
from paraloom.data_parallel.optimizer import DistributedOptimizer

__all__ = ["DataParallel", "DataParallelNaive", "DistributedOptimizer"]
