"""Run directories: `runs/<name>/` with the resolved config; an existing run is never overwritten."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from paraloom.config import Config, dump_config
from paraloom.config.errors import UserError

# what a launcher writes before the workers start: the config, node logs, the run's prediction of
# itself (perfmodel/runs/contract.py: made by the launcher for a run on an emulated cluster)
PREPARED = {"config.yaml", "nodes", "prediction.json"}


def default_name(cfg: Config, world: int) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    layout = f"{cfg.parallel.mode}{world}"
    if cfg.parallel.model_parallel and cfg.parallel.mode != "layers":
        try:
            dp, tp, pp = cfg.grid(world)
            layout = f"dp{dp}tp{tp}pp{pp}"
        except UserError:
            pass  # the grid is refused later, with its own message
    # a user's package.module:factory without the colon (paths, PYTHONPATH lists, scp, TensorBoard)
    model, data = (name.replace(":", ".") for name in (cfg.model.name, cfg.data.name))
    return f"{model}-{data}-{layout}-{stamp}"


def new_run_dir(cfg: Config, path: Path | None = None, *, world: int | None = None) -> Path:
    """Create the run directory and write `config.yaml` (with the final run name) into it.

    A directory that a launcher prepared (holding only what PREPARED names) is taken as it is.
    """
    if path is None:
        base = Path(cfg.run.out_dir)
        name = default_name(cfg, world or cfg.parallel.nproc)
        path = base / (cfg.run.name or name)
        suffix = 2
        while cfg.run.name is None and path.exists():
            path = base / f"{name}-{suffix}"
            suffix += 1
    if path.exists() and any(p.name not in PREPARED for p in path.iterdir()):
        raise UserError(f"run directory {str(path)!r} already holds a run; "
                        "choose another run.name (or remove it)")
    if (path / "config.yaml").exists():
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create run directory {str(path)!r}: {exc.strerror}") from None
    named = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=path.name))
    dump_config(named, path / "config.yaml")
    return path
