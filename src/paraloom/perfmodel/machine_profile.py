"""The hardware profile a run predicts itself from (`run.hardware`): this machine's, calibrated once
on loopback and cached, or a preset, or a YAML file.

The cache lives in `$PARALOOM_CACHE_DIR`, else `$XDG_CACHE_HOME/paraloom`, else
`~/.cache/paraloom`, one file per host name and threads per worker (what the compute rates depend
on); delete the file to measure again. `$PARALOOM_HARDWARE` stands in for "auto" where it is set.
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


__all__ = ["cache_dir", "cached_path", "resolve_hardware"]
