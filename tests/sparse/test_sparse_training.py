"""`sparse.*` in the data-parallel trainer: pruned weights stay zero, masks cut traffic, resume is exact."""

import torch
from distributed import run_workers

from paraloom.config import load_config
from paraloom.sparse.training import schedule_for
from paraloom.train import train

BASE = ["model.name=mlp", "model.hidden=64", "sparse.sparsity=0.8", "sparse.every=2", "sparse.end_step=8",
        "data.batch_size=64", "run.checkpoint_every=0", "run.log_every=2"]

torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])  # import torch._dynamo once, before forking


def _train(rank, world, overrides, run_dir):
    cfg = load_config(None, BASE + list(overrides))
    cfg.validate_world(world)
    summary = train(cfg, run_dir if rank == 0 else None, device=torch.device("cpu"))
    return summary


def _weights(run_dir):
    state = torch.load(run_dir / "model.pt", weights_only=True)
    return {k: v for k, v in state.items() if k.endswith("weight")}


def test_pruned_weights_are_zero_and_traffic_shrinks(tmp_path):
    (tmp_path / "a").mkdir()
    summary = run_workers(_train, 2, ["optim.max_steps=12"], tmp_path / "a")[0]
    assert abs(summary["sparse"]["sparsity"] - 0.8) < 0.01
    for name, w in _weights(tmp_path / "a").items():  # each layer at the target, exactly zero
        assert abs(float((w == 0).float().mean()) - 0.8) < 0.01, name
    assert summary["sparse"]["gradient_density_sent"] < 0.3  # weights at 20%; the biases go too
    (tmp_path / "d").mkdir()
    dense = run_workers(_train, 2, ["optim.max_steps=12", "sparse.sparsity=0"], tmp_path / "d")[0]
    assert summary["comm_bytes_per_step"] < 0.6 * dense["comm_bytes_per_step"]  # dense until step 2


def test_resume_keeps_the_masks_and_ends_like_a_straight_run(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    run_workers(_train, 2, ["optim.max_steps=12"], straight)
    run_workers(_train, 2, ["optim.max_steps=6", "run.checkpoint_every=3"], resumed)
    run_workers(_train, 2, ["optim.max_steps=12"], resumed)  # resumes from step 6's checkpoint
    a, b = _weights(straight), _weights(resumed)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_gradual_schedule_ends_on_an_update_step():
    cfg = load_config(None, ["sparse.sparsity=0.9", "sparse.every=10", "sparse.start_step=5"]).sparse
    schedule = schedule_for(cfg, total_steps=100)  # half the run is 50: the next update after it is 55
    assert (schedule.start, schedule.end, schedule.every) == (5, 55, 10)
    assert schedule.target(55) == 0.9 and schedule.due(55) and not schedule.due(60)
