"""The CLI: user errors are one line with exit code 2; `paraloom train` runs end to end."""

import contextlib
import fcntl
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from paraloom.cli import main


@pytest.mark.parametrize(("argv", "message"), [
    (["train", "--set", "data.name=nope"], "data.name='nope' is not valid"),
    (["train", "--nproc", "0"], "--nproc 0 must be at least 1"),
    (["train", "--nproc", "two"], "--nproc"),
    (["train", "absent.yaml"], "config file 'absent.yaml' does not exist"),
    (["train", "--set", "data.batch_size=1"], "gives some of the 2 workers no sample"),
    (["train", "--set", "data.batch_size=63", "--set", "model.name=gpt", "--set", "data.name=text",
      "--set", "parallel.tp=2", "--nproc", "4"], "cannot be split across 2 data-parallel replicas"),
    (["train", "--set", "bogus"], "must look like section.key=value"),
    (["train", "--bogus"], "No such option"),
    (["nope"], "No such command"),
    # a setting the run's strategy has no use for is refused, naming both (its STRATEGY_ENTRIES' unused)
    (["train", "--set", "parallel.mode=ps", "--set", "comm.sync=local_sgd"],
     "the parameter_server strategy does not use comm.sync=local_sgd"),
    (["train", "--set", "parallel.mode=ps", "--set", "guard.nan=false"],
     "the parameter_server strategy does not use guard.nan=false"),
    (["train", "--set", "parallel.mode=ps", "--set", "run.device=cuda"], "parameter_server strategy"),
    (["train", "--set", "parallel.microbatches=4"],
     "the data_parallel strategy does not use parallel.microbatches=4"),
    (["train", "--set", "ps.servers=2"], "the data_parallel strategy does not use ps.servers=2"),
    (["train", "--set", "model.name=gpt", "--set", "data.name=text", "--set", "parallel.tp=2",
      "--set", "comm.engine=naive"], "the model_parallel strategy does not use comm.engine=naive"),
])
def test_user_errors_are_one_line_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("paraloom: error: ") and message in lines[0]
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # nothing was started


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU for run.device=cuda")
def test_cuda_on_a_machine_without_a_gpu_is_refused_before_anything_starts(capsys, tmp_path, monkeypatch):
    test_user_errors_are_one_line_exit_2(["train", "--set", "run.device=cuda"],
                                         "run.device=cuda but no CUDA device is visible to torch",
                                         capsys, tmp_path, monkeypatch)
    assert not any(tmp_path.iterdir())  # no calibration tried, no run directory


def test_existing_run_name_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "mine").mkdir(parents=True)
    (tmp_path / "runs" / "mine" / "summary.json").write_text("{}")
    assert main(["train", "--set", "run.name=mine"]) == 2
    assert "already holds a run" in capsys.readouterr().err


def _one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("paraloom: error: ") and "Traceback" not in err, err
    return lines[0]


@contextlib.contextmanager
def _held(run_dir):
    """The lock a running `paraloom train` holds on its run directory, taken by this process."""
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def test_a_run_directory_in_use_is_refused_naming_its_holder(tmp_path, capsys):
    """A second run of the same run.name, or a second --resume, while the first runs: one line naming the
    process that holds it, nothing written; a lock its holder left when it died holds nothing."""
    from paraloom.config import load_config
    from paraloom.run.directory import claim_run_dir, new_run_dir

    run_dir = tmp_path / "mine"
    with claim_run_dir(load_config(None, ["optim.max_steps=4"]), run_dir):  # a launcher that has just begun
        written = (run_dir / "config.yaml").read_text()
        for argv in (["--set", f"run.out_dir={tmp_path}", "--set", "run.name=mine"],
                     ["--resume", str(run_dir)]):
            assert main(["train", *argv, "--set", "optim.max_steps=6"]) == 2
            line = _one_error_line(capsys)
            assert f"is in use by process {os.getpid()}" in line and "one run at a time" in line
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "config.yaml"]
        assert (run_dir / "config.yaml").read_text() == written
    # the holder is gone, its lock file stays: the directory is a prepared one, taken as it is
    assert new_run_dir(load_config(None, ["optim.max_steps=2"]), run_dir) == run_dir
    assert (run_dir / ".lock").read_text() == f"{os.getpid()}\n"  # held by this process until it ends


