"""Performance model: model profiles and hardware profiles (the planner predicts plans from these)."""

from importlib import import_module
from typing import Any

_LAZY = {  # torch loads on first use of a profile, so reading a hardware profile stays light
    "LayerProfile": "paraloom.perfmodel.profile",
    "ModelProfile": "paraloom.perfmodel.profile",
    "profile_model": "paraloom.perfmodel.profile",
    "build_from_spec": "paraloom.perfmodel.specs",
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
