"""A checkpoint resumes on another number of ranks: same global batch, same next steps."""

import json
import os
import shutil
from collections import Counter

import pytest
import torch
from distributed import run_workers

from paraloom.config import load_config
from paraloom.data import DataSets, TensorPairs, make_synthetic
from paraloom.data.sharding import ShardedBatches
from paraloom.train import train
from paraloom.train.checkpoint.store import load_checkpoint, step_dir

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
]


def _run(rank, world, settings, run_dir):
    cfg = load_config(None, [*BASE, *settings])
    return train(cfg, run_dir if rank == 0 else None, device=torch.device("cpu"))


def _model(run_dir):
    return torch.load(run_dir / "model.pt", weights_only=True)


def _resume_from(straight, step, out):
    """A run directory holding only `straight`'s checkpoint of `step`: the steps after it are redone."""
    out.mkdir()
    shutil.copytree(step_dir(straight, step), step_dir(out, step))
    return out


@pytest.mark.parametrize(
    "settings",
    [
        [],
        ["comm.scheduler=priority"],
        ["comm.scheduler=fifo"],
        ["comm.algorithm=tree"],
        ["comm.shard_optimizer=true"],
        ["parallel.shard=full", "parallel.shard_units=size:0.001"],  # each Linear a unit; DCP reshards
    ],
    ids=["wait_free", "priority", "fifo", "tree", "shard_optimizer", "fully_sharded"],
)
def test_dp4_checkpoint_goes_on_at_dp2_and_dp3_as_dp4_would(settings, tmp_path, capfd):
    straight = tmp_path / "dp4"
    straight.mkdir()
    run_workers(_run, 4, settings, straight, timeout=120)
    expected = _model(straight)
    for world in (2, 3):  # dp3 splits every batch of 32 unevenly (11, 11, 10), weighing each share
        resumed = _resume_from(straight, 5, tmp_path / f"dp{world}")
        summaries = run_workers(_run, world, settings, resumed, timeout=120)
        assert summaries[0]["steps"] == 15
        got = _model(resumed)
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)
        resize = summaries[0]["resizes"]
        assert [(r["step"], r["old_world_size"], r["new_world_size"]) for r in resize] == [(5, 4, world)]
        assert 0 < resize[0]["seconds_lost"] < 60
    err = capfd.readouterr().err
    assert "saved by 4 ranks, resumed on 2" in err and "saved by 4 ranks, resumed on 3" in err


def test_one_step_delay_resumes_on_another_size_with_its_pending_step_applied(tmp_path, capfd):
    settings = ["comm.sync=one_step_delay"]
    straight = tmp_path / "dp2"
    straight.mkdir()
    run_workers(_run, 2, settings, straight, timeout=120)  # its finish() lands the step of step 15
    resumed = _resume_from(straight, 15, tmp_path / "dp3")
    run_workers(_run, 3, settings, resumed, timeout=120)  # no step left: the model as loaded
    expected, got = _model(straight), _model(resumed)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-7)
    assert "the pending averaged step is applied" in capfd.readouterr().err
    again = _resume_from(straight, 10, tmp_path / "dp3_from_10")  # and training goes on from there
    summary = run_workers(_run, 3, settings, again, timeout=120)[0]
    assert summary["steps"] == 15 and summary["final_loss"] < 10


def test_local_sgd_resumes_on_another_size_from_the_average_of_the_saved_replicas(tmp_path, capfd):
    settings = ["comm.sync=local_sgd", "comm.local_steps=2"]  # step 15 ends unaveraged: replicas differ
    straight = tmp_path / "dp2"
    straight.mkdir()
    run_workers(_run, 2, settings, straight, timeout=120)
    replicas = [load_checkpoint(straight, 15, r, torch.device("cpu"))[1]["model"] for r in (0, 1)]
    assert any(not torch.equal(replicas[0][k], replicas[1][k]) for k in replicas[0])
    resumed = _resume_from(straight, 15, tmp_path / "dp3")
    run_workers(_run, 3, settings, resumed, timeout=120)  # no step left: the model as loaded
    got = _model(resumed)
    for key in got:
        torch.testing.assert_close(got[key], (replicas[0][key] + replicas[1][key]) / 2, rtol=0, atol=1e-7)
    assert "every rank starts from the average of the 2 saved replicas on 3 ranks" in capfd.readouterr().err


@pytest.mark.parametrize("settings", [["comm.compressor=topk", "comm.density=0.1"],
                                      ["comm.compressor=powersgd"]], ids=["topk", "powersgd"])
