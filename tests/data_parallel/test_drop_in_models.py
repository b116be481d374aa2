"""paraloom.DataParallel against torch DDP on what users' models and loops contain: frozen and bf16
parameters, activation checkpointing, two forwards per backward, sparse gradients, recurrent and
attention layers, a gradient scaler, and the user's own collectives between backward and step."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from paraloom import DataParallel


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        x = checkpoint(lambda t: F.relu(self.b(t)), F.relu(self.a(x)), use_reentrant=self.reentrant)
        return self.c(x)


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.attn = nn.LSTM(8, 8, batch_first=True), nn.MultiheadAttention(8, 2)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        h = self.lstm(x)[0]
        return self.out(self.attn(h, h, h, need_weights=False)[0].mean(1))


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _model(case):
    torch.manual_seed(0)
    if case == "frozen":
        model = _mlp()
        model[0].requires_grad_(False)
        return model
    return {"bf16": lambda: _mlp().to(torch.bfloat16), "reentrant": lambda: Checkpointed(True),
            "non_reentrant": lambda: Checkpointed(False), "recurrent": Recurrent,
            "sparse": lambda: nn.Sequential(nn.Embedding(20, 8, sparse=True), nn.Flatten(), nn.Linear(16, 4)),
            }.get(case, _mlp)()


def _input(case, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    if case == "sparse":
        return torch.randint(0, 20, (4, 2), generator=g)
    if case == "recurrent":
        return torch.randn(4, 5, 8, generator=g)
    x = torch.randn(4, 8, generator=g)
    return x.bfloat16() if case == "bf16" else x


def _train(wrap, case, rank):
    model = wrap(_model(case))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scaler = torch.amp.GradScaler("cpu") if case == "scaler" else None
    logged = []
    for step in range(4):
        optimizer.zero_grad()
        x = _input(case, rank, step)
        if case == "two_forwards":  # e.g. two views of a batch through one model, one loss
            loss = (model(x) - model(x.flip(0))).pow(2).mean()
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scaler is not None):
                loss = model(x).float().pow(2).mean()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if case == "collectives":  # the user's own, on the default group, before the step
                total = loss.detach().clone()
                dist.all_reduce(total)
                gathered = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, float(loss))
                dist.barrier()
                logged.append((float(total), gathered))
            optimizer.step()
    return [p.detach().clone() for p in model.module.parameters()], logged


def _both(rank, world, cases):
    torch.set_num_threads(1)
    return {case: (_train(DDP, case, rank), _train(DataParallel, case, rank)) for case in cases}


CASES = ["frozen", "bf16", "reentrant", "non_reentrant", "two_forwards", "sparse", "recurrent", "scaler",
         "collectives"]


@pytest.mark.parametrize("world", [2, 3])
def test_what_users_models_and_loops_hold_trains_as_under_ddp(world):
    """Bitwise on 2 ranks; on 3, DDP divides each rank's gradient before summing and paraloom after,
    so the parameters agree to rounding (torch's default tolerances for their dtype, bf16 included)."""
    exact = {"rtol": 0, "atol": 0} if world == 2 else {}
    for out in run_workers(_both, world, CASES, timeout=120):
        for case, ((ddp, ddp_logged), (ours, our_logged)) in out.items():
            torch.testing.assert_close(ours, ddp, **exact, msg=lambda m, c=case: f"{c}: {m}")
            torch.testing.assert_close(our_logged, ddp_logged, **exact, msg=lambda m, c=case: f"{c}: {m}")
