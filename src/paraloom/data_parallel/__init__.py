"""Data parallelism: the naive all-reduce reference (engines with buckets and overlap build on it)."""

from paraloom.data_parallel.naive import DataParallelNaive

__all__ = ["DataParallelNaive"]
