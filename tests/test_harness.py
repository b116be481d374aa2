"""The multi-process harness itself: results come back by rank, failures and hangs reach pytest."""

import os

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers


def _rank_sum(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_results_come_back_by_rank(world):
    assert run_workers(_rank_sum, world) == [world * (world + 1) / 2] * world


def _fail_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("boom on one")
    return rank


def test_a_failing_rank_fails_the_test_with_its_traceback():
    with pytest.raises(AssertionError, match="(?s)rank 1 of 2 failed.*boom on one"):
        run_workers(_fail_on_rank_one, 2, timeout=10)


def _die_hard(rank, world):
    if rank == 0:
        os._exit(3)
    return rank


def test_a_killed_rank_is_named_and_no_process_is_left():
    with pytest.raises(AssertionError, match=r"ranks \[0\] of 2 gave no result"):
        run_workers(_die_hard, 2, timeout=10)
