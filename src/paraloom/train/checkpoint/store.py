"""Checkpoints in torch.distributed.checkpoint (DCP) format: atomic, checksummed, keep-last-k.

Layout: `RUN_DIR/checkpoints/step-00000030/` holds DCP's files (`.metadata` and a `.distcp` file
per rank) with every tensor of the state, `objects-rank<r>.pt` with the rest of it (state_tree:
the skeletons, read with `weights_only=True`; rank 0's holds the shared part's too), and
`manifest.json` (step, world size, the run's grid, SHA-256 and size of every file). The shared
part (model and optimizer where every rank holds the same) is written once, by rank 0; each rank
writes its own part
(communication state, RNG states, and model and optimizer where replicas differ); sharded state
is saved as DTensors, which DCP reshards when a run of another size loads it. Ranks write into
`step-<8-digit step>.tmp/`; rank 0 then fsyncs and hashes what is on disk, writes the manifest
and renames the folder into place, so a checkpoint is either whole or absent (with `seal_behind`,
that sealing runs on a thread of rank 0's own, and no rank waits on the disk). Nothing
of a checkpoint is read before every checksum matches: a damaged checkpoint is passed over for
the previous one, with a warning naming the file. The checksums catch damage, not tampering
(whoever can write the folder can rewrite the manifest too): so what is unpickled is unpickled by
an allow-list (`weights_only=True` for paraloom's files, reader.py's for DCP's `.metadata`), and a
file that names anything else is refused in one line. The run directory must be reachable from
every rank (one machine, or a shared filesystem).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from paraloom.config.errors import UserError
from paraloom.train.checkpoint import state_tree
from paraloom.train.checkpoint.reader import CheckpointReader

FOLDER = "checkpoints"
ROOT = "state"  # every tensor under one key: DCP logs each top-level key it turns into a state dict
MANIFEST = "manifest.json"
def objects_file(rank: int) -> str:
    return f"objects-rank{rank}.pt"


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / FOLDER / f"step-{step:08d}"


def save_checkpoint(run_dir: Path, step: int, *, local: dict[str, Any], shared: dict[str, Any] | None,
                    keep: int, group: dist.ProcessGroup | None = None, meta: dict[str, Any] | None = None,
                    async_group: dist.ProcessGroup | None = None, seal_behind: bool = False,
                    ) -> PendingSave | None:
    """Collective over `group`: every rank saves `local`; rank 0 also `shared`, then seals. `meta`
    (rank 0's) goes into the manifest. With `async_group` (a gloo group of the same ranks, for DCP's
    background writes) the tensors are copied and written behind training: the PendingSave's `wait`
    returns once the checkpoint is sealed, and the next save must wait for it first. With
    `seal_behind`, a synchronous save's sealing (hashing, manifest, rename: rank 0's alone) runs on a
    thread of its own as well: the checkpoint is whole on disk when this returns, and valid once
    sealed; until then the one before stays the newest valid."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    final = step_dir(run_dir, step)
    staging = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # left by a run that died while saving
        staging.mkdir(parents=True)
    dist.barrier(group)
    skeleton, tensors = state_tree.split(local, f"rank{rank}")
    shared_skeleton = None
    if rank == 0 and shared is not None:
        shared_skeleton, shared_tensors = state_tree.split(shared, "shared")
        tensors.update(shared_tensors)
    _write(staging / objects_file(rank), {"local": skeleton, "shared": shared_skeleton})
    writer = dcp.FileSystemWriter(staging, sync_files=False)  # the seal fsyncs every file
    seal = (lambda: _seal(staging, final, step, world, meta, keep)) if rank == 0 else None
    if async_group is not None:  # rank 0's write finishes last: DCP's metadata waits for every rank's files
        response = dcp.async_save({ROOT: tensors}, storage_writer=writer, process_group=async_group)
        return PendingSave(getattr(response, "upload_completion", response), seal)
    # the same plan every time; DCP's coordinator (rank 0) returns once every rank's files are written
    dcp.save({ROOT: tensors}, storage_writer=writer, process_group=group,
             planner=dcp.DefaultSavePlanner(enable_plan_caching=True))
    if seal is not None and seal_behind:
        return PendingSave(_sealer().submit(seal), None)
    if seal is not None:
        seal()
    return None


