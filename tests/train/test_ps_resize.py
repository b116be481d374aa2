"""A parameter-server checkpoint resumes on another number of servers and workers: the servers' state is
the saved one, cut again; BSP then goes on as the straight run does; the clocks restart at the cut."""

import shutil

import pytest
import torch
from distributed import run_workers

from paraloom.config import load_config
from paraloom.config.errors import UserError
from paraloom.parameter_server.resplit import recut
from paraloom.parameter_server.server import ParameterServer
from paraloom.perfmodel.measure.machine_profile import resolve_hardware
from paraloom.perfmodel.runs.contract import predict
from paraloom.train import train
from paraloom.train.checkpoint.store import load_checkpoint, step_dir
from paraloom.train.strategies.parameter_server import ParameterServerStrategy

torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])  # import torch._dynamo once, before forking

BASE = [
    "model.name=mlp",
    "model.hidden=16",
    "data.name=synthetic",
    "data.n_samples=256",
    "data.batch_size=32",
    "optim.name=adam",
    "optim.lr=0.01",
    "optim.max_steps=15",
    "run.checkpoint_every=5",
    "run.save_model=true",
    "parallel.mode=ps",
    "ps.partition_mb=0.0002",  # 52 elements a slice: every server holds several
]
HARDWARE = "run.hardware=h100-ib-ndr"  # a preset: the resized run prices itself at both sizes


def _run(rank, world, settings, run_dir):
    """The summary, and what a resized resume loaded: a server's slices, a worker's client state."""
    loaded, original = {}, ParameterServerStrategy.load_resized

    def spy(self, state, saved_world, others):
        original(self, state, saved_world, others)
        loaded["state"] = [s.state_dict() for s in self.slices] if self.serves else self.client.state_dict()

    ParameterServerStrategy.load_resized = spy  # in this forked rank only
    cfg = load_config(None, [*BASE, *settings])
    summary = train(cfg, run_dir if rank == 0 else None, device=torch.device("cpu"))
    return summary, loaded.get("state")


def _straight(tmp_path, settings):
    run_dir = tmp_path / "straight"
    run_dir.mkdir()
    run_workers(_run, 4, [*settings, "ps.servers=2"], run_dir, timeout=120)  # 2 workers, 2 servers
    return run_dir


def _resume_from(straight, step, out):
    """A run directory holding only `straight`'s checkpoint of `step`: the steps after it are redone."""
    out.mkdir()
    shutil.copytree(step_dir(straight, step), step_dir(out, step))
    return out


def _saved_slices(run_dir, step, ranks):
    parts = [load_checkpoint(run_dir, step, r, torch.device("cpu"))[1] for r in ranks]
    return [piece for part in parts for piece in part["slices"]]


def _joined(slices, name):
    return torch.cat([s["optimizer"]["state"][0][name] if name != "param" else s["param"] for s in slices])


def test_bsp_resumes_on_another_number_of_servers_and_workers_as_the_straight_run_goes_on(tmp_path, capfd):
    straight = _straight(tmp_path, [])
    expected = torch.load(straight / "model.pt", weights_only=True)
    saved = _saved_slices(straight, 5, [2, 3])
    resizes = {}
    for workers, servers in ((2, 1), (2, 3), (3, 1)):  # the global batch is kept: 3 workers take 11, 11, 10
        resumed = _resume_from(straight, 5, tmp_path / f"{workers}w{servers}s")
        settings = [f"ps.servers={servers}", *([HARDWARE] if (workers, servers) == (2, 1) else [])]
        results = run_workers(_run, workers + servers, settings, resumed, timeout=120)
        summary = results[0][0]
        assert summary["steps"] == 15 and (summary["workers"], summary["servers"]) == (workers, servers)
        got = torch.load(resumed / "model.pt", weights_only=True)
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)
        loaded = [piece for _, state in results[workers:] for piece in state]  # in flat order
        assert len(loaded) > servers  # several slices a server
        for name in ("param", "exp_avg", "exp_avg_sq"):  # the saved state, bitwise
            assert torch.equal(_joined(loaded, name), _joined(saved, name)), name
        for piece in loaded:
            assert piece["clocks"] == dict.fromkeys(range(workers), 5) and piece["version"] == 5
            assert piece["received"] == {w: 5 if w < 2 else 0 for w in range(workers)}  # a new worker: none
            assert float(piece["optimizer"]["state"][0]["step"]) == 5
        assert [state["clock"] for _, state in results[:workers]] == [5] * workers
        (resizes[workers, servers],) = summary["resizes"]
        assert (resizes[workers, servers]["step"], resizes[workers, servers]["old_world_size"],
                resizes[workers, servers]["new_world_size"]) == (5, 4, workers + servers)
    # the old size is priced with the servers it had: 2 workers and 2 servers
    hardware = resolve_hardware("h100-ib-ndr", 1)
    old = predict(load_config(None, [*BASE, "ps.servers=2", HARDWARE]), 2, hardware)["step_seconds"]
    new = predict(load_config(None, [*BASE, "ps.servers=1", HARDWARE]), 2, hardware)["step_seconds"]
    assert old != new
    assert resizes[2, 1]["predicted_step_seconds_old"] == old
    assert resizes[2, 1]["predicted_step_seconds_new"] == new
    err = capfd.readouterr().err
    assert "saved by 4 ranks, resumed on 3" in err and "saved by 4 ranks, resumed on 5" in err


