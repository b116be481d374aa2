"""The throughput of a parameter-server run's workers together, from each worker's timeline of steps."""

from __future__ import annotations

import torch


def all_workers_throughput(timelines: list[torch.Tensor]) -> float:
    """Samples per second of all workers together while all of them were training: from the last
    worker's start to the first worker's finish, every worker's samples in that window. Under BSP
    this is the usual figure; under ASP it does not credit the fast workers' early finish, nor
    charge the straggler's lone tail, to the throughput of the whole.

    Each timeline is (wall clock, samples) rows: the start, then one row per step.
    """
    start = max(float(t[0, 0]) for t in timelines)
    end = min(float(t[-1, 0]) for t in timelines)
    if end <= start:
        return 0.0
    done = sum(float(t[1:, 1][(t[1:, 0] > start) & (t[1:, 0] <= end)].sum()) for t in timelines)
    return done / (end - start)
