"""Per-rank batches: every sample once per epoch, none dropped, the short last batch split evenly."""

import pytest
import torch

from paraloom.data import ShardedBatches


@pytest.mark.parametrize(("n", "batch", "world"), [(100, 10, 1), (100, 12, 3), (101, 16, 4),
                                                   (7, 8, 4), (3, 4, 4), (1797, 64, 2)])
def test_every_sample_exactly_once_per_epoch(n, batch, world):
    shards = [ShardedBatches(n, batch, rank=r, world=world, seed=3) for r in range(world)]
    for epoch in range(2):
        per_rank = [list(s.epoch(epoch)) for s in shards]
        assert all(len(steps) == len(shards[0]) == -(-n // batch) for steps in per_rank)
        seen = torch.cat([idx for steps in per_rank for idx, _ in steps])
        assert sorted(seen.tolist()) == list(range(n))
        for step in zip(*per_rank, strict=True):
            sizes = [idx.numel() for idx, _ in step]
            counts = {count for _, count in step}
            assert len(counts) == 1 and sum(sizes) == counts.pop()  # every rank knows the total
            assert max(sizes) - min(sizes) <= 1


def test_order_is_seeded_identical_across_instances_and_changes_by_epoch():
    a, b = ShardedBatches(50, 10, seed=1), ShardedBatches(50, 10, seed=1)
    assert torch.equal(a.order(0), b.order(0))
    assert not torch.equal(a.order(0), a.order(1))
    assert not torch.equal(a.order(0), ShardedBatches(50, 10, seed=2).order(0))
    assert torch.equal(ShardedBatches(5, 2, shuffle=False).order(4), torch.arange(5))


def test_every_seed_the_config_takes_orders_the_data():
    """run.seed goes up to 2**63-1 (config/sections.py); times the epoch stride it passes 2**64."""
    top = ShardedBatches(50, 10, seed=2**63 - 1)
    assert sorted(top.order(7).tolist()) == list(range(50))
    assert not torch.equal(top.order(0), top.order(1))


def test_full_batches_split_evenly():
    shard = ShardedBatches(64, 16, rank=1, world=4, shuffle=False)
    first, count = next(shard.epoch(0))
    assert count == 16 and first.tolist() == [4, 5, 6, 7]
