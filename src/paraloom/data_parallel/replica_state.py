"""A data-parallel replica's checkpoint state: model, optimizer and the engine's communication state."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def engine_state(model: nn.Module, optimizer: torch.optim.Optimizer, engine) -> dict[str, Any]:
    """The engine's communication state, with model and optimizer under "shared" when every replica
    holds the same (the sync mode decides: local SGD and one-step delay make them differ)."""
    state: dict[str, Any] = {"engine": engine.comm_state_dict()}
    replicas = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if engine.replicas_identical:
        state["shared"] = replicas
    else:
        state.update(replicas)
    return state


def load_engine_state(model: nn.Module, optimizer: torch.optim.Optimizer, engine,
                      state: dict[str, Any], *, keep_compressor: bool = True) -> None:
    """Load what `engine_state` gave (its "shared" part as written once, by rank 0); without
    `keep_compressor` the compressor keeps its fresh state (a resize: residuals were per old rank)."""
    replicas = state if "model" in state else state.get("shared")
    if replicas is None or "model" not in replicas:
        raise RuntimeError("the checkpoint holds no model state")
    model.load_state_dict(replicas["model"])
    optimizer.load_state_dict(replicas["optimizer"])
    engine.load_comm_state_dict(state["engine"], keep_compressor=keep_compressor)


def average_states(states: list[Any]) -> Any:
    """The element-wise mean of like-shaped states (nested dicts and lists); floating-point tensors are
    averaged, everything else (step counts, hyper-parameters) taken from the first."""
    first = states[0]
    if isinstance(first, dict):
        return {key: average_states([s[key] for s in states]) for key in first}
    if isinstance(first, (list, tuple)):
        items = [average_states([s[i] for s in states]) for i in range(len(first))]
        return items if isinstance(first, list) else tuple(items)
    if torch.is_tensor(first) and first.is_floating_point():
        return torch.stack(states).mean(dim=0)
    return first
