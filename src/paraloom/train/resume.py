"""The record of restarts and redone steps: rank 0's last finished step, and every resume's count."""

from __future__ import annotations

import json
import os
from pathlib import Path

from paraloom.train.metrics import write_json

PROGRESS = "progress"  # rank 0's last finished step, overwritten in place every step
RESUMES = "resumes.json"


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
