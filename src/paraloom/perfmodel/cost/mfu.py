"""Model FLOPs utilisation (MFU), as torchtitan and Megatron-LM report it: the FLOPs the model needs
for a step over what the devices the run holds could do in that step at their peak.

The model's FLOPs are its forward and backward as the profile counts them op by op (matmuls,
convolutions, attention and elementwise work; measure/profile.py), per sample times the step's
global batch — recomputation not counted (it is work the plan adds, not the model's), and the
same for every plan of one model and batch, so MFU compares plans. The peak is the device's
`peak_flops` for the run's precision: a GPU's data sheet (presets) or, on a CPU profile
`paraloom calibrate` measured, the best single-core matmul rate it found — and a CPU host lends
at most its cores (`host_cores`) whatever the number of ranks on it.
"""

from __future__ import annotations

from paraloom.perfmodel.hardware import Hardware
from paraloom.perfmodel.model_profile import ModelProfile


def model_flops_per_sample(profile: ModelProfile) -> float:
    """Forward and backward FLOPs of one sample, every layer and op class (no recomputation)."""
    return float(sum(sum(layer.fwd_flops.values()) + sum(layer.bwd_flops.values())
                     for layer in profile.layers))


def peak_flops(hw: Hardware, dtype: str, devices: int) -> float:
    """FLOP/s of `devices` ranks at their peak in `dtype` (fp32's where the device lists no other):
    on a CPU host no more ranks than its cores."""
    per_device = hw.device.peak_flops.get(dtype) or hw.device.peak("fp32")
    cores = hw.constants.get("host_cores")
    return per_device * (min(devices, cores) if cores else devices)


def mfu(flops_per_step: float, step_seconds: float, peak: float) -> float:
    """The share of `peak` FLOP/s that `flops_per_step` FLOPs in `step_seconds` use."""
    return flops_per_step / (step_seconds * peak) if step_seconds > 0 and peak > 0 else 0.0


__all__ = ["mfu", "model_flops_per_sample", "peak_flops"]
