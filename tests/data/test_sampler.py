"""ShardedBatchSampler: ShardedBatches' order in a DataLoader; DDP's gradient equals one process's."""

import multiprocessing as mp

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from paraloom.config.errors import UserError
from paraloom.data import ShardedBatches, ShardedBatchSampler

CASES = [(9, 4, 4), (10, 4, 1), (11, 4, 2), (19, 6, 3), (17, 8, 4), (5, 2, 4), (64, 16, 4)]


def _samplers(n, batch, world, **kwargs):
    return [ShardedBatchSampler(n, batch, rank=r, world=world, seed=5, **kwargs) for r in range(world)]


@pytest.mark.parametrize(("n", "batch", "world"), CASES)
def test_equals_sharded_batches_slice_for_slice(n, batch, world):
    for rank, sampler in enumerate(_samplers(n, batch, world)):
        shards = ShardedBatches(n, batch, rank=rank, world=world, seed=5)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            expected = list(shards.epoch(epoch))
            got = list(sampler.batches())
            assert len(got) == len(expected) == len(sampler)
            for (indices, count), mine in zip(expected, got, strict=True):
                assert mine.global_count == count
                if indices.numel():
                    assert torch.equal(mine.indices, indices)
                    assert mine.scale == world / count
                else:  # padded: one real sample of the global batch, weighed 0
                    assert mine.indices.numel() == 1 and mine.scale == 0.0
            assert list(sampler) == [b.indices.tolist() for b in got]
            assert sampler.loss_scales() == [b.scale for b in got]
            assert [sampler.loss_scale(i) for i in range(len(sampler))] == sampler.loss_scales()
            assert sampler.global_counts() == [count for _, count in expected]


@pytest.mark.parametrize(("n", "batch", "world"), CASES)
def test_every_sample_once_per_epoch_and_scales_sum_to_one_mean(n, batch, world):
    samplers = _samplers(n, batch, world)
    for epoch in range(3):
        for s in samplers:
            s.set_epoch(epoch)
        per_rank = [list(s.batches()) for s in samplers]
        real = [b.indices for steps in per_rank for b in steps if b.scale]
        assert sorted(torch.cat(real).tolist()) == list(range(n))
        for step in zip(*per_rank, strict=True):
            # sum over ranks of scale * local count / world = 1: the global batch's mean, exactly
            assert sum(b.scale * b.indices.numel() for b in step) / world == pytest.approx(1.0)
            assert all(b.indices.numel() >= 1 for b in step)  # every rank steps, so DDP's collective runs


def test_empty_slices_pad_with_the_first_sample_of_the_global_batch():
    samplers = _samplers(9, 4, 4)  # last global batch: 1 sample, ranks 1-3 get nothing
    last = [list(s.batches())[-1] for s in samplers]
    assert [b.global_count for b in last] == [1] * 4
    assert [b.scale for b in last] == [4.0, 0.0, 0.0, 0.0]
    assert all(torch.equal(b.indices, last[0].indices) for b in last)
    assert [s.loss_scale(2) for s in samplers] == [4.0, 0.0, 0.0, 0.0]


def test_resume_mid_epoch_skips_the_first_batches():
    sampler = ShardedBatchSampler(23, 4, rank=1, world=2, seed=2)
    sampler.set_epoch(3)
    whole, scales, counts = list(sampler), sampler.loss_scales(), sampler.global_counts()
    sampler.set_epoch(3, start=4)
    assert len(sampler) == len(whole) - 4 == 2
    assert list(sampler) == whole[4:]
    assert sampler.loss_scales() == scales[4:] and sampler.global_counts() == counts[4:]
    assert sampler.loss_scale(1) == scales[5]
    sampler.set_epoch(4)  # a new epoch starts from its beginning
    assert len(sampler) == 6 and list(sampler) != whole
    sampler.set_epoch(4, start=6)
    assert list(sampler) == [] and len(sampler) == 0
    with pytest.raises(UserError, match="start=7"):
        sampler.set_epoch(4, start=7)
    with pytest.raises(IndexError):
        sampler.loss_scale(0)


def test_skip_resumes_an_epoch_at_a_sample_with_another_global_batch():
    # 8 batches of 4 then the rest of the epoch in batches of 6 over 3 ranks: every sample once
    before = ShardedBatchSampler(45, 4, rank=0, world=1, seed=5)
    before.set_epoch(2)
    first = [i for batch in list(before)[:8] for i in batch]
    after = [ShardedBatchSampler(45, 6, rank=r, world=3, seed=5) for r in range(3)]
    for sampler in after:
        sampler.set_epoch(2, skip=32)
    assert [len(s) for s in after] == [3, 3, 3] and after[0].global_counts() == [6, 6, 1]
    rest = [i for s in after for b in s.batches() if b.scale > 0 for i in b.indices.tolist()]
    assert sorted(first + rest) == list(range(45))
    assert [s.loss_scales()[-1] for s in after] == [3.0, 0.0, 0.0]  # the last batch's one sample
    with pytest.raises(UserError, match="skip=14"):
        after[0].set_epoch(2, start=6, skip=14)


