"""The hardware profile a run predicts itself from (`run.hardware`): this machine's, calibrated once
on loopback and cached, or a preset, or a YAML file.

The cache lives in `$PARALOOM_CACHE_DIR`, else `$XDG_CACHE_HOME/paraloom`, else
`~/.cache/paraloom`, one file per host name and threads per worker (what the compute rates depend
on); delete the file to measure again. `$PARALOOM_HARDWARE` stands in for "auto" where it is set.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

from paraloom.perfmodel.hardware import Hardware, load_hardware


def cache_dir() -> Path:
    if os.environ.get("PARALOOM_CACHE_DIR"):
        return Path(os.environ["PARALOOM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "paraloom"


def cached_path(threads: int) -> Path:
    return cache_dir() / f"hardware-{socket.gethostname()}-{threads}t.yaml"


def resolve_hardware(name: str, threads: int) -> Hardware | None:
    """The profile `run.hardware` names; None for "none", or for "auto" before the first calibration.
    "auto" reads `$PARALOOM_HARDWARE` first, where set (a cluster's shared profile, or "none")."""
    if name == "auto" and os.environ.get("PARALOOM_HARDWARE"):
        name = os.environ["PARALOOM_HARDWARE"]
    if name == "none":
        return None
    if name == "auto":
        path = cached_path(threads)
        return load_hardware(path) if path.is_file() else None
    return load_hardware(name)


def calibrate_once(threads: int, progress: Callable[[str], None]) -> Path | None:
    """This machine's cached profile, measured now (on loopback) if there is none yet; None where
    `$PARALOOM_HARDWARE` names the profile instead."""
    path = cached_path(threads)
    if os.environ.get("PARALOOM_HARDWARE"):
        return None
    if path.is_file():
        return path
    from paraloom.perfmodel.calibrate import calibrate

    progress(f"calibrating this machine once (about 15 s), cached in {path}")
    hw, _ = calibrate(threads=threads, name=f"{socket.gethostname()} (loopback, {threads} threads)",
                      progress=lambda what: progress(f"  measuring {what}"))
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".tmp{os.getpid()}")
    staging.write_text(hw.to_yaml())
    os.replace(staging, path)  # whole or absent, when two runs calibrate at once
    return path


def threads_per_worker(nproc: int) -> int:
    """The threads each of `nproc` workers on this host gets (as worker.py shares the cores)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // max(1, nproc))


__all__ = ["cache_dir", "cached_path", "calibrate_once", "resolve_hardware", "threads_per_worker"]
