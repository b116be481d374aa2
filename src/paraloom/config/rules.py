"""Which options combine: pure, torch-free checks, each rule written once; a broken rule is a UserError.

Config validates through these, and so do the layers that take the same options directly
(`DataParallel`'s keywords, the planner's `Plan`, the parameter server's push codec), so a
combination is refused with the same words wherever it is asked for.
"""

from __future__ import annotations

from collections.abc import Iterable

from paraloom.config.choices import (
    ALL_REDUCE_ALGORITHMS,
    COMM_SCHEDULERS,
    COMPRESSORS,
    DENSITY_COMPRESSORS,
    FIXED_SIZE_COMPRESSORS,
    FULLY_SHARDED,
    PARALLEL_MODES,
    SHARD_LEVELS,
    SHARDABLE_ALGORITHMS,
    STRATEGY_ENTRIES,
    SYNC_MODES,
)
from paraloom.config.errors import UserError


def check_name(key: str, value: str, names: Iterable[str], *, factory: bool = False) -> str:
    """`value` if it is one of `names`; otherwise one line that lists them (and, where a user's
    factory may stand instead, says how to name one)."""
    names = tuple(names)
    if value not in names:
        own = " or your own package.module:factory" if factory else ""
        raise UserError(f"{key}={value!r} is not valid; choose one of: {', '.join(names)}{own}")
    return value


def is_factory(name: str) -> bool:
    """Whether `name` reads `package.module:factory` (identifiers; the factory may be dotted)."""
    module, sep, attr = name.partition(":")
    return bool(sep) and all(part.isidentifier() for part in (*module.split("."), *attr.split(".")))


def check_dp_options(*, sync: str = "sync", scheduler: str = "wait_free", shard_optimizer: bool = False,
                     algorithm: str = "native", local_steps: int = 4, local_warmup: int = 0,
                     credit_mb: float = 8.0, compressor: str | None = None,
                     bucket_mb: float | str = 25.0) -> None:
    """The data-parallel engine's options (comm.*): each name known, and the combinations built."""
    check_name("comm.sync", sync, SYNC_MODES)
    check_name("comm.scheduler", scheduler, COMM_SCHEDULERS)
    if isinstance(bucket_mb, str) and bucket_mb != "auto":
        raise UserError(f"comm.bucket_mb={bucket_mb!r} must be a number of MB or auto")
    plain = sync == "sync" and not shard_optimizer and (compressor or "none") == "none" \
        and algorithm == "native"  # what the trials of auto may switch between freely
    if scheduler == "auto" and not plain:
        raise UserError("comm.scheduler=auto picks fifo, wait_free or priority for plain synchronous "
                        "averaging (comm.sync=sync, native all-reduce, no sharding, no compressor); "
                        "name a scheduler with these options")
    if bucket_mb == "auto" and (not plain or scheduler == "priority"):
        raise UserError("comm.bucket_mb=auto tries bucket sizes for plain synchronous averaging under fifo, "
                        "wait_free or auto (comm.sync=sync, native all-reduce, no sharding, no compressor; "
                        "priority cuts partitions of comm.partition_mb); give a number of MB")
    check_name("comm.algorithm", algorithm, ALL_REDUCE_ALGORITHMS)
    compressor = compressor or "none"
    check_name("comm.compressor", compressor, ("none", *COMPRESSORS))
    if local_steps < 1 or local_warmup < 0:
        raise UserError("comm.local_steps must be at least 1 and comm.local_warmup not negative")
    if credit_mb <= 0:
        raise UserError(f"comm.credit_mb={credit_mb} must be positive")
    if shard_optimizer and sync != "sync":
        raise UserError(f"comm.shard_optimizer=true works with comm.sync=sync only, not {sync!r}")
    if shard_optimizer and algorithm not in SHARDABLE_ALGORITHMS:
        raise UserError(f"comm.shard_optimizer=true reduce-scatters with algorithm "
                        f"{' or '.join(SHARDABLE_ALGORITHMS)}, not {algorithm!r}")
    if compressor != "none" and (shard_optimizer or sync == "one_step_delay"):
        raise UserError(f"comm.compressor={compressor} compresses the gradient all-reduce of comm.sync=sync "
                        "or local_sgd's warm-up; not with one_step_delay or shard_optimizer")
    if compressor == "powersgd" and scheduler == "priority" and algorithm != "native":
        raise UserError("comm.compressor=powersgd with comm.scheduler=priority needs comm.algorithm=native: "
                        "its two rounds come from two threads, which one comm thread would serialize "
                        "differently on different ranks")
    if scheduler == "priority" and (sync != "sync" or shard_optimizer):
        raise UserError("comm.scheduler=priority works with comm.sync=sync and no optimizer sharding: "
                        "its deferred updates replace the synchronous step")


