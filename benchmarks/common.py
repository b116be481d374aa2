"""What the benchmark scripts share: a `paraloom train` run and its run dir read back, tables, the report."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.table import Table


def train_run(out: Path, name: str, args: Sequence[str] = (), *, sets: Sequence[str] = (),
              env: dict[str, str] | None = None, timeout: float = 1800, save_model: bool = False,
              checkpoints: bool = False) -> Path:
    """Run `paraloom train ARGS --set SETS...` as a subprocess into `out`/NAME, without checkpoints
    unless `checkpoints` (and without model.pt unless `save_model`); returns the run dir. A failed
    run ends the benchmark with the tail of its stderr."""
    run_name = name.replace(" ", "_")  # a run name is one word
    own = [f"run.out_dir={out}", f"run.name={run_name}"] + ([] if checkpoints else ["run.checkpoint_every=0"])
    if not save_model:
        own.append("run.save_model=false")
    cmd = [sys.executable, "-m", "paraloom", "train", *args]
    for item in [*sets, *own]:
        cmd += ["--set", item]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    return out / run_name


def train(out: Path, name: str, args: Sequence[str] = (), *, sets: Sequence[str] = (),
          env: dict[str, str] | None = None, timeout: float = 1800, save_model: bool = False,
          with_metrics: bool = False, checkpoints: bool = False) -> Any:
    """`train_run`, then its summary.json; with `with_metrics`, (summary, metrics.jsonl's records)."""
    run = train_run(out, name, args, sets=sets, env=env, timeout=timeout, save_model=save_model,
                    checkpoints=checkpoints)
    summary = json.loads((run / "summary.json").read_text())
    if not with_metrics:
        return summary
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return summary, [json.loads(line) for line in lines if line]


def make_table(title: str, columns: Sequence[str], *, left: Sequence[str] = ()) -> Table:
    """A rich table with these columns, right-justified but for those in `left`."""
    out = Table(title=title)
    for column in columns:
        out.add_column(column, justify="left" if column in left else "right")
    return out


def write_json(path: str | Path, report: dict[str, Any], indent: int = 2) -> None:
    """The report as indented JSON (rewritten whole each time: a partial run leaves what it has), with
    the machine it ran on under "machine" (figures of two CPUs do not compare)."""
    out = report if "machine" in report else {**report, "machine": machine()}
    Path(path).write_text(json.dumps(out, indent=indent) + "\n")


def machine() -> dict[str, Any]:
    """What a result depends on beyond the code: the CPU's model and cores, torch's and Python's versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch_version, "python": platform.python_version()}
