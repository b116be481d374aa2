"""A DDP script with its import changed restarts under torchrun and ends as an uninterrupted run.

examples/ddp_snapshot.py (PyTorch's DDP tutorial in shape: a snapshot every epoch, resumed from at
start) runs under `torchrun --standalone --nproc-per-node 2 --max-restarts 1` with
`from paraloom import DataParallel as DDP`; after its first snapshot one worker is killed (SIGKILL).
The restarted workers must resume and end with the parameters of the same script trained without
interruption (by forked ranks, which costs a second); the surviving worker's error names the peer's death.
One such torchrun costs ~10 s (four workers importing torch, the agent), so this runs one;
benchmarks/drop_in_restarts.py runs ten for each of torch's DDP and the drop-in.
"""

import importlib.util
import os
import re

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from scripts import ROOT

from paraloom.run.agent_store import RENDEZVOUS, attempt_prefix, isolate_attempts


def _load(name: str, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def restarts():
    """benchmarks/drop_in_restarts.py, which starts, kills and reads back the torchrun runs."""
    return _load("drop_in_restarts", ROOT / "benchmarks" / "drop_in_restarts.py")


def _uninterrupted(rank, world, script_path, epochs, where):
    os.environ["RANK"] = str(rank)  # as torchrun would
    script = _load("ddp_snapshot_paraloom", script_path)
    dataset, model, optimizer = script.load_train_objs()
    trainer = script.Trainer(model, script.prepare_dataloader(dataset, 32), optimizer, 1,
                             str(where / "snapshot.pt"))
    trainer.train(epochs)
    return trainer.model.module.state_dict()


def test_a_killed_worker_restarts_and_ends_as_an_uninterrupted_run(restarts, tmp_path):
    script = restarts.write_script("paraloom", tmp_path)
    epochs = 4
    run = restarts.run_once(script, tmp_path / "killed", kill_rank=0, epochs=epochs, kill_after=1, timeout=90,
                            delay=0.0)
    output = run["output"]
    assert run["killed"] is not None, f"no worker was killed:\n{output[-3000:]}"
    assert run["code"] == 0, f"{restarts.failure(run)}:\n{output[-4000:]}"
    resumed = re.search(r"Resuming training from snapshot at epoch (\d+)", output)
    assert resumed and 1 <= int(resumed[1]) < epochs, output[-3000:]  # a restart in the middle of the run
    # the survivor of the killed attempt names the peer's death, not uneven inputs (when it raises before
    # the agent stops it: on a busy machine the agent's SIGTERM can come first)
    said = restarts.survivor_error(run)
    assert said is None or "a peer rank died (its connection closed)" in said, said
    assert "same number of batches" not in output
    expected = run_workers(_uninterrupted, 2, script, epochs, tmp_path)[0]
    got = restarts.final_state(tmp_path / "killed")
    assert got is not None and got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def test_only_the_agents_store_of_a_torchrun_worker_gets_the_attempts_prefix(monkeypatch):
    made = []

    def create(*args):
        made.append(args)
        return dist.HashStore()

    monkeypatch.setattr(RENDEZVOUS, "_create_c10d_store", create)
    isolate_attempts()
    isolate_attempts()  # once is enough: a second call wraps nothing again
    create = RENDEZVOUS._create_c10d_store
    for name in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert attempt_prefix() is None
    assert isinstance(create("localhost", 29500, 0, 2, None), dist.HashStore)  # outside torchrun
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert attempt_prefix() == "paraloom/attempt-1"
    store = create("localhost", 29500, 0, 2, None)
    assert isinstance(store, dist.PrefixStore)
    store.set("key", "value")
    assert store.underlying_store.get("paraloom/attempt-1/key") == b"value"
    assert isinstance(create("localhost", 29501, 0, 2, None), dist.HashStore)  # not the agent's
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # a store per round: nothing to keep apart
    assert isinstance(create("localhost", 29500, 0, 2, None), dist.HashStore)
    assert len(made) == 4
