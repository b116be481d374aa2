"""run.resize_policy: the global batch, learning rate and length of a run resumed on another number
of data-parallel workers.

`global_batch` (the default) changes nothing: each worker's share of the same global batch grows or
shrinks, and the steps after the resize are the steps the old size would have taken.
`per_rank_batch` keeps each worker's share instead: the global batch becomes the checkpoint's
global batch x new workers / saved workers, the learning rate follows it by the linear scaling
rule (Goyal et al. 2017: `optim.lr` x global batch / `data.batch_size`, or `optim.scale_lr`'s own
rule when it is on), and the run's length is kept in samples: the interrupted epoch goes on from
the first sample it has not seen (the loop counts its position in samples), and the run ends once
it has seen the samples the configured run would have. The schedule keeps counting steps, over the
new number of steps.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from paraloom.config import Config
from paraloom.train.checkpoint.store import latest_valid, manifest_of
from paraloom.train.loss_eval import planned_steps, steps_per_epoch


def resized_config(cfg: Config, run_dir: Path | None, n_train: int) -> Config:
    """Collective: `cfg` as the run must train after resuming its newest checkpoint on this world
    (`cfg` itself unless run.resize_policy=per_rank_batch and the global batch changes)."""
    if cfg.run.resize_policy != "per_rank_batch":
        return cfg
    saved = _saved_position(run_dir)
    if saved is None:
        return cfg
    step, samples, saved_batch, saved_dp = saved
    dp = dist.get_world_size()
    batch = max(dp, round(saved_batch * dp / saved_dp))
    if batch == saved_batch == cfg.data.batch_size:
        return cfg  # never resized (or back at the configured size): the configured run
    planned = _planned_samples(cfg, n_train)
    total = step + steps_between(samples, planned, n_train, batch)
    per_epoch = -(-n_train // batch)
    optim = cfg.optim
    lr = optim.lr if optim.scale_lr else optim.lr * batch / cfg.data.batch_size
    epochs = max(optim.epochs, -(-total // per_epoch))  # enough that max_steps, not epochs, ends the run
    resized = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=batch),
                                  optim=dataclasses.replace(optim, lr=lr, max_steps=total, epochs=epochs))
    if dist.get_rank() == 0:
        print(f"paraloom: run.resize_policy=per_rank_batch: global batch {saved_batch} on {saved_dp} workers "
              f"-> {batch} on {dp}, learning rate {resized.optim.scaled_lr(batch):.4g} (linear scaling); "
              f"{total - step} steps left", file=sys.stderr)
    return resized


def steps_between(start: int, end: int, epoch_samples: int, batch: int) -> int:
    """Steps of `batch` samples from sample `start` to `end` of the run, an epoch's short last batch
    being a step of its own."""
    steps, position = 0, start
    while position < end:
        stop = min(end, (position // epoch_samples + 1) * epoch_samples)
        steps += -(-(stop - position) // batch)
        position = stop
    return steps


def _planned_samples(cfg: Config, n_train: int) -> int:
    """Samples the configured run trains on."""
    steps, per_epoch = planned_steps(cfg, n_train), steps_per_epoch(cfg, n_train)
    epochs, rest = divmod(steps, per_epoch)
    return epochs * n_train + min(rest * cfg.data.batch_size, n_train)


def _saved_position(run_dir: Path | None) -> tuple[int, int, int, int] | None:
    """(step, samples, global batch, data-parallel workers) of the newest whole checkpoint, from rank
    0's reading of its manifest; None without one (or one saved before these were recorded)."""
    found = torch.full((4,), -1, dtype=torch.int64)
    if dist.get_rank() == 0 and run_dir is not None:
        path = latest_valid(run_dir, quiet=True)  # the resume warns of a damaged one, once
        manifest = manifest_of(path) if path is not None else {}
        if all(key in manifest for key in ("samples", "global_batch", "dp_size")):
            found = torch.tensor([manifest["step"], manifest["samples"], manifest["global_batch"],
                                  manifest["dp_size"]], dtype=torch.int64)
    dist.broadcast(found, src=0)
    return None if found[0] < 0 else tuple(int(v) for v in found)  # type: ignore[return-value]
