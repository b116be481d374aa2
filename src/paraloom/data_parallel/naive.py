"""DataParallelNaive: all-reduce every gradient after backward, one blocking call per parameter.

The correctness reference for every faster data-parallel engine: no buckets, no overlap.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from paraloom.comm.algorithms import check_algorithm
from paraloom.comm.collectives import CommStats, all_reduce, broadcast


class DataParallelNaive(nn.Module):
    """Wraps a module; `sync_gradients()` after backward averages gradients over `group`."""

    def __init__(self, module: nn.Module, *, group: dist.ProcessGroup | None = None,
                 algorithm: str = "native", stats: CommStats | None = None) -> None:
        super().__init__()
        check_algorithm(algorithm)
        self.module = module
        self.group = group
        self.algorithm = algorithm
        self.world_size = dist.get_world_size(group)
        self.stats = stats if stats is not None else CommStats()
        self._params = [p for p in module.parameters() if p.requires_grad]
        with torch.no_grad():  # every replica starts from group rank 0's state, as DDP does
            for tensor in [*module.parameters(), *module.buffers()]:
                broadcast(tensor.data, group=group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Average every parameter's gradient over the group; a missing gradient counts as zero."""
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            all_reduce(p.grad, group=self.group, op=dist.ReduceOp.AVG, algorithm=self.algorithm,
                       stats=self.stats)

    guard = False  # guard_nonfinite(): skip steps with NaN/Inf gradients on any rank

    def guard_nonfinite(self) -> None:
        self.guard = True

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Average gradients, step, zero the gradients: the same contract as DataParallel.step."""
        if self.guard:
            bad = torch.zeros((), dtype=torch.uint8)
            for p in self._params:
                if p.grad is not None:
                    bad |= ~torch.isfinite(p.grad).all()
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
            if bad.item():
                for p in self._params:
                    if p.grad is not None:
                        p.grad.zero_()
                return False
        self.sync_gradients()
        optimizer.step()
        for p in self._params:
            p.grad.zero_()
        return True

    def finish(self) -> None:
        """Nothing is ever left in flight."""

    replicas_identical = True  # synchronous: every rank holds the same parameters between steps

    def comm_state_dict(self) -> dict:
        return {"updater": {}, "compressor": None}

    def load_comm_state_dict(self, state: dict) -> None:
        if state["updater"] or state["compressor"] is not None:
            raise ValueError("the checkpoint holds engine state that the naive engine does not keep")

    def close(self) -> None:
        """Nothing to release; here so every engine can be closed the same way."""
