"""Membership changes on an emulated cluster: a node lost for good, the run going on smaller, and growing
back when the node returns (torchrun --nnodes MIN:MAX, over real TCP between namespaces)."""

import json
import subprocess
import sys

import pytest

from paraloom.cli import main
from paraloom.cluster.torchrun import _wait_all
from paraloom.config.errors import WorkersFailed

pytestmark = pytest.mark.netns
# digits, 23 steps an epoch
RUN = ["model.name=mlp", "data.batch_size=64", "run.checkpoint_every=20", "run.log_every=100",
       "run.nodes=3..4"]


def _ours() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("plm-")}


def _train(tmp_path, name: str, inject: str, epochs: int) -> dict:
    settings = [*RUN, f"optim.epochs={epochs}", f"run.out_dir={tmp_path}", f"run.name={name}"]
    sets = [arg for s in settings for arg in ("--set", s)]
    proc = subprocess.run([sys.executable, "-m", "paraloom", "train", "--emulate", "4x1gbit", *sets,
                           "--inject", inject], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:] + "\nnode 0's output:\n" + proc.stdout[-6000:]
    assert "node 3 lost" in proc.stderr
    return json.loads((tmp_path / name / "summary.json").read_text())


@pytest.mark.timeout(500)
def test_a_lost_node_leaves_the_run_on_three_and_its_return_grows_it_back(tmp_path):
    before = _ours()
    # long enough on 3 nodes for node 3 to start again and join (about 15 s: worker start-up)
    summary = _train(tmp_path, "back", "lose:node=3,step=30,back=0", epochs=25)
    assert summary["world_size"] == 4 and summary["steps"] == 25 * 23
    shrink, grow = summary["resizes"]
    assert (shrink["step"], shrink["old_world_size"], shrink["new_world_size"]) == (20, 4, 3)
    assert (grow["old_world_size"], grow["new_world_size"]) == (3, 4)
    assert 0 < summary["steps_redone"] <= 2 * 20 and 0 < shrink["seconds_lost"] < 120
    assert summary["test_accuracy"] > 0.9
    assert _ours() == before
    assert subprocess.run(["pgrep", "-f", "torch.distributed.run"], capture_output=True).stdout == b""


class _Proc:
    """A node's torchrun as _wait_all sees it: exits with `code` at poll `polls`; `then()` runs at poll
    `at`."""

    def __init__(self, code, polls, *, then=None, at=0):
        self.code, self.polls, self.then, self.at, self.count = code, polls, then, at, 0

    def poll(self):
        self.count += 1
        if self.then is not None and self.count == self.at:
            self.then()
        return self.code if self.count >= self.polls else None


def _resizes(run_dir, n):
    (run_dir / "resumes.json").write_text(json.dumps({"restarts": n, "steps_redone": 0, "resizes": [{}] * n}))


def test_the_launcher_lets_a_lost_node_go_and_stops_on_any_other_failure(tmp_path):
    logs = tmp_path / "nodes"
    logs.mkdir()
    _wait_all([_Proc(0, 5), _Proc(0, 5), _Proc(-9, 1)], logs, {2: None}, None, run_dir=tmp_path)
    with pytest.raises(WorkersFailed, match=r"node 1 failed \(exit code -9\)"):
        _wait_all([_Proc(0, 5), _Proc(-9, 1), _Proc(0, 5)], logs, {2: None}, None, run_dir=tmp_path)
    started = []

    def start(node):
        started.append(node)
        return _Proc(0, 3)

    _resizes(tmp_path, 1)  # on record before the loss
    _wait_all([_Proc(0, 8), _Proc(0, 8), _Proc(-9, 1)], logs, {2: 0.0}, start, run_dir=tmp_path)
    assert started == []  # the run ended before the others went on without node 2: not started again
    resumed = _Proc(0, 12, then=lambda: _resizes(tmp_path, 2), at=4)  # the others resume, smaller
    _wait_all([resumed, _Proc(0, 12), _Proc(-9, 1)], logs, {2: 0.0}, start, run_dir=tmp_path)
    assert started == [2]


def test_lose_needs_a_cluster_run_that_may_shrink(capsys):
    assert main(["train", "--inject", "lose:node=1,step=5"]) == 2
    assert "needs run.nodes=MIN..MAX (on a cluster, or local nodes)" in capsys.readouterr().err
    assert main(["train", "--set", "run.nodes=3..4", "--set", "run.max_restarts=0"]) == 2
    assert "goes on through restarts: give run.max_restarts >= 1" in capsys.readouterr().err
    assert main(["train", "--set", "run.nodes=4..3"]) == 2
    assert "must read MIN..MAX with 1 <= MIN <= MAX" in capsys.readouterr().err
    assert main(["train", "--inject", "lose:node=0,step=5"]) == 2
    assert "node 0 hosts the rendezvous" in capsys.readouterr().err
