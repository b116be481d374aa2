"""Run-directory output: metrics.jsonl (a line per logged step), optional TensorBoard, JSON files; memory."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


class MetricsLogger:
    """Appends one JSON line per logged step; mirrors scalars to TensorBoard when asked."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = False) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def save_state(path: Path, state: dict[str, torch.Tensor]) -> None:
    """torch.save through a temporary file and a rename, so a crash leaves no torn file."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def memory_mb() -> tuple[float, float]:
    """(resident, peak resident) memory of this process in MB (Linux /proc; zeros where unavailable)."""
    found = {"VmRSS:": 0.0, "VmHWM:": 0.0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":", 1)[0] + ":"
                if key in found:
                    found[key] = int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return found["VmRSS:"], found["VmHWM:"]
