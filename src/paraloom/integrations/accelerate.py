"""Accelerate bridge: `prepare(accelerator, *objects)`, Accelerate's `prepare` for a model wrapped in
`paraloom.DataParallel`, so that Accelerate saves, loads and unwraps it as it does its own DDP.

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model = paraloom.DataParallel(model.to(accelerator.device), scheduler="priority", compressor="powersgd")
    optimizer = paraloom.DistributedOptimizer(optimizer, model)   # where the engine applies the update
    model, optimizer, data = prepare(accelerator, model, optimizer, data)
    ...
    accelerator.save_state(directory)          # the engine's state_dict (`module.` keys, as DDP's), ...
    accelerator.load_state(directory)
    accelerator.save_model(model, directory)   # the bare module's keys
    accelerator.unwrap_model(model)            # the bare module

Needs `pip install "paraloom[accelerate]"`. Why a helper: `Accelerator.prepare` wraps every model
with trainable parameters in torch's DDP when several processes run, so an engine handed to it would
be wrapped twice; a model never handed to it is not among the models `save_state` and `load_state`
save and load; and `unwrap_model` (through which `save_model` and `get_state_dict` go) recognises the
wrappers it knows by class (`extract_model_from_parallel` in accelerate/utils/other.py: DDP,
DataParallel, DeepSpeed, FSDP). `prepare` here relies on the two points of Accelerate that the least
can move without breaking Accelerate's own promises:

- each engine is marked with the flag Accelerate sets on whatever it has prepared
  (`_is_accelerate_prepared`, read by `Accelerator.prepare_model` so that it never wraps twice); then
  Accelerate's own `prepare` records the engine among its models as it is and prepares the rest;
- this accelerator's `unwrap_model` (the instance's, not the class's) first takes the module out of
  an engine, then does what it always does.

Accelerate's mixed precision (`mixed_precision="bf16"` / `"fp16"`) is applied to the wrapped
module's forward as `prepare_model` applies it before it wraps a model in DDP. Settings that make
Accelerate wrap, shard or convert the model itself (DeepSpeed, FSDP, Megatron-LM, XLA, tensor or
context parallelism, fp8, `dynamo_backend`) are refused in one line, and so is an Accelerator that
counts fewer processes than torch.distributed does: on a machine without GPUs, `Accelerator()` without
`cpu=True` (or `ACCELERATE_USE_CPU=1`) runs each process as if it were alone. The engine's own
communication state (error-feedback memories, PowerSGD's warm-up count) is not in Accelerate's
checkpoint; a resumed run starts it afresh.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch.distributed as dist
from torch import nn

from paraloom.data_parallel import DataParallel
from paraloom.integrations import MissingExtra

try:
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager
except ModuleNotFoundError as exc:
    if exc.name not in ("accelerate", "accelerate.utils"):  # not installed, or an error inside it
        raise
    raise MissingExtra("accelerate", "accelerate") from None

# Accelerate's distributed types that wrap, shard or place the model themselves
OWN_WRAPPERS = {"DEEPSPEED": "DeepSpeed", "FSDP": "FSDP", "MEGATRON_LM": "Megatron-LM", "XLA": "XLA"}


def refusal(*, distributed_type: str, mixed_precision: str, dynamo_backend: str, model_parallel: bool,
            num_processes: int, world_size: int) -> str | None:
    """Why an Accelerator with these settings cannot hold a `paraloom.DataParallel`, in one line;
    None where it can. `world_size` is torch.distributed's, `num_processes` the Accelerator's."""
    if distributed_type in OWN_WRAPPERS:
        return (f"Accelerate's {OWN_WRAPPERS[distributed_type]} wraps or shards the model itself, and "
                "paraloom.DataParallel takes DDP's place: launch without it (plain multi-process setup)")
    if model_parallel:
        return ("Accelerate's tensor or context parallelism (parallelism_config) does not combine with "
                "paraloom.DataParallel: leave parallelism_config out")
    if mixed_precision == "fp8":
        return ("mixed_precision='fp8' converts the model inside Accelerate's own preparation: "
                "give mixed_precision='bf16' or 'fp16' with paraloom.DataParallel")
    if dynamo_backend.upper() != "NO":
        return (f"dynamo_backend={dynamo_backend.lower()!r} compiles the model inside Accelerate's own "
                "preparation: give dynamo_backend='no' with paraloom.DataParallel")
    if num_processes == 1 and world_size > 1:
        return (f"the Accelerator counts 1 process of the {world_size} started, so it would not shard the "
                "data: without GPUs, give Accelerator(cpu=True) (or set ACCELERATE_USE_CPU=1 for the launch)")
    if num_processes != world_size:
        return (f"the Accelerator counts {num_processes} processes and torch.distributed {world_size}: "
                "start the processes with `accelerate launch` or torchrun, one Accelerator in each")
    return None


class UnwrapEngines:
    """An accelerator's `unwrap_model` that first takes the module out of a `paraloom.DataParallel`."""

    def __init__(self, unwrap_model: Any) -> None:
        self.unwrap_model = unwrap_model

    def __call__(self, model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        while isinstance(model, DataParallel):
            model = model.module
        return self.unwrap_model(model, *args, **kwargs)


def _autocast_forward(accelerator: Any, module: nn.Module) -> None:
    """Accelerate's mixed-precision forward (as `Accelerator.prepare_model` sets it on a model before it
    wraps it): run under autocast, return fp32; `unwrap_model(keep_fp32_wrapper=False)` takes it off."""
    if not accelerator.native_amp or "_original_forward" in module.__dict__:
        return
    module._original_forward = module.forward
    autocast = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
    forward = module.forward
    if hasattr(forward, "__func__"):
        module.forward = MethodType(autocast(forward.__func__), module)
        module.forward = MethodType(convert_outputs_to_fp32(module.forward.__func__), module)
    else:
        module.forward = convert_outputs_to_fp32(autocast(forward))


def prepare(accelerator: Any, *objects: Any) -> Any:
    """`accelerator.prepare(*objects)`, where each `paraloom.DataParallel` among `objects` is recorded as
    a model Accelerate has prepared (saved by `save_state`, loaded by `load_state`, unwrapped by
    `unwrap_model` and `save_model`) instead of being wrapped again; see the module docstring.
    Returns what `accelerator.prepare` returns: the objects in order (one object alone)."""
    engines = [obj for obj in objects if isinstance(obj, DataParallel)]
    if engines:
        config = accelerator.parallelism_config
        why = refusal(distributed_type=str(accelerator.distributed_type.value),
                      mixed_precision=str(accelerator.mixed_precision),
                      dynamo_backend=str(accelerator.state.dynamo_plugin.backend.value),
                      model_parallel=config is not None and (config.tp_enabled or config.cp_enabled),
                      num_processes=accelerator.num_processes,
                      world_size=dist.get_world_size() if dist.is_initialized() else 1)
        if why is not None:
            raise ValueError(why)
        if not isinstance(vars(accelerator).get("unwrap_model"), UnwrapEngines):
            accelerator.unwrap_model = UnwrapEngines(accelerator.unwrap_model)
    for engine in engines:
        _autocast_forward(accelerator, engine.module)
        engine._is_accelerate_prepared = True
    return accelerator.prepare(*objects)
