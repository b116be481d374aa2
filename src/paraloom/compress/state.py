"""Checkpointable compressor state: the fields a class names in `state_fields`, as tensors and numbers.

Error-feedback residuals, DGC momenta, PowerSGD factors, per-key call counters (which seed the
shared random streams) and generator states — what a resumed run needs to send the same bytes
an uninterrupted run would. Everything is plain dicts, tensors and ints, so it loads with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

from typing import Any

import torch

from paraloom.compress.base import ErrorFeedback


def state_dict_of(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in getattr(type(obj), "state_fields", ()):
        value = getattr(obj, name)
        if isinstance(value, ErrorFeedback):
            value = {"residual": dict(value.residual)}
        elif isinstance(value, torch.Generator):
            value = value.get_state()
        elif hasattr(type(value), "state_fields"):
            value = state_dict_of(value)
        elif isinstance(value, dict):
            value = dict(value)
        out[name] = value
    return out


def load_state_of(obj: Any, state: dict[str, Any]) -> None:
    names = tuple(getattr(type(obj), "state_fields", ()))
    retired = getattr(type(obj), "retired_fields", ())  # written by earlier versions, no longer needed
    state = {k: v for k, v in state.items() if k not in retired}
    if set(state) != set(names):
        raise ValueError(f"{type(obj).__name__} state has fields {sorted(state)}, expected {sorted(names)}")
    for name in names:
        current, value = getattr(obj, name), state[name]
        if isinstance(current, ErrorFeedback):
            current.residual = dict(value["residual"])
        elif isinstance(current, torch.Generator):
            current.set_state(value)
        elif hasattr(type(current), "state_fields"):
            load_state_of(current, value)
        else:
            setattr(obj, name, dict(value) if isinstance(value, dict) else value)


def drop_nonfinite(obj: Any) -> int:
    """Forget per-key tensors (residuals, momenta, factors) holding NaN or Inf; returns how many."""
    dropped = 0
    for name in getattr(type(obj), "state_fields", ()):
        value = getattr(obj, name)
        if isinstance(value, ErrorFeedback):
            value = value.residual
        elif hasattr(type(value), "state_fields"):
            dropped += drop_nonfinite(value)
            continue
        if isinstance(value, dict):
            for key in [k for k, v in value.items() if torch.is_tensor(v) and v.is_floating_point()
                        and not bool(torch.isfinite(v).all())]:
                del value[key]
                dropped += 1
    return dropped
