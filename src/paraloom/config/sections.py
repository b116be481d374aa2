"""Run configuration: dataclass sections, loaded from YAML with dotted `--set` overrides, and the
checks of a configuration against its number of workers (the dp x tp x pp grid and its limits)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from paraloom.config import choices, rules
from paraloom.config.errors import UserError
from paraloom.config.fault_specs import check_faults, parse_faults
from paraloom.config.yaml_io import build_section, merge, parse_overrides, read_yaml

SEED_MAX = 2**63 - 1
# a collective's timeout: below a second a busy machine's ordinary step times out; above a week
# nobody is waiting (and 1e300 s overflows the timedelta the process group takes)
TIMEOUT_RANGE = (1.0, 7 * 86400.0)


def _one_of(*names: str, default: str, factory: bool = False) -> Any:
    """A name out of `names`; with `factory`, also a user's `package.module:factory`."""
    return field(default=default, metadata={"choices": names, "factory": factory})


# run.name: one directory name any filesystem, shell and tool takes as it is
RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")


def _options() -> Any:
    """Keyword arguments for a factory or a constructor (`--set section.options.key=value`)."""
    return field(default_factory=dict)


@dataclass(kw_only=True)
class RunConfig:
    name: str | None = None  # run directory name under out_dir; None -> generated, never reused
    out_dir: str = "runs"  # parent of run directories
    seed: int = 0  # seeds model init and data order (same on every rank)
    device: str = _one_of(*choices.DEVICES, default="auto")  # auto: cuda if available
    log_every: int = 10  # steps between metrics.jsonl lines
    tensorboard: bool = False  # also write TensorBoard scalars (needs tensorboard installed)
    save_model: bool = True  # write the final model state to model.pt
    trace: bool = False  # write a Chrome trace per rank (runs/<name>/trace/rank<r>.json)
    trace_steps: int = 5  # steps traced, starting at the second step
    checkpoint_every: int = 50  # steps between checkpoints (0: only at the end); train/checkpoint/store.py
    keep_checkpoints: int = 3  # newest checkpoints kept in runs/<name>/checkpoints
    async_checkpoint: bool = False  # write checkpoints behind training (DCP's async_save of a copy)
    max_restarts: int = 3  # elastic restarts after a worker fails (each resumes from the last checkpoint)
    # "MIN..MAX" on a cluster: the run goes on with as few as MIN nodes (torchrun --nnodes MIN:MAX);
    # a node lost for good leaves the survivors to resume at the smaller size, one that joins grows it
    nodes: str | None = None
    # what a data-parallel run resumed on another number of workers keeps (train/checkpoint/resize_policy.py)
    resize_policy: str = _one_of(*choices.RESIZE_POLICIES, default="global_batch")
    inject: str | None = None  # faults for tests: "kill:rank=1,step=30; slow:rank=random,factor=2"
    eval_every_epoch: bool = False  # test accuracy after each epoch -> summary.epoch_accuracy
    precision: str = _one_of(*choices.PRECISIONS, default="fp32")  # bf16/fp16: autocast (fp16: loss scaling)
    # the profile a run predicts itself from: auto (this machine's, calibrated once and cached), none,
    # a preset (h100-ib-ndr, ...: `paraloom plan --help`) or a YAML file (`paraloom calibrate`)
    hardware: str = "auto"
    contract_tolerance: float = 0.25  # warn when a term misses its prediction by this share of the step
    health_every: int = 10  # steps between straggler checks (train/health.py); 0: none

    def __post_init__(self) -> None:
        _positive(self, "log_every")
        _positive(self, "trace_steps")
        _positive(self, "keep_checkpoints")
        if not 0 <= self.seed <= SEED_MAX:  # torch.manual_seed's and numpy's range, both
            raise UserError(f"run.seed={self.seed} must lie between 0 and 2**63-1 ({SEED_MAX})")
        if not self.contract_tolerance > 0:
            raise UserError(f"run.contract_tolerance={self.contract_tolerance} must be above 0 (0.25: 25% of "
                            "the predicted step)")
        if self.checkpoint_every < 0 or self.max_restarts < 0 or self.health_every < 0:
            raise UserError("run.checkpoint_every, run.max_restarts and run.health_every must not be "
                            "negative")
        if self.inject is not None:
            parse_faults(self.inject)
        self.node_range()
        if self.name is not None and not RUN_NAME.fullmatch(self.name):
            shown = repr(self.name) if len(self.name) <= 100 else \
                f"{self.name[:20]!r}... ({len(self.name)} characters)"
            raise UserError(f"run.name={shown} must be a plain directory name: 1 to 100 letters (a-z, A-Z), "
                            "digits, '.', '_' or '-', not starting with '.' or '-'")

    def node_range(self) -> tuple[int, int] | None:
        """(MIN, MAX) of run.nodes, or None."""
        return None if self.nodes is None else rules.node_range(str(self.nodes))


