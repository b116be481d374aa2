"""Uneven inputs with `model.join()` / `Join([model])`: paraloom's DataParallel against DDP, same ranks."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer

from paraloom import DataParallel


def _model() -> nn.Module:
    torch.manual_seed(0)  # BatchNorm: buffers that DDP and paraloom sync before each forward
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _train(wrapper, rank: int, batches: int, *, divide: bool, accumulate: int, options: dict,
           use_join_class: bool = False, zero: bool = False, device: str = "cpu") -> list[torch.Tensor]:
    model = wrapper(_model().to(device), **options)
    if zero:  # torch's sharded optimizer joins beside the model: it steps on what the model leaves it
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    context = (Join([model, opt] if zero else [model], divide_by_initial_world_size=divide) if use_join_class
               else model.join(divide_by_initial_world_size=divide))
    with context:
        for step in range(batches):
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 * rank + step)).to(device)
            if step % accumulate:  # the others' no_sync() steps: the joined ranks shadow nothing
                with model.no_sync():
                    model(x).square().mean().backward()
                continue
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    model.eval()
    with torch.no_grad():
        out = model(torch.ones(2, 6, device=device))
    return [t.detach().cpu() for t in (*model.module.state_dict().values(), out)]


def _against_ddp(rank, world, divide, accumulate, options, use_join_class, zero, device="cpu"):
    torch.set_num_threads(1)
    batches = 3 + 2 * rank  # every rank a different number of batches, the last the most
    ddp = _train(nn.parallel.DistributedDataParallel, rank, batches, divide=divide, accumulate=accumulate,
                 options={}, use_join_class=zero, zero=zero, device=device)
    ours = _train(DataParallel, rank, batches, divide=divide, accumulate=accumulate, options=options,
                  use_join_class=use_join_class or zero, zero=zero, device=device)
    return ddp, ours


@pytest.mark.parametrize("world, divide, accumulate, options, use_join_class, zero", [
    (2, True, 1, {}, False, False),
    (3, False, 1, {}, True, False),
    (3, True, 2, {"scheduler": "fifo", "algorithm": "ring", "bucket_cap_mb": 1e-4}, False, False),
    (2, True, 1, {}, True, True),
])
def test_uneven_inputs_train_as_ddp_joins(world, divide, accumulate, options, use_join_class, zero):
    """Final parameters, buffers and outputs equal DDP's on every rank (and so every rank's alike)."""
    results = run_workers(_against_ddp, world, divide, accumulate, options, use_join_class, zero, timeout=120)
    for ddp, ours in results:
        torch.testing.assert_close(ours, ddp)


def _compressed(rank, world, options):
    torch.set_num_threads(1)
    model = DataParallel(_model(), **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with model.join():
        for step in range(2 + 3 * rank):
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 * rank + step))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered), model.stats.calls


@pytest.mark.parametrize("options", [{"compressor": "topk", "compressor_options": {"density": 0.1}},
                                     {"compressor": "powersgd"}])
def test_compressed_collectives_are_shadowed(options):
    """A joined rank runs the compressor's own collectives on zeros: no hang, replicas equal at the end."""
    results = run_workers(_compressed, 2, options, timeout=60)
    assert all(same for same, _ in results)
    calls = [n for _, n in results]  # rank 0 trained 2 steps and shadowed the other 3: as many as rank 1
    assert calls[0] == calls[1] > 0


def _refused(rank, world, options):
    model = DataParallel(nn.Linear(3, 2), **options)
    try:
        model.join()
    except ValueError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.parametrize("options, says", [({"scheduler": "priority"}, "PriorityUpdater"),
                                           ({"sync": "local_sgd"}, "LocalSGDUpdater")])
def test_updaters_outside_backward_are_refused(options, says):
    for message in run_workers(_refused, 2, options):
        assert says in message and "join() shadows" in message


def _early(rank, world):
    model = DataParallel(nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with model.join(throw_on_early_termination=True):
            for _ in range(2 + rank):
                model(torch.randn(4, 3)).sum().backward()
                opt.step()
                opt.zero_grad()
    except RuntimeError as exc:
        return "raised" if "exhausted" in str(exc) or "uneven" in str(exc).lower() else str(exc)
    return "finished"


def test_throw_on_early_termination_stops_every_rank():
    assert run_workers(_early, 2, timeout=60) == ["raised", "raised"]


def test_a_peer_that_died_is_named_as_such_not_as_uneven_inputs():
    from paraloom.data_parallel.ddp_interface import sync_failure

    died = sync_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection reset by peer"))
    assert died.startswith("the gradient all-reduce did not complete: a peer rank died")
    assert "uneven" not in died and "Connection reset by peer" in died
    waited = sync_failure(RuntimeError("Timed out waiting 30000ms for recv operation to complete"))
    assert "inputs are uneven, train inside `with model.join():`" in waited
