"""An exponential moving average of a model's weights (`optim.ema`), kept beside them on each rank."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class WeightAverage:
    """The average torch's `AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay),
    use_buffers=True)` keeps, over this rank's own part of the model (a tensor-parallel slice, a
    pipeline stage): the first update copies the weights, each later one moves the average a
    (1 - decay) share of the way to them, in one `_foreach_lerp_` over every floating-point tensor.
    Buffers that are not floating point (BatchNorm's batch counter) are copied.

    The tensors are those of `module.state_dict()` when it is built: build it after anything that
    re-binds them (the engine's flat buffers), as the loop does. A fully sharded model's are
    DTensors: the average is kept as DTensors of the same layout (a checkpoint saves them sharded)
    and updated through their local shards.
    """

    def __init__(self, module: nn.Module, decay: float) -> None:
        self.decay = decay
        state = module.state_dict()
        self.keys = list(state)
        self.average = [t.detach().clone() for t in state.values()]
        # the arithmetic runs on local tensors (a DTensor's shard): foreach ops take plain tensors
        self.live = [_local(t.detach()) for t in state.values()]
        self.averaged = [_local(t) for t in self.average]
        floating = [t.is_floating_point() for t in self.live]
        self.pairs = [[t for t, f in zip(tensors, floating, strict=True) if f]
                      for tensors in (self.averaged, self.live)]
        self.others = [(a, t) for a, t, f in zip(self.averaged, self.live, floating, strict=True) if not f]
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step that was taken (a skipped one leaves the average as it is)."""
        if self.updates == 0:
            torch._foreach_copy_(self.averaged, self.live)
        else:
            torch._foreach_lerp_(*self.pairs, 1.0 - self.decay)
            for average, live in self.others:
                average.copy_(live)
        self.updates += 1

    @contextlib.contextmanager
    @torch.no_grad()
    def applied(self) -> Iterator[None]:
        """The model holds the average inside the block (to evaluate or save it), its weights after."""
        kept = [t.clone() for t in self.live]
        torch._foreach_copy_(self.live, self.averaged)
        try:
            yield
        finally:
            torch._foreach_copy_(self.live, kept)

    def state_dict(self) -> dict:
        return {"updates": self.updates, "average": dict(zip(self.keys, self.average, strict=True))}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        saved = state["average"]
        if list(saved) != self.keys:
            raise ValueError("the checkpoint's weight average holds other tensors than this model")
        torch._foreach_copy_(self.averaged, [_local(saved[k]).to(t.device)
                                             for k, t in zip(self.keys, self.averaged, strict=True)])
        self.updates = int(state["updates"])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage: writes land in the DTensor), any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