@dataclass(kw_only=True)
class ModelConfig:
    name: str = _one_of(*choices.MODELS, default="cnn", factory=True)  # see models/, or pkg.module:factory
    hidden: int = 128  # width of the hidden (fully connected) layer(s)
    depth: int = 2  # mlp: number of hidden layers
    channels: int = 32  # cnn: channels of the first convolution (the second has twice as many)
    n_layers: int = 4  # gpt: transformer blocks
    d_model: int = 128  # gpt: hidden size
    n_heads: int = 4  # gpt: attention heads (divides d_model; tensor parallelism splits them)
    # gpt: recompute in backward instead of saving: none, selective (the attention core), full (each
    # block); true and false still read as full and none
    recompute: bool | str = _one_of("none", "selective", "full", default="none")
    attention: str = _one_of("sdpa", "math", default="sdpa")  # gpt: fused kernel, or T x T scores in memory
    options: dict[str, Any] = _options()  # keyword arguments of the model (zoo class or user factory)
    tp_plan: dict[str, Any] | None = None  # module-name pattern -> style (docs/guide/model-parallel.md)

    def __post_init__(self) -> None:
        for key in ("hidden", "depth", "channels", "n_layers", "d_model", "n_heads"):
            _positive(self, key)
        if isinstance(self.recompute, bool):
            self.recompute = "full" if self.recompute else "none"


@dataclass(kw_only=True)
class DataConfig:
    name: str = _one_of(*choices.DATASETS, default="digits", factory=True)  # text: stdlib source bytes
    batch_size: int = 64  # global batch per step, split evenly across data-parallel ranks
    test_fraction: float = 0.2  # held-out share, stratified, fixed by split_seed
    split_seed: int = 0  # seed of the train/test split
    shuffle: bool = True  # reshuffle the training order every epoch (seeded)
    n_samples: int = 4096  # synthetic: number of samples
    n_features: int = 32  # synthetic: features per sample
    n_classes: int = 4  # synthetic: classes
    seq_len: int = 128  # text: bytes per sample (the gpt's context)
    text_bytes: int = 1_000_000  # text: training bytes read (validation gets test_fraction as much)
    options: dict[str, Any] = _options()  # keyword arguments of a user's data factory
    workers: int = 0  # DataLoader worker processes reading a user's data set (0: in the training process)

    def __post_init__(self) -> None:
        for key in ("batch_size", "n_samples", "n_features", "seq_len", "text_bytes"):
            _positive(self, key)
        if self.workers < 0:
            raise UserError(f"data.workers={self.workers} must not be negative")
        if self.n_classes < 2:
            raise UserError(f"data.n_classes={self.n_classes} must be at least 2")
        if not 0.0 < self.test_fraction < 1.0:
            raise UserError(f"data.test_fraction={self.test_fraction} must lie strictly between 0 and 1")


