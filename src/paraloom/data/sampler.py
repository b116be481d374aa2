"""ShardedBatchSampler: ShardedBatches' exact per-rank order as a DataLoader batch sampler."""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sized
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from paraloom.config.errors import UserError
from paraloom.data.sharding import ShardedBatches


class ShardBatch(NamedTuple):
    """One batch of this rank: its sample indices, the global batch's size, the loss scale."""

    indices: torch.Tensor
    global_count: int
    scale: float


class ShardedBatchSampler(Sampler[list[int]]):
    """Per-rank batches for `DataLoader(dataset, batch_sampler=sampler)`, in ShardedBatches' order.

    Each epoch draws one seeded permutation (the same on every rank), cuts it into global batches
    of `global_batch` samples, and rank r takes the r-th of `world` near-equal slices: every
    sample once per epoch across the ranks. The last global batch may be short and split
    unevenly; a rank whose slice is empty still yields one real sample (the global batch's first)
    so that DDP's collectives run on every rank, and its loss scale is 0.

    Multiply the SUMMED per-sample loss by the batch's scale, `world / global_count` (0 for that
    padding sample): DDP averages gradients over `world`, which gives exactly the gradient of the
    whole global batch's mean loss, short batch included::

        sampler = ShardedBatchSampler(dataset, global_batch=64)  # rank, world: torch.distributed's
        loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(loader):
                loss = F.cross_entropy(ddp(x), y, reduction="sum") * sampler.loss_scale(i)
                opt.zero_grad(); loss.backward(); opt.step()

    `set_epoch(epoch, start=k)` resumes an epoch after its first k batches, `skip=s` after its
    first s samples (a run resumed with another global batch); `loss_scale(i)`, `loss_scales()`
    and `global_counts()` count the batches this epoch yields, from there on.
    A loop that indexes tensors itself iterates `batches()`: (indices, global_count, scale).
    `drop_last=True` skips the short last global batch.
    """

    def __init__(self, dataset_or_len: Sized | int, global_batch: int, *, rank: int | None = None,
                 world: int | None = None, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False) -> None:
        super().__init__()
        try:
            n = operator.index(dataset_or_len)
        except TypeError:
            n = len(dataset_or_len)
        if n < 1:
            raise UserError(f"the data set has {n} samples; a sampler needs at least one")
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
            raise UserError(f"global_batch={global_batch!r} must be a positive whole number")
        if drop_last and n < global_batch:
            raise UserError(f"global_batch={global_batch} with drop_last=True leaves no batch of "
                            f"{n} samples; lower global_batch or set drop_last=False")
        initialized = dist.is_available() and dist.is_initialized()
        rank = (dist.get_rank() if initialized else 0) if rank is None else rank
        world = (dist.get_world_size() if initialized else 1) if world is None else world
        if world < 1 or not 0 <= rank < world:
            raise UserError(f"rank={rank} lies outside world={world}; give 0 <= rank < world")
        self.shards = ShardedBatches(n, global_batch, rank=rank, world=world, seed=seed,
                                     shuffle=shuffle)
        self.drop_last = drop_last
        self.epoch, self.skip = 0, 0  # samples of the epoch's order passed over

    @property
    def rank(self) -> int:
        return self.shards.rank

    @property
    def world(self) -> int:
        return self.shards.world

    def n_batches(self) -> int:
        """Global batches in a whole epoch, whatever `start`."""
        full, rest = divmod(self.shards.n_samples, self.shards.global_batch)
        return full + (1 if rest and not self.drop_last else 0)

    def set_epoch(self, epoch: int, start: int = 0, *, skip: int = 0) -> None:
        """Draw epoch `epoch`'s order (as DistributedSampler) and pass over its first `start` batches
        and then `skip` samples."""
        if not 0 <= start <= self.n_batches():
            raise UserError(f"start={start} lies outside the epoch's {self.n_batches()} batches")
        passed = min(start * self.shards.global_batch, self.shards.n_samples) + skip
        if skip < 0 or passed > self.shards.n_samples:
            raise UserError(f"skip={skip} after {start} batches lies outside the epoch's "
                            f"{self.shards.n_samples} samples")
        self.epoch, self.skip = epoch, passed

    def __len__(self) -> int:
        left, size = self.shards.n_samples - self.skip, self.shards.global_batch
        return left // size if self.drop_last else -(-left // size)

    def global_counts(self) -> list[int]:
        """Samples in each global batch this epoch yields (from `start` on)."""
        left, size = self.shards.n_samples - self.skip, self.shards.global_batch
        return [min(size, left - b * size) for b in range(len(self))]

    def loss_scales(self) -> list[float]:
        """The factor for each batch's summed loss: world / global_count, 0 where the slice is empty."""
        return [self._scale(count) for count in self.global_counts()]

    def loss_scale(self, i: int) -> float:
        """The loss factor of the i-th batch this epoch yields (counted from `start`)."""
        if not 0 <= i < len(self):
            raise IndexError(f"batch {i} of an epoch that yields {len(self)}")
        size = self.shards.global_batch
        return self._scale(min(size, self.shards.n_samples - self.skip - i * size))

    def _scale(self, global_count: int) -> float:
        has_samples = self.rank < global_count  # tensor_split hands the short batch's spare to low ranks
        return self.world / global_count if has_samples else 0.0

    def batches(self) -> Iterator[ShardBatch]:
        """This epoch's batches from `start` on, as (indices, global_count, loss scale)."""
        global_batches = self.shards.order(self.epoch)[self.skip:].split(self.shards.global_batch)
        for b in range(len(self)):
            batch = global_batches[b]
            piece = batch.tensor_split(self.world)[self.rank]
            if piece.numel() == 0:  # keep DDP's collectives in step: one real sample, weighed 0
                piece = batch[:1]
            yield ShardBatch(piece, batch.numel(), self._scale(batch.numel()))

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches():
            yield batch.indices.tolist()
