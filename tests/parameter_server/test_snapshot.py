"""Parameter-server snapshots: consistent cuts under ASP, exact BSP resume, and dropped non-finite pushes."""

import copy
import io
import time

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers

from paraloom.parameter_server import ParameterServer, PSClient, PushCodec, flatten_model, staleness_bound
from paraloom.parameter_server.message import NONFINITE, PUSH
from paraloom.parameter_server.server import serve
from paraloom.parameter_server.shard import slice_layout

torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])  # import torch._dynamo once, before forking


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))  # 58 parameters


def _batch(step, rank):
    """Worker `rank`'s batch at `step`: the same in every run, whatever ran before it."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 4, generator=g), torch.randint(0, 2, (4,), generator=g)


def _optimizer(name):
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=0.01)
    return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def _save(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _load(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def _assert_same(a, b, where="state"):
    """Bitwise equality of nested dicts, lists, tensors and numbers."""
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


class _Recording(ParameterServer):
    """Records its parameters and optimizer as they are when it answers the reads a snapshot held."""

    armed = False
    served_after = None

    def release_held(self):
        super().release_held()
        self.armed = True

    def answer(self):
        if self.armed:
            self.served_after = {"param": self.param.detach().clone(),
                                 "optimizer": copy.deepcopy(self.optimizer.state_dict())}
            self.armed = False
        super().answer()


def _server(rank, workers, servers, bounds, codecs, run):
    model = _model()
    flat, _ = flatten_model(model)
    mine = [i for i, owner in enumerate(servers) if owner == rank]
    slices = [_Recording(flat[bounds[i][0]:bounds[i][1]], _optimizer(run["optim"]),
                         workers=list(range(workers)), bound=staleness_bound(run["consistency"], 0),
                         average=run["consistency"] == "bsp", codec=codecs[i], slot=slot)
              for slot, i in enumerate(mine)]
    if run.get("resume"):
        for piece, state in zip(slices, _load(run["resume"]["servers"][rank]), strict=True):
            piece.load_state_dict(state)
    snapshots = []

    def on_snapshot(clock, states):
        snapshots.append((clock, _save(states)))

    stats = serve(slices, None if run.get("no_callback") else on_snapshot)
    final = _save([s.state_dict() for s in slices])
    return ("server", stats, snapshots, [s.served_after for s in slices], final)


def _worker(rank, model, servers, bounds, codecs, run):
    client = PSClient(model, servers, bounds, codecs=codecs)
    if run.get("resume"):
        client.load_state_dict(_load(run["resume"]["clients"][rank]))
    start = client.clock
    client.pull()
    if run.get("overlap"):
        client.attach(model)
    finite, saved, after_snapshot = [], None, None
    snap_at = run.get("snap_at_of", {}).get(rank, run.get("snap_at"))
    for step in range(start, run["steps"]):
        snapshot = step + 1 == snap_at
        if snapshot:
            client.mark_snapshot()  # before backward: attach() pushes slices from there
        x, y = _batch(step, rank)
        loss = F.cross_entropy(model(x), y)
        if (step, rank) in run.get("nan", ()):
            loss = loss * float("nan")
        if rank == run.get("slow_rank"):
            time.sleep(0.003)
        loss.backward()
        client.push()
        finite.append(client.last_push_finite)
        if not run.get("overlap"):
            client.pull()
        if snapshot:
            client.settle()  # the parameters served right after the snapshot
            saved, after_snapshot = _save(client.state_dict()), client.flat.clone()
    client.settle()
    client.close()
    return ("worker", client.flat.clone(), finite, saved, after_snapshot)


def _job(rank, world, workers, run):
    model = _model()
    n = sum(p.numel() for p in model.parameters())
    layout = slice_layout(n, world - workers, run.get("slice_elements", 10**9))
    servers, bounds = [workers + s for s, _, _ in layout], [(lo, hi) for _, lo, hi in layout]
    codecs = [PushCodec(hi - lo, run.get("compressor"), run.get("options")) for lo, hi in bounds]
    if rank >= workers:
        return _server(rank, workers, servers, bounds, codecs, run)
    return _worker(rank, model, servers, bounds, codecs, run)


def _run(workers, servers, **run):
    run.setdefault("consistency", "bsp")
    run.setdefault("optim", "sgd")
    out = run_workers(_job, workers + servers, workers, run, timeout=60)
    return [rest for kind, *rest in out if kind == "worker"], {r: rest for r, (kind, *rest) in enumerate(out)
                                                              if kind == "server"}


@pytest.mark.parametrize("overlap", [False, True])
def test_asp_snapshot_is_a_consistent_cut(overlap):
    """3 workers (rank 0 slow), 2 servers of 2 slices each; without the cut the fast workers would be
    well past the snapshot's clock by the time the slow one reaches it."""
    workers, steps, snap_at = 3, 30, 15
    clients, servers = _run(workers, 2, consistency="asp", steps=steps, snap_at=snap_at, slow_rank=0,
                            slice_elements=15, overlap=overlap)
    served = []
    for stats, snapshots, served_after, _ in servers.values():
        assert stats["slices"] == 2 and stats["received"] == [steps] * workers
        assert [clock for clock, _ in snapshots] == [snap_at]
        states = _load(snapshots[0][1])
        for state, after in zip(states, served_after, strict=True):
            assert state["received"] == {w: snap_at for w in range(workers)}
            assert state["clocks"] == {w: snap_at for w in range(workers)}
            assert state["pushes_applied"] == state["version"] == workers * snap_at  # ASP: a step a push
            _assert_same({"param": state["param"], "optimizer": state["optimizer"]}, after)
            served.append(state["param"])
    for _, finite, _, after_snapshot in clients:  # every worker read exactly the snapshot's parameters
        assert all(finite)
        assert torch.equal(after_snapshot, torch.cat(served))
    assert max(max(stats["read_staleness"]) for stats, *_ in servers.values()) >= 2  # asynchrony was real