@dataclass(kw_only=True)
class OptimConfig:
    name: str = "adam"  # any torch.optim optimizer by name (adam, adamw, sgd, rmsprop, ...), lars or lamb
    options: dict[str, Any] = _options()  # the optimizer's keyword arguments; they win over lr/momentum/...
    lr: float = 2e-3  # learning rate (of a global batch of base_batch samples when scale_lr)
    momentum: float = 0.9  # where the optimizer takes one (sgd, rmsprop, lars)
    weight_decay: float = 0.0  # where the optimizer takes it
    epochs: int = 12  # passes over the training set
    max_steps: int | None = None  # stop early after this many steps (None: run all epochs)
    schedule: str = _one_of(*choices.LR_SCHEDULES, default="constant")  # decay after the warm-up
    warmup_steps: int = 0  # linear warm-up of the learning rate over the first steps
    min_lr_ratio: float = 0.0  # cosine/linear/step: the rate at the last step, as a share of lr
    step_every: int | None = None  # step decay: steps between drops (None: a third of the run)
    step_gamma: float = 0.1  # step decay: factor of each drop
    accumulate: int = 1  # micro-batches per optimizer step, gradients summed locally, synced once
    scale_lr: bool = False  # linear scaling rule (Goyal et al. 2017): lr * data.batch_size / base_batch
    base_batch: int = 64  # the global batch `lr` was tuned for (scale_lr)
    clip_norm: float | None = None  # clip the gradient to this global L2 norm (None: no clipping)
    ema: float | None = None  # decay of a moving average of the weights (AveragedModel's EMA): model_ema.pt
    label_smoothing: float = 0.0  # cross-entropy's (Szegedy et al. 2016), of the training loss only
    # parameters named as named_parameters() gives them, comma-separated; 1d: every bias and norm scale
    no_decay: str | None = None  # trained without weight decay: "*.bias,*norm*", or 1d (optim/groups.py)

    def __post_init__(self) -> None:
        for key in ("epochs", "accumulate", "base_batch"):
            _positive(self, key)
        for key in ("max_steps", "step_every"):
            if getattr(self, key) is not None:
                _positive(self, key)
        if not self.name or not self.name.replace("_", "").isalnum():
            raise UserError(f"optim.name={self.name!r} must name an optimizer, e.g. adamw, sgd, lamb")
        if self.lr <= 0:
            raise UserError(f"optim.lr={self.lr} must be positive")
        if self.momentum < 0 or self.weight_decay < 0 or self.warmup_steps < 0:
            raise UserError("optim.momentum, optim.weight_decay and optim.warmup_steps must not be negative")
        if not 0.0 <= self.min_lr_ratio <= 1.0 or not 0.0 < self.step_gamma <= 1.0:
            raise UserError("optim.min_lr_ratio must lie in [0, 1] and optim.step_gamma in (0, 1]")
        if self.ema is not None and not 0.0 < self.ema < 1.0:
            raise UserError(f"optim.ema={self.ema} is the average's decay: it must lie in (0, 1), e.g. 0.999")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise UserError(f"optim.label_smoothing={self.label_smoothing} must lie in [0, 1)")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise UserError(f"optim.clip_norm={self.clip_norm} must be positive (or null: no clipping)")

    def scaled_lr(self, global_batch: int) -> float:
        """The learning rate for a global batch of `global_batch` samples (the scaling rule, if asked)."""
        return self.lr * global_batch / self.base_batch if self.scale_lr else self.lr


@dataclass(kw_only=True)
class ParallelConfig:
    # dp: data parallel (comm.*), with tp/pp > 1 a dp x tp x pp hybrid; ps: parameter server (ps.*);
    # layers: plain model parallelism, consecutive layers on consecutive ranks, no micro-batches
    mode: str = _one_of(*choices.PARALLEL_MODES, default="dp")
    nproc: int = 2  # worker processes per node (`--nproc`)
    tp: int = 1  # tensor-parallel ranks per model replica (Megatron: heads and MLP columns split)
    pp: int = 1  # pipeline stages per model replica (layers mode: every rank is a stage)
    microbatches: int = 1  # pipeline: micro-batches per step (m)
    schedule: str = _one_of(*choices.PIPELINE_SCHEDULES, default="1f1b")  # pipeline schedule
    virtual_stages: int = 1  # interleaved_1f1b: model chunks per stage (v; the bubble shrinks v-fold)
    balance: str = _one_of(*choices.PIPELINE_BALANCE, default="params")  # pipeline stages balanced by
    # what data parallelism splits across ranks: optimizer (ZeRO-1: its state; comm.shard_optimizer),
    # gradients (ZeRO-2, FSDP SHARD_GRAD_OP), full (ZeRO-3, FSDP FULL_SHARD: parameters too), hybrid
    # (full inside groups of parallel.shard_group ranks, replicated across them: FSDP HYBRID_SHARD)
    shard: str = _one_of(*choices.SHARD_LEVELS, default="none")
    shard_units: str = "auto"  # gathered at once: auto (blocks), size:MB, or module classes / name patterns
    shard_group: int = 0  # hybrid: ranks that shard one copy of the model (0: a node's, parallel.nproc)
    reshard_after_forward: bool = True  # full/hybrid: free a unit after forward, gather it again for backward
    shard_prefetch: int = 1  # units whose all-gather is issued while the one before them computes
    # bf16/fp16 runs: the dtype gradients are reduce-scattered in (parameters compute in run.precision)
    shard_reduce_dtype: str = _one_of(*choices.SHARD_REDUCE_DTYPES, default="fp32")
    # optim.accumulate > 1: gradients add up unsharded, reduce-scattered on the last micro-batch (the whole
    # model's gradients held meanwhile), or sharded, every micro-batch reduce-scattering into the shards
    shard_accumulate: str = _one_of(*choices.SHARD_ACCUMULATE, default="unsharded")

    def __post_init__(self) -> None:
        for key in ("nproc", "tp", "pp", "microbatches", "virtual_stages"):
            _positive(self, key)
        rules.check_sharding(shard=self.shard, mode=self.mode, tp=self.tp, pp=self.pp,
                             shard_group=self.shard_group, shard_prefetch=self.shard_prefetch)
        rules.check_parallel_layout(mode=self.mode, tp=self.tp, pp=self.pp, microbatches=self.microbatches)
        rules.check_interleaving(schedule=self.schedule, virtual_stages=self.virtual_stages, pp=self.pp,
                                 microbatches=self.microbatches)

    @property
    def model_parallel(self) -> bool:
        """True when a replica spans several ranks (tensor or pipeline parallel, or layers mode)."""
        return self.mode == "layers" or self.tp > 1 or self.pp > 1