def check_compressor_options(compressor: str, *, density: float | None, bits: int | None,
                             lowrank: int | None) -> None:
    """comm.density, comm.bits and comm.lowrank: each only for the compressors that take it."""
    if density is not None:
        if compressor not in DENSITY_COMPRESSORS:
            raise UserError(f"comm.density applies to compressors {', '.join(DENSITY_COMPRESSORS)}, "
                            f"not comm.compressor={compressor}")
        if not 0 < density <= 1:
            raise UserError(f"comm.density={density} must lie in (0, 1]")
    if bits is not None and (compressor != "qsgd" or bits not in (2, 4, 8)):
        raise UserError(f"comm.bits={bits} applies to comm.compressor=qsgd, with 8, 4 or 2 bits")
    if lowrank is not None and (compressor != "powersgd" or lowrank < 1):
        raise UserError(f"comm.lowrank={lowrank} applies to comm.compressor=powersgd, and must be at least 1")


def check_push_compressor(compressor: str) -> None:
    """A parameter server decodes pushes of one fixed size: only those compressors may push."""
    if compressor not in ("none", *FIXED_SIZE_COMPRESSORS):
        raise UserError(f"comm.compressor={compressor} cannot compress parameter-server pushes "
                        "(parallel.mode=ps): its payload size or decoding changes from step to step; "
                        f"choose none or one of: {', '.join(FIXED_SIZE_COMPRESSORS)}")


def strategy_for(*, mode: str, tp: int, pp: int, shard: str = "none") -> str:
    """The training strategy a run's parallel settings ask for: the first registry entry
    (choices.STRATEGY_ENTRIES) whose `chosen_when` says yes, decided in this one place."""
    return next(name for name, entry in STRATEGY_ENTRIES.items() if entry.chosen_when(mode, tp, pp, shard))


def check_sharding(*, shard: str, mode: str, tp: int, pp: int, shard_group: int, shard_prefetch: int) -> None:
    """parallel.shard against the rest of parallel.*: the levels and layouts that run."""
    check_name("parallel.shard", shard, SHARD_LEVELS)
    if shard in FULLY_SHARDED and mode != "dp":
        raise UserError(f"parallel.shard={shard} shards data-parallel replicas; it takes parallel.mode=dp, "
                        f"not {mode}")
    if shard_group < 0 or shard_prefetch < 0:
        raise UserError("parallel.shard_group and parallel.shard_prefetch must not be negative "
                        "(shard_group 0: the ranks of a node)")
    if shard_group and shard != "hybrid":
        raise UserError(f"parallel.shard_group={shard_group} sizes hybrid sharding's groups; it takes "
                        f"parallel.shard=hybrid, not {shard}")


def check_strategy_settings(strategy: str, changed: dict[str, object], *, device: str, pp: int = 1) -> None:
    """Refuse, before launch, a setting the run's strategy would otherwise ignore.

    `changed`: the settings that differ from their defaults, by dotted key; `pp`: parallel.pp.
    """
    entry = STRATEGY_ENTRIES[strategy]
    unused = [key for key in entry.unused_at(pp) if key in changed]
    if unused:
        key, value = unused[0], changed[unused[0]]
        value = str(value).lower() if isinstance(value, bool) else value  # as the user wrote it
        raise UserError(f"the {strategy} strategy does not use {key}={value}: {entry.why_unused}; "
                        f"leave it at its default")
    if strategy != "data_parallel" and changed.get("run.resize_policy", "global_batch") != "global_batch":
        raise UserError(f"run.resize_policy={changed['run.resize_policy']} applies to data-parallel runs; "
                        f"a resized {strategy} run keeps the global batch (leave it at global_batch)")
    if entry.cpu_only and device == "cuda":
        raise UserError(f"the {strategy} strategy runs on CPU (gloo) so far; use run.device=cpu")


