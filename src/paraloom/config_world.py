"""Checks of a run configuration against its number of workers: the dp x tp x pp grid and its limits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paraloom.errors import UserError

if TYPE_CHECKING:
    from paraloom.config import Config, ParallelConfig


def check_modes(par: ParallelConfig) -> None:
    """The combinations of parallel.mode with tensor and pipeline parallelism that make sense."""
    if par.mode == "ps" and (par.tp > 1 or par.pp > 1):
        raise UserError("parallel.mode=ps trains whole replicas: leave parallel.tp and parallel.pp at 1")
    if par.mode == "layers" and (par.tp > 1 or par.microbatches > 1):
        raise UserError("parallel.mode=layers has no micro-batches or tensor parallelism: for those "
                        "use parallel.mode=dp with parallel.pp / parallel.microbatches / parallel.tp")


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
    if cfg.data.batch_size % dp:
        below = cfg.data.batch_size // dp * dp
        near = f"{below} or {below + dp}" if below else str(dp)
        who = "data-parallel replicas" if cfg.parallel.model_parallel else "workers"
        raise UserError(
            f"data.batch_size={cfg.data.batch_size} cannot be split across {dp} "
            f"{who}; choose a multiple of {dp}, e.g. {near}")
    m = cfg.parallel.microbatches
    if (cfg.data.batch_size // dp) % m:
        raise UserError(f"the per-replica batch of {cfg.data.batch_size // dp} does not split into "
                        f"parallel.microbatches={m}; choose data.batch_size as a multiple of {dp * m}")
    if cfg.parallel.model_parallel:
        _validate_model_parallel(cfg, dp, tp, pp)
    if cfg.run.inject is not None:
        from paraloom.train.faults import check_faults, parse_faults

        check_faults(parse_faults(cfg.run.inject), world_size)
    if cfg.model.name == "cnn" and cfg.data.name == "synthetic":
        raise UserError("model.name=cnn needs image data; data.name=synthetic gives vectors: "
                        "use model.name=mlp")
    if (cfg.model.name == "gpt") != (cfg.data.name == "text"):
        raise UserError(f"model.name={cfg.model.name} cannot train on data.name={cfg.data.name}: "
                        "the gpt reads data.name=text, and only the gpt does")

def _validate_model_parallel(cfg: Config, dp: int, tp: int, pp: int) -> None:
    if cfg.parallel.mode == "ps":
        raise UserError("parallel.mode=ps trains whole replicas on every worker")
    if tp > 1:
        if cfg.model.name != "gpt":
            raise UserError(f"parallel.tp={tp} splits the gpt's attention heads and MLP; "
                            f"model.name={cfg.model.name} has none: use model.name=gpt or tp=1")
        if cfg.model.n_heads % tp:
            options = [t for t in range(1, cfg.model.n_heads + 1) if cfg.model.n_heads % t == 0]
            raise UserError(f"parallel.tp={tp} does not divide model.n_heads={cfg.model.n_heads}; "
                            f"choose tp in {{{', '.join(map(str, options))}}}")
    if pp > 1 and cfg.model.name == "gpt" and pp > cfg.model.n_layers + 2:
        raise UserError(f"parallel.pp={pp} stages exceed the gpt's {cfg.model.n_layers + 2} pieces "
                        "(embedding, blocks, head): raise model.n_layers or lower parallel.pp")
    if cfg.comm.sync != "sync" or cfg.comm.shard_optimizer:
        raise UserError("tensor and pipeline parallelism run with comm.sync=sync and "
                        "comm.shard_optimizer=false")
    if dp > 1 and cfg.comm.scheduler == "priority" and cfg.comm.compressor == "powersgd":
        raise UserError("comm.compressor=powersgd under comm.scheduler=priority needs a whole-world "
                        "data-parallel group; with tensor or pipeline parallelism use wait_free or fifo")