@dataclass(kw_only=True)
class CommConfig:
    backend: str = _one_of(*choices.BACKENDS, default="auto")  # auto: nccl on cuda else gloo
    algorithm: str = _one_of(*choices.ALL_REDUCE_ALGORITHMS, default="native")  # gradient all-reduce
    engine: str = _one_of(*choices.ENGINES, default="bucketed")  # naive: one all-reduce per tensor
    scheduler: str = _one_of(*choices.COMM_SCHEDULERS, default="wait_free")  # launch order; auto: measured
    # gradient bucket size, MB (DDP's default); auto: sizes tried on the first steps (data_parallel/auto.py)
    bucket_mb: float | str = 25.0
    first_bucket_mb: float = 1.0  # the first bucket backward fills is small, to start early
    partition_mb: float = 2.0  # priority: tensors are cut into (and small ones merged up to) this size
    credit_mb: float = 8.0  # priority: at most this many MB in flight (planned and enforced)
    sync: str = _one_of(*choices.SYNC_MODES, default="sync")  # gradient sync mode
    local_steps: int = 4  # local_sgd: parameters are averaged every this many steps (H)
    local_warmup: int = 0  # local_sgd: synchronous steps first (post-local SGD)
    delay_lr: float | None = None  # one_step_delay: local compensation step size (None: optim.lr)
    shard_optimizer: bool = False  # ZeRO-style: optimizer state and update sharded across ranks
    compressor: str = _one_of("none", *choices.COMPRESSORS, default="none")  # dgc takes sgd's optim.momentum
    density: float | None = None  # topk/randomk/dgc: share of elements sent (None: the compressor's)
    bits: int | None = None  # qsgd: bits per element, 8, 4 or 2 (None: 8)
    lowrank: int | None = None  # powersgd: rank r of the approximation (None: 2)
    timeout_s: float = 300.0  # collective timeout before a rank gives up
    interface: str | None = None  # network interface for gloo; None: loopback for local runs

    def __post_init__(self) -> None:
        if not TIMEOUT_RANGE[0] <= self.timeout_s <= TIMEOUT_RANGE[1]:
            raise UserError(f"comm.timeout_s={self.timeout_s} must lie between {TIMEOUT_RANGE[0]:g} s and "
                            f"{TIMEOUT_RANGE[1]:g} s (7 days)")
        numeric = () if isinstance(self.bucket_mb, str) else (self.bucket_mb,)  # auto: rules.check_dp_options
        if min(self.first_bucket_mb, self.partition_mb, *numeric) <= 0:
            raise UserError("comm.bucket_mb, comm.first_bucket_mb and comm.partition_mb must be positive")
        rules.check_dp_options(sync=self.sync, scheduler=self.scheduler, shard_optimizer=self.shard_optimizer,
                               algorithm=self.algorithm, local_steps=self.local_steps,
                               local_warmup=self.local_warmup, credit_mb=self.credit_mb,
                               compressor=self.compressor, bucket_mb=self.bucket_mb)
        rules.check_compressor_options(self.compressor, density=self.density, bits=self.bits,
                                       lowrank=self.lowrank)

    def compressor_options(self) -> dict[str, Any]:
        """Keyword options for `paraloom.compress.make_compressor` from the keys that were set."""
        options: dict[str, Any] = {}
        if self.density is not None:
            options["density"] = self.density
        if self.bits is not None:
            options["bits"] = self.bits
        if self.lowrank is not None:
            options["rank"] = self.lowrank
        return options


