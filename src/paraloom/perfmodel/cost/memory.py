"""Memory per device of a plan: weights, gradients, optimizer state, activations and sync buffers."""

from __future__ import annotations

from paraloom.config.choices import FULLY_SHARDED
from paraloom.perfmodel.cost.sharding import sharded_state
from paraloom.perfmodel.model_profile import ModelProfile

# Megatron tensor parallelism splits most of a transformer layer's activations but not all: per
# layer s*b*h*(10 + 24/t) bytes plus the attention scores (Korthikanti et al. 2022, "Reducing
# Activation Recomputation in Large Transformer Models", eq. 2, without sequence parallelism), so
# 10/34 of them stay whole on every tensor-parallel rank. Applied to every layer as the estimate.
TP_REPLICATED_ACTIVATIONS = 10 / 34


def in_flight(schedule: str, microbatches: int, pp: int, stage: int, v: int = 1) -> float:
    """Micro-batches whose activations a stage holds at its peak (of its whole share of the model).

    GPipe runs every forward before any backward: all m. 1F1B starts backward after pp - stage
    forwards and then alternates (Narayanan et al. 2019, PipeDream-Flush): at most pp - stage.
    Interleaved 1F1B holds its warm-up's (pp - stage - 1) x 2 + (v - 1) x pp chunk forwards and one
    more, each a v-th of the stage (Narayanan et al. 2021): about pp + (pp - 1) / v on the first stage.
    Without a pipeline, accumulated micro-batches free their activations one by one: 1.
    """
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return microbatches
    if schedule == "interleaved_1f1b" and v > 1:
        return min(microbatches * v, (pp - stage - 1) * 2 + (v - 1) * pp + 1) / v
    return min(microbatches, pp - stage)


def activation_share(tp: int, sequence_parallel: bool = False) -> float:
    """A tensor-parallel rank's share of a layer's activations: all split with sequence parallelism
    (Korthikanti et al. 2022, eq. 4: s b h (34 + 5 a s / h) / t), else 10/34 of them whole."""
    if sequence_parallel:
        return 1.0 / tp
    return TP_REPLICATED_ACTIVATIONS + (1 - TP_REPLICATED_ACTIVATIONS) / tp


def layout_state(part: ModelProfile, plan, layout: str, optimizer: str) -> dict[str, float]:
    """Bytes of training state one device holds all step long under another framework's layout, the
    model itself in the profile's dtype (`half_model`: w bytes a parameter, 2 for fp16 and bf16; the
    optimizer's fp32 master weights and moments are `optimizer_bytes`, 12 a parameter with Adam):
    - megatron (Megatron-LM's DistributedDataParallel with contiguous buffers, gradients accumulated
      and all-reduced in fp32, without its distributed optimizer): weights w, `main_grad` 4, the
      optimizer's: 18 bytes a parameter in fp16 with Adam, no bucket copy (the buffer is reduced as is);
    - zero1, zero2, zero3 (DeepSpeed; Rajbhandari et al. 2020, "ZeRO", section 5 and Figure 1): the
      optimizer's state split over the data-parallel ranks; zero2 the gradients (w) too; zero3 the
      weights too: 4 + 12/N_d, 2 + 14/N_d and 16/N_d bytes a parameter in fp16 with Adam.
    """
    params = part.n_params / plan.tp
    weight, grad = params * part.dtype_bytes, params * (4.0 if layout == "megatron" else part.dtype_bytes)
    optimizer = part.optimizer_bytes(optimizer) / plan.tp
    if layout.startswith("zero"):
        stage = int(layout[-1])
        optimizer /= plan.dp
        grad /= plan.dp if stage >= 2 else 1
        weight /= plan.dp if stage == 3 else 1
    return {"weights": weight, "grads": grad, "optimizer": optimizer, "buffers": 0.0}


def stage_memory(part: ModelProfile, plan, stage: int, micro: float, opts,
                 shard_size: int = 1) -> dict[str, float]:
    """Bytes one device of `stage` holds, by kind (`shard_size`: the ranks a fully sharded plan's
    copy of the model is split over, cost/sharding.py)."""
    params = part.n_params / plan.tp
    weights = params * part.dtype_bytes  # fp32 weights; under autocast, the low-precision copies it makes
    grads = part.grad_bytes / plan.tp
    optimizer = part.optimizer_bytes(opts.optimizer) / plan.tp
    if opts.shard_optimizer or plan.shard == "optimizer":
        optimizer /= plan.dp
    buffers = params * 4.0 if plan.dp > 1 else 0.0  # the engine's fp32 buckets hold a gradient copy
    held = in_flight(plan.schedule, plan.microbatches, plan.pp, stage, plan.virtual_stages)
    share = activation_share(plan.tp, plan.sequence_parallel)
    activations = part.activation_bytes() * micro * share * held
    # the layer whose forward and backward need the most room besides what it saves (a language
    # model's loss over its vocabulary, usually), with every other layer's saved tensors held
    working = max(layer.work_bytes for layer in part.layers) * micro * share
    state = {"weights": weights, "grads": grads, "optimizer": optimizer, "buffers": buffers}
    if opts.layout != "ddp":
        state = layout_state(part, plan, opts.layout, opts.optimizer)
    elif plan.shard in FULLY_SHARDED:
        state = sharded_state(part, plan, opts.optimizer, shard_size, prefetch=opts.shard_prefetch,
                              reshard=opts.reshard_after_forward, units=opts.shard_units)
    return {**state, "activations": activations, "working": working}


def peak_bytes(kinds: dict[str, float], mixed: bool) -> float:
    """A device's peak from `stage_memory`'s kinds. Optimizer state (with autocast's fp32 weights),
    buffers and fp32 weights stay; gradients are made during backward (they are set to None after
    each step, torch's default) while backward frees the saved activations and autocast's weight
    copies layer by layer: the peak is at backward's start or its end, whichever holds more."""
    kept = kinds["optimizer"] + kinds["buffers"] + (0.0 if mixed else kinds["weights"])
    backward = kinds["activations"] + kinds["working"] + (kinds["weights"] if mixed else 0.0)
    return kept + max(backward, kinds["grads"])


def layout_peak(kinds: dict[str, float]) -> float:
    """A device's peak under another framework's layout: its state stays all step (weights, the
    gradient buffer, the optimizer's), the activations and working room on top."""
    return sum(kinds.values())


def stage_peaks(profile: ModelProfile, plan, stages: list[tuple[int, int]], micro: float,
                opts, shard_size: int = 1) -> list[float]:
    """A device's peak bytes in each stage of the plan (the fullest device is their max). A fully
    sharded plan's kinds are already those at its peak (units in flight): summed, as a layout's."""
    mixed = profile.dtype != "fp32"
    kinds = [stage_memory(profile.slice(start, stop), plan, k, micro, opts, shard_size)
             for k, (start, stop) in enumerate(stages)]
    summed = opts.layout != "ddp" or plan.shard in FULLY_SHARDED
    return [layout_peak(k) if summed else peak_bytes(k, mixed) for k in kinds]
