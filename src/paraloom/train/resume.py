"""What a checkpoint holds for the trainer, and the record of restarts and redone steps.

Shared part (rank 0; only when replicas are identical): model and optimizer. Each rank's part:
step, counters, RNG states, the engine's communication state, and model and optimizer when the
sync mode makes replicas differ (local SGD, one-step delay).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paraloom.train.metrics import write_json

PROGRESS = "progress"  # rank 0's last finished step, overwritten in place every step
RESUMES = "resumes.json"


def capture(model: nn.Module, optimizer: torch.optim.Optimizer, engine, *, step: int,
            counters: dict[str, float], device: torch.device) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared, local) checkpoint parts of this rank, between steps."""
    local: dict[str, Any] = {"step": step, "counters": dict(counters), "engine": engine.comm_state_dict(),
                             "rng": {"torch": torch.get_rng_state()}}
    if device.type == "cuda":
        local["rng"]["cuda"] = torch.cuda.get_rng_state(device)
    replicas = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if engine.replicas_identical:
        return replicas, local
    local.update(replicas)
    return {}, local


def restore(model: nn.Module, optimizer: torch.optim.Optimizer, engine, shared: dict[str, Any] | None,
            local: dict[str, Any], device: torch.device) -> tuple[int, dict[str, float]]:
    """Load a checkpoint's parts; returns (step, counters)."""
    replicas = local if "model" in local else shared
    if replicas is None or "model" not in replicas:
        raise RuntimeError("the checkpoint holds no model state")
    model.load_state_dict(replicas["model"])
    optimizer.load_state_dict(replicas["optimizer"])
    engine.load_comm_state_dict(local["engine"])
    torch.set_rng_state(local["rng"]["torch"].cpu())
    if device.type == "cuda" and "cuda" in local["rng"]:
        torch.cuda.set_rng_state(local["rng"]["cuda"].cpu(), device)
    return int(local["step"]), dict(local["counters"])


class ProgressMarker:
    """Rank 0 writes its last finished step into one small file, in place (no fsync, no sync point)."""

    def __init__(self, run_dir: Path) -> None:
        self.fd = os.open(run_dir / PROGRESS, os.O_RDWR | os.O_CREAT, 0o644)

    def mark(self, step: int) -> None:
        os.pwrite(self.fd, f"{step:>12d}\n".encode(), 0)

    def close(self) -> None:
        os.close(self.fd)


def record_resume(run_dir: Path, resumed_step: int) -> dict[str, int]:
    """Count one more resume of `run_dir` and the steps done again since `resumed_step`."""
    record = read_resumes(run_dir)
    try:
        reached = int((run_dir / PROGRESS).read_text().strip() or 0)
    except (OSError, ValueError):
        reached = resumed_step
    record["restarts"] += 1
    record["steps_redone"] += max(0, reached - resumed_step)
    write_json(run_dir / RESUMES, record)
    return record


def read_resumes(run_dir: Path | None) -> dict[str, int]:
    empty = {"restarts": 0, "steps_redone": 0}
    if run_dir is None:
        return empty
    try:
        raw = json.loads((run_dir / RESUMES).read_text())
        return {key: int(raw[key]) for key in empty}
    except (OSError, ValueError, KeyError, TypeError):
        return empty
