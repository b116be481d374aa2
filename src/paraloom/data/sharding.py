"""Deterministic per-rank batches: every training sample once per epoch, none dropped.

Each epoch draws one seeded permutation (the same on every rank) and cuts it into global
batches of `global_batch` samples; rank r takes the r-th of `world` near-equal slices of each.
The last batch of an epoch may be short (N mod global_batch samples): its slices differ in size
by at most one and some may be empty. Every batch reports its global sample count, so a rank
weights its loss by `local_count / global_count` and the averaged gradient equals the
full-batch gradient exactly, short batch included.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class ShardedBatches:
    def __init__(self, n_samples: int, global_batch: int, *, rank: int = 0, world: int = 1,
                 seed: int = 0, shuffle: bool = True) -> None:
        if n_samples < 1 or global_batch < 1:
            raise ValueError("n_samples and global_batch must be positive")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a world of {world}")
        self.n_samples, self.global_batch = n_samples, global_batch
        self.rank, self.world, self.seed, self.shuffle = rank, world, seed, shuffle

    def __len__(self) -> int:
        return -(-self.n_samples // self.global_batch)

    def order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n_samples)
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**64)  # run.seed up to 2**63-1
        return torch.randperm(self.n_samples, generator=gen)

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, int]]:
        """Yield (this rank's sample indices, samples in the whole global batch)."""
        for batch in self.order(epoch).split(self.global_batch):
            yield batch.tensor_split(self.world)[self.rank], batch.numel()
