"""Mixed precision: autocast's dtypes, fp16's loss scaler, and an overflow skipped alike on every rank."""

import json

import pytest
import torch
from distributed import run_workers

from paraloom.config import load_config
from paraloom.optim.precision import LossScaler, autocast
from paraloom.train import train


def test_autocast_computes_matmuls_in_the_asked_dtype():
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with autocast(torch.device("cpu"), precision):
            assert layer(x).dtype == dtype


def test_the_scaler_backs_off_on_an_overflow_and_grows_after_good_steps():
    w = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([w], lr=0.1)
    scaler = LossScaler(init=2.0**16, interval=2)
    optimizer.register_step_pre_hook(scaler.unscale_)
    loss = (w.half() * 2000.0).sum()  # fp16 holds up to 65504: the scaled gradient overflows
    scaler.scaled(loss).backward()
    assert not bool(torch.isfinite(w.grad).all())
    assert scaler.update(False) is True and scaler.scale == 2.0**15  # the scaler's own skip
    w.grad = None
    scaler.scaled((w * 3.0).sum()).backward()
    optimizer.step()  # the pre-hook unscales: the update is lr * 3, whatever the scale
    torch.testing.assert_close(w.detach(), torch.full((3,), 1.0 - 0.3))
    assert scaler.update(True) is False and scaler.update(True) is False
    assert scaler.scale == 2.0**16  # two good steps in a row: grown back
    floor = LossScaler(init=1.0, floor=1.0)
    assert floor.update(False) is False  # at its floor a skip is a bad step, counted by the guard


def _train(rank, world, sets, run_dir):
    cfg = load_config(None, sets)
    cfg.validate_world(world)
    return train(cfg, run_dir if rank == 0 else None, device=torch.device("cpu"))


FP16 = ["run.precision=fp16", "optim.max_steps=5", "run.log_every=1", "run.checkpoint_every=0",
        "run.save_model=false", "guard.max_bad_steps=1", "model.name=mlp"]


@pytest.mark.parametrize(("world", "sets"),
                         [(2, []), (2, ["parallel.mode=layers"]), (3, ["data.batch_size=63"])],
                         ids=["dp2", "layers2", "dp3"])
def test_an_fp16_overflow_skips_the_step_on_every_rank_and_backs_off_alike(world, sets, tmp_path):
    # rank 1's gradients of step 3 turn non-finite, as an fp16 overflow does; guard.max_bad_steps=1
    # would stop the run at one bad step, so finishing shows the scaler's skip is not counted as one
    summaries = run_workers(_train, world, [*FP16, *sets, "run.inject=nan:rank=1,step=3"], tmp_path,
                            timeout=120)
    summary = summaries[0]
    assert summary["steps"] == 5 and summary["skipped_steps"] == 1
    assert summary["loss_scale_per_rank"] == [2.0**15] * world  # halved once, on every rank
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["loss_scale"] for row in rows] == [2.0**16] * 2 + [2.0**15] * 3
    assert [row["skipped_steps"] for row in rows] == [0, 0, 1, 1, 1]


def test_bf16_trains_digits_about_as_well_as_fp32(tmp_path):
    sets = ["model.name=mlp", "optim.epochs=4", "run.checkpoint_every=0", "run.save_model=false"]
    (tmp_path / "fp32").mkdir()
    (tmp_path / "bf16").mkdir()
    fp32 = run_workers(_train, 2, sets, tmp_path / "fp32", timeout=120)[0]
    bf16 = run_workers(_train, 2, [*sets, "run.precision=bf16"], tmp_path / "bf16", timeout=120)[0]
    assert fp32["test_accuracy"] > 0.9
    assert abs(bf16["test_accuracy"] - fp32["test_accuracy"]) < 0.02  # benchmarks/precision.py: 3 seeds
