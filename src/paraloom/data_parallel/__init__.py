"""Data parallelism: the bucketed, overlapped engine and the naive all-reduce reference."""

from paraloom.data_parallel.engine import DataParallel
from paraloom.data_parallel.naive import DataParallelNaive

__all__ = ["DataParallel", "DataParallelNaive"]
