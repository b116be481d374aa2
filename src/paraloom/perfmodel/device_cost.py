"""What one device spends on a layer's forward or backward (roofline per op class, no faster than
its host issues its ops) and on the optimizer's step."""

from __future__ import annotations

from paraloom.perfmodel.hardware import Hardware
from paraloom.perfmodel.profile import ModelProfile

# Bytes an optimizer update reads and writes per parameter (fp32 state): plain SGD reads weight and
# grad and writes weight (12); with momentum it also reads and writes the buffer (20); Adam reads
# weight, grad, m, v and writes weight, m, v (28). A fused kernel does it in one pass: memory-bound.
UPDATE_BYTES = {"sgd": 12.0, "momentum": 20.0, "adam": 28.0}
LAUNCH = "launch_s"  # a GPU's seconds to issue one kernel (paraloom calibrate --device)
# torch's optimizer step measured on the device (calibrate --device): seconds per parameter and per
# parameter tensor, as `<name>.<optimizer>`; where measured they replace UPDATE_BYTES at bandwidth
UPDATE_PER_PARAM, UPDATE_PER_TENSOR = "update_s_per_param", "update_s_per_tensor"
HOST = "host_s"  # the host's seconds to issue one op, as `host_s.<op class>.<fwd|bwd>` (calibrate --device)


def layer_seconds(layer, hw: Hardware, dtype: str, phase: str, samples: float, tp: int,
                  sequence_parallel: bool = False) -> float:
    """Roofline per op class: FLOPs at the achieved rate or bytes at memory bandwidth, whichever is slower,
    a 3x3 stride-1 convolution's FLOPs divided by the device's Winograd factor for the dtype;
    and no faster than the host issues the layer's ops where a GPU profile measured that (`host_s.*`
    or `launch_s`, from `paraloom calibrate --device`): small layers wait on their host.

    Megatron tensor parallelism splits the matmul, attention (and convolution) work of a layer
    tp ways; elementwise work on the replicated activations ("other") is not split, unless sequence
    parallelism splits those activations along the sequence too (Korthikanti et al. 2022, section 4.2).
    """
    flops = layer.fwd_flops if phase == "fwd" else layer.bwd_flops
    moved = layer.fwd_mem_bytes if phase == "fwd" else layer.bwd_mem_bytes
    gain = hw.device.winograd.get(dtype, 1.0)
    winograd = layer.fwd_winograd if phase == "fwd" else layer.bwd_winograd
    if winograd and gain > 1 and f"flops.{dtype}.conv" not in hw.constants:  # a measured rate is cuDNN's
        flops = {**flops, "conv": flops.get("conv", 0.0) - winograd + winograd / gain}
    total = 0.0
    for op_class in set(flops) | set(moved):
        share = 1.0 if op_class == "other" and not sequence_parallel else 1.0 / tp
        compute = flops.get(op_class, 0.0) * samples * share / hw.achieved_flops(dtype, op_class)
        memory = moved.get(op_class, 0.0) * samples * share / hw.device.mem_bandwidth
        total += max(compute, memory)
    return max(total, _issue_seconds(layer, hw, phase))


def _issue_seconds(layer, hw: Hardware, phase: str) -> float:
    """What the host needs to issue a layer's ops: per op class where the profile measured it
    (`host_s.*`), else a kernel launch (`launch_s`) per op; 0 where neither was measured."""
    ops = layer.fwd_ops if phase == "fwd" else layer.bwd_ops
    costs = {c: hw.constants.get(f"{HOST}.{c}.{phase}") for c in ops}
    if ops and all(cost is not None for cost in costs.values()):
        return sum(count * costs[c] for c, count in ops.items())
    kernels = layer.fwd_kernels if phase == "fwd" else layer.bwd_kernels
    return kernels * hw.constants.get(LAUNCH, 0.0)


def update_seconds(part: ModelProfile, hw: Hardware, tp: int, optimizer: str) -> float:
    """The optimizer's step over one device's share of `part`: torch's own step as measured on the
    device (per parameter and per tensor) where the profile has it, else its bytes at bandwidth."""
    params = part.n_params / tp
    per_param = hw.constants.get(f"{UPDATE_PER_PARAM}.{optimizer}")
    if per_param is None:
        return UPDATE_BYTES.get(optimizer, 28.0) * params / hw.device.mem_bandwidth
    per_tensor = hw.constants.get(f"{UPDATE_PER_TENSOR}.{optimizer}", 0.0)
    return per_param * params + per_tensor * part.param_tensors