_SEALER: ThreadPoolExecutor | None = None


def _sealer() -> ThreadPoolExecutor:
    global _SEALER
    if _SEALER is None:
        _SEALER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paraloom-seal")
    return _SEALER


class PendingSave:
    """A checkpoint being written behind training; rank 0 seals it as soon as DCP's write is done."""

    def __init__(self, future, seal) -> None:
        self.future, self.sealed, self.error = future, threading.Event(), None
        if seal is None:
            self.sealed.set()
        else:
            future.add_done_callback(lambda done: self._seal(done, seal))

    def _seal(self, done, seal) -> None:
        try:
            if done.exception() is None:
                seal()
        except BaseException as error:  # noqa: BLE001 - raised again by wait(), in the training thread
            self.error = error
        finally:
            self.sealed.set()

    def wait(self) -> None:
        self.future.result()  # a failed write raises here
        self.sealed.wait()
        if self.error is not None:
            raise self.error


def _seal(staging: Path, final: Path, step: int, world: int, meta: dict[str, Any] | None, keep: int) -> None:
    """Flush every file to disk and hash it, write the manifest, and move the folder into place (rank 0)."""
    files = {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size}
             for p in sorted(staging.iterdir()) if p.name != MANIFEST}  # _sha256 fsyncs first
    manifest = {"step": step, "world_size": world, "format": "dcp", **(meta or {}), "files": files}
    with open(staging / MANIFEST, "w") as f:
        f.write(json.dumps(manifest, indent=1))
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.rename(staging, final)
    _fsync_dir(final.parent)
    _prune(final.parent, keep)


def _write(path: Path, obj: dict[str, Any]) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)  # fsync'ed by the seal


def _sha256(path: Path, *, sync: bool = True) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if sync:  # whatever process wrote it: its pages reach the disk
            os.fsync(f.fileno())
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
        if file.stat().st_size != meta.get("bytes") or _sha256(file, sync=False) != meta.get("sha256"):
            return f"{file} does not match its checksum (truncated or corrupt)"
    return None


def candidates(run_dir: Path) -> list[Path]:
    """The sealed checkpoint folders of `run_dir` (`step-<digits>`: not a `.tmp` one), newest first,
    whole or not."""
    folder = run_dir / FOLDER
    return sorted((p for p in folder.glob("step-*") if p.name.removeprefix("step-").isdigit()),
                  key=_step_of, reverse=True) if folder.is_dir() else []


def latest_valid(run_dir: Path, *, quiet: bool = False) -> Path | None:
    """The newest whole checkpoint of `run_dir`, warning about each damaged one passed over (unless
    `quiet`: a first look, before the resume that warns)."""
    for path in candidates(run_dir):
        problem = verify(path)
        if problem is not None:
            if not quiet:
                print(f"paraloom: warning: skipping checkpoint {path.name}: {problem}", file=sys.stderr)
            continue
        return path
    return None


# a manifest's whole-number fields and the least value of each; step and world_size are in every one
WHOLE_FIELDS = {"step": 0, "world_size": 1, "samples": 0, "global_batch": 1, "dp_size": 1}