def test_ssp_resumes_on_fewer_servers_with_its_clocks_restarted_at_the_cut(tmp_path, capfd):
    settings = ["ps.consistency=ssp", "ps.staleness=1", "comm.compressor=topk", "comm.density=0.25"]
    straight = _straight(tmp_path, settings)
    resumed = _resume_from(straight, 5, tmp_path / "2w1s")
    results = run_workers(_run, 3, [*settings, "ps.servers=1"], resumed, timeout=120)
    summary = results[0][0]
    assert summary["steps"] == 15 and summary["final_loss"] < 10
    clients, (slices,) = [state for _, state in results[:2]], [state for _, state in results[2:]]
    assert [c["clock"] for c in clients] == [5, 5]
    assert all(piece["clocks"] == {0: 5, 1: 5} for piece in slices)
    sent = sum(summary["pushes_sent_per_worker"]) - sum(c["pushes_sent"] for c in clients)
    applied = sum(s["pushes_applied"] for s in summary["servers_stats"]) - \
        sum(piece["pushes_applied"] for piece in slices)
    assert sent == applied == 10 * 2 * len(slices)  # 10 steps, 2 workers, every slice once a step
    assert summary["pushes_dropped"] == 0
    assert "comm.compressor=topk: the workers' error-feedback state starts from zero on 2 workers and " \
           "1 server (saved by 4 ranks)" in capfd.readouterr().err


def _sgd_momentum(params):
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    optimizer.param_groups[0]["updates"] = 0  # as server_optimizer's schedule count
    return optimizer


def _stepped_slice(values, steps, *, pushes):
    piece = ParameterServer(torch.tensor(values), _sgd_momentum, workers=[0, 1], bound=None, average=False)
    for _ in range(steps):
        piece.param.grad.copy_(piece.param.detach() * 0.5 + 1)
        piece.step()
        piece.optimizer.param_groups[0]["updates"] += 1
    piece.clocks, piece.pushes_applied, piece.received = {0: 3, 1: 3}, pushes, {0: 3, 1: 3}
    return piece.state_dict()


def test_recut_joins_elementwise_state_and_takes_the_rest_from_the_first_elements_slice():
    """Two saved slices of 3 and 2 elements onto three of 1, 3 and 1; 2 ASP workers become 3."""
    saved = [_stepped_slice([1.0, 2.0, 3.0], 6, pushes=6), _stepped_slice([4.0, 5.0], 4, pushes=4)]
    whole = torch.cat([s["param"] for s in saved])
    momentum = torch.cat([s["optimizer"]["state"][0]["momentum_buffer"] for s in saved])
    states = recut(saved, [(0, 1), (1, 4), (4, 5)], n_params=5, workers=[0, 1, 2], clock=3,
                   updates_scale=(3, 2))
    assert torch.equal(torch.cat([s["param"] for s in states]), whole)
    assert torch.equal(torch.cat([s["optimizer"]["state"][0]["momentum_buffer"] for s in states]), momentum)
    assert [s["version"] for s in states] == [6, 6, 4]  # the saved slice holding each first element
    assert [s["pushes_applied"] for s in states] == [6, 6, 4]
    assert [s["optimizer"]["param_groups"][0]["updates"] for s in states] == [9, 9, 6]  # per 3 workers
    assert all(s["clocks"] == {0: 3, 1: 3, 2: 3} and s["received"] == {0: 3, 1: 3, 2: 0} for s in states)
    fresh = ParameterServer(torch.zeros(3), _sgd_momentum, workers=[0, 1, 2], bound=None, average=False)
    fresh.load_state_dict(states[1])  # loads as a slice of 3 elements and 3 workers
    assert torch.equal(fresh.param.detach(), whole[1:4])
    with pytest.raises(UserError, match="hold 5 parameters; this model has 6"):
        recut(saved, [(0, 6)], n_params=6, workers=[0], clock=3)


def _train_or_refuse(rank, world, settings, run_dir):
    try:
        train(load_config(None, settings), run_dir if rank == 0 else None, device=torch.device("cpu"))
    except UserError as exc:
        return str(exc)
    return None


def test_a_checkpoint_of_another_kind_of_parallelism_is_refused_in_one_line(tmp_path):
    ps_dir = tmp_path / "ps"
    ps_dir.mkdir()
    run_workers(_train_or_refuse, 3, [*BASE, "optim.max_steps=5"], ps_dir, timeout=120)  # 2 workers, 1 server
    data_parallel = [s for s in BASE if not s.startswith(("parallel.mode", "ps."))]
    for message in run_workers(_train_or_refuse, 2, data_parallel, ps_dir, timeout=120):
        assert message is not None and "\n" not in message
        assert "was saved by a parameter server run, and this run is data parallel" in message
    dp_dir = tmp_path / "dp"
    dp_dir.mkdir()
    run_workers(_train_or_refuse, 2, [*data_parallel, "optim.max_steps=5"], dp_dir, timeout=120)
    for message in run_workers(_train_or_refuse, 3, BASE, dp_dir, timeout=120):
        assert message is not None and "was saved by a data parallel run, and this run is parameter " \
            "server" in message