def test_a_compressed_run_resumes_on_another_size_with_its_residuals_reset(settings, tmp_path, capfd):
    straight = tmp_path / "dp2"
    straight.mkdir()
    run_workers(_run, 2, settings, straight, timeout=120)
    resumed = _resume_from(straight, 10, tmp_path / "dp3")
    summaries = run_workers(_run, 3, settings, resumed, timeout=120)
    assert summaries[0]["steps"] == 15 and summaries[0]["skipped_steps"] == 0
    err = capfd.readouterr().err
    name = settings[0].split("=")[1]
    assert f"comm.compressor={name}: its error-feedback state starts from zero on 3 ranks (saved by 2)" in err
    before, after = _model(straight), _model(resumed)
    assert all(torch.isfinite(after[k]).all() for k in after) and any(
        not torch.equal(before[k], after[k]) for k in after
    )  # steps 11-15 were trained anew


def test_asynchronous_checkpoints_resume_exactly(tmp_path):
    settings = ["run.async_checkpoint=true"]
    straight = tmp_path / "async"
    straight.mkdir()
    summary = run_workers(_run, 2, settings, straight, timeout=120)[0]
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == [
        "step-00000005", "step-00000010", "step-00000015"]
    assert summary["checkpoint_seconds"] > 0
    plain = tmp_path / "plain"
    plain.mkdir()
    run_workers(_run, 2, [], plain, timeout=120)
    resumed = _resume_from(straight, 5, tmp_path / "resumed")
    run_workers(_run, 2, settings, resumed, timeout=120)
    expected = _model(plain)
    for run_dir in (straight, resumed):
        assert all(torch.equal(_model(run_dir)[k], expected[k]) for k in expected)


def test_a_resize_is_planned_again_and_kept_in_the_summary(tmp_path, capfd):
    settings = ["run.hardware=h100-ib-ndr"]  # a preset: every run can price itself with it
    straight = tmp_path / "dp2"
    straight.mkdir()
    run_workers(_run, 2, settings, straight, timeout=120)
    resumed = _resume_from(straight, 5, tmp_path / "dp3")
    (resize,) = run_workers(_run, 3, settings, resumed, timeout=120)[0]["resizes"]
    assert (resize["step"], resize["old_world_size"], resize["new_world_size"]) == (5, 2, 3)
    old, new = resize["predicted_step_seconds_old"], resize["predicted_step_seconds_new"]
    assert 0 < old and 0 < new and new != old
    assert json.loads((resumed / "prediction.json").read_text())["step_seconds"] == new  # made for dp3
    assert f"resized from 2 to 3 ranks: predicted step {new * 1e3:.2f} ms (at 2: {old * 1e3:.2f} ms)" in (
        capfd.readouterr().err)


class Logged(torch.utils.data.Dataset):
    """The synthetic training set, each sample read appended to `log`.<pid>."""

    def __init__(self, x, y, log):
        self.x, self.y, self.log = x, y, log

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        with open(f"{self.log}.{os.getpid()}", "a") as out:
            out.write(f"{i}\n")
        return self.x[i], self.y[i]


def logged_data(log, n_samples=320):
    split = make_synthetic(n_samples=n_samples)  # 256 training samples
    return DataSets(Logged(split.x_train, split.y_train, log), TensorPairs(split.x_test, split.y_test),
                    n_classes=split.n_classes)


def _read_log(log):
    return Counter(int(i) for path in log.parent.glob(log.name + ".*") for i in path.read_text().split())


def test_per_rank_batch_policy_keeps_each_share_scales_the_rate_and_sees_every_sample_once(tmp_path, capfd):
    log = tmp_path / "read"
    settings = ["run.resize_policy=per_rank_batch", f"data.name={__name__}:logged_data",
                f"data.options.log={log}", "model.hidden=16"]
    straight = tmp_path / "dp4"
    straight.mkdir()
    run_workers(_run, 4, settings, straight, timeout=120)  # no resize: the configured run
    resumed = _resume_from(straight, 5, tmp_path / "dp2")  # 5 steps of 32: 160 samples of epoch 0
    for path in tmp_path.glob("read.*"):
        path.unlink()
    summary = run_workers(_run, 2, settings, resumed, timeout=120)[0]
    # 15 steps of 32 = the whole epoch 0 and 224 samples of epoch 1, now in batches of 16
    order = ShardedBatches(256, 32).order
    probes = Counter({0: 2})  # each rank's model reads sample 0 for its input shape (models/make.py)
    assert _read_log(log) == Counter(order(0)[160:].tolist()) + Counter(order(1)[:224].tolist()) + probes
    assert summary["steps"] == 5 + 96 // 16 + 224 // 16 and summary["samples"] == 15 * 32
    rates = [row["lr"] for row in map(json.loads, (resumed / "metrics.jsonl").read_text().splitlines())]
    assert rates == [pytest.approx(0.005)] * 3  # steps 10, 20, 25; 0.01 x 16 / 32: the linear scaling rule
    assert "global batch 32 on 4 workers -> 16 on 2, learning rate 0.005" in capfd.readouterr().err
    back = _resume_from(resumed, 15, tmp_path / "dp4_again")  # and on 4 workers again: 32, 0.01
    summary = run_workers(_run, 4, settings, back, timeout=120)[0]
    assert summary["steps"] == 15 + 160 // 32 and summary["samples"] == 15 * 32
