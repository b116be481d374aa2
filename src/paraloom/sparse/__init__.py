"""Sparse training: magnitude pruning on a one-shot or gradual (cubic) schedule, same masks on every rank."""

from paraloom.sparse.pruning import MagnitudePruner, default_targets
from paraloom.sparse.sparsity_schedule import SparsitySchedule, cubic_sparsity, is_prune_step

__all__ = ["MagnitudePruner", "SparsitySchedule", "cubic_sparsity", "default_targets", "is_prune_step"]