def test_drop_last_skips_the_short_batch():
    for rank in range(3):
        kept = ShardedBatchSampler(22, 6, rank=rank, world=3, seed=1, drop_last=True)
        full = ShardedBatchSampler(22, 6, rank=rank, world=3, seed=1)
        assert len(kept) == 3 and len(full) == 4
        assert list(kept) == list(full)[:3]
        assert kept.global_counts() == [6, 6, 6] and kept.loss_scales() == [0.5, 0.5, 0.5]
    assert len(ShardedBatchSampler(24, 6, drop_last=True)) == 4


def test_len_defaults_and_refusals():
    assert len(ShardedBatchSampler(list(range(10)), 3)) == 4  # a data set or its length
    sampler = ShardedBatchSampler(10, 3, shuffle=False)
    assert (sampler.rank, sampler.world) == (0, 1)  # no process group: one process
    assert list(sampler) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    with pytest.raises(UserError, match="drop_last"):
        ShardedBatchSampler(5, 8, drop_last=True)
    with pytest.raises(UserError, match="rank=2"):
        ShardedBatchSampler(5, 2, rank=2, world=2)
    with pytest.raises(UserError, match="global_batch"):
        ShardedBatchSampler(5, 0)
    with pytest.raises(UserError, match="0 samples"):
        ShardedBatchSampler([], 2)


# ---- the acceptance test: an ordinary DDP script with a plain DataLoader ----

N, GLOBAL_BATCH, EPOCHS, LR = 19, 6, 2, 0.2  # batches of 6, 6, 6, 1: world 2-4 leaves empty slices


class Points(Dataset):
    """A user's own map-style data set: one (features, class) pair per index."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, 5, generator=gen)
        self.y = torch.randint(0, 3, (N,), generator=gen)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _full_batch_grads(model: nn.Module, data: Points, indices: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    F.cross_entropy(model(data.x[indices]), data.y[indices]).backward()  # mean over the global batch
    return [p.grad.clone() for p in model.parameters()]


def _one_process() -> list[torch.Tensor]:
    data, model = Points(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    order = ShardedBatches(N, GLOBAL_BATCH, seed=7)
    for epoch in range(EPOCHS):
        for indices in order.order(epoch).split(GLOBAL_BATCH):
            _full_batch_grads(model, data, indices)
            opt.step()
    return [p.detach() for p in model.parameters()]


def _ddp_user_script(rank: int, world: int, num_workers: int) -> list[torch.Tensor]:
    if num_workers:  # run_workers' ranks are daemons, which may not start the loader's worker
        mp.current_process().daemon = False  # processes; the loader still reaps its own workers
    data = Points()
    ddp = DistributedDataParallel(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    reference = _model()  # one process stepping on whole global batches, beside us
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    sampler = ShardedBatchSampler(data, GLOBAL_BATCH, seed=7)  # rank and world from the process group
    loader = DataLoader(data, batch_sampler=sampler, num_workers=num_workers)
    order = ShardedBatches(N, GLOBAL_BATCH, seed=7)
    steps = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        global_batches = order.order(epoch).split(GLOBAL_BATCH)
        for i, (x, y) in enumerate(loader):
            loss = F.cross_entropy(ddp(x), y, reduction="sum") * sampler.loss_scale(i)
            opt.zero_grad()
            loss.backward()
            expected = _full_batch_grads(reference, data, global_batches[i])
            for p, g in zip(ddp.parameters(), expected, strict=True):
                torch.testing.assert_close(p.grad, g)
            opt.step()
            ref_opt.step()
            steps += 1
    assert steps == EPOCHS * len(global_batches)
    return [p.detach() for p in ddp.module.parameters()]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ddp_with_a_plain_dataloader_equals_one_process(world):
    expected = _one_process()
    for params in run_workers(_ddp_user_script, world, 0, timeout=30):
        for got, want in zip(params, expected, strict=True):
            torch.testing.assert_close(got, want)


def test_ddp_with_dataloader_workers_equals_one_process():
    expected = _one_process()
    for params in run_workers(_ddp_user_script, 2, 2, timeout=30):
        for got, want in zip(params, expected, strict=True):
            torch.testing.assert_close(got, want)
