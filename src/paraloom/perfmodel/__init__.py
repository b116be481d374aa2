"""The performance model: what a parallel plan costs, before it runs and checked after.

One function prices a plan: `paraloom.perfmodel.cost.step_time.estimate(profile, hardware, plan,
global_batch, options)` gives its step time, throughput and memory per device. Around it:

- `plan` (`Plan`, `Options`, `Estimate`), `model_profile` (`ModelProfile`) and `hardware`
  (`Hardware`, presets): the types at the bottom, torch-free;
- `cost/`: the pure, torch-free formulas the estimate sums (step time, network, memory, overlap,
  compression, device and CPU costs, links, the parameter server's sync, storage);
- `measure/`: what is measured to fill them (model profiles, micro-benchmarks, calibration,
  device profiles, the rechecks after a run); link timings are handed in by the caller;
- `runs/`: the runs' own bookkeeping (the runtime contract, history, finished runs, fitting);
- `from_config` and `planner`: a config's plan, and the search over plans and node counts.
"""

from importlib import import_module
from typing import Any

_LAZY = {  # torch loads on first use of a profile, so reading a hardware profile stays light
    "LayerProfile": "paraloom.perfmodel.model_profile",
    "ModelProfile": "paraloom.perfmodel.model_profile",
    "profile_model": "paraloom.perfmodel.measure.profile",
    "build_from_spec": "paraloom.perfmodel.measure.specs",
    "Plan": "paraloom.perfmodel.plan",
    "Options": "paraloom.perfmodel.plan",
    "Estimate": "paraloom.perfmodel.plan",
    "estimate": "paraloom.perfmodel.cost.step_time",
    "Device": "paraloom.perfmodel.hardware",
    "Hardware": "paraloom.perfmodel.hardware",
    "Link": "paraloom.perfmodel.hardware",
    "device_preset": "paraloom.perfmodel.hardware",
    "link_preset": "paraloom.perfmodel.hardware",
    "load_hardware": "paraloom.perfmodel.hardware",
    "preset_names": "paraloom.perfmodel.hardware",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'paraloom.perfmodel' has no attribute {name!r}")