@dataclass(kw_only=True)
class PSConfig:
    servers: int = 1  # parameter-server processes (ranks after the workers), each owning a shard
    consistency: str = _one_of(*choices.CONSISTENCY, default="bsp")  # when a worker may read
    staleness: int = 3  # ssp: clocks a worker may run ahead of the slowest
    overlap: bool = True  # push each slice during backward, load each reply when forward needs it
    partition_mb: float = 0.5  # a server's shard travels as slices of at most this size, each on its own

    def __post_init__(self) -> None:
        _positive(self, "servers")
        if not self.partition_mb > 0:
            raise UserError(f"ps.partition_mb={self.partition_mb} must be positive")
        if self.staleness < 0:
            raise UserError(f"ps.staleness={self.staleness} must not be negative")


@dataclass(kw_only=True)
class SparseConfig:
    sparsity: float = 0.0  # final share of pruned Linear/Conv2d weights (magnitude); 0: dense training
    schedule: str = _one_of(*choices.PRUNING_SCHEDULES, default="gradual")  # gradual: cubic (Zhu & Gupta)
    initial: float = 0.0  # gradual: sparsity at start_step
    start_step: int = 0  # first mask update (oneshot: the only one)
    end_step: int | None = None  # gradual: last mask update (None: half of the run's steps)
    every: int = 10  # gradual: steps between mask updates
    scope: str = _one_of(*choices.PRUNING_SCOPES, default="layer")  # one threshold per tensor, or one overall
    structured: bool = False  # prune whole neurons / output channels (by L2 norm) instead of weights
    sync_threshold: float = 0.5  # gradient pieces below this density send only their unmasked values

    def __post_init__(self) -> None:
        if not 0.0 <= self.initial <= self.sparsity < 1.0:
            raise UserError(f"sparse.initial={self.initial} and sparse.sparsity={self.sparsity} need "
                            "0 <= initial <= sparsity < 1")
        if self.start_step < 0 or self.every < 1 or not 0.0 < self.sync_threshold <= 1.0:
            raise UserError("sparse.start_step must not be negative, sparse.every must be at least 1 and "
                            "sparse.sync_threshold must lie in (0, 1]")


@dataclass(kw_only=True)
class GuardConfig:
    nan: bool = True  # skip (on every rank) a step whose gradients hold NaN or Inf anywhere
    max_bad_steps: int = 5  # stop after this many skipped steps in a row

    def __post_init__(self) -> None:
        _positive(self, "max_bad_steps")


