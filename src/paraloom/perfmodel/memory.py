"""Memory per device of a plan: weights, gradients, optimizer state, activations and sync buffers."""

from __future__ import annotations

from paraloom.perfmodel.profile import ModelProfile

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


def activation_share(tp: int) -> float:
    return TP_REPLICATED_ACTIVATIONS + (1 - TP_REPLICATED_ACTIVATIONS) / tp


def stage_memory(part: ModelProfile, plan, stage: int, micro: float, opts) -> dict[str, float]:
    """Bytes one device of `stage` holds, by kind."""
    params = part.n_params / plan.tp
    weights = params * part.dtype_bytes  # fp32 weights; under autocast, the low-precision copies it makes
    grads = part.grad_bytes / plan.tp
    optimizer = part.optimizer_bytes(opts.optimizer) / plan.tp
    if opts.shard_optimizer:
        optimizer /= plan.dp
    buffers = params * 4.0 if plan.dp > 1 else 0.0  # the engine's fp32 buckets hold a gradient copy
    held = in_flight(plan.schedule, plan.microbatches, plan.pp, stage, plan.virtual_stages)
    activations = part.activation_bytes() * micro * activation_share(plan.tp) * held
    # the layer whose forward and backward need the most room besides what it saves (a language
    # model's loss over its vocabulary, usually), with every other layer's saved tensors held
    working = max(layer.work_bytes for layer in part.layers) * micro * activation_share(plan.tp)
    return {"weights": weights, "grads": grads, "optimizer": optimizer, "buffers": buffers,
            "activations": activations, "working": working}


def peak_bytes(kinds: dict[str, float], mixed: bool) -> float:
    """A device's peak from `stage_memory`'s kinds. Optimizer state (with autocast's fp32 weights),
    buffers and fp32 weights stay; gradients are made during backward (they are set to None after
    each step, torch's default) while backward frees the saved activations and autocast's weight
    copies layer by layer: the peak is at backward's start or its end, whichever holds more."""
    kept = kinds["optimizer"] + kinds["buffers"] + (0.0 if mixed else kinds["weights"])
    backward = kinds["activations"] + kinds["working"] + (kinds["weights"] if mixed else 0.0)
    return kept + max(backward, kinds["grads"])


def stage_peaks(profile: ModelProfile, plan, stages: list[tuple[int, int]], micro: float,
                opts) -> list[float]:
    """A device's peak bytes in each stage of the plan (the fullest device is their max)."""
    mixed = profile.dtype != "fp32"
    return [peak_bytes(stage_memory(profile.slice(start, stop), plan, k, micro, opts), mixed)
            for k, (start, stop) in enumerate(stages)]
