"""ParaloomStrategy under Lightning's own Trainer: 2 CPU processes end where Lightning's DDPStrategy does."""

import os
import socket
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("pytorch_lightning", reason="needs pytorch_lightning: pip install paraloom[lightning]")

from scripts import run_command  # noqa: E402

SCRIPT = Path(__file__).with_name("lightning_digits.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit(strategy: str, out: Path, *args: str) -> dict:
    """Run the script (Lightning starts the second process itself); rank 0's parameters and losses."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "GLOO_SOCKET_IFNAME": "lo"}
    run_command([sys.executable, str(SCRIPT), "--strategy", strategy, "--out", str(out), *args],
                timeout=90, env=env)
    return torch.load(out / f"{strategy}.pt", weights_only=True)


def test_paraloom_strategy_matches_ddp_strategy(tmp_path):
    # accumulating 2 micro-batches: Lightning runs every other backward under block_backward_sync()
    args = ("--steps", "15", "--accumulate", "2")
    ours, theirs = fit("paraloom", tmp_path, *args), fit("ddp", tmp_path, *args)
    assert ours["state_dict"].keys() == theirs["state_dict"].keys()
    for name, value in theirs["state_dict"].items():
        torch.testing.assert_close(ours["state_dict"][name], value, msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(ours["losses"], theirs["losses"])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_paraloom_strategy_with_priority_and_powersgd_trains(tmp_path):
    # the priority updater applies the step itself: the strategy wraps the optimizer in DistributedOptimizer
    result = fit("paraloom", tmp_path, "--steps", "40", "--scheduler", "priority", "--compressor", "powersgd")
    losses = result["losses"]
    assert _mean(losses[-10:]) < 0.5 * _mean(losses[:10]), losses


def test_comm_hook_callback_compresses_lightning_ddp(tmp_path):
    result = fit("ddp", tmp_path, "--steps", "40", "--hook", "powersgd")
    assert _mean(result["losses"][-10:]) < 0.5 * _mean(result["losses"][:10]), result["losses"]
    fp32 = 40 * 4 * sum(value.numel() for value in result["state_dict"].values())
    assert 0 < result["hook_bytes"] < 0.5 * fp32  # plain for PowerSGD's 10 warm-up steps, then rank 2
