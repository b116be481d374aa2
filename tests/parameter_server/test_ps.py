"""Parameter server: the clock rule, shards, BSP == synchronous SGD, and ASP/SSP bookkeeping."""

import time

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers

from paraloom.errors import UserError
from paraloom.parameter_server import (
    ParameterServer,
    PSClient,
    PushCodec,
    flatten_model,
    may_read,
    shard_bounds,
    staleness_bound,
)

torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])  # import torch._dynamo once, before forking


def test_clock_rule():
    assert staleness_bound("bsp", 5) == 0 and staleness_bound("asp", 5) is None
    assert staleness_bound("ssp", 3) == 3
    assert may_read(4, [4, 4, 5], 0) and not may_read(5, [4, 5, 5], 0)
    assert may_read(7, [4, 7], 3) and not may_read(8, [4, 8], 3)
    assert may_read(10**6, [0, 0], None)
    with pytest.raises(UserError, match="choose one of: bsp, asp, ssp"):
        staleness_bound("hogwild", 0)
    with pytest.raises(UserError, match="must not be negative"):
        staleness_bound("ssp", -1)


def test_shards_cover_the_vector_evenly():
    assert shard_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert shard_bounds(2, 4) == [(0, 0), (0, 1), (1, 1), (1, 2)]
    for n, k in [(1, 1), (1000, 7), (5, 5)]:
        bounds = shard_bounds(n, k)
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        sizes = [hi - lo for lo, hi in bounds]
        assert max(sizes) - min(sizes) <= 1


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _data(steps, batch):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 6, generator=g), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(steps)]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def _ps_job(rank, world, workers, consistency, staleness, steps, batch, slow_rank=None, *, overlap=False,
            compressor=None, tokens=None):
    servers = list(range(workers, world))
    model = _model()
    n = sum(p.numel() for p in model.parameters())
    bounds = shard_bounds(n, len(servers))
    codecs = [PushCodec(hi - lo, compressor) for lo, hi in bounds]
    token = (tokens or {}).get(rank, 0)
    if rank >= workers:  # a server
        flat, _ = flatten_model(model)
        i = rank - workers
        server = ParameterServer(flat[bounds[i][0]:bounds[i][1]], _sgd, workers=list(range(workers)),
                                 bound=staleness_bound(consistency, staleness), average=consistency == "bsp",
                                 token=token, codec=codecs[i])
        return ("server", server.serve())
    client = PSClient(model, servers, bounds, token=token, codecs=codecs)
    try:
        client.pull()
    except UserError as refused:
        return ("refused", str(refused))
    if overlap:
        client.attach(model)
    for x, y in _data(steps, batch):
        xs, ys = x.chunk(workers)[rank], y.chunk(workers)[rank]
        F.cross_entropy(model(xs), ys).backward()
        if rank == slow_rank:
            time.sleep(0.002)
        client.push()
        if not overlap:
            client.pull()
    client.settle()
    client.close()
    return ("worker", client.flat.clone(), client.pushes_sent, client.pushes_during_backward)


def _sgd_reference(steps, batch):
    reference = _model()
    optimizer = _sgd(reference.parameters())
    for x, y in _data(steps, batch):
        optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()  # the mean over the global batch
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in reference.parameters()])


@pytest.mark.parametrize("workers,servers", [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_bsp_equals_synchronous_sgd(workers, servers):
    steps, batch = 10, 8
    out = run_workers(_ps_job, workers + servers, workers, "bsp", 0, steps, batch, timeout=60)
    expected = _sgd_reference(steps, batch)
    for kind, *rest in out:
        if kind == "worker":
            torch.testing.assert_close(rest[0], expected)
    stats = [rest[0] for kind, *rest in out if kind == "server"]
    assert all(s["updates"] == steps and s["pushes_applied"] == steps * workers for s in stats)
    assert all(set(s["read_staleness"]) == {0} for s in stats)


@pytest.mark.parametrize("servers", [1, 3])
def test_overlapped_pushes_and_loads_equal_synchronous_sgd(servers):
    """Shards pushed from backward hooks and loaded from forward pre-hooks (3 servers: shards that
    cut through parameters) give the same parameters as plain BSP."""
    steps, batch = 10, 8
    out = run_workers(_ps_job, 2 + servers, 2, "bsp", 0, steps, batch, overlap=True, timeout=60)
    expected = _sgd_reference(steps, batch)
    workers = [rest for kind, *rest in out if kind == "worker"]
    assert len(workers) == 2
    for flat, pushes, during_backward in workers:
        torch.testing.assert_close(flat, expected)
        assert during_backward == pushes  # every shard left from a gradient hook, none from push()


def test_fp16_pushes_stay_close_to_synchronous_sgd():
    steps, batch = 10, 8
    out = run_workers(_ps_job, 3, 2, "bsp", 0, steps, batch, compressor="fp16", timeout=60)
    expected = _sgd_reference(steps, batch)
    for kind, *rest in out:
        if kind == "worker":
            assert not torch.equal(rest[0], expected)  # rounded on the way ...
            torch.testing.assert_close(rest[0], expected, rtol=0, atol=2e-3)  # ... by fp16's precision


def test_a_worker_with_another_runs_token_is_refused():
    out = run_workers(_ps_job, 3, 2, "asp", 0, 20, 8, tokens={1: 99}, timeout=60)
    assert out[1][0] == "refused" and "refused this worker" in out[1][1]
    kind, flat, pushes, _ = out[0]
    server = out[2][1]
    assert kind == "worker" and pushes == 20
    assert server["refused"] == 1 and server["pushes_applied"] == 20  # the refused one changed nothing


@pytest.mark.parametrize("consistency,staleness", [("asp", 0), ("ssp", 1), ("ssp", 3)])
def test_no_push_is_lost_and_ssp_reads_stay_within_the_bound(consistency, staleness):
    workers, steps = 4, 500  # 2,000 pushes
    out = run_workers(_ps_job, workers + 1, workers, consistency, staleness, steps, 8, slow_rank=0,
                      timeout=120)
    sent = sum(rest[1] for kind, *rest in out if kind == "worker")
    stats = [rest[0] for kind, *rest in out if kind == "server"]
    assert sent == workers * steps
    assert sum(s["pushes_applied"] for s in stats) == sent
    assert all(s["updates"] == workers * steps for s in stats)  # one step per push
    reads = max(max(s["read_staleness"]) for s in stats)
    if consistency == "ssp":
        assert reads <= staleness
    else:
        assert reads > 3  # the slow worker falls behind: asynchronous reads run ahead of it
