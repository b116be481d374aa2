"""find_unused_parameters=True as in DDP: parameters no rank used keep gradient None, AdamW skips them."""

import contextlib

import pytest
import torch
from distributed import run_workers
from torch import nn

from paraloom import DataParallel


class Branches(nn.Module):
    """Two branches taken in turn, one never: weight decay and Adam's moments tell None from zero."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.never = nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(3, 4)

    def forward(self, x, branch: str):
        return getattr(self, branch)(x).square().sum()


def _train(wrapper, rank: int, *, accumulate: bool, uneven: bool, options: dict, device: str = "cpu"):
    torch.manual_seed(0)
    model = wrapper(Branches().to(device), find_unused_parameters=True, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    none_after_backward = []
    steps = 4 + (2 * rank if uneven else 0)
    with model.join() if uneven else contextlib.nullcontext():
        for i in range(steps):
            x = torch.ones(2, 3, device=device) * (rank + 1) + i
            if accumulate:  # b only in the micro-step that does not synchronize: it counts as used
                with model.no_sync():
                    model(x, "b").backward()
            model(x, "a" if i % 2 == 0 else ("a" if accumulate else "b")).backward()
            none_after_backward.append([p.grad is None for p in model.module.parameters()])
            opt.step()
            opt.zero_grad()
    return [p.detach().cpu() for p in model.module.parameters()], none_after_backward


def _against_ddp(rank, world, accumulate, uneven, options, device="cpu"):
    torch.set_num_threads(1)
    ddp = _train(nn.parallel.DistributedDataParallel, rank, accumulate=accumulate, uneven=uneven, options={},
                 device=device)
    ours = _train(DataParallel, rank, accumulate=accumulate, uneven=uneven, options=options, device=device)
    return ddp, ours


@pytest.mark.parametrize("accumulate, uneven, options", [
    (False, False, {}),
    (True, False, {"scheduler": "fifo"}),
    (False, True, {"algorithm": "ring"}),
])
def test_unused_parameters_keep_none_as_under_ddp(accumulate, uneven, options):
    for (ddp_params, ddp_none), (params, none) in run_workers(_against_ddp, 2, accumulate, uneven, options,
                                                              timeout=120):
        assert none == ddp_none  # which gradients are None after each backward
        assert any(any(step) for step in none)  # the case is exercised: some gradient stayed None
        torch.testing.assert_close(params, ddp_params)