def test_a_snapshot_without_a_callback_is_a_barrier():
    """No on_snapshot: the marked pushes' reads are still held until all are in, then answered
    together, from one state."""
    clients, servers = _run(3, 1, consistency="asp", steps=20, snap_at=10, slow_rank=0, no_callback=True)
    assert all(torch.equal(after, clients[0][3]) for _, _, _, after in clients)
    (stats, snapshots, served_after, _), = servers.values()
    assert snapshots == [] and served_after[0] is not None and stats["received"] == [20] * 3


def test_workers_marking_different_steps_are_told():
    with pytest.raises(AssertionError, match=r"mark_snapshot\(\)"):
        _run(2, 1, consistency="asp", steps=10, snap_at_of={0: 4, 1: 5})


@pytest.mark.parametrize("workers,servers,compressor,options,optim,overlap,slice_elements", [
    (2, 1, None, None, "sgd", False, 10**9),
    (3, 1, None, None, "adam", False, 10**9),  # rank 0 slow: pushes arrive out of worker order
    (4, 2, None, None, "sgd", True, 15),
    (2, 2, "topk", {"density": 0.25}, "adam", True, 15),  # error-feedback memory; Adam's step counts
    (2, 1, "dgc", {"density": 0.25, "momentum": 0.9}, "sgd", False, 20),  # DGC's momenta and sampler
])
def test_bsp_resumes_bitwise_from_a_snapshot(workers, servers, compressor, options, optim, overlap,
                                             slice_elements):
    """Bitwise for any number of workers: a server sums a clock's pushes in worker order, not in the
    order they arrive (which, with three or more, once moved the last bits from run to run)."""
    steps, snap_at = 8, 3
    run = dict(steps=steps, compressor=compressor, options=options, optim=optim, overlap=overlap,
               slice_elements=slice_elements, slow_rank=0 if workers > 2 else None)
    whole, whole_servers = _run(workers, servers, snap_at=snap_at, **run)
    plain, _ = _run(workers, servers, **run)
    for (flat, *_), (reference, *_) in zip(whole, plain, strict=True):
        assert torch.equal(flat, reference)  # a snapshot does not change a BSP run
    resume = {"servers": {r: snapshots[0][1]
                          for r, (_, snapshots, _, _) in whole_servers.items()},
              "clients": {r: saved for r, (_, _, saved, _) in enumerate(whole)}}
    for _, snapshots, _, _ in whole_servers.values():
        assert snapshots[0][0] == snap_at
        assert all(s["received"] == {w: snap_at for w in range(workers)} for s in _load(snapshots[0][1]))
    resumed, resumed_servers = _run(workers, servers, resume=resume, **run)
    for (flat, *_), (reference, *_) in zip(resumed, whole, strict=True):
        assert torch.equal(flat, reference)
    for r, (stats, _, _, final) in resumed_servers.items():
        _assert_same(_load(final), _load(whole_servers[r][3]))  # parameters, optimizer, counters
        assert stats["received"] == [steps] * workers