@dataclass(kw_only=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)

    def __post_init__(self) -> None:
        # comm.shard_optimizer=true is parallel.shard=optimizer, written the older way: each sets the other
        if self.parallel.shard == "optimizer" and not self.comm.shard_optimizer:
            self.comm = dataclasses.replace(self.comm, shard_optimizer=True)  # validated again
        elif self.comm.shard_optimizer and self.parallel.shard == "none":
            self.parallel = dataclasses.replace(self.parallel, shard="optimizer")
        elif self.comm.shard_optimizer and self.parallel.shard != "optimizer":
            raise UserError(f"comm.shard_optimizer=true is parallel.shard=optimizer; parallel.shard="
                            f"{self.parallel.shard} already shards the optimizer state: leave it off")
        if self.sparse.sparsity > 0:
            rules.check_sparse_training(mode=self.parallel.mode, model_parallel=self.parallel.model_parallel,
                                        compressor=self.comm.compressor, sync=self.comm.sync,
                                        engine=self.comm.engine)
        if self.parallel.mode == "ps":
            rules.check_push_compressor(self.comm.compressor)
        rules.check_strategy_settings(self.strategy, self.changed(), device=self.run.device,
                                      pp=self.parallel.pp)
        rules.check_recipe(self.strategy, clip_norm=self.optim.clip_norm, precision=self.run.precision,
                           guard_nan=self.guard.nan, scheduler=self.comm.scheduler,
                           no_decay=self.optim.no_decay, shard_optimizer=self.comm.shard_optimizer,
                           ema=self.optim.ema, sync=self.comm.sync)

    @property
    def strategy(self) -> str:
        """The training strategy these settings ask for (choices.STRATEGIES)."""
        return rules.strategy_for(mode=self.parallel.mode, tp=self.parallel.tp, pp=self.parallel.pp,
                                  shard=self.parallel.shard)

    def changed(self) -> dict[str, Any]:
        """Every setting that differs from its default, by dotted key."""
        out = {}
        for section in dataclasses.fields(self):
            value = getattr(self, section.name)
            for key in dataclasses.fields(value):
                default = key.default if key.default is not dataclasses.MISSING else key.default_factory()
                if getattr(value, key.name) != default:
                    out[f"{section.name}.{key.name}"] = getattr(value, key.name)
        return out

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Any, *, source: str = "config") -> Config:
        """Build and validate a Config from plain data (a parsed YAML mapping)."""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise UserError(f"{source} must be a mapping of sections, got {type(raw).__name__}")
        sections = section_types()
        for name in raw:
            if name not in sections:
                raise UserError(f"unknown section {name!r} in {source}; sections: {', '.join(sections)}")
        built = {}
        for name, section_type in sections.items():
            values = raw.get(name) or {}
            if not isinstance(values, dict):
                raise UserError(f"section {name!r} in {source} must be a mapping of keys")
            built[name] = build_section(name, section_type, values)
        return cls(**built)

    def processes(self, workers: int) -> int:
        """Processes started for `workers` workers: they and, in ps mode, the servers."""
        return workers + (self.ps.servers if self.parallel.mode == "ps" else 0)

    def grid(self, world_size: int) -> tuple[int, int, int]:
        """(dp, tp, pp) for `world_size` workers; layers mode makes every rank a stage."""
        return grid(self, world_size)

    def validate_world(self, world_size: int) -> None:
        """Checks that depend on the number of workers; run before any worker starts."""
        validate_world(self, world_size)


def _positive(section: Any, key: str) -> None:
    value = getattr(section, key)
    if value < 1:
        raise UserError(f"{_section_name(section)}.{key}={value} must be at least 1")


def _section_name(section: Any) -> str:
    return type(section).__name__.removesuffix("Config").lower()


def section_types() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """YAML file (optional) + dotted overrides -> validated Config."""
    raw = read_yaml(path) if path is not None else {}
    source = f"config file {str(path)!r}" if path is not None else "config"
    return Config.from_dict(merge(raw, parse_overrides(list(overrides))), source=source)


def dump_config(config: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))


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
    """The threads each of `nproc` workers on this host gets (as run/worker.py shares the cores)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // max(1, nproc))


def left_behind(recorded: dict[str, Any], overrides: list[str]) -> list[str]:
    """A resume whose overrides switch strategy (a pipeline's checkpoint trained on as dp, with
    `--set parallel.pp=1`): the recorded settings the new strategy has no use for, as overrides that put
    them back to their defaults (each `section.key=default`); none where the strategy stays. Without
    them the new strategy would refuse settings the user never gave in this command."""
    def strategy(raw: dict[str, Any]) -> str:
        par = raw.get("parallel") if isinstance(raw.get("parallel"), dict) else {}
        return rules.strategy_for(mode=par.get("mode", "dp"), tp=par.get("tp", 1), pp=par.get("pp", 1),
                                  shard=par.get("shard", "none"))

    merged = merge(recorded, parse_overrides(overrides))
    after = strategy(merged)
    if strategy(recorded) == after:
        return []
    given = {item.partition("=")[0].strip() for item in overrides}
    defaults = Config().to_dict()
    reset = []
    for key in choices.STRATEGY_ENTRIES[after].unused_at(merged.get("parallel", {}).get("pp", 1)):
        section, _, name = key.partition(".")
        value = recorded.get(section, {}).get(name, defaults[section][name])
        if key not in given and value != defaults[section][name]:
            reset.append(f"{key}={json.dumps(defaults[section][name])}")
    return reset
