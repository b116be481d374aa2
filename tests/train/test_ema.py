"""optim.ema: torch's AveragedModel EMA of the weights, kept per rank, checkpointed, resumed exactly,
and refused where a step leaves no one set of weights to average."""

import shutil

import pytest
import torch
from distributed import run_workers
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from paraloom.config import load_config
from paraloom.config.errors import UserError
from paraloom.optim.ema import WeightAverage
from paraloom.train import train
from paraloom.train.checkpoint.store import step_dir

GPT = ["model.name=gpt", "data.name=text", "data.seq_len=16", "data.text_bytes=4000", "model.d_model=16",
       "model.n_heads=2", "model.n_layers=2", "data.batch_size=8", "optim.name=adamw", "optim.lr=0.01",
       "optim.max_steps=6", "run.checkpoint_every=3", "run.log_every=1", "optim.ema=0.9"]


def test_the_average_is_averaged_models_with_buffers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    ours, theirs = WeightAverage(model, 0.9), AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9),
                                                            use_buffers=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        optimizer.zero_grad()
        model(torch.randn(6, 4, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
        optimizer.step()
        ours.update()
        theirs.update_parameters(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with ours.applied():
        inside = {k: v.clone() for k, v in model.state_dict().items()}
    expected = theirs.module.state_dict()
    for key, value in inside.items():
        if value.is_floating_point():  # the batch counter is copied, not averaged
            torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)
        else:
            assert torch.equal(value, weights[key])
        assert torch.equal(model.state_dict()[key], weights[key])  # the weights are back after the block
    assert not torch.equal(inside["0.weight"], weights["0.weight"])
    again = WeightAverage(model, 0.9)
    again.load_state_dict(ours.state_dict())
    assert again.updates == 4
    assert all(torch.equal(a, b) for a, b in zip(again.average, ours.average, strict=True))
    with pytest.raises(ValueError, match="other tensors"):
        WeightAverage(nn.Linear(4, 8), 0.9).load_state_dict(ours.state_dict())


@pytest.mark.parametrize(("setting", "message"), [
    ("optim.ema=1.0", "must lie in (0, 1)"),
    ("parallel.mode=ps", "does not keep optim.ema"),
    ("comm.scheduler=priority", "comm.scheduler=priority (priority) applies"),
    ("comm.sync=local_sgd", "comm.sync=local_sgd steps replicas that differ"),
])
def test_refused_where_no_one_set_of_weights_is_left_to_average(setting, message):
    with pytest.raises(UserError) as caught:
        load_config(None, [*GPT, setting])
    assert message in str(caught.value)


def _run(rank, world, settings, run_dir):
    cfg = load_config(None, [*GPT, *settings])
    try:
        return train(cfg, run_dir if rank == 0 else None, device=torch.device("cpu"))
    except UserError as exc:
        return str(exc)


def _from(straight, step, out):
    out.mkdir()
    shutil.copytree(step_dir(straight, step), step_dir(out, step))
    return out


@pytest.mark.parametrize("grid", [[], ["parallel.pp=2", "parallel.microbatches=2"]], ids=["dp2", "pp2"])
def test_a_resumed_run_ends_with_the_straight_runs_average(grid, tmp_path):
    straight = tmp_path / "straight"
    straight.mkdir()
    summary = run_workers(_run, 2, grid, straight, timeout=120)[0]
    assert 0 <= summary["ema_test_accuracy"] <= 1 and summary["ema_val_loss"] > 0
    resumed = _from(straight, 3, tmp_path / "resumed")
    run_workers(_run, 2, grid, resumed, timeout=120)
    for name in ("model.pt", "model_ema.pt"):
        want, got = (torch.load(d / name, weights_only=True) for d in (straight, resumed))
        assert all(torch.equal(got[k], want[k]) for k in want), name
    ema, weights = (torch.load(straight / n, weights_only=True) for n in ("model_ema.pt", "model.pt"))
    assert any(not torch.equal(ema[k], weights[k]) for k in weights)
    # without the average in the checkpoint, or cut for another grid: one line, not a half-loaded run
    without = run_workers(_run, 2, [*grid, "optim.ema=null"], _from(straight, 3, tmp_path / "plain"),
                          timeout=120)
    assert without[0]["steps"] == 6  # a run without ema resumes from one that had it
    plain = tmp_path / "plain_straight"
    plain.mkdir()
    run_workers(_run, 2, [*grid, "optim.ema=null", "optim.max_steps=3"], plain, timeout=120)
    refused = run_workers(_run, 2, grid, plain, timeout=120)
    assert all("holds no weight average" in r for r in refused), refused
    if grid:
        regrid = run_workers(_run, 1, ["parallel.mode=layers"], _from(straight, 3, tmp_path / "regrid"),
                             timeout=120)
        assert "the weight average resumes only on the grid it was saved with" in regrid[0], regrid


@pytest.mark.parametrize("grid", [[], ["parallel.pp=2", "parallel.microbatches=2"]], ids=["dp2", "pp2"])
def test_each_epoch_scores_the_average_beside_the_weights(grid, tmp_path):
    sets = [*grid, "optim.max_steps=null", "optim.epochs=2", "run.eval_every_epoch=true",
            "run.checkpoint_every=0"]
    summary = run_workers(_run, 2, sets, tmp_path, timeout=120)[0]
    weights, averaged = summary["epoch_accuracy"], summary["ema_epoch_accuracy"]
    assert len(weights) == len(averaged) == 2
    assert [seconds for seconds, _ in averaged] == [seconds for seconds, _ in weights]
    # the last epoch's scores are the final evaluation's: the weights', then the average's
    assert weights[-1][1] == pytest.approx(summary["test_accuracy"])
    assert averaged[-1][1] == pytest.approx(summary["ema_test_accuracy"])
    assert averaged != weights  # the average is what was scored, not the weights again


@pytest.mark.parametrize("grid", [["parallel.pp=2", "parallel.microbatches=2"], ["parallel.tp=2"]],
                         ids=["full_dp2_pp2", "full_dp2_tp2"])
def test_a_fully_sharded_stage_or_slice_keeps_its_own_average_through_a_resume(grid, tmp_path):
    """Each stage's (or tp slice's) average is a DTensor of its own, sharded over its data-parallel
    ranks: the checkpoint keeps them apart. Without that the pp case fails (the stages' averages
    overwrote one another); the tp case passed either way: it checks that a sliced average resumes."""
    settings = [*grid, "parallel.shard=full"]
    straight = tmp_path / "straight"
    straight.mkdir()
    run_workers(_run, 4, settings, straight, timeout=120)
    resumed = _from(straight, 3, tmp_path / "resumed")
    run_workers(_run, 4, settings, resumed, timeout=120)
    for name in ("model.pt", "model_ema.pt"):
        want, got = (torch.load(d / name, weights_only=True) for d in (straight, resumed))
        assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want), name
    ema, weights = (torch.load(straight / n, weights_only=True) for n in ("model_ema.pt", "model.pt"))
    assert all(not torch.equal(ema[k], weights[k]) for k in weights if weights[k].is_floating_point()
               and weights[k].numel() > 1)
