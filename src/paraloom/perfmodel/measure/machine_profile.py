"""The hardware profile a run predicts itself from (`run.hardware`): this machine's, calibrated once
and cached, or a preset, or a YAML file.

A run on CPUs reads the host's loopback calibration (on an emulated cluster: one with its links
measured across a cluster of that rate, made by the launcher), a run on GPUs the GPU's own
(`paraloom calibrate --device cuda`, made by `paraloom train` on first use): a GPU run priced from
the CPU's rates would be off by orders of magnitude. The cache lives in `$PARALOOM_CACHE_DIR`,
else `$XDG_CACHE_HOME/paraloom`, else `~/.cache/paraloom`, one file per host name and threads per
worker (what a CPU's compute rates depend on), and per link rate for runs on an emulated cluster,
or per host for its GPUs; delete the file to measure again. `$PARALOOM_HARDWARE` stands in for
"auto" where it is set.
A profile measured once goes on describing the machine as it was then: a run that finds a term off
names the file and its age where it is an hour old or more (`cached_source`, perfmodel/runs/contract.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from paraloom.perfmodel.hardware import Hardware, load_hardware


def cache_dir() -> Path:
    if os.environ.get("PARALOOM_CACHE_DIR"):
        return Path(os.environ["PARALOOM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "paraloom"


def cached_path(threads: int, device: str = "cpu", link: str | None = None) -> Path:
    """This host's cached profile for workers of `threads` threads on the CPU, or for its GPUs
    (`device` "cuda"; the threads do not matter there); `link`: for runs on an emulated cluster of
    that rate ("1gbit"), whose inter-node link was measured across such a cluster."""
    key = "cuda" if device == "cuda" else f"{threads}t" + (f"-{link}" if link else "")
    return cache_dir() / f"hardware-{socket.gethostname()}-{key}.yaml"


def resolve_hardware(name: str, threads: int, device: str = "cpu") -> Hardware | None:
    """The profile `run.hardware` names for a run on `device` ("cpu" or "cuda"); None for "none", or
    for "auto" before the first calibration. "auto" reads `$PARALOOM_HARDWARE` first, where set (a
    cluster's shared profile, or "none")."""
    if name == "auto" and os.environ.get("PARALOOM_HARDWARE"):
        name = os.environ["PARALOOM_HARDWARE"]
    if name == "none":
        return None
    if name == "auto":
        path = cached_path(threads, device)
        return load_hardware(path) if path.is_file() else None
    return load_hardware(name)


def cached_source(name: str, threads: int, device: str = "cpu") -> Path | None:
    """The cached file `resolve_hardware(name, threads, device)` reads, where it reads one; None for
    a preset, a YAML file the user wrote, `$PARALOOM_HARDWARE`, or no calibration yet."""
    if name != "auto" or os.environ.get("PARALOOM_HARDWARE"):
        return None
    path = cached_path(threads, device)
    return path if path.is_file() else None


def calibrate_gpu_once(progress: Callable[[str], None]) -> Path | None:
    """This host's GPU profile, measured now if there is none yet (`paraloom calibrate --device
    cuda`, in a process of its own, so that the caller never holds a CUDA context while its workers
    train); None where `$PARALOOM_HARDWARE` names the profile instead. Raises RuntimeError with the
    calibration's last line where it fails."""
    path = cached_path(0, "cuda")
    if os.environ.get("PARALOOM_HARDWARE"):
        return None
    if path.is_file():
        return path
    progress(f"calibrating this machine's GPU once (paraloom calibrate --device cuda), cached in {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f"{path.stem}.tmp{os.getpid()}.yaml")
    with subprocess.Popen(gpu_calibration_command(staging), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as child:
        lines = []
        for line in child.stdout:
            lines.append(line.rstrip())
            if line.startswith("measuring "):
                progress(f"  {line.rstrip()}")
    if child.returncode != 0 or not staging.is_file():
        staging.unlink(missing_ok=True)
        last = next((line for line in reversed(lines) if line.strip()), f"exit code {child.returncode}")
        raise RuntimeError(last)
    os.replace(staging, path)  # whole or absent, when two runs calibrate at once
    return path


def gpu_calibration_command(out: Path) -> list[str]:
    return [sys.executable, "-m", "paraloom", "calibrate", "--device", "cuda", "--out", str(out)]


__all__ = ["cache_dir", "cached_path", "cached_source", "calibrate_gpu_once", "resolve_hardware"]
