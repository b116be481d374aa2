"""The plan, model spec and options a `paraloom train` config runs, so a run can be predicted."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

from paraloom.config import Config
from paraloom.config.choices import AUTO_START_BUCKET_MB, FULLY_SHARDED
from paraloom.config.errors import UserError
from paraloom.config.rules import is_factory
from paraloom.perfmodel.plan import Options, Plan


@dataclass(frozen=True)
class Predictable:
    spec: str
    recompute: str
    plan: Plan
    global_batch: int
    options: Options
    data: str | None = None  # a user's data set, `package.module:factory[:k=v]`: the profile's input
    shard_units: str = "auto"  # parallel.shard_units: what measure/profile.py `with_units` sizes


def spec_of(cfg: Config) -> str:
    """The model spec for the config's model on the config's data (input shape and classes): a
    user's factory with its options, or a zoo model shaped for the data set (a user's included)."""
    import torch

    from paraloom.data import load_dataset, load_user_data
    from paraloom.models import MODELS

    if is_factory(cfg.model.name):
        return factory_spec(cfg.model.name, cfg.model.options, "model.options")
    if cfg.model.name in ("gpt", "bert"):
        m = cfg.model
        accepted = inspect.signature(MODELS[m.name]).parameters
        # what else the config builds it with: the attention kernel where not the default, its options
        extra = {**({"attention": m.attention} if m.attention != "sdpa" and "attention" in accepted else {}),
                 **m.options}
        args = [f"layers={m.n_layers}", f"hidden={m.d_model}", f"heads={m.n_heads}",
                f"seq={cfg.data.seq_len}", "vocab=256", *_spec_args(extra, "model.options")]
        return f"{m.name}:" + ",".join(args)
    if is_factory(cfg.data.name):  # the shape of its first sample, its classes
        user = load_user_data(cfg.data.name, cfg.data.options)
        input_shape, n_classes = tuple(torch.as_tensor(user.train[0][0]).shape), user.n_classes
    else:
        data = dataclasses.asdict(cfg.data)
        data.pop("options")
        split = load_dataset(data.pop("name"), **data)
        input_shape, n_classes = split.input_shape, split.n_classes
    accepted = inspect.signature(MODELS[cfg.model.name]).parameters
    args = [f"{k}={v}" for k, v in {**dataclasses.asdict(cfg.model), **cfg.model.options}.items()
            if k in accepted and k not in ("recompute",) and not isinstance(v, bool)]
    shape = "x".join(str(n) for n in input_shape)
    return f"{cfg.model.name}:" + ",".join([f"input={shape}", f"classes={n_classes}", *args])


def factory_spec(name: str, options: dict, key: str) -> str:
    """`package.module:factory[:k=v,...]`, as the planner reads a user's factory and its options
    (numbers, true/false and lower-case names; anything else cannot be written so and is refused)."""
    args = _spec_args(options, key)
    return name + (":" + ",".join(args) if args else "")


def _spec_args(options: dict, key: str) -> list[str]:
    """`k=v` for each option, as a planner spec writes it; `key` names the options in an error."""
    args = []
    for k, v in options.items():
        name_like = isinstance(v, str) and v.isidentifier() and v == v.lower()
        if not (isinstance(v, (bool, int, float)) or name_like):
            raise UserError(f"{key}.{k}={v!r} cannot be written in a planner spec: it takes numbers, "
                            "true/false and lower-case names")
        args.append(f"{k}={str(v).lower() if isinstance(v, bool) else v}")
    return args


ADAM_LIKE = ("adam", "adamw", "nadam", "radam", "adamax", "lamb")  # two state tensors a parameter


def optimizer_kind(name: str, momentum: float) -> str:
    """The profile's optimizer class by the state it keeps a parameter: AdamW, NAdam, LAMB ... two
    tensors ("adam"); SGD and LARS one with momentum, none without; RMSprop, Adagrad ... one."""
    name = name.lower()
    if name in ADAM_LIKE:
        return "adam"
    if name in ("sgd", "lars"):
        return "momentum" if momentum else "sgd"
    return "momentum"


def predictable(cfg: Config, world: int) -> Predictable:
    """What to predict for `cfg` run on `world` workers (servers not counted)."""
    dp, tp, pp = cfg.grid(world)
    comm, par = cfg.comm, cfg.parallel
    ps = par.mode == "ps"
    interleaved = par.schedule == "interleaved_1f1b" and pp > 1
    # layers mode runs one micro-batch; with pp = 1, accumulation's micro-batches are the model's
    micro = 1 if par.mode == "layers" else par.microbatches
    micro = cfg.optim.accumulate if pp == 1 and micro == 1 and par.mode != "ps" else micro
    plan = Plan(dp=dp, tp=tp, pp=pp, microbatches=micro, schedule=par.schedule if pp > 1 else "1f1b",
                virtual_stages=par.virtual_stages if interleaved else 1,
                scheduler="wait_free" if comm.scheduler == "auto" else comm.scheduler,  # auto: contract.py
                sync=comm.sync if comm.sync != "local_sgd" else "sync",
                compressor=comm.compressor, algorithm=comm.algorithm,
                servers=cfg.ps.servers if ps else 0, consistency=cfg.ps.consistency if ps else "bsp",
                shard=par.shard if not ps else "none",
                shard_group=par.shard_group if par.shard == "hybrid" else 0,
                shard_accumulate=par.shard_accumulate if par.shard in FULLY_SHARDED and micro > 1
                else "unsharded")
    optimizer = optimizer_kind(cfg.optim.name, cfg.optim.options.get("momentum", cfg.optim.momentum))
    options = Options(optimizer=optimizer, first_bucket_mb=comm.first_bucket_mb,
                      bucket_mb=AUTO_START_BUCKET_MB if comm.bucket_mb == "auto" else comm.bucket_mb,
                      partition_mb=comm.partition_mb, credit_mb=comm.credit_mb,
                      ps_partition_mb=cfg.ps.partition_mb, shard_optimizer=comm.shard_optimizer,
                      guard=cfg.guard.nan, shard_prefetch=par.shard_prefetch,
                      reshard_after_forward=par.reshard_after_forward)
    recompute = cfg.model.recompute if cfg.model.name == "gpt" else "none"
    data = cfg.data
    data_spec = factory_spec(data.name, data.options, "data.options") if is_factory(data.name) else None
    spec = spec_of(cfg)
    return Predictable(spec, recompute, plan, cfg.data.batch_size, options, data_spec, par.shard_units)


def plan_inputs(cfg: Config) -> dict[str, Any]:
    """What `paraloom plan CONFIG` plans for: the config's model (shaped for its data set), its data
    set where it is a user's, the global batch, the precision, the recomputation and the optimizer's
    state, as `predictable` reads them for a run."""
    data, optim = cfg.data, cfg.optim
    return {"model": spec_of(cfg), "global_batch": data.batch_size, "dtype": cfg.run.precision,
            "data": factory_spec(data.name, data.options, "data.options") if is_factory(data.name) else None,
            "recompute": cfg.model.recompute if cfg.model.name == "gpt" else "none",
            "optimizer": optimizer_kind(optim.name, optim.options.get("momentum", optim.momentum))}
