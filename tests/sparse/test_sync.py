"""Mask-aware sync: pruned positions never travel, the bytes scale with density, and the sum is exact."""

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers

from paraloom.comm.collectives import CommStats
from paraloom.data_parallel import DataParallel
from paraloom.sparse import MagnitudePruner, SparsitySchedule
from paraloom.sparse.sync import MaskedSync


def make_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _step(rank, world, sparsity, masked):
    model = make_mlp()
    stats = CommStats()
    engine = DataParallel(model, stats=stats, bucket_mb=0.001, first_bucket_mb=0.001)
    pruner = MagnitudePruner(model, SparsitySchedule("oneshot", sparsity))
    pruner.update(0)
    sync = None
    if masked:
        sync = MaskedSync(engine, threshold=0.5)
        sync.set_masks({pruner.targets[name]: mask for name, mask in pruner.masks.items()})
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    stats.take()
    F.cross_entropy(engine(x), y).backward()  # the engine launches pieces from backward's hooks
    engine.sync_gradients()
    pruner.mask_gradients()  # dense: pruned positions were averaged too and are zeroed here
    sent = stats.take().bytes
    grads = [p.grad.clone() for p in model.parameters()]
    engine.close()
    return sent, grads, sync.density() if sync else 1.0


@pytest.mark.parametrize("world", [2, 3])
def test_masked_sync_sends_only_unmasked_values_and_sums_exactly(world):
    dense = run_workers(_step, world, 0.9, False)
    masked = run_workers(_step, world, 0.9, True)
    for (sent_d, grads_d, _), (sent_m, grads_m, density) in zip(dense, masked, strict=True):
        for a, b in zip(grads_d, grads_m, strict=True):
            torch.testing.assert_close(a, b)  # masked positions are zero either way
        assert density < 0.2
        # weights at 10% density; biases (not pruned) and pieces above the threshold go dense
        assert sent_m == pytest.approx(sent_d * density, rel=0.01)
        assert sent_m < 0.15 * sent_d


def test_dense_pieces_stay_dense_below_the_threshold_of_sparsity():
    (sent_d, _, _), _ = run_workers(_step, 2, 0.3, False)
    (sent_m, _, density), _ = run_workers(_step, 2, 0.3, True)
    assert density == 1.0 and sent_m == sent_d  # 70% alive > threshold 0.5: nothing compacted
