"""The f/g conjugate ops and sequence parallelism's g / g-bar, forward and backward, against hand
computation on 1, 2 and 4 ranks."""

import pytest
import torch
from distributed import run_workers
from torch.testing import assert_close

from paraloom.tensor_parallel import (
    all_gather_to_region,
    copy_to_region,
    gather_from_region,
    reduce_from_region,
    reduce_scatter_from_region,
    relayout,
    scatter_to_region,
)


def _check_mappings(rank, world):
    base = torch.arange(16.0).reshape(2, 8)
    ranks = torch.arange(world, dtype=torch.float32)

    # copy: identity forward; backward sums every rank's gradient
    x = base.clone().requires_grad_()
    y = copy_to_region(x)
    assert_close(y, base)
    y.backward(torch.full_like(y, rank + 1.0))
    assert_close(x.grad, torch.full_like(base, float((ranks + 1).sum())))

    # reduce: sum forward; backward is the identity; the input is left alone
    x = (base + 100 * rank).requires_grad_()
    y = reduce_from_region(x)
    assert_close(y, world * base + 100 * float(ranks.sum()))
    assert_close(x.detach(), base + 100 * rank)
    grad = torch.full_like(y, rank + 1.0)
    y.backward(grad)
    assert_close(x.grad, grad)

    # scatter: keep this rank's slice of the last dim; backward gathers every rank's slice gradient
    width = 8 // world
    x = base.clone().requires_grad_()
    y = scatter_to_region(x)
    assert_close(y, base[:, rank * width: (rank + 1) * width])
    y.backward(torch.full_like(y, rank + 1.0))
    assert_close(x.grad, (ranks + 1).repeat_interleave(width).expand(2, 8))

    # gather: concatenate every rank's piece in rank order; backward keeps this rank's slice
    x = (base[:, :2] + 100 * rank).requires_grad_()
    y = gather_from_region(x)
    assert_close(y, torch.cat([base[:, :2] + 100 * r for r in range(world)], dim=-1))
    grad = torch.arange(2.0 * 2 * world).reshape(2, 2 * world)
    y.backward(grad)
    assert_close(x.grad, grad[:, 2 * rank: 2 * rank + 2])

    # a gradient buffer shared by two branches is not reduced twice
    x = base.clone().requires_grad_()
    (copy_to_region(x) + copy_to_region(x)).sum().backward()
    assert_close(x.grad, torch.full_like(base, 2.0 * world))

    # along the sequence (dim 1 of (batch, seq, hidden)): scatter keeps this rank's positions,
    # gather puts every rank's back in rank order; their backwards are each other's forwards
    seq = torch.arange(2.0 * 8 * 3).reshape(2, 8, 3)
    length = 8 // world
    mine = seq[:, rank * length: (rank + 1) * length]
    x = seq.clone().requires_grad_()
    y = scatter_to_region(x, dim=1)
    assert_close(y, mine)
    y.backward(torch.full_like(y, rank + 1.0))
    assert_close(x.grad, (ranks + 1).repeat_interleave(length)[None, :, None].expand(2, 8, 3))
    x = mine.clone().requires_grad_()
    y = gather_from_region(x, dim=1)
    assert_close(y, seq)
    y.backward(seq * 10)
    assert_close(x.grad, mine * 10)

    # g (Korthikanti et al. 2022): all-gather the sequence forward; backward sums the ranks' partial
    # gradients and keeps this rank's positions
    x = mine.clone().requires_grad_()
    y = all_gather_to_region(x, dim=1)
    assert_close(y, seq)
    y.backward(seq * (rank + 1))
    assert_close(x.grad, mine * float((ranks + 1).sum()))

    # g-bar: sum the ranks' partial outputs keeping this rank's positions; backward all-gathers
    x = (seq * (rank + 1)).requires_grad_()
    y = reduce_scatter_from_region(x, dim=1)
    assert_close(y, mine * float((ranks + 1).sum()))
    y.backward(torch.full_like(y, rank + 1.0))
    assert_close(x.grad, (ranks + 1).repeat_interleave(length)[None, :, None].expand(2, 8, 3))

    # from the last dimension to the sequence through a whole tensor, and back in backward
    full = torch.arange(2.0 * 8 * 3 * world).reshape(2, 8, 3 * world)
    x = full[..., rank * 3: (rank + 1) * 3].clone().requires_grad_()
    y = relayout(x, "shard", "sequence", None)
    assert_close(y, full[:, rank * length: (rank + 1) * length])
    y.backward(torch.full_like(y, rank + 1.0))
    assert_close(x.grad, (ranks + 1).repeat_interleave(length)[None, :, None].expand(2, 8, 3))
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
def test_mappings_match_hand_computation(world):
    assert all(run_workers(_check_mappings, world))


def test_without_process_group_every_mapping_is_identity():
    x = torch.randn(3, 4)
    for op in (copy_to_region, reduce_from_region, scatter_to_region, gather_from_region,
               all_gather_to_region, reduce_scatter_from_region):
        assert op(x) is x
