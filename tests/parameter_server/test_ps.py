"""Parameter server: the clock rule, shards, BSP == synchronous SGD, and ASP/SSP bookkeeping."""

import time

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers

from paraloom.config.errors import UserError
from paraloom.parameter_server import (
    ParameterServer,
    PSClient,
    PushCodec,
    flatten_model,
    may_read,
    shard_bounds,
    staleness_bound,
)
from paraloom.parameter_server.server import serve
from paraloom.parameter_server.shard import slice_layout

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


def test_slices_cut_each_shard_in_order():
    assert slice_layout(10, 2, 100) == [(0, 0, 5), (1, 5, 10)]  # one slice per server
    assert slice_layout(10, 2, 2) == [(0, 0, 1), (0, 1, 3), (0, 3, 5), (1, 5, 6), (1, 6, 8), (1, 8, 10)]
    for n, k, size in [(1000, 3, 7), (163, 2, 40), (5, 5, 1)]:
        layout = slice_layout(n, k, size)
        assert [lo for _, lo, _ in layout[1:]] == [hi for _, _, hi in layout[:-1]]  # contiguous
        assert layout[0][1] == 0 and layout[-1][2] == n and all(hi - lo <= size for _, lo, hi in layout)
        assert [server for server, _, _ in layout] == sorted(server for server, _, _ in layout)
        for server, (lo, hi) in enumerate(shard_bounds(n, k)):  # a server's slices are its shard
            mine = [(a, b) for owner, a, b in layout if owner == server]
            assert mine[0][0] == lo and mine[-1][1] == hi


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
            compressor=None, tokens=None, slice_elements=10**9):
    model = _model()
    n = sum(p.numel() for p in model.parameters())
    layout = slice_layout(n, world - workers, slice_elements)
    servers, bounds = [workers + s for s, _, _ in layout], [(lo, hi) for _, lo, hi in layout]
    codecs = [PushCodec(hi - lo, compressor) for lo, hi in bounds]
    token = (tokens or {}).get(rank, 0)
    if rank >= workers:  # a server
        flat, _ = flatten_model(model)
        mine = [i for i, owner in enumerate(servers) if owner == rank]
        if len(mine) == 1:  # the single-slice server's own loop
            i = mine[0]
            server = ParameterServer(flat[bounds[i][0]:bounds[i][1]], _sgd, workers=list(range(workers)),
                                     bound=staleness_bound(consistency, staleness),
                                     average=consistency == "bsp", token=token, codec=codecs[i])
            return ("server", server.serve())
        return ("server", serve([ParameterServer(flat[bounds[i][0]:bounds[i][1]], _sgd,
                                                 workers=list(range(workers)),
                                                 bound=staleness_bound(consistency, staleness),
                                                 average=consistency == "bsp", token=token, codec=codecs[i],
                                                 slot=slot)
                                 for slot, i in enumerate(mine)]))
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


@pytest.mark.parametrize("workers,servers,slice_elements", [(2, 1, 10**9), (2, 2, 10**9), (4, 1, 10**9),
                                                            (4, 2, 10**9), (2, 2, 40)])
def test_bsp_equals_synchronous_sgd(workers, servers, slice_elements):
    """Also with each server's shard in three slices (163 parameters, 2 servers, 40 a slice)."""
    steps, batch = 10, 8
    out = run_workers(_ps_job, workers + servers, workers, "bsp", 0, steps, batch,
                      slice_elements=slice_elements, timeout=60)
    expected = _sgd_reference(steps, batch)
    for kind, *rest in out:
        if kind == "worker":
            torch.testing.assert_close(rest[0], expected)
    stats = [rest[0] for kind, *rest in out if kind == "server"]
    slices = 3 if slice_elements == 40 else 1
    assert all(s.get("slices", 1) == slices for s in stats)
    assert all(s["updates"] == steps * slices and s["pushes_applied"] == steps * workers * slices
               for s in stats)
    assert all(set(s["read_staleness"]) == {0} for s in stats)
    # the optimizer steps' CPU, timed on the serving thread: part of the process's
    assert all(0 < s["update_cpu_seconds"] <= s["cpu_seconds"] for s in stats)


@pytest.mark.parametrize("servers,slice_elements", [(1, 10**9), (3, 10**9), (1, 30)])
def test_overlapped_pushes_and_loads_equal_synchronous_sgd(servers, slice_elements):
    """Slices pushed from backward hooks and loaded from forward pre-hooks (3 servers, or one
    server's shard in 6 slices: slices that cut through parameters) give the same parameters as
    plain BSP."""
    steps, batch = 10, 8
    out = run_workers(_ps_job, 2 + servers, 2, "bsp", 0, steps, batch, overlap=True,
                      slice_elements=slice_elements, timeout=60)
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


@pytest.mark.parametrize("consistency,staleness,slice_elements", [("asp", 0, 10**9), ("ssp", 1, 10**9),
                                                                  ("ssp", 3, 10**9), ("ssp", 2, 60)])
def test_no_push_is_lost_and_ssp_reads_stay_within_the_bound(consistency, staleness, slice_elements):
    """2,000 pushes (one server; or its shard in 3 slices, each read and bounded on its own)."""
    workers, steps = 4, 500
    out = run_workers(_ps_job, workers + 1, workers, consistency, staleness, steps, 8, slow_rank=0,
                      slice_elements=slice_elements, timeout=120)
    slices = 1 if slice_elements > 163 else 3
    sent = sum(rest[1] for kind, *rest in out if kind == "worker")
    stats = [rest[0] for kind, *rest in out if kind == "server"]
    assert sent == workers * steps * slices
    assert sum(s["pushes_applied"] for s in stats) == sent
    assert all(s["received"] == [steps] * workers and s["dropped"] == 0 for s in stats)  # slice 0's
    assert all(s["updates"] == workers * steps * slices for s in stats)  # one step per push
    reads = max(max(s["read_staleness"]) for s in stats)
    if consistency == "ssp":
        assert reads <= staleness
    else:
        assert reads > 3  # the slow worker falls behind: asynchronous reads run ahead of it
