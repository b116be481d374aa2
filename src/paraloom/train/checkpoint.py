"""Checkpoints: atomic, checksummed, keep-last-k, one file per rank where ranks differ.

Layout: `RUN_DIR/checkpoints/step-00000030/` holding `shared.pt` (model and optimizer, written
by rank 0 when every rank holds the same), `rank<r>.pt` (each rank's own: communication state,
RNG states, and model and optimizer where replicas differ) and `manifest.json` (step, world
size, SHA-256 and size of every file). Ranks write into `step-<8-digit step>.tmp/`, each file
fsync'ed; rank 0 then hashes what is on disk, writes the manifest, and renames the folder into
place, so a checkpoint is either whole or absent. Loading verifies every checksum and passes
over a damaged checkpoint for the previous one, with a warning naming the file. Files load with
`torch.load(weights_only=True)`. The run directory must be reachable from every rank (one
machine, or a shared filesystem).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paraloom.errors import UserError

FOLDER = "checkpoints"
MANIFEST = "manifest.json"
SHARED = "shared.pt"


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / FOLDER / f"step-{step:08d}"


def save_checkpoint(run_dir: Path, step: int, *, local: dict[str, Any], shared: dict[str, Any] | None,
                    keep: int, group: dist.ProcessGroup | None = None) -> None:
    """Collective over `group`: every rank saves `local`; rank 0 also `shared`, then seals."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    final = step_dir(run_dir, step)
    staging = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # left by a run that died while saving
        staging.mkdir(parents=True)
    dist.barrier(group)
    _write(staging / f"rank{rank}.pt", local)
    if rank == 0 and shared is not None:
        _write(staging / SHARED, shared)
    dist.barrier(group)
    if rank != 0:
        return
    files = {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size} for p in sorted(staging.glob("*.pt"))}
    manifest = {"step": step, "world_size": world, "files": files}
    with open(staging / MANIFEST, "w") as f:
        f.write(json.dumps(manifest, indent=1))
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.rename(staging, final)
    _fsync_dir(final.parent)
    _prune(run_dir / FOLDER, keep)


def _write(path: Path, obj: dict[str, Any]) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(folder: Path, keep: int) -> None:
    sealed = sorted(p for p in folder.glob("step-*") if not p.name.endswith(".tmp"))
    for old in sealed[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def verify(path: Path) -> str | None:
    """None if the checkpoint folder is whole; otherwise what is wrong, naming the file."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        if not isinstance(files, dict) or not files:
            return f"{path / MANIFEST} lists no files"
    except (OSError, ValueError, KeyError, TypeError):
        return f"{path / MANIFEST} is missing or unreadable"
    for name, meta in files.items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != meta.get("bytes") or _sha256(file) != meta.get("sha256"):
            return f"{file} does not match its checksum (truncated or corrupt)"
    return None


def latest_valid(run_dir: Path, world_size: int) -> Path | None:
    """The newest whole checkpoint of `run_dir`, warning about each damaged one passed over."""
    folder = run_dir / FOLDER
    candidates = sorted((p for p in folder.glob("step-*") if not p.name.endswith(".tmp")),
                        key=_step_of, reverse=True) if folder.is_dir() else []
    for path in candidates:
        problem = verify(path)
        if problem is not None:
            print(f"paraloom: warning: skipping checkpoint {path.name}: {problem}", file=sys.stderr)
            continue
        saved_world = json.loads((path / MANIFEST).read_text())["world_size"]
        if saved_world != world_size:
            raise UserError(f"checkpoint {path} was written by {saved_world} ranks; resume it with "
                            f"{saved_world} workers, not {world_size}")
        return path
    return None


def agree_on_checkpoint(run_dir: Path | None, group: dist.ProcessGroup | None = None) -> int | None:
    """Collective: rank 0 picks the checkpoint to resume from; every rank gets its step (or None)."""
    step = torch.tensor([-1], dtype=torch.int64)
    if dist.get_rank(group) == 0 and run_dir is not None:
        found = latest_valid(run_dir, dist.get_world_size(group))
        if found is not None:
            step[0] = _step_of(found)
    dist.broadcast(step, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    return None if step.item() < 0 else int(step.item())


def load_checkpoint(run_dir: Path, step: int, rank: int,
                    device: torch.device) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(shared part or None, this rank's part) of the checkpoint at `step`."""
    path = step_dir(run_dir, step)
    shared = None
    if (path / SHARED).is_file():
        shared = torch.load(path / SHARED, map_location=device, weights_only=True)
    local = torch.load(path / f"rank{rank}.pt", map_location=device, weights_only=True)
    return shared, local

