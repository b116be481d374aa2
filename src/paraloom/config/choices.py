"""Every plug-in name paraloom knows, once; torch-free, the bottom of the package.

Config, the engine, the parameter server, the planner and the CLI read their choices from here;
each registry (compressors, schedulers, sync modes, all-reduce algorithms) is checked against
its list by a test, so a name cannot be offered that nothing implements, nor the reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

# ---- what is trained
MODELS = ("cnn", "mlp", "gpt", "resnet18", "resnet50", "resnet101", "resnet152", "vgg16",
          "alexnet", "googlenet", "inception_v3", "bert")  # paraloom.models
DATASETS = ("digits", "synthetic", "text")  # paraloom.data; text: the stdlib's source bytes
OPTIMIZERS = ("adam", "adamw", "sgd", "lars", "lamb")  # the usual; optim.name takes any torch.optim class
LR_SCHEDULES = ("constant", "cosine", "linear", "step")  # after optim.warmup_steps of linear warm-up
PRECISIONS = ("fp32", "bf16", "fp16")  # run.precision: torch.autocast's dtype; fp16 adds a loss scaler
DEVICES = ("auto", "cpu", "cuda")  # auto: cuda if available

# ---- how the work is split: parallel.mode (the training strategy's family)
PARALLEL_MODES = ("dp", "ps", "layers")  # data parallel (+ tp/pp hybrids), parameter server, layers
# parallel.shard: what data parallelism splits across ranks, ZeRO-1/2/3 and FSDP's HYBRID_SHARD
SHARD_LEVELS = ("none", "optimizer", "gradients", "full", "hybrid")
FULLY_SHARDED = ("gradients", "full", "hybrid")  # the levels torch's fully_shard trains
SHARD_REDUCE_DTYPES = ("fp32", "bf16")  # parallel.shard_reduce_dtype: gradients' reduce-scatter dtype
# parallel.shard_accumulate: where accumulation's micro-batches add up their gradients: unsharded (each
# unit's whole gradient kept until the last micro-batch reduce-scatters it once: DDP's no_sync), or
# sharded (every micro-batch reduce-scatters into the shards: m reductions, gradient memory 1/s)
SHARD_ACCUMULATE = ("unsharded", "sharded")


class StrategyEntry(NamedTuple):
    """A strategy's registry entry: everything the config must know of it before any worker starts.

    module: the module of paraloom.train.strategies whose `@register_strategy` class implements it;
    chosen_when(mode, tp, pp, shard): whether a run's parallel.* settings ask for it (entries are asked in
    order, the first that says yes is the run's strategy); unused: the settings it has no use for
    (changing one from its default is refused before launch); why_unused: the reason that refusal gives;
    cpu_only: whether it runs on CPU (gloo) only, so that run.device=cuda is refused and auto means cpu;
    unused_one_stage: settings it uses only with pipeline stages (parallel.pp > 1), unused otherwise.
    """

    module: str
    chosen_when: Callable[[str, int, int, str], bool]
    unused: tuple[str, ...]
    why_unused: str
    cpu_only: bool = False
    unused_one_stage: tuple[str, ...] = ()

    def unused_at(self, pp: int) -> tuple[str, ...]:
        """The settings this strategy has no use for at `pp` pipeline stages."""
        return (*self.unused, *self.unused_one_stage) if pp == 1 else self.unused


_PIPELINE = ("parallel.microbatches", "parallel.schedule", "parallel.virtual_stages", "parallel.balance")
_PS = ("ps.servers", "ps.consistency", "ps.staleness", "ps.overlap", "ps.partition_mb")
_ENGINE = ("comm.sync", "comm.shard_optimizer", "comm.engine", "comm.algorithm", "comm.scheduler",
           "comm.bucket_mb", "comm.first_bucket_mb", "comm.partition_mb", "comm.credit_mb",
           "comm.local_steps", "comm.local_warmup", "comm.delay_lr")
_CODEC = ("comm.compressor", "comm.density", "comm.bits", "comm.lowrank")
_SHARD = ("parallel.shard_units", "parallel.shard_group", "parallel.reshard_after_forward",
          "parallel.shard_prefetch", "parallel.shard_reduce_dtype", "parallel.shard_accumulate")
# strategy name -> its entry; paraloom.train.strategies imports each entry's module
STRATEGY_ENTRIES = {
    "parameter_server": StrategyEntry(
        "parameter_server", lambda mode, tp, pp, shard: mode == "ps",
        (*_PIPELINE, *_ENGINE, "guard.nan", "parallel.shard", *_SHARD),  # servers drop non-finite pushes
        "workers push each shard to its server (ps.*), with no all-reduce engine, no pipeline, no "
        "parameter sharding, and non-finite pushes always dropped", cpu_only=True),
    "fully_sharded": StrategyEntry(
        "fully_sharded", lambda mode, tp, pp, shard: mode == "dp" and shard in FULLY_SHARDED,
        (*_PS, *_ENGINE, *_CODEC, "sparse.sparsity"),
        "torch's fully_shard gathers and reduce-scatters its units: no engine scheduling, sync modes or "
        "compression, no parameter servers, no pruning, and pipeline settings only with parallel.pp > 1",
        unused_one_stage=_PIPELINE),  # with parallel.pp > 1 its stages are what is sharded
    "model_parallel": StrategyEntry(
        "model_parallel", lambda mode, tp, pp, shard: mode == "layers" or tp > 1 or pp > 1,
        (*_PS, "comm.engine", *_SHARD),  # the naive engine cannot hold back a micro-batch's sync
        "it has no parameter servers, its data-parallel sync needs the bucketed engine, and it shards no "
        "parameters"),
    "data_parallel": StrategyEntry(
        "data_parallel", lambda mode, tp, pp, shard: True,  # what every other run gets
        (*_PIPELINE, *_PS, *_SHARD), "it has no pipeline stages and no parameter servers, and shards no "
        "parameters (parallel.shard=full or hybrid does)"),
}
STRATEGIES = tuple(STRATEGY_ENTRIES)
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
PIPELINE_BALANCE = ("params", "time")  # what pipeline stages are balanced by

# ---- data-parallel communication: comm.*
BACKENDS = ("auto", "gloo", "nccl")  # auto: nccl on cuda, else gloo
ENGINES = ("bucketed", "naive")  # naive: one blocking all-reduce per tensor (the reference)
ALL_REDUCE_ALGORITHMS = ("native", "ring", "halving_doubling", "tree", "one_to_all")
SHARDABLE_ALGORITHMS = ("native", "ring")  # those with a reduce-scatter and an all-gather
WIRE_DTYPES = ("float32", "float16", "bfloat16")  # what the engine all-reduces: gradients, fp16/bf16 payloads
# all-reduce algorithms of other systems that the performance model prices (a plan on a cluster that
# runs them: `paraloom plan --plan dp=64,algorithm=double_binary_tree`) but paraloom does not run
# (hierarchical_<alg>: reduce-scatter inside each node, <alg> across nodes, all-gather inside: NCCL's
# and Horovod's hierarchical all-reduce, Goyal et al. 2017's three phases)
# how a framework lays a model's training state out in memory (perfmodel/cost/memory.py): paraloom's and torch
# DDP's under autocast, Megatron-LM's fp32 main_grad, DeepSpeed ZeRO's stages; the planner prices all
MEMORY_LAYOUTS = ("ddp", "megatron", "zero1", "zero2", "zero3")
MODELLED_ALGORITHMS = ("reduction_tree", "double_binary_tree", "hierarchical_ring",
                       "hierarchical_halving_doubling", "hierarchical_double_binary_tree")
# scheduler name -> the module of paraloom.comm whose `@register_scheduler` class implements it; the
# planner tries them in this order
SCHEDULER_MODULES = {"fifo": "policies", "wait_free": "policies", "priority": "priority"}
SCHEDULERS = tuple(SCHEDULER_MODULES)
COMM_SCHEDULERS = (*SCHEDULERS, "auto")  # auto: each tried for a few steps (data_parallel/auto.py)
RESIZE_POLICIES = ("global_batch", "per_rank_batch")  # run.resize_policy: what a resized run keeps
BUCKET_SIZES_MB = (1.0, 5.0, 25.0, 100.0)  # comm.bucket_mb=auto tries these (data_parallel/auto.py)
AUTO_START_BUCKET_MB = 25.0  # ... starting from DDP's default, which the perf model prices
SYNC_MODES = ("sync", "one_step_delay", "local_sgd")  # what engine.step does after backward

# compressor name -> the module of paraloom.compress that implements it (imported on first use)
COMPRESSOR_MODULES = {
    "fp16": "fp16", "bf16": "fp16", "qsgd": "qsgd", "onebit": "sign", "efsign": "sign",
    "topk": "topk", "randomk": "topk", "dgc": "dgc", "powersgd": "powersgd",
}
COMPRESSORS = tuple(COMPRESSOR_MODULES)
DENSITY_COMPRESSORS = ("topk", "randomk", "dgc")  # those that take comm.density
# payloads whose size and decoding never change from step to step: a parameter server's push
FIXED_SIZE_COMPRESSORS = ("fp16", "bf16", "qsgd", "onebit", "efsign", "topk", "dgc")
MULTI_ROUND_COMPRESSORS = ("powersgd",)  # reducers of their own, not compress/decompress pairs

# ---- parameter server: ps.*
CONSISTENCY = ("bsp", "asp", "ssp")

# ---- sparse training: sparse.*
PRUNING_SCHEDULES = ("gradual", "oneshot")
PRUNING_SCOPES = ("layer", "global")

# ---- faults: run.inject kinds and the keys each takes
FAULT_KINDS = {"kill": ("rank", "step"), "hang": ("rank", "step"), "nan": ("rank", "step"),
               "slow": ("rank", "factor"), "slow_data": ("rank", "factor"), "lose": ("node", "step")}


def registrar(kind: str) -> tuple[dict[str, type], Callable[[type], type]]:
    """(registry, class decorator) of one plug-in family whose classes carry their `name`: the decorator
    adds a class to the registry as its module is imported, and refuses a second class of one name."""
    registry: dict[str, type] = {}

    def register(cls: type) -> type:
        if cls.name in registry:
            raise ValueError(f"{kind} {cls.name!r} is registered twice")
        registry[cls.name] = cls
        return cls

    return registry, register
