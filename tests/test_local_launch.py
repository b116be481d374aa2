"""The local launcher: torch's elastic agent starts CPU workers from a forkserver that imported the
training stack once, GPU workers by spawn; failures and restarts pass through either way."""

import multiprocessing
import os
import sys
from multiprocessing import forkserver
from pathlib import Path

import pytest

from paraloom.cli import train as cli_train
from paraloom.config import load_config
from paraloom.config.errors import WorkersFailed
from paraloom.run import launch, prestart


def _where_am_i(fail_first: bool) -> dict:
    """A worker's view: was the training stack imported before this function ran, and which start."""
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if fail_first and restart == 0 and os.environ["RANK"] == "1":
        raise RuntimeError("rank 1 fails on its first start")
    return {"preloaded": "paraloom.train" in sys.modules and "torch._dynamo" in sys.modules,
            "restart": restart, "rank": int(os.environ["RANK"]), "pid": os.getpid()}


@pytest.mark.timeout(180)
def test_forkserver_workers_find_the_stack_imported_and_restart_from_it():
    out = launch.elastic_run(_where_am_i, (True,), nproc=2, max_restarts=1, start_method="forkserver")
    assert sorted(out) == [0, 1]
    assert all(r["preloaded"] and r["restart"] == 1 for r in out.values()), out
    assert out[0]["pid"] != out[1]["pid"] and os.getpid() not in {r["pid"] for r in out.values()}
    with pytest.raises(WorkersFailed, match="rank 1 failed .*rank 1 fails on its first start"):
        launch.elastic_run(_where_am_i, (True,), nproc=2, max_restarts=0, start_method="forkserver")
    # the forkserver leaves with its launch, reaped: no child of this process is left
    assert not multiprocessing.active_children()
    assert forkserver._forkserver._forkserver_pid is None


def test_cpu_runs_fork_from_a_forkserver_and_gpu_runs_spawn(monkeypatch, tmp_path: Path):
    seen = []
    monkeypatch.setattr(launch, "elastic_run",
                        lambda fn, args, **kw: seen.append(kw["start_method"]) or {0: {}})
    monkeypatch.setattr(launch.worker, "cuda_index", lambda *a, **k: 0)
    for device, cuda in (("cpu", True), ("auto", False), ("auto", True), ("cuda", True)):
        monkeypatch.setattr(launch.torch.cuda, "is_available", lambda cuda=cuda: cuda)
        monkeypatch.setattr(launch.torch.cuda, "device_count", lambda: 1)
        cfg = load_config(None, [f"run.device={device}"])
        launch.launch_local(cfg, tmp_path, started_at=0.0)
    assert seen == ["forkserver", "forkserver", "spawn", "spawn"]
    monkeypatch.setattr(launch.multiprocessing, "get_all_start_methods", lambda: ["spawn"])  # as on Windows
    launch.launch_local(load_config(None, ["run.device=cpu"]), tmp_path, started_at=0.0)
    assert seen[-1] == "spawn"


def _parent(_: bool) -> int:
    return os.getppid()


@pytest.mark.timeout(180)
def test_a_forkserver_started_early_is_the_one_the_launch_forks_from_and_it_leaves_with_it():
    prestart.start()  # as `paraloom train` does before importing torch
    server = forkserver._forkserver._forkserver_pid
    assert server is not None
    out = launch.elastic_run(_parent, (False,), nproc=2, start_method="forkserver")
    assert set(out.values()) == {server}  # no second server: the workers forked from the early one
    assert forkserver._forkserver._forkserver_pid is None and not multiprocessing.active_children()
    # a server no launch took (one an earlier launch left) is not reused: it holds its own environment
    prestart.start()
    prestart.take()
    prestart.take()
    assert forkserver._forkserver._forkserver_pid is None
    prestart.stop()


def test_paraloom_train_starts_the_forkserver_early_only_for_cpu_workers_on_this_machine(monkeypatch):
    calls = []
    monkeypatch.setattr(prestart, "start", lambda: calls.append("start"))
    monkeypatch.setattr(cli_train, "_train_on", lambda *a, **k: (_ for _ in ()).throw(SystemExit(0)))
    for device, gpu, expected in (("cpu", True, ["start"]), ("auto", False, ["start"]), ("auto", True, [])):
        monkeypatch.setattr(prestart, "gpu_visible", lambda gpu=gpu: gpu)
        calls.clear()
        with pytest.raises(SystemExit):
            cli_train.train(set_=[f"run.device={device}", "run.hardware=none"], nproc=2)
        assert calls == expected, (device, gpu)


def test_a_first_use_calibration_runs_before_the_forkserver_starts(monkeypatch, tmp_path):
    """The calibration measures this machine's compute: not while a server imports torch beside it."""
    calls = []
    monkeypatch.setattr(prestart, "start", lambda: calls.append("start"))
    monkeypatch.setattr(prestart, "gpu_visible", lambda: False)
    monkeypatch.setattr(cli_train, "_calibrate_once", lambda cfg, emulated=None: calls.append("calibrate"))
    monkeypatch.setattr(cli_train, "_train_on", lambda *a, **k: (_ for _ in ()).throw(SystemExit(0)))
    monkeypatch.delenv("PARALOOM_HARDWARE", raising=False)
    monkeypatch.setenv("PARALOOM_CACHE_DIR", str(tmp_path))  # nothing cached: the run calibrates first
    with pytest.raises(SystemExit):
        cli_train.train(set_=["run.device=cpu"], nproc=2)
    assert calls == ["calibrate", "start"]
    calls.clear()
    from paraloom.config.sections import threads_per_worker
    from paraloom.perfmodel.measure.machine_profile import cached_path

    cached_path(threads_per_worker(2)).write_text("{}")  # a profile cached: the server starts at once
    with pytest.raises(SystemExit):
        cli_train.train(set_=["run.device=cpu"], nproc=2)
    assert calls == ["start", "calibrate"]


def test_no_forkserver_is_started_where_the_platform_has_none(monkeypatch):
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])  # as on Windows
    prestart.start()
    prestart.stop()
    monkeypatch.undo()
    assert getattr(forkserver._forkserver, "_forkserver_pid", None) is None