def check_recipe(strategy: str, *, clip_norm: float | None, precision: str, guard_nan: bool,
                 scheduler: str, no_decay: str | None = None, shard_optimizer: bool = False,
                 ema: float | None = None, sync: str = "sync") -> None:
    """The optimizer recipe (optim.*, run.precision) against the strategy that must honour it."""
    if ema is not None:
        check_weight_average(strategy, scheduler=scheduler, sync=sync)
    if no_decay is not None and not no_decay.replace(",", "").strip():
        raise UserError("optim.no_decay names no parameter; give name patterns (\"*.bias,*norm*\") or 1d")
    if no_decay and strategy == "parameter_server":
        raise UserError("the parameter_server strategy does not take optim.no_decay so far: its servers "
                        "step flat slices that cut across parameters, with one weight decay for all")
    if no_decay and shard_optimizer:
        raise UserError("optim.no_decay needs two parameter groups; comm.shard_optimizer=true steps flat "
                        "shards with one: leave one of them off")
    if strategy == "parameter_server" and precision == "fp16":
        raise UserError("the parameter_server strategy does not train at run.precision=fp16 so far (its "
                        "loss scale would differ per worker); use bf16 or fp32")
    if clip_norm is not None and scheduler in ("priority", "auto"):
        raise UserError("optim.clip_norm needs every gradient before any update; comm.scheduler=priority "
                        f"updates each layer as its gradients land (comm.scheduler={scheduler} may pick it): "
                        "use wait_free or fifo")
    if precision == "fp16" and not guard_nan:
        raise UserError("run.precision=fp16 skips the steps whose scaled gradients overflow through the "
                        "non-finite guard: leave guard.nan=true")


def check_weight_average(strategy: str, *, scheduler: str, sync: str) -> None:
    """optim.ema averages the weights each step leaves; where a step leaves none to read, refuse."""
    if strategy == "parameter_server":
        raise UserError("the parameter_server strategy does not keep optim.ema so far: the weights live on "
                        "its servers, a worker holds only what it last pulled")
    if scheduler in ("priority", "auto"):
        raise UserError(f"optim.ema averages the weights after each step; comm.scheduler={scheduler} "
                        "(priority) applies a step's updates during the next forward: use wait_free or fifo")
    if sync in ("one_step_delay", "local_sgd"):
        raise UserError(f"optim.ema averages one set of weights; comm.sync={sync} steps replicas that differ "
                        "between synchronizations: use comm.sync=sync")


def check_parallel_layout(*, mode: str, tp: int, pp: int, microbatches: int) -> None:
    """parallel.mode against tensor and pipeline parallelism: the combinations that make sense."""
    check_name("parallel.mode", mode, PARALLEL_MODES)
    if mode == "ps" and (tp > 1 or pp > 1):
        raise UserError("parallel.mode=ps trains whole replicas: leave parallel.tp and parallel.pp at 1")
    if mode == "layers" and (tp > 1 or microbatches > 1):
        raise UserError("parallel.mode=layers has no micro-batches or tensor parallelism: for those "
                        "use parallel.mode=dp with parallel.pp / parallel.microbatches / parallel.tp")


def check_interleaving(*, schedule: str, virtual_stages: int, pp: int, microbatches: int) -> None:
    """parallel.virtual_stages is interleaved 1F1B's, which runs micro-batches in groups of pp."""
    if virtual_stages > 1 and schedule != "interleaved_1f1b":
        raise UserError(f"parallel.virtual_stages={virtual_stages} is for parallel.schedule=interleaved_1f1b "
                        f"(model chunks per stage); schedule {schedule} runs one chunk per stage")
    if schedule == "interleaved_1f1b" and pp > 1 and microbatches % pp:
        raise UserError(f"parallel.schedule=interleaved_1f1b runs micro-batches in groups of the {pp} "
                        f"stages: parallel.microbatches={microbatches} must be a multiple of {pp}")


def check_model_parallel_sync(*, dp: int, sync: str, shard_optimizer: bool, scheduler: str,
                              compressor: str, bucket_mb: float | str = 25.0) -> None:
    """What data parallelism may do beside tensor or pipeline parallelism."""
    if sync != "sync" or shard_optimizer:
        raise UserError("tensor and pipeline parallelism run with comm.sync=sync and "
                        "comm.shard_optimizer=false")
    if scheduler == "auto" or bucket_mb == "auto":
        raise UserError("comm.scheduler=auto and comm.bucket_mb=auto are for data parallelism alone so far; "
                        "with tensor or pipeline parallelism name a scheduler and a bucket size")
    if dp > 1 and scheduler == "priority" and compressor == "powersgd":
        raise UserError("comm.compressor=powersgd under comm.scheduler=priority needs a whole-world "
                        "data-parallel group; with tensor or pipeline parallelism use wait_free or fifo")


