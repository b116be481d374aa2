"""How a run stops: Ctrl-C and SIGTERM end every process in seconds with one line and 128 + the signal,
leave no half-written checkpoint, and resume exactly; a launcher killed outright takes its workers with
it; a mistake a restart would repeat stops every rank at once with exit 2 and no restart."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from scripts import tagged_processes

from paraloom.cluster.emulated import live_owner
from paraloom.train import stopping
from paraloom.train.checkpoint.records import read_progress

TAG = f"paraloom-stop-{os.getpid()}"
SMALL = ["--set", "model.name=mlp", "--set", "model.hidden=32", "--set", "run.checkpoint_every=10",
         "--set", "run.log_every=50", "--set", "run.hardware=none"]
PLANS = {  # what is interrupted: each stops alike, and resumes where an uninterrupted run ends
    "dp": ["--set", "optim.epochs=8"],
    "pp": ["--set", "parallel.pp=2", "--set", "parallel.microbatches=2", "--set", "optim.epochs=8"],
    "ps": ["--set", "parallel.mode=ps", "--set", "optim.epochs=4"],
}


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "paraloom", "train", *args]


def start(args: list[str], out: Path, name: str) -> subprocess.Popen:
    """`paraloom train` in a session of its own, as a terminal would start it."""
    cmd = command(*SMALL, *args, "--set", f"run.out_dir={out}", "--set", f"run.name={name}")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, PARALOOM_TEST_TAG=TAG))


def run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PARALOOM_TEST_TAG=TAG))


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while (read_progress(run_dir) or (0, 0))[0] < step:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"step {step} not reached"
        time.sleep(0.05)


def tagged() -> list[int]:
    """Processes still carrying this test's tag."""
    return tagged_processes(TAG)


