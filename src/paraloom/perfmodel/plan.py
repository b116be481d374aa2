"""The plan types at the bottom of the performance model: a `Plan` (the grid and every choice that
changes a step's time), the `Options` a step runs with besides, and the `Estimate` the model gives
for it (`paraloom.perfmodel.cost.step_time.estimate`). Torch-free."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from paraloom.config import CommConfig, GuardConfig, OptimConfig, ParallelConfig, PSConfig
from paraloom.config.choices import (
    ALL_REDUCE_ALGORITHMS,
    CONSISTENCY,
    FULLY_SHARDED,
    MEMORY_LAYOUTS,
    MODELLED_ALGORITHMS,
    PIPELINE_SCHEDULES,
    SCHEDULERS,
    SHARD_ACCUMULATE,
    SHARD_LEVELS,
)
from paraloom.config.errors import UserError
from paraloom.config.rules import check_interleaving, check_name, check_parallel_layout

_COMM, _GUARD, _OPTIM, _PS = CommConfig(), GuardConfig(), OptimConfig(), PSConfig()
_PARALLEL = ParallelConfig()
PRICED_SYNC_MODES = ("sync", "one_step_delay")  # of choices.SYNC_MODES, those priced here (not local SGD)
SYNC_OVERHEAD = "sync_overhead_s"  # a synchronous multi-replica step's own cost (paraloom calibrate --from)
# the priority scheduler's own costs (paraloom calibrate --from priority runs): a piece's past its
# all-reduce's calibrated latency, and the scheduler's per step (its issuing thread and deferred
# updates) per core's share of the host
PIECE_OVERHEAD, PRIORITY_OVERHEAD = "piece_overhead_s", "priority_overhead_s"


@dataclass(frozen=True)
class Plan:
    """One way to run the model: the grid and every choice that changes the step's time."""

    dp: int = 1  # data-parallel replicas (parameter server: workers)
    tp: int = 1  # tensor-parallel ranks per replica
    pp: int = 1  # pipeline stages per replica
    microbatches: int = 1  # per step and replica (pipeline, or gradient accumulation when pp = 1)
    schedule: str = "1f1b"  # pipeline schedule
    virtual_stages: int = 1  # interleaved_1f1b: model chunks per stage (v)
    scheduler: str = "wait_free"  # data-parallel communication scheduler
    sync: str = "sync"  # or one_step_delay
    compressor: str = "none"
    algorithm: str = "ring"  # all-reduce algorithm: paraloom's, or another system's tree (priced, not run)
    servers: int = 0  # > 0: a parameter server with this many shards instead of all-reduce
    consistency: str = "bsp"  # parameter server: bsp, asp or ssp
    # Megatron's sequence parallelism (Korthikanti et al. 2022): the activations a tp group keeps whole
    # split along the sequence; priced, not run by paraloom (the planner never offers it)
    sequence_parallel: bool = False
    # a parameter server's workers sum their gradients inside each node first and the node pushes once
    # (TensorFlow's variable_update=distributed_replicated); priced, not run by paraloom
    ps_node_sum: bool = False
    # with ps_node_sum: the servers run on the workers' nodes, one a node, sharing their NICs (as the
    # TensorFlow benchmarks' ps tasks did); priced, not run by paraloom
    ps_colocated: bool = False
    # what data parallelism shards (parallel.shard): none, optimizer (ZeRO-1), gradients, full, hybrid
    # (cost/sharding.py prices the last three, which train with pp = 1, tensor parallelism composing)
    shard: str = "none"
    shard_group: int = 0  # hybrid: ranks sharding one copy (0: a node's devices)
    # fully sharded with microbatches > 1: gradients add up unsharded (one reduction, the whole model's
    # gradients held) or sharded (a reduction each micro-batch): parallel.shard_accumulate
    shard_accumulate: str = "unsharded"

    def __post_init__(self) -> None:
        for key in ("dp", "tp", "pp", "microbatches", "virtual_stages"):
            if getattr(self, key) < 1:
                raise UserError(f"plan {key}={getattr(self, key)} must be at least 1")
        check_interleaving(schedule=self.schedule, virtual_stages=self.virtual_stages, pp=self.pp,
                           microbatches=self.microbatches)
        for key, names in (("schedule", PIPELINE_SCHEDULES), ("scheduler", SCHEDULERS),
                           ("sync", PRICED_SYNC_MODES), ("consistency", CONSISTENCY),
                           ("algorithm", (*ALL_REDUCE_ALGORITHMS, *MODELLED_ALGORITHMS))):
            check_name(f"plan {key}", getattr(self, key), names)
        if self.servers:
            check_parallel_layout(mode="ps", tp=self.tp, pp=self.pp, microbatches=self.microbatches)
        if self.ps_node_sum not in (True, False) or (self.ps_node_sum and not (self.servers and
                                                                               self.consistency == "bsp")):
            raise UserError(f"plan ps_node_sum={self.ps_node_sum} must be true or false, and true only with "
                            "servers and consistency bsp")
        if self.ps_colocated not in (True, False) or (self.ps_colocated and not self.ps_node_sum):
            raise UserError(f"plan ps_colocated={self.ps_colocated} must be true or false, and true only "
                            "with ps_node_sum (one pushing worker a node)")
        check_name("plan shard", self.shard, SHARD_LEVELS)
        split_optimizer = (self.tp > 1 or self.pp > 1) and self.shard == "optimizer"
        if self.shard != "none" and (self.servers or self.sync != "sync"
                                     or self.compressor != "none" or split_optimizer):
            raise UserError(f"plan shard={self.shard} shards synchronous data parallelism: it takes no "
                            "servers, sync=sync and no compressor (and tp or pp > 1 a fully sharded level)")
        check_name("plan shard_accumulate", self.shard_accumulate, SHARD_ACCUMULATE)
        if self.shard_accumulate != "unsharded" and (self.shard not in FULLY_SHARDED
                                                     or self.microbatches == 1):
            raise UserError(f"plan shard_accumulate={self.shard_accumulate} takes a fully sharded plan "
                            "(gradients, full, hybrid) with microbatches > 1")
        if self.shard_group < 0 or (self.shard_group and self.shard != "hybrid"):
            raise UserError(f"plan shard_group={self.shard_group} sizes hybrid sharding's groups")
        if self.sequence_parallel not in (True, False) or (self.sequence_parallel and self.tp == 1):
            raise UserError(f"plan sequence_parallel={self.sequence_parallel} must be true or false, and "
                            "true only with tp > 1 (it splits what tensor parallelism keeps whole)")

    @property
    def devices(self) -> int:
        """Accelerators the plan trains on. Parameter servers are host processes beside the workers
        (as TensorFlow's ps tasks ran on the workers' machines), not devices."""
        return self.dp * self.tp * self.pp

    def label(self) -> str:
        parts = [f"dp{self.dp}"] + [f"tp{self.tp}" + " sp" * self.sequence_parallel] * (self.tp > 1)
        parts += [f"pp{self.pp}"] * (self.pp > 1)
        if self.microbatches > 1:
            parts.append(f"m{self.microbatches}" + (f" {self.schedule}" if self.pp > 1 else "")
                         + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.servers:
            parts.append(f"ps{self.servers} {self.consistency}" + " node-sum" * self.ps_node_sum
                         + " co-located" * self.ps_colocated)
        elif self.shard in FULLY_SHARDED:
            parts.append(f"{self.shard}{self.shard_group or ''}" if self.shard == "hybrid" else self.shard)
            if self.shard_accumulate == "sharded":
                parts.append("sum-sharded")
        elif self.dp > 1:
            parts.append(self.scheduler if self.sync == "sync" else self.sync)
            if self.algorithm not in ("ring", "native"):
                parts.append(self.algorithm)
            if self.shard == "optimizer":
                parts.append("opt-shard")
        if self.compressor != "none":
            parts.append(self.compressor)
        return " ".join(parts)


@dataclass(frozen=True)
class Estimate:
    """What the model predicts for one plan."""

    plan: Plan
    step_s: float
    samples_per_s: float
    memory_bytes: float  # the fullest device
    fits: bool
    bottleneck: str  # the largest term of `breakdown`
    breakdown: dict[str, float] = field(default_factory=dict)  # seconds per step by cause
    phases: dict[str, float] = field(default_factory=dict)  # forward, backward (recomputation included)
    # and update seconds of the step's own work, before any overlap or waiting
    memory_per_stage: tuple[float, ...] = ()  # a device's bytes, pipeline stage by stage

    def to_dict(self) -> dict:
        return {**asdict(self), "plan": asdict(self.plan), "label": self.plan.label()}


@dataclass(frozen=True)
class Options:
    """What the step does besides the plan; defaults are paraloom's config defaults (one source)."""

    optimizer: str = _OPTIM.name
    bucket_mb: float = _COMM.bucket_mb
    first_bucket_mb: float = _COMM.first_bucket_mb
    partition_mb: float = _COMM.partition_mb
    ps_partition_mb: float = _PS.partition_mb  # a parameter server's shard travels as slices of at most this
    credit_mb: float = _COMM.credit_mb  # priority scheduler: bytes in flight at most (comm.credit_mb)
    shard_optimizer: bool = _COMM.shard_optimizer
    shard_prefetch: int = _PARALLEL.shard_prefetch  # fully sharded: units gathered ahead
    reshard_after_forward: bool = _PARALLEL.reshard_after_forward  # full/hybrid: gathered again for backward
    # fully sharded: each unit's parameters, the root's leftovers last, as `parallel.shard_units` cuts the
    # model (measure/profile.py shard_unit_sizes); empty: the profile's layers are the units
    shard_units: tuple[int, ...] = ()
    straggler: float = 1.0  # one data-parallel worker's compute is this many times slower
    guard: bool = _GUARD.nan  # guard.nan: skip steps with NaN/Inf gradients (some updaters all-reduce a flag)
    layout: str = "ddp"  # a framework's memory layout (memory.layout_state): ddp (paraloom), megatron, zeroN
    sample_bytes: float = 0.0  # a sample as stored, read from storage every step (0: the data set in memory)

    def __post_init__(self) -> None:
        check_name("memory layout", self.layout, MEMORY_LAYOUTS)