def manifest_of(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint folder `path` (after `verify`), its fields checked: one that was
    damaged or edited is one line naming the file and the field, not a failure deep in a resume."""
    file = path / MANIFEST
    manifest = json.loads(file.read_text())
    problem = _bad_field(manifest)
    if problem is not None:
        raise UserError(f"checkpoint manifest {file}: {problem}; the file is damaged or was edited: restore "
                        f"it, or move {path.name} out of {path.parent} to resume from the checkpoint before")
    return manifest


def _whole(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _bad_field(manifest: Any) -> str | None:
    """What is wrong with a manifest's fields, or None (fields older manifests lack may be absent)."""
    if not isinstance(manifest, dict):
        return f"holds a JSON {type(manifest).__name__}, not an object"
    for key, least in WHOLE_FIELDS.items():
        if (key in manifest or key in ("step", "world_size")) and not _whole(manifest.get(key), least):
            return f"{key}={manifest.get(key)!r} must be a whole number of at least {least}"
    grid = manifest.get("grid")
    if grid is not None and not (isinstance(grid, list) and all(_whole(n, 1) for n in grid)):
        return f"grid={grid!r} must be a list of whole numbers of at least 1"
    if not isinstance(manifest.get("strategy", ""), str):
        return f"strategy={manifest['strategy']!r} must be a strategy's name"
    saved_at = manifest.get("saved_at", 0.0)
    if isinstance(saved_at, bool) or not isinstance(saved_at, int | float):
        return f"saved_at={saved_at!r} must be a time in seconds"
    return None


def agree_on_checkpoint(run_dir: Path | None, group: dist.ProcessGroup | None = None,
                        grid: list[int] | None = None) -> tuple[int, int, bool] | None:
    """Collective: rank 0 picks the checkpoint to resume from; every rank gets (its step, the number
    of ranks that saved it, whether they were laid out as `grid` is: the manifest's "grid"), or None."""
    found = torch.tensor([-1, 0, 1], dtype=torch.int64)
    if dist.get_rank(group) == 0 and run_dir is not None:
        path = latest_valid(run_dir)
        if path is not None:
            manifest = manifest_of(path)
            found[0], found[1] = _step_of(path), int(manifest["world_size"])
            found[2] = int(manifest.get("grid") == grid)
    dist.broadcast(found, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    return None if found[0].item() < 0 else (int(found[0]), int(found[1]), bool(found[2]))


def load_checkpoint(run_dir: Path, step: int, rank: int, device: torch.device,
                    group: dist.ProcessGroup | None = None, *, source_rank: int | None = None,
                    make_sharded=None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(shared part or None, rank `source_rank`'s part (default: `rank`'s)) of the checkpoint at `step`.

    Collective over `group` where torch.distributed is set up (DCP plans the reads together);
    `make_sharded(name, global_shape, dtype)` gives the DTensor a sharded entry loads into."""
    shared, parts = load_parts(run_dir, step, [rank if source_rank is None else source_rank], device, group,
                               make_sharded=make_sharded)
    return shared, parts[0]


def load_parts(run_dir: Path, step: int, ranks: list[int], device: torch.device,
               group: dist.ProcessGroup | None = None, *,
               make_sharded=None) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(shared part or None, the parts of the saved `ranks`), as load_checkpoint."""
    path = step_dir(run_dir, step)
    shared = _read(path / objects_file(0))["shared"]
    parts = [_read(path / objects_file(r))["local"] for r in ranks]
    wanted: dict[str, torch.Tensor] = {}
    for skeleton in [*parts, *([shared] if shared is not None else [])]:
        wanted.update(state_tree.targets(skeleton, device, make_sharded))
    single = not (dist.is_available() and dist.is_initialized())
    reader = CheckpointReader(path)
    reader.read_metadata()  # refused here, in one line: DCP logs a traceback and wraps what its reader raises
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # a single process: meant
        dcp.load({ROOT: wanted}, storage_reader=reader, process_group=group, no_dist=single)
    return (None if shared is None else state_tree.join(shared, wanted)), \
        [state_tree.join(part, wanted) for part in parts]


def _read(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # torch's allow-list refused a global: its message runs to lines
        refused = re.search(r"GLOBAL (\S+)", str(exc))
        what = f"names {refused.group(1)}, which" if refused else "holds an object that"
        raise UserError(f"checkpoint file {path} {what} torch.load(weights_only=True) refuses: refused "
                        "(the file may be crafted)") from None


def discard_staging(run_dir: Path) -> list[str]:
    """Remove the half-written checkpoints (`step-N.tmp/`) a stopped run left; their names. Only
    for a launcher whose workers are all gone: a live rank 0 may be sealing one."""
    folder = run_dir / FOLDER
    staged = sorted(folder.glob("step-*.tmp")) if folder.is_dir() else []
    for path in staged:
        shutil.rmtree(path, ignore_errors=True)
    return [path.name for path in staged]
