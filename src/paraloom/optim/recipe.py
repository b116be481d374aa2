"""The optimizer recipe of a run (`optim.*`, `run.precision`): the optimizer and what surrounds its step."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from paraloom.config import Config
from paraloom.optim.clip import GlobalNormClip
from paraloom.optim.groups import decay_groups
from paraloom.optim.lr_schedule import lr_factor, make_schedule
from paraloom.optim.optimizers import make_optimizer
from paraloom.optim.precision import LossScaler, autocast


class Recipe:
    """The optimizer and what surrounds its step (`optim.*`, `run.precision`): the learning-rate
    schedule, gradient clipping by global norm, fp16's loss scaler, accumulation and autocast.

    Clipping and unscaling are step pre-hooks of the optimizer (unscale first), so they act on the
    gradients the optimizer is about to apply, whichever updater drives it; an optimizer that
    steps a shard (`partition_group` set on it, see data_parallel/sharded_optimizer.py) sums the norm over
    that group too. `clip_group` and `counted` describe a model spread over several ranks (see
    optim/clip.py).
    """

    def __init__(self, cfg: Config, params, *, total_steps: int, device: torch.device,
                 clip_group: dist.ProcessGroup | None = None, counted=None) -> None:
        optim = cfg.optim
        momentum = 0.0 if cfg.comm.compressor == "dgc" else optim.momentum  # see dgc_options
        self.base_lr = optim.scaled_lr(cfg.data.batch_size)
        self.optimizer = make_optimizer(optim.name, decay_groups(params), lr=self.base_lr, momentum=momentum,
                                        weight_decay=optim.weight_decay, options=optim.options)
        self.schedule = make_schedule(self.optimizer, **schedule_options(cfg, total_steps))
        self.scaler = LossScaler() if cfg.run.precision == "fp16" else None
        if self.scaler is not None:
            self.optimizer.register_step_pre_hook(self.scaler.unscale_)
        self.clip = GlobalNormClip(optim.clip_norm, group=clip_group, counted=counted) \
            if optim.clip_norm is not None else None
        if self.clip is not None:
            self.optimizer.register_step_pre_hook(self._clip)
        self.accumulate, self.precision, self.device = optim.accumulate, cfg.run.precision, device

    def _clip(self, optimizer: torch.optim.Optimizer, *_) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.clip(params, getattr(optimizer, "partition_group", None))

    def autocast(self):
        return autocast(self.device, self.precision)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scaled(loss) if self.scaler is not None else loss).backward()

    def after_step(self, stepped: bool) -> bool:
        """Advance the schedule; True when a skipped step was the loss scaler's own backing off."""
        self.schedule.step()
        return self.scaler.update(stepped) if self.scaler is not None else False

    def learning_rate(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the optimizer's own: the schedule goes on from its step, at this recipe's base rate
        where the checkpoint's differs (run.resize_policy=per_rank_batch scales it)."""
        self.schedule.load_state_dict(state["schedule"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        saved = self.schedule.base_lrs
        if saved and saved[0] != self.base_lr:
            ratio = self.base_lr / saved[0]
            self.schedule.base_lrs = [lr * ratio for lr in saved]
            for group in self.optimizer.param_groups:
                group["initial_lr"], group["lr"] = group["initial_lr"] * ratio, group["lr"] * ratio


def schedule_options(cfg: Config, total_steps: int) -> dict[str, Any]:
    """`make_schedule` / `lr_factor`'s settings from `optim.*`."""
    optim = cfg.optim
    return {"kind": optim.schedule, "warmup_steps": optim.warmup_steps,
            "total_steps": max(total_steps, optim.warmup_steps + 1), "min_lr_ratio": optim.min_lr_ratio,
            "step_gamma": optim.step_gamma, "step_every": optim.step_every}


def server_optimizer(cfg: Config, params, *, total_steps: int,
                     updates_per_step: int) -> torch.optim.Optimizer:
    """A parameter server's optimizer for one slice, following the schedule by the updates it takes:
    `updates_per_step` of them make one step of the run (BSP: 1; ASP/SSP: one per worker). The count
    lives in the param group, so the optimizer's state dict (the server's checkpoint) carries it."""
    optim = cfg.optim
    optimizer = make_optimizer(optim.name, params, lr=optim.scaled_lr(cfg.data.batch_size),
                               momentum=0.0 if cfg.comm.compressor == "dgc" else optim.momentum,
                               weight_decay=optim.weight_decay, options=optim.options)
    settings = schedule_options(cfg, total_steps)
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
        group.setdefault("updates", 0)

    def before(opt: torch.optim.Optimizer, *_) -> None:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lr_factor(group["updates"] // updates_per_step, **settings)

    def after(opt: torch.optim.Optimizer, *_) -> None:
        for group in opt.param_groups:
            group["updates"] += 1

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
    return optimizer
