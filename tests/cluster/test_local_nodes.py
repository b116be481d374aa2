"""run.nodes without a cluster: local nodes (an elastic agent each, on loopback) that a run can lose
and go on without, as on a cluster."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paraloom.cluster.local import TAG, LocalNodes


def _tagged(tag: str) -> list[int]:
    marker = f"{TAG}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.timeout(300)
def test_a_run_on_local_nodes_loses_one_and_finishes_on_the_other(tmp_path):
    settings = ["model.name=mlp", "data.batch_size=64", "optim.epochs=1", "run.checkpoint_every=5",
                "run.log_every=100", "run.nodes=1..2", "run.hardware=none", f"run.out_dir={tmp_path}",
                "run.name=local"]
    sets = [arg for s in settings for arg in ("--set", s)]
    proc = subprocess.run([sys.executable, "-m", "paraloom", "train", "--nproc", "1", *sets,
                           "--inject", "lose:node=1,step=8"], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "2 local nodes" in proc.stderr and "node 1 lost" in proc.stderr
    summary = json.loads((tmp_path / "local" / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["steps"] == 23
    (resize,) = summary["resizes"]
    assert (resize["step"], resize["old_world_size"], resize["new_world_size"]) == (5, 2, 1)
    assert 0 < summary["steps_redone"] <= 5 and summary["test_accuracy"] > 0.8


def test_local_nodes_stop_every_process_they_started():
    nodes = LocalNodes(2)
    assert nodes.address(1) == "127.0.0.1" and nodes.rdzv_port > 0 and "2 local nodes" in nodes.describe()
    child = subprocess.Popen([*nodes.exec_prefix(0), sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)  # out of reach of this process group, as workers are
    try:
        deadline = time.monotonic() + 10
        while not _tagged(nodes.tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _tagged(nodes.tag) == [child.pid]
        nodes.stop_processes(grace_s=1.0)
        assert child.wait(timeout=5) != 0 and _tagged(nodes.tag) == []
    finally:
        if child.poll() is None:
            child.kill()