def test_a_resume_of_a_run_in_use_is_refused_before_its_checkpoints_are_read(tmp_path, capsys):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("optim:\n  max_steps: 4\n")
    (run_dir / "checkpoints" / "step-00000002").mkdir(parents=True)  # damaged: no manifest
    with _held(run_dir):
        assert main(["train", "--resume", str(run_dir)]) == 2
        assert f"in use by process {os.getpid()}" in _one_error_line(capsys)
    assert main(["train", "--resume", str(run_dir)]) == 2  # a stale lock: on to the checkpoints
    assert "no checkpoint is whole" in _one_error_line(capsys)
    assert not (run_dir / "config_history.jsonl").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--restart-from-scratch"], "--restart-from-scratch starts the run given with --resume RUN_DIR again"),
    (["--resume", "{run}", "--set", "run.name=other"], "a resumed run keeps its directory"),
])
def test_resume_options_that_cannot_apply_are_refused(argv, message, tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("run:\n  name: x\n")
    assert main(["train", *(a.replace("{run}", str(tmp_path)) for a in argv)]) == 2
    assert message in _one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_help_lists_sections_and_keys(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for key in ("run:", "data:", "batch_size", "comm:", "timeout_s", "parallel:", "nproc"):
        assert key in out


def _check_run_dir(run_dir, steps, log_every):
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("test_accuracy", "wall_seconds", "samples_per_second", "restarts"):
        assert key in summary
    assert summary["steps"] == steps and summary["restarts"] == 0 and summary["world_size"] == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(log_every, steps + 1, log_every))
    for row in rows:
        assert {"step", "loss", "lr", "samples_per_s", "comm_bytes", "comm_seconds"} <= row.keys()
        assert row["comm_bytes"] > 0
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["run"]["name"] == run_dir.name
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    return summary


def test_train_end_to_end_with_two_workers(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "paraloom", "train", "--nproc", "2", "--set", "optim.max_steps=6",
         "--set", "run.log_every=2", "--set", "run.name=e2e", "--set", f"run.out_dir={tmp_path}"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = _check_run_dir(tmp_path / "e2e", steps=6, log_every=2)
    assert summary["comm_bytes_per_step"] > 0
    assert "test accuracy" in proc.stdout


def test_worker_module_runs_under_torchrun(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"optim": {"max_steps": 4}, "run": {"log_every": 2},
                                      "comm": {"interface": "lo"}}))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "paraloom.run.worker", str(config), "--run-dir", str(tmp_path / "tr")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    _check_run_dir(tmp_path / "tr", steps=4, log_every=2)


def test_rank_0_under_a_users_torchrun_takes_the_run_directory_or_names_its_holder(tmp_path, capsys,
                                                                                   monkeypatch):
    """No paraloom launcher holds the directory there: rank 0 does, a new run's and a continued one's."""
    from paraloom.run import worker

    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    config, run_dir = tmp_path / "c.yaml", tmp_path / "tr"
    config.write_text(yaml.safe_dump({"optim": {"max_steps": 4}}))
    run_dir.mkdir()
    with _held(run_dir):
        assert worker.main([str(config), "--run-dir", str(run_dir)]) == 2  # a new run in it
        (run_dir / "checkpoints").mkdir()
        assert worker.main([str(config), "--run-dir", str(run_dir)]) == 2  # continuing its run
    err = capsys.readouterr().err
    assert err.count(f"error: run directory {str(run_dir)!r} is in use by process {os.getpid()}") == 2
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "checkpoints"]


def test_a_peer_lost_under_torchrun_is_one_line_not_a_traceback(tmp_path):
    """Rank 1 hangs at step 3: rank 0 names it in one line (no traceback) and exits 1, a failure
    torchrun's agent restarts where its --max-restarts allows (here none, its default)."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"optim": {"max_steps": 6}, "comm": {"interface": "lo", "timeout_s": 5},
                                      "run": {"inject": "hang:rank=1,step=3"}}))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "paraloom.run.worker", str(config), "--run-dir", str(tmp_path / "hang")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "stopped answering" in line]
    assert lines and lines[0].startswith("paraloom: rank 0: rank 1 stopped answering"), proc.stderr[-3000:]
    assert "PeerFailure" not in proc.stderr and "exitcode  : 1" in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard installed")
def test_tensorboard_without_the_package_is_a_user_error(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--set", "run.tensorboard=true"]) == 2
    assert "pip install tensorboard" in capsys.readouterr().err


def test_public_api():
    import paraloom

    assert paraloom.Topology(dp=2).world_size == 2
    assert set(paraloom.__all__) <= set(dir(paraloom)) | set(paraloom._LAZY)
    with pytest.raises(AttributeError):
        paraloom.nope  # noqa: B018


@pytest.mark.parametrize(("extra", "shown", "hidden"), [
    ({"test_accuracy": None}, ["validation loss"], ["test accuracy"]),  # the model returns its own loss
    ({"test_accuracy": 0.9, "ema_test_accuracy": 0.95, "ema_val_loss": 0.2},
     ["test accuracy", "0.9000", "weight average", "test accuracy 0.9500, validation loss 0.200"], []),
])
def test_the_summary_table_shows_what_the_run_measured(extra, shown, hidden, capsys, tmp_path):
    from paraloom.cli.train import print_summary

    print_summary({"wall_seconds": 1.0, "train_seconds": 0.5, "samples_per_second": 10.0, "val_loss": 0.3,
                   "comm_bytes_per_step": 0.0, "comm_seconds_per_step": 0.0, **extra}, tmp_path)
    out = capsys.readouterr().out
    assert all(text in out for text in shown) and not any(text in out for text in hidden), out
