"""The hardware profile a run predicts itself from (`run.hardware`): this machine's, calibrated once
on loopback and cached, or a preset, or a YAML file.

The cache lives in `$PARALOOM_CACHE_DIR`, else `$XDG_CACHE_HOME/paraloom`, else
`~/.cache/paraloom`, one file per host name and threads per worker (what the compute rates depend
on); delete the file to measure again. `$PARALOOM_HARDWARE` stands in for "auto" where it is set.
A profile measured once goes on describing the machine as it was then: a run that finds a term off
names the file and its age (`cached_source`, perfmodel/contract.py).
"""

from __future__ import annotations

import os
import socket
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


def cached_source(name: str, threads: int) -> Path | None:
    """The cached file `resolve_hardware(name, threads)` reads, where it reads one; None for a preset,
    a YAML file the user wrote, `$PARALOOM_HARDWARE`, or no calibration yet."""
    if name != "auto" or os.environ.get("PARALOOM_HARDWARE"):
        return None
    path = cached_path(threads)
    return path if path.is_file() else None


__all__ = ["cache_dir", "cached_path", "cached_source", "resolve_hardware"]
