"""The record of restarts and redone steps: rank 0's last finished step, every resume's count, each resize;
the steps a finished run reported."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from paraloom.files import write_json

_IMPORTED_AT = time.time()
PROGRESS = "progress"  # rank 0's last finished step, overwritten in place every step
RESUMES = "resumes.json"


class ProgressMarker:
    """Rank 0 writes its last finished step and the wall time into one small file, in place (no fsync,
    no sync point)."""

    def __init__(self, run_dir: Path) -> None:
        self.fd = os.open(run_dir / PROGRESS, os.O_RDWR | os.O_CREAT, 0o644)

    def mark(self, step: int) -> None:
        os.pwrite(self.fd, f"{step:>12d} {time.time():>18.3f}\n".encode(), 0)

    def close(self) -> None:
        os.close(self.fd)


def read_progress(run_dir: Path) -> tuple[int, float] | None:
    """(last finished step, its wall time) of an earlier attempt, or None."""
    try:
        step, at = (run_dir / PROGRESS).read_text().split()[:2]
        return int(step), float(at)
    except (OSError, ValueError):
        return None


def reported_steps(run_dir: Path) -> int | None:
    """The steps the run in `run_dir` reported having done (its summary.json, written as it ends), or None."""
    try:
        return int(json.loads((run_dir / "summary.json").read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_resume(run_dir: Path, resumed_step: int) -> dict[str, int]:
    """Count one more resume of `run_dir` and the steps done again since `resumed_step`."""
    record = read_resumes(run_dir)
    progress = read_progress(run_dir)
    reached = resumed_step if progress is None else progress[0]
    record["restarts"] += 1
    record["steps_redone"] += max(0, reached - resumed_step)
    write_json(run_dir / RESUMES, record)
    return record


def process_started_at() -> float:
    """When this process started (Linux: from /proc; elsewhere: when this module was imported)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as stat:
            boot = next(float(line.split()[1]) for line in stat if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


def record_resize(run_dir: Path, resize: dict[str, Any], *, saved_at: float | None) -> None:
    """Add a resize to the record, with the seconds it lost: the work since its checkpoint that the
    earlier attempt did and this one redoes, and this attempt's start-up (the idle time between the two
    attempts is not counted: a restart by hand may come days later)."""
    progress = read_progress(run_dir)
    redone = max(0.0, progress[1] - saved_at) if progress is not None and saved_at is not None else 0.0
    record = read_resumes(run_dir)
    start_up = time.time() - process_started_at()
    record["resizes"].append({**resize, "seconds_lost": round(redone + start_up, 3)})
    write_json(run_dir / RESUMES, record)


def read_resumes(run_dir: Path | None) -> dict[str, Any]:
    empty: dict[str, Any] = {"restarts": 0, "steps_redone": 0, "resizes": []}
    if run_dir is None:
        return empty
    try:
        raw = json.loads((run_dir / RESUMES).read_text())
        return {"restarts": int(raw["restarts"]), "steps_redone": int(raw["steps_redone"]),
                "resizes": list(raw.get("resizes", []))}
    except (OSError, ValueError, KeyError, TypeError):
        return empty