def _reference_with_dropped(steps, workers, nan):
    """BSP on one process, each step's update the mean of the finite workers' gradients."""
    model = _model()
    optimizer = _optimizer("sgd")(model.parameters())
    for step in range(steps):
        finite = [w for w in range(workers) if (step, w) not in nan]
        optimizer.zero_grad()
        (sum(F.cross_entropy(model(_batch(step, w)[0]), _batch(step, w)[1]) for w in finite)
         / len(finite)).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("consistency", ["bsp", "asp"])
def test_a_nan_push_is_dropped_and_counted(consistency):
    workers, steps, nan = 2, 6, {(3, 1)}
    clients, servers = _run(workers, 1, consistency=consistency, steps=steps, nan=nan)
    (stats, _, _, final), = servers.values()
    assert stats["dropped"] == 1 and stats["received"] == [steps, steps]
    assert stats["pushes_applied"] == workers * steps - 1
    assert stats["updates"] == (steps if consistency == "bsp" else workers * steps - 1)
    (state,) = _load(final)  # weights_only
    assert state["dropped"] == 1 and state["received"] == {0: steps, 1: steps}
    assert torch.isfinite(state["param"]).all()
    assert [finite for _, finite, _, _ in clients] == [[True] * steps, [True] * 3 + [False] + [True] * 2]
    for flat, *_ in clients:
        assert torch.isfinite(flat).all()
        if consistency == "bsp":  # the step with the NaN took worker 0's gradient alone
            torch.testing.assert_close(flat, _reference_with_dropped(steps, workers, nan))


def _push(server, worker, clock, grad, flags=PUSH):
    message = server.codec.message()
    message.body.copy_(grad)
    message.write_header(flags, clock, server.version, 0)
    server.handle(worker, message)  # a push without PULL: nothing is sent, no process group needed


def test_bsp_steps_with_the_mean_of_the_finite_pushes_and_state_round_trips():
    def fresh():
        return ParameterServer(torch.zeros(3), lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.5),
                               workers=[0, 1, 2], bound=0, average=True)

    server = fresh()
    nan = torch.tensor([1.0, float("nan"), 0.0])
    _push(server, 0, 1, torch.tensor([1.0, 2.0, 3.0]))
    _push(server, 1, 1, nan)
    _push(server, 2, 1, torch.tensor([3.0, 2.0, 1.0]))
    assert torch.equal(server.param.detach(), torch.tensor([-2.0, -2.0, -2.0]))  # mean of two, not three
    assert (server.version, server.dropped, server.pushes_applied) == (1, 1, 2)
    for worker in range(3):  # a clock of nothing but dropped pushes takes no step
        _push(server, worker, 2, torch.tensor([float("inf"), 0.0, 0.0]))
    assert (server.version, server.dropped) == (1, 4)
    _push(server, 0, 3, torch.ones(3), flags=PUSH | NONFINITE)  # the worker's own verdict is final
    _push(server, 1, 3, torch.ones(3))  # mid-clock: a partial sum in .grad
    assert server.received == {0: 3, 1: 3, 2: 2} and server.clocks == {0: 3, 1: 3, 2: 2}
    restored = fresh()
    restored.load_state_dict(_load(_save(server.state_dict())))
    _assert_same(restored.state_dict(), server.state_dict())
    for piece in (server, restored):
        _push(piece, 2, 3, torch.full((3,), 5.0))
    _assert_same(restored.state_dict(), server.state_dict())
    assert server.version == 2 and torch.equal(server.param.detach(), torch.tensor([-6.0, -6.0, -6.0]))


def test_asp_drops_a_nan_push_and_still_advances_the_clock():
    server = ParameterServer(torch.zeros(2), lambda p: torch.optim.SGD(p, lr=1.0), workers=[0, 1], bound=None,
                             average=False)
    _push(server, 0, 1, torch.tensor([float("nan"), 1.0]))
    _push(server, 1, 1, torch.tensor([2.0, 4.0]))
    assert torch.equal(server.param.detach(), torch.tensor([-1.0, -2.0]))  # divided by W, as always
    assert (server.version, server.dropped, server.pushes_applied) == (1, 1, 1)
    assert server.clocks == {0: 1, 1: 1} and server.received == {0: 1, 1: 1}