def gone_within(seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := tagged()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", list(PLANS))
def test_ctrl_c_stops_every_process_with_one_line_and_resumes_exactly(plan, tmp_path):
    """dp's resumed run is compared with an uninterrupted one bitwise; pp's and ps's resume exactly
    from a checkpoint however their run stopped (tests/train/test_matrix.py), so here they finish."""
    if plan == "dp":
        straight = run(command(*SMALL, *PLANS[plan], "--set", f"run.out_dir={tmp_path}",
                               "--set", "run.name=straight"))
        assert straight.returncode == 0, straight.stderr[-3000:]
    proc = start(PLANS[plan], tmp_path, "cut")
    run_dir = tmp_path / "cut"
    wait_for_step(proc, run_dir, 14)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group gets it
    began = time.monotonic()
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - began < 5 and proc.returncode == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("paraloom: interrupted at step ") and f"--resume {run_dir}" in last
    assert "Traceback" not in err and "SignalException" not in err
    assert not gone_within(5)  # nothing of the run is left running...
    assert not list((run_dir / "checkpoints").glob("*.tmp"))  # ...nor half written
    done = run(command("--resume", str(run_dir)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["restarts"] == 1
    if plan == "dp":
        expected, got = params(tmp_path / "straight"), params(run_dir)
        assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.timeout(300)
def test_sigterm_exits_143_and_a_killed_launcher_takes_its_workers_with_it(tmp_path):
    proc = start(["--set", "optim.epochs=50"], tmp_path, "term")
    wait_for_step(proc, tmp_path / "term", 3)
    proc.send_signal(signal.SIGTERM)  # the launcher alone, as a scheduler's kill does
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and err.strip().splitlines()[-1].startswith("paraloom: interrupted"), err
    assert not gone_within(5)

    proc = start(["--set", "optim.epochs=50"], tmp_path, "killed")
    wait_for_step(proc, tmp_path / "killed", 3)
    assert len(tagged()) >= 3  # the launcher, its forkserver, two workers
    proc.kill()
    proc.communicate()
    left = gone_within(5)
    assert not left, f"still running 5 s after the launcher was killed: {left}"


BAD_MODEL = """
import torch

class Bad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 10)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:  # past every check made before launch
            raise ValueError("no good at the third call")
        return self.lin(x.flatten(1))

def make(**options):
    return Bad()
"""


@pytest.mark.timeout(300)
def test_a_mistake_a_restart_would_repeat_stops_every_rank_at_once_with_exit_2(tmp_path):
    (tmp_path / "badmodel.py").write_text(BAD_MODEL)
    path = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = dict(os.environ, PARALOOM_TEST_TAG=TAG, PYTHONPATH=path)
    done = subprocess.run(command("--set", "model.name=badmodel:make", "--set", f"run.out_dir={tmp_path}",
                                  "--set", "run.name=bad", "--set", "run.max_restarts=3",
                                  "--set", "run.hardware=none"),
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("paraloom: error: rank ") and "ValueError: no good at the third call" in last
    assert "badmodel.py:13" in last and "a restart would repeat it" in last
    assert "Traceback" not in done.stderr and "death signal" not in done.stderr
    resumes = tmp_path / "bad" / "resumes.json"
    assert not resumes.exists() or json.loads(resumes.read_text())["restarts"] == 0  # never restarted
    assert not gone_within(5)


def test_what_a_restart_can_cure_is_told_from_what_it_cannot():
    from paraloom.config.errors import UserError
    from paraloom.train.guards import PeerFailure, TooManyBadSteps

    curable = [PeerFailure("rank 1 stopped answering"), TooManyBadSteps("5 in a row after good steps"),
               RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"),
               RuntimeError("Timed out waiting 30000ms for send operation to complete")]
    repeated = [UserError("data.seq_len=900 is longer than the corpus"), ValueError("bad shape"),
                RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x17 and 16x4)"),
                MemoryError(), OSError(28, "No space left on device"),
                TooManyBadSteps("5 in a row, from the first", from_the_start=True)]
    assert not any(stopping.is_deterministic(exc) for exc in curable)
    assert all(stopping.is_deterministic(exc) for exc in repeated)
    assert "no space left on the device" in stopping.describe(OSError(28, "No space left on device"), 1)
    from torch.distributed.checkpoint.api import CheckpointException

    full = CheckpointException("write", {0: (OSError(28, "No space left on device"), None)})
    assert stopping.is_deterministic(full) and "no space left" in stopping.describe(full, 0)


def test_the_first_rank_to_report_is_the_one_said(tmp_path):
    path = tmp_path / "stop.json"
    assert stopping.read_stop(path) is None
    stopping.write_stop(path, "rank 1: first", 1)
    stopping.write_stop(path, "rank 0: second", 0)
    assert stopping.read_stop(path) == "rank 1: first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stop.json"]


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_ctrl_c_brings_an_emulated_cluster_down_and_a_killed_launchers_cluster_goes_next(tmp_path):
    from paraloom.cli import main

    emulate = ["--emulate", "2x1gbit", "--set", "optim.epochs=60"]
    before = set(_namespaces("plm-"))
    proc = start(emulate, tmp_path, "emu")
    wait_for_step(proc, tmp_path / "emu", 12)
    os.killpg(proc.pid, signal.SIGINT)
    began = time.monotonic()
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - began < 5 and proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("paraloom: interrupted at step ")
    assert "Traceback" not in err and "SignalException" not in err
    assert not gone_within(5) and set(_namespaces("plm-")) == before
    assert not list((tmp_path / "emu" / "checkpoints").glob("*.tmp"))

    proc = start(emulate, tmp_path, "emu-killed")
    wait_for_step(proc, tmp_path / "emu-killed", 3)
    clusters = {ns.split("-")[1] for ns in set(_namespaces("plm-")) - before}
    assert clusters and all(live_owner(name) == proc.pid for name in clusters)  # the launcher's
    proc.kill()  # the launcher alone: its torchrun agents and their workers go with it...
    proc.communicate()
    assert not gone_within(5)
    orphaned = sorted(set(_namespaces("plm-")) - before)
    assert orphaned  # ...its cluster's namespaces stay, until the next command that finds them
    assert not any(live_owner(name) for name in clusters)  # whose owner is gone: orphans
    assert main(["cluster", "down", "--stale"]) == 0
    assert set(_namespaces("plm-")) == before


def test_every_row_of_the_guides_fault_table_names_a_test_that_exists():
    root = Path(__file__).resolve().parents[2]
    guide = (root / "docs" / "guide" / "fault-tolerance.md").read_text()
    table = guide.split("## What happens when", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in table.splitlines()
            if line.startswith("| ") and "---" not in line]
    assert len(rows) >= 15 and rows[0][0].strip() == "fault"
    for fault, _, code, test in rows[1:]:
        path, name = test.strip().strip("`").split("::")
        assert f"def {name}(" in (root / path).read_text(), (fault, test)
        assert code.strip() in ("", "0", "1", "2", "130", "137", "143"), fault


@pytest.mark.timeout(300)
def test_non_finite_steps_from_the_first_stop_at_once_without_restarts(tmp_path):
    done = run(command(*SMALL, "--inject", "nan:rank=0,step=1", "--set", "guard.max_bad_steps=1",
                       "--set", "run.max_restarts=3", "--set", "optim.epochs=1",
                       "--set", f"run.out_dir={tmp_path}", "--set", "run.name=nan"))
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "no step of this attempt was finite, so a restart would repeat it" in last
    assert "Traceback" not in done.stderr
    resumes = tmp_path / "nan" / "resumes.json"
    assert not resumes.exists() or json.loads(resumes.read_text())["restarts"] == 0


def test_a_stopped_runs_half_written_checkpoints_are_discarded_and_whole_ones_kept(tmp_path):
    from paraloom.train.checkpoint.store import discard_staging, step_dir

    whole, staged = step_dir(tmp_path, 10), step_dir(tmp_path, 20).with_name("step-00000020.tmp")
    for folder in (whole, staged):
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(b"\0" * 1024)
    assert discard_staging(tmp_path) == ["step-00000020.tmp"]
    assert whole.is_dir() and not staged.exists()


@pytest.mark.timeout(300)
def test_a_full_disk_stops_the_run_at_once_with_one_line_and_no_half_written_checkpoint(tmp_path):
    disk = tmp_path / "small"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        done = run(command(*SMALL, "--set", "optim.epochs=2", "--set", "run.max_restarts=3",
                           "--set", f"run.out_dir={disk}", "--set", "run.name=full"))
        assert done.returncode == 2, done.stderr[-3000:]
        last = done.stderr.strip().splitlines()[-1]  # whichever rank's write failed first
        assert re.match(r"paraloom: error: rank \d: no space left on the device", last), last
        assert "Traceback" not in done.stderr and "resuming" not in done.stderr  # no restart
        assert not list((disk / "full" / "checkpoints").glob("*.tmp"))
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
