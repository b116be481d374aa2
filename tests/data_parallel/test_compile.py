"""torch.compile and DataParallel, either way round (aot_eager backend): trains equal to eager."""

import pytest
import torch
from distributed import run_workers

from paraloom import DataParallel, DistributedOptimizer

TINY = 1e-6  # MB: one bucket per parameter


def _train(rank, world, placement, options):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                              torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if placement == "compiled_inside":
        engine = model = DataParallel(torch.compile(net, backend="aot_eager"), **options)
    elif placement == "compiled_outside":
        engine = DataParallel(net, **options)
        model = torch.compile(engine, backend="aot_eager")
    else:
        engine = model = DataParallel(net, **options)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), engine)
    launched = []
    for step in range(4):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        opt.zero_grad()
        model(x).square().mean().backward()
        launched.append(engine.launched_in_backward)
        opt.step()
    engine.finish()
    engine.close()
    return [p.detach().clone() for p in net.parameters()], launched


@pytest.mark.parametrize("options", [{"scheduler": "wait_free", "bucket_mb": TINY, "first_bucket_mb": TINY},
                                     {"scheduler": "fifo"}, {"scheduler": "priority"}],
                         ids=["wait_free", "fifo", "priority"])
def test_compiled_trains_like_eager(options):
    eager = run_workers(_train, 2, "eager", options, timeout=300)
    for placement in ("compiled_inside", "compiled_outside"):
        compiled = run_workers(_train, 2, placement, options, timeout=300)
        for (params, launched), (ref, ref_launched) in zip(compiled, eager, strict=True):
            torch.testing.assert_close(params, ref)
            if options["scheduler"] == "wait_free":
                # under compilation the buckets still launch before backward returns (all but the
                # last of the 6), but the compiled backward is one autograd node that computes every
                # gradient before the first accumulation: they overlap the rest of backward's
                # accumulation, not its computation
                assert min(ref_launched) >= 5 and min(launched) >= 5, (placement, launched, ref_launched)


@pytest.mark.parametrize("options", [{"sync": "one_step_delay"}, {"sync": "local_sgd", "local_steps": 2},
                                     {"shard_optimizer": True}], ids=["one_step_delay", "local_sgd", "shard"])
def test_every_updater_compiles(options):
    """No updater needs refusing under torch.compile: each trains equal to eager, either way round."""
    eager = run_workers(_train, 2, "eager", {"scheduler": "wait_free", **options}, timeout=300)
    for placement in ("compiled_inside", "compiled_outside"):
        compiled = run_workers(_train, 2, placement, {"scheduler": "wait_free", **options}, timeout=300)
        for (params, _), (ref, _) in zip(compiled, eager, strict=True):
            torch.testing.assert_close(params, ref)
