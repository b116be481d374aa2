"""Checks of a run configuration against its number of workers: the dp x tp x pp grid and its limits."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from paraloom import rules
from paraloom.config_faults import check_faults, parse_faults
from paraloom.errors import UserError

if TYPE_CHECKING:
    from paraloom.config import Config


def grid(cfg: Config, world_size: int) -> tuple[int, int, int]:
    """(dp, tp, pp) for `world_size` workers; layers mode makes every rank a stage."""
    par = cfg.parallel
    pp = world_size if par.mode == "layers" and par.pp == 1 else par.pp
    if world_size % (par.tp * pp):
        raise UserError(f"parallel.tp={par.tp} x parallel.pp={pp} does not divide {world_size} "
                        f"workers; choose a world size that is a multiple of {par.tp * pp}")
    return world_size // (par.tp * pp), par.tp, pp


def validate_world(cfg: Config, world_size: int) -> None:
    """Checks that depend on the number of workers; run before any worker starts."""
    dp, tp, pp = grid(cfg, world_size)
    microbatches = cfg.parallel.microbatches * (cfg.optim.accumulate if cfg.parallel.model_parallel else 1)
    rules.check_batch_split(batch_size=cfg.data.batch_size, dp=dp, microbatches=microbatches,
                            model_parallel=cfg.parallel.model_parallel)
    if cfg.parallel.model_parallel:
        rules.check_tensor_parallel(tp=tp, model=cfg.model.name, n_heads=cfg.model.n_heads,
                                    has_plan=bool(cfg.model.tp_plan))
        rules.check_pipeline_stages(pp=pp, model=cfg.model.name, n_layers=cfg.model.n_layers,
                                    virtual_stages=cfg.parallel.virtual_stages)
        rules.check_model_parallel_sync(dp=dp, sync=cfg.comm.sync, shard_optimizer=cfg.comm.shard_optimizer,
                                        scheduler=cfg.comm.scheduler, compressor=cfg.comm.compressor,
                                        bucket_mb=cfg.comm.bucket_mb)
    if cfg.run.inject is not None:
        check_faults(parse_faults(cfg.run.inject), world_size)
    rules.check_model_data(cfg.model.name, cfg.data.name)


def threads_per_worker(nproc: int) -> int:
    """The threads each of `nproc` workers on this host gets (as worker.py shares the cores)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // max(1, nproc))
