"""The local history of runs: every run's configuration, prediction and measured terms, a JSON line each.

Rank 0 appends one line when a run with a run directory finishes (`record`), to `history.jsonl`
in the cache directory (`machine_profile.cache_dir`). `paraloom history` lists it and scores the
white, grey and black boxes on it (`perfmodel/runs/fitted.py`); `paraloom calibrate --from history`
refits the white box's constants from the runs it lists whose directories are still there.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from paraloom.perfmodel.measure.machine_profile import cache_dir

FILE = "history.jsonl"


def history_path() -> Path:
    return cache_dir() / FILE


def entry_of(run_dir: Path, config: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """One run's line: what it ran, what it predicted of itself and what it measured."""
    contract = summary.get("contract") or {}
    predicted = contract.get("predicted") or {}
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "run_dir": str(Path(run_dir).resolve()),
            "config": config, "world_size": summary.get("world_size"), "nodes": summary.get("nodes"),
            "predicted": predicted if "terms" in predicted else None,
            "measured": contract.get("measured"), "samples_per_second": summary.get("samples_per_second")}


def record(run_dir: Path, config: dict[str, Any], summary: dict[str, Any]) -> None:
    """Append the run's line: one write in append mode, whole even beside another run's."""
    path = history_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(entry_of(run_dir, config, summary)) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read(path: Path | None = None) -> list[dict[str, Any]]:
    """Every whole line of the history (a torn or foreign line is passed over), oldest first."""
    path = path or history_path()
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and "config" in entry:
            out.append(entry)
    return out


def finished_run_dirs(entries: list[dict[str, Any]]) -> list[Path]:
    """The run directories of `entries` still on disk with their summary and config."""
    dirs = dict.fromkeys(Path(e["run_dir"]) for e in entries if e.get("run_dir"))
    return [d for d in dirs if (d / "summary.json").is_file() and (d / "config.yaml").is_file()]
