"""The whole CLI under faults: killed ranks restart and finish exactly, damaged checkpoints are passed
over, hung ranks are named within the timeout, NaN steps are skipped, memory stays flat."""

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from scripts import tagged_processes

from paraloom.config import load_config
from paraloom.train.checkpoint.store import step_dir

SMALL = ["--set", "model.name=mlp", "--set", "model.hidden=32", "--set", "optim.epochs=2",
         "--set", "run.checkpoint_every=10", "--set", "run.log_every=5"]  # 46 steps on 2 ranks
TAG = f"paraloom-ft-{os.getpid()}"


def paraloom(*args, out: Path, name: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "paraloom", "train", *SMALL, "--set", f"run.out_dir={out}",
           "--set", f"run.name={name}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PARALOOM_TEST_TAG=TAG))


def resume(run_dir: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paraloom", "train", "--resume", str(run_dir)],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PARALOOM_TEST_TAG=TAG))


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def leftovers() -> list[int]:
    """Processes still carrying this test's tag."""
    return tagged_processes(TAG)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("ft")
    done = paraloom(out=out, name="straight")
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "straight"


@pytest.mark.timeout(600)
def test_killed_rank_restarts_and_ends_exactly_where_an_uninterrupted_run_does(baseline, tmp_path):
    expected = final_params(baseline)
    kills = {seed: random.Random(seed).randint(2, 46) for seed in range(5)}

    def kill_run(seed):
        return paraloom("--inject", f"kill:rank=1,step={kills[seed]}", out=tmp_path, name=f"kill{seed}")

    # three runs at a time: much of a run is process start-up and restart back-off, not CPU
    with ThreadPoolExecutor(max_workers=3) as pool:
        done = dict(zip(kills, pool.map(kill_run, kills), strict=True))
    for seed, step in kills.items():
        assert done[seed].returncode == 0, done[seed].stderr[-3000:]
        run_dir = tmp_path / f"kill{seed}"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["restarts"] == 1 and summary["steps"] == 46
        assert summary["steps_redone"] == (step - 1) % 10  # since the last checkpoint (every 10)
        got = final_params(run_dir)
        assert all(torch.equal(got[k], expected[k]) for k in expected), f"kill at step {step}"
    assert not leftovers()


def test_truncated_latest_checkpoint_resumes_from_the_one_before(baseline, tmp_path):
    run_dir = tmp_path / "cut"
    shutil.copytree(baseline, run_dir)
    for name in ("model.pt", "summary.json"):
        (run_dir / name).unlink()
    shutil.rmtree(step_dir(run_dir, 46))  # as if the run had stopped after step 40's checkpoint
    damaged = step_dir(run_dir, 40) / ".metadata"  # DCP's index of the tensors
    damaged.write_bytes(damaged.read_bytes()[:100])
    done = resume(run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipping checkpoint step-00000040" in done.stderr and ".metadata" in done.stderr
    assert "resuming from checkpoint step 30 of 46" in done.stderr
    expected, got = final_params(baseline), final_params(run_dir)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def _prepared_run(run_dir: Path, steps: list[int], *, damaged: bool, summary_at: int | None = None) -> None:
    """A run directory as a run that saved `steps` leaves it: its config, metrics and sealed checkpoints
    (manifest and checksums; `damaged`: no file matches its checksum)."""
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(f"run:\n  name: {run_dir.name}\nmodel:\n  name: mlp\n  hidden: 8\n"
                                         "optim:\n  max_steps: 2\n")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in steps))
    if summary_at is not None:
        (run_dir / "summary.json").write_text(json.dumps({"steps": summary_at}))
    for step in steps:
        folder = step_dir(run_dir, step)
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(b"tensors")
        digest = hashlib.sha256(b"tensors" + (b"!" if damaged else b"")).hexdigest()
        (folder / "manifest.json").write_text(json.dumps({"step": step, "world_size": 1, "files": {
            "__0_0.distcp": {"sha256": digest, "bytes": 7}}}))


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_resume_whose_checkpoints_are_all_damaged_is_refused_and_changes_nothing(tmp_path, capsys):
    """Once it started again from step 0 after two warnings, over the damaged checkpoints and metrics."""
    from paraloom.cli import main

    run_dir = tmp_path / "damaged"
    _prepared_run(run_dir, [10, 20], damaged=True)
    before = _snapshot(run_dir)
    assert main(["train", "--resume", str(run_dir), "--set", "optim.max_steps=30"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("paraloom: error: ") and "Traceback" not in err, err
    for step in (10, 20):  # each checkpoint named, with why it was passed over
        assert f"step-000000{step}: {step_dir(run_dir, step)}/__0_0.distcp does not match its checksum" in err
    assert "--restart-from-scratch" in err
    assert _snapshot(run_dir) == {**before, ".lock": b""}  # its lock, let go


def test_a_finished_run_resumed_as_it_was_is_refused(tmp_path, capsys):
    """Once "resuming from checkpoint step 2 of 2", a run that trained nothing, its summary written again."""
    from paraloom.cli import main

    run_dir = tmp_path / "done"
    _prepared_run(run_dir, [2], damaged=False, summary_at=2)
    assert main(["train", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("paraloom: error: nothing is left to train: the run in ")
    assert len(err.splitlines()) == 1 and "finished at step 2, its newest checkpoint (summary.json); to " \
        f"train on, raise optim.max_steps (now 2) with --set: paraloom train --resume {run_dir} --set " \
        "optim.max_steps=..." in err
    assert not (run_dir / "config_history.jsonl").exists()


def test_restart_from_scratch_moves_the_earlier_attempt_aside_and_records_the_overrides(tmp_path, capsys):
    """The explicit way to start again in the same directory: nothing deleted, the config's overrides kept
    for the next --resume (which once dropped them without a word)."""
    from paraloom.cli import main

    run_dir = tmp_path / "again"
    _prepared_run(run_dir, [10, 20], damaged=True)
    before = _snapshot(run_dir)
    assert main(["train", "--resume", str(run_dir), "--restart-from-scratch", "--nproc", "1",
                 "--set", "optim.max_steps=3", "--set", "run.log_every=1"]) == 0
    err = capsys.readouterr().err
    assert f"paraloom: starting {run_dir} again from step 0 (--restart-from-scratch): its earlier " in err
    assert "resuming from checkpoint" not in err and "skipping checkpoint" not in err
    discarded = next(run_dir.glob("discarded-*"))
    assert _snapshot(discarded) == {name: data for name, data in before.items() if name != "config.yaml"}
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in rows] == [1, 2, 3]  # this run's alone
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-00000003"]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["optim"]["max_steps"] == 3 and config["parallel"]["nproc"] == 1
    assert config["run"]["name"] == "again" and config["model"]["hidden"] == 8
    (record,) = [json.loads(line) for line in (run_dir / "config_history.jsonl").read_text().splitlines()]
    assert record["step"] is None and record["discarded"] == discarded.name
    assert record["overrides"] == ["optim.max_steps=3", "run.log_every=1", "parallel.nproc=1"]
    # the run it started is whole: resumed as it is, it has nothing left to train
    assert main(["train", "--resume", str(run_dir)]) == 2
    assert "nothing is left to train: the run in " in capsys.readouterr().err


def test_a_resume_before_the_first_checkpoint_says_it_starts_from_step_0(tmp_path, capsys):
    from paraloom.run.directory import resume_run

    run_dir = tmp_path / "early"
    _prepared_run(run_dir, [], damaged=False)
    (run_dir / "checkpoints" / "step-00000010.tmp").mkdir(parents=True)  # a save the stop cut short
    cfg = load_config(run_dir / "config.yaml", ["optim.max_steps=4"])
    with resume_run(run_dir, cfg, overrides=["optim.max_steps=4"], inject=[]) as resumed:
        assert resumed.step is None
        assert resumed.begin(cfg) == run_dir
    err = capsys.readouterr().err
    assert f"paraloom: {run_dir} holds no checkpoint (its run stopped before writing one): training starts " \
           "from step 0\n" in err
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["optim"]["max_steps"] == 4
    (record,) = [json.loads(line) for line in (run_dir / "config_history.jsonl").read_text().splitlines()]
    assert record["step"] is None and record["overrides"] == ["optim.max_steps=4"]


def test_hung_rank_fails_the_run_within_the_timeout_naming_it(tmp_path):
    started = time.time()
    done = paraloom("--inject", "hang:rank=1,step=10", "--set", "comm.timeout_s=5",
                    "--set", "run.max_restarts=0", out=tmp_path, name="hang", timeout=120)
    ended = time.time()
    assert done.returncode != 0
    assert "rank 1 stopped answering" in done.stderr and "step 10" in done.stderr
    hung_at = (tmp_path / "hang" / ".fired-hang-rank1-step10").stat().st_mtime
    assert started < hung_at and ended - hung_at < 5 + 10
    time.sleep(1)
    assert not leftovers()


def test_nan_step_is_skipped_and_a_run_of_them_stops_with_the_checkpoint_intact(tmp_path):
    with ThreadPoolExecutor(max_workers=2) as pool:
        skipped = pool.submit(paraloom, "--inject", "nan:rank=0,step=5", out=tmp_path, name="nan")
        stopped = pool.submit(paraloom, "--inject", "nan:rank=1,step=15", "--set", "guard.max_bad_steps=1",
                              "--set", "run.max_restarts=0", out=tmp_path, name="stop")
        # a parameter-server worker that is not rank 0: its skip is its own, reported and counted
        ps = pool.submit(paraloom, "--inject", "nan:rank=2,step=5", "--set", "parallel.mode=ps",
                         "--nproc", "3", out=tmp_path, name="ps")
    done = ps.result()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 2: step 5 skipped: non-finite gradients" in done.stderr
    summary = json.loads((tmp_path / "ps" / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["pushes_dropped"] == 1
    done = skipped.result()
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "nan" / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["steps"] == 46
    assert "step 5 skipped: non-finite gradients" in done.stderr

    done = stopped.result()
    assert done.returncode == 1
    assert "1 steps in a row (up to step 15) had NaN or Inf gradients" in done.stderr
    from paraloom.train.checkpoint.store import latest_valid

    assert latest_valid(tmp_path / "stop") == step_dir(tmp_path / "stop", 10)


def test_soak_memory_stays_flat(tmp_path):
    done = paraloom("--set", "optim.epochs=100", "--set", "optim.max_steps=2000",
                    "--set", "data.batch_size=16", "--set", "run.log_every=100",
                    "--set", "run.checkpoint_every=500", out=tmp_path, name="soak", timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "soak" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2000
    base = next(r["rss_mb"] for r in rows if r["step"] == 200)
    for row in rows:
        if row["step"] > 200:
            for rank, (now, then) in enumerate(zip(row["rss_mb"], base, strict=True)):
                assert now < then * 1.05, f"rank {rank} grew from {then} MB to {now} MB by step {row['step']}"


def test_a_pipelines_checkpoint_resumes_as_data_parallel_with_one_setting_changed(tmp_path):
    first = paraloom("--set", "parallel.pp=2", "--set", "parallel.microbatches=2",
                     "--set", "optim.max_steps=20", out=tmp_path, name="pp")
    assert first.returncode == 0, first.stderr[-3000:]
    done = subprocess.run([sys.executable, "-m", "paraloom", "train", "--resume", str(tmp_path / "pp"),
                           "--set", "parallel.pp=1", "--set", "optim.max_steps=30"],
                          capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PARALOOM_TEST_TAG=TAG))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming on another strategy: parallel.microbatches back to the default" in done.stderr
    assert "resuming from checkpoint step 20 of 30" in done.stderr
