"""What one device spends on a layer's forward or backward (roofline per op class, no faster than
its host issues its ops) and on the optimizer's step."""

from __future__ import annotations

from dataclasses import replace

from paraloom.perfmodel.hardware import Hardware
from paraloom.perfmodel.model_profile import ModelProfile

# Bytes an optimizer update reads and writes per parameter (fp32 state): plain SGD reads weight and
# grad and writes weight (12); with momentum it also reads and writes the buffer (20); Adam reads
# weight, grad, m, v and writes weight, m, v (28). A fused kernel does it in one pass: memory-bound.
UPDATE_BYTES = {"sgd": 12.0, "momentum": 20.0, "adam": 28.0}
LAUNCH = "launch_s"  # a GPU's seconds to issue one kernel (paraloom calibrate --device)
# torch's optimizer step measured on the device (calibrate --device): seconds per parameter and per
# parameter tensor, as `<name>.<optimizer>`; where measured they replace UPDATE_BYTES at bandwidth
UPDATE_PER_PARAM, UPDATE_PER_TENSOR = "update_s_per_param", "update_s_per_tensor"
HOST = "host_s"  # the host's seconds to issue one op, as `host_s.<op class>.<fwd|bwd>` (calibrate --device)
# a CPU's seconds per op beyond its arithmetic, as `dispatch_s.<op class>.<fwd|bwd>` (paraloom calibrate on
# a CPU, `cpu_host.py`): the core that computes the op dispatches it too, so these add to its compute
DISPATCH = "dispatch_s"
# seconds a framework's host adds per op launched that the device does not hide (an executor's per-op
# work between kernels, as TensorFlow 1.x's showed: its intercept per step grows with the model's op
# count); 0 unless a profile or a framework's fitted constants say (benchmarks/perfmodel_published.py)
OP_OVERHEAD = "op_overhead_s"


def layer_seconds(layer, hw: Hardware, dtype: str, phase: str, samples: float, tp: int,
                  sequence_parallel: bool = False) -> float:
    """Roofline per op class: FLOPs at the achieved rate or bytes at memory bandwidth, whichever is slower,
    a 3x3 stride-1 convolution's FLOPs divided by the device's Winograd factor for the dtype (a 5x5's
    by the same tile's factor for 5x5: `winograd_5x5`);
    and no faster than the host issues the layer's ops where a GPU profile measured that (`host_s.*`
    or `launch_s`, from `paraloom calibrate --device`): small layers wait on their host; plus, on a
    CPU, each op's dispatch and autograd work (`dispatch_s.*`), which the computing core does too;
    plus a framework's per-op overhead where the profile has one (`op_overhead_s`).

    Megatron tensor parallelism splits the matmul, attention (and convolution) work of a layer
    tp ways; elementwise work on the replicated activations ("other") is not split, unless sequence
    parallelism splits those activations along the sequence too (Korthikanti et al. 2022, section 4.2).
    """
    flops = layer.fwd_flops if phase == "fwd" else layer.bwd_flops
    moved = layer.fwd_mem_bytes if phase == "fwd" else layer.bwd_mem_bytes
    gain = hw.device.winograd.get(dtype, 1.0)
    three, five = ((layer.fwd_winograd, layer.fwd_winograd5) if phase == "fwd" else
                   (layer.bwd_winograd, layer.bwd_winograd5))
    if (three or five) and gain > 1 and f"flops.{dtype}.conv" not in hw.constants:  # measured: cuDNN's own
        conv = flops.get("conv", 0.0) - three - five + three / gain + five / winograd_5x5(gain)
        flops = {**flops, "conv": conv}
    total = 0.0
    for op_class in set(flops) | set(moved):
        share = 1.0 if op_class == "other" and not sequence_parallel else 1.0 / tp
        compute = flops.get(op_class, 0.0) * samples * share / hw.achieved_flops(dtype, op_class)
        memory = moved.get(op_class, 0.0) * samples * share / hw.device.mem_bandwidth
        total += max(compute, memory)
    kernels = layer.fwd_kernels if phase == "fwd" else layer.bwd_kernels
    return (max(total, _issue_seconds(layer, hw, phase)) + dispatch_seconds(layer, hw, phase)
            + kernels * hw.constants.get(OP_OVERHEAD, 0.0))


def without_dispatch(hw: Hardware) -> Hardware:
    """`hw` with no CPU dispatch costs: its compute is then its arithmetic alone."""
    return replace(hw, constants={k: v for k, v in hw.constants.items() if not k.startswith(f"{DISPATCH}.")})


def dispatch_seconds(layer, hw: Hardware, phase: str) -> float:
    """A CPU's seconds dispatching a layer's ops in `phase` (`dispatch_s.*`); 0 where not measured."""
    ops = layer.fwd_ops if phase == "fwd" else layer.bwd_ops
    return sum(count * hw.constants.get(f"{DISPATCH}.{op}.{phase}", 0.0) for op, count in ops.items())


def winograd_5x5(gain: float) -> float:
    """The multiply saving of Winograd's F(m x m, 5 x 5) for the output tile m whose F(m x m, 3 x 3)
    saves `gain`: F(m, r) needs (m + r - 1)^2 multiplies where direct convolution needs m^2 r^2 (Lavin
    and Gray 2016), so sqrt(gain) = 3 m / (m + 2); F(2x2, 3x3)'s 2.25 gives F(2x2, 5x5)'s 100/36."""
    root = gain ** 0.5
    m = 2 * root / (3 - root)
    return (5 * m / (m + 4)) ** 2


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