def check_sparse_training(*, mode: str, model_parallel: bool, compressor: str, sync: str,
                          engine: str) -> None:
    """Pruning masks are the compression of plain synchronous data parallelism."""
    if mode != "dp" or model_parallel or compressor != "none" or sync != "sync" or engine != "bucketed":
        raise UserError("sparse.sparsity > 0 runs in data-parallel training (parallel.mode=dp, no tp/pp) "
                        "with comm.sync=sync, comm.engine=bucketed and comm.compressor=none: the masks "
                        "are its compression")


def check_model_data(model: str, data: str) -> None:
    """A zoo model and a built-in data set that fit together."""
    if is_factory(model) or is_factory(data):
        return  # a user's: built and checked before launch (preflight)
    if model == "cnn" and data == "synthetic":
        raise UserError("model.name=cnn needs image data; data.name=synthetic gives vectors: "
                        "use model.name=mlp")
    if (model in ("gpt", "bert")) != (data == "text"):
        raise UserError(f"model.name={model} cannot train on data.name={data}: "
                        "the gpt and the bert read data.name=text, and only they do")


def check_batch_split(*, batch_size: int, dp: int, microbatches: int, model_parallel: bool) -> None:
    """Under model parallelism the global batch splits evenly over data-parallel replicas, and each share
    into micro-batches. Data-parallel workers alone take near-equal shares, their losses weighted by
    their share (as the short last batch is): any batch of at least one sample per worker."""
    if not model_parallel:
        if batch_size < dp:
            raise UserError(f"data.batch_size={batch_size} gives some of the {dp} workers no sample; "
                            f"choose at least {dp}")
        return
    if batch_size % dp:
        below = batch_size // dp * dp
        near = f"{below} or {below + dp}" if below else str(dp)
        raise UserError(f"data.batch_size={batch_size} cannot be split across {dp} data-parallel replicas; "
                        f"choose a multiple of {dp}, e.g. {near}")
    if (batch_size // dp) % microbatches:
        raise UserError(f"the per-replica batch of {batch_size // dp} does not split into "
                        f"parallel.microbatches={microbatches}; choose data.batch_size as a multiple of "
                        f"{dp * microbatches}")


def check_tensor_parallel(*, tp: int, model: str, n_heads: int, has_plan: bool = False) -> None:
    """Tensor parallelism splits a model by its plan: the gpt's own (tp must divide its heads), a
    zoo model's given as model.tp_plan, or a user's model's (checked against the model before launch)."""
    if tp == 1 or is_factory(model):
        return
    if model != "gpt":
        if has_plan:
            return
        raise UserError(f"parallel.tp={tp} needs a tensor-parallel plan; model.name={model} has none: "
                        "set model.tp_plan, use model.name=gpt, or tp=1")
    if n_heads % tp:
        options = [t for t in range(1, n_heads + 1) if n_heads % t == 0]
        raise UserError(f"parallel.tp={tp} does not divide model.n_heads={n_heads}; "
                        f"choose tp in {{{', '.join(map(str, options))}}}")


def check_pipeline_stages(*, pp: int, model: str, n_layers: int, virtual_stages: int = 1) -> None:
    """A gpt has n_layers + 2 pieces to place on stages (embedding, blocks, head), v per stage when
    interleaved."""
    if pp > 1 and model == "gpt" and pp * virtual_stages > n_layers + 2:
        chunks = f" x parallel.virtual_stages={virtual_stages}" if virtual_stages > 1 else ""
        raise UserError(f"parallel.pp={pp}{chunks} stages exceed the gpt's {n_layers + 2} pieces "
                        "(embedding, blocks, head): raise model.n_layers or lower parallel.pp")


def node_range(text: str) -> tuple[int, int]:
    """run.nodes="MIN..MAX" as (MIN, MAX)."""
    low, sep, high = text.partition("..")
    if not (sep and low.strip().isdigit() and high.strip().isdigit()) or not 1 <= int(low) <= int(high):
        raise UserError(f"run.nodes={text!r} must read MIN..MAX with 1 <= MIN <= MAX, e.g. 3..4")
    return int(low), int(high)
