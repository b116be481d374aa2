"""The loop's checkpoints: saving (at once, or behind training), resuming (at the saved size or another),
and the record of each resume and resize."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paraloom.config import Config
from paraloom.config.errors import UserError
from paraloom.optim.ema import WeightAverage
from paraloom.perfmodel.runs.contract import replan
from paraloom.train.checkpoint.records import PROGRESS, record_resize, record_resume
from paraloom.train.checkpoint.store import (
    PendingSave,
    agree_on_checkpoint,
    load_parts,
    manifest_of,
    save_checkpoint,
    step_dir,
)
from paraloom.train.strategies.base import Strategy


class Checkpoints:
    """Loop's part that writes and reads checkpoints (a mixin: Loop sets the attributes named here)."""

    cfg: Config
    strategy: Strategy
    run_dir: Path | None
    rank: int
    device: torch.device
    is_main: bool
    step: int
    total_steps: int
    counters: dict[str, Any]
    started_at: float
    pending: PendingSave | None
    async_group: dist.ProcessGroup | None
    ema: WeightAverage | None


    def resume(self) -> int | None:
        """Load the newest whole checkpoint of the run directory, if any (collective). One that another
        number or layout of ranks saved loads where the strategy can carry its state over
        (resize_refusal)."""
        group = self.strategy.checkpoint_group
        found = agree_on_checkpoint(self.run_dir, group=group, grid=self.strategy.grid_record())
        if found is not None:
            resumed, saved_world, same_grid = found
            self.refuse_another_strategy(resumed)
            world = dist.get_world_size(group)
            resized = saved_world != world or not same_grid
            refusal = self.strategy.resize_refusal() if resized else None
            if refusal is not None:
                layout = f"{saved_world} ranks, this run has {world}" if saved_world != world else \
                    f"another layout of {world} ranks ({self.strategy.grid_record()} now)"
                raise UserError(f"the checkpoint of step {resumed} in {self.run_dir} was saved by {layout}: "
                                f"{refusal}")
            self.load_resumed(resumed, saved_world, resized)
            if self.is_main:
                size = f" (saved by {saved_world} ranks, resumed on {world})" if resized else ""
                print(f"paraloom: resuming from checkpoint step {self.step} of {self.total_steps}{size}",
                      file=sys.stderr)
            if resized and self.is_main and self.run_dir is not None:
                self.record_resize(resumed, saved_world, world)
        self.strategy.take_comm()  # loading and the initial broadcast are not a training step's traffic
        if self.is_main and self.run_dir is not None and (self.run_dir / PROGRESS).exists():
            record_resume(self.run_dir, self.step)  # an earlier attempt trained here
        return None if found is None else found[0]

    def refuse_another_strategy(self, step: int) -> None:
        """One line, not a missing key deep in the load, when a kind of parallelism this strategy cannot
        carry on from saved `step`."""
        saved_by, name = manifest_of(step_dir(self.run_dir, step)).get("strategy"), self.strategy.name
        if saved_by is not None and saved_by not in self.strategy.resumes_from:  # older ones do not say
            raise UserError(f"the checkpoint of step {step} in {self.run_dir} was saved by a "
                            f"{saved_by.replace('_', ' ')} run, and this run is {name.replace('_', ' ')}: "
                            "resume it with the parallel settings it was saved with, or set another "
                            "run.out_dir to start afresh")

    def load_resumed(self, step: int, saved_world: int, resized: bool) -> None:
        """Read the checkpoint of `step` into the strategy, the step, the counters and the RNG states."""
        saved_grid = manifest_of(step_dir(self.run_dir, step)).get("grid") if resized else None
        sources = self.strategy.resize_sources(saved_world, saved_grid) if resized else [self.rank]
        shared, (local, *others) = load_parts(self.run_dir, step, sources, self.device,
                                              self.strategy.checkpoint_group,
                                              make_sharded=self.strategy.make_sharded)
        self.step = int(local.pop("step"))
        self.counters.update(local.pop("counters", {}))
        rng = local.pop("rng")
        self.load_weight_average(local.pop("ema", None), resized and (saved_grid is not None or
                                                                    self.strategy.grid_record() is not None))
        if resized:
            for other in others:
                for key in ("step", "counters", "rng", "ema"):
                    other.pop(key, None)
            self.strategy.load_resized({**local, "shared": shared}, saved_world, others)
        else:
            self.strategy.load_state_dict({**local, "shared": shared})
        torch.set_rng_state(rng["torch"].cpu())
        if self.device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"].cpu(), self.device)

    def load_weight_average(self, state: dict[str, Any] | None, regridded: bool) -> None:
        """optim.ema's average from the checkpoint: every data-parallel replica's is the same, so any
        rank's serves another size; a stage's or a slice's serves only its own place in the grid."""
        if self.ema is None:
            return
        if state is None or regridded:
            why = "holds no weight average (it was saved without optim.ema)" if state is None else \
                "cut the model another way (the weight average resumes only on the grid it was saved with)"
            raise UserError(f"optim.ema={self.cfg.optim.ema}: the checkpoint in {self.run_dir} {why}; "
                            "set another run.out_dir to start afresh")
        self.ema.load_state_dict(state)

    def record_resize(self, step: int, saved_world: int, world: int) -> None:
        """Predict the step at the new size beside the old (the run's own profile) and keep the record."""
        cfg, manifest = self.cfg, manifest_of(step_dir(self.run_dir, step))
        servers = old_servers = cfg.ps.servers if cfg.parallel.mode == "ps" else 0
        saved_grid = manifest.get("grid")
        if servers and saved_grid is not None and len(saved_grid) == 2:
            old_servers = saved_grid[1]  # a parameter-server run's grid_record: [workers, servers]
        old_cfg = dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, servers=old_servers)) \
            if old_servers != servers else cfg
        planned = replan(self.run_dir, cfg, saved_world - old_servers, world - servers,
                         torch.get_num_threads(), old_cfg=old_cfg, device=self.device.type)
        old, new = planned["predicted_step_seconds_old"], planned["predicted_step_seconds_new"]
        if old is not None and new is not None:
            print(f"paraloom: resized from {saved_world} to {world} ranks: predicted step {new * 1e3:.2f} ms "
                  f"(at {saved_world}: {old * 1e3:.2f} ms)", file=sys.stderr)
        saved_at = manifest.get("saved_at")
        record_resize(self.run_dir, {"step": step, "old_world_size": saved_world, "new_world_size": world,
                                     **planned}, saved_at=saved_at)

    def saves_after(self, step: int) -> bool:
        every = self.cfg.run.checkpoint_every
        return self.run_dir is not None and (step == self.total_steps or bool(every) and step % every == 0)

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Write the checkpoint of `step` (collective over the strategy's checkpoint group)."""
        began = time.perf_counter()
        shared = state.pop("shared", None)
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        local = {"step": step, "counters": dict(self.counters), "rng": rng, **state}
        if self.ema is not None:
            local["ema"] = self.ema.state_dict()
        self.drain_saves()  # one checkpoint in flight at most
        self.pending = save_checkpoint(
            self.run_dir, step, local=local, shared=shared if self.is_main else None,
            keep=self.cfg.run.keep_checkpoints, group=self.strategy.checkpoint_group,
            async_group=self.async_group, seal_behind=True,
            meta={"saved_at": time.time(), "strategy": self.strategy.name,
                  "grid": self.strategy.grid_record(),
                  # the data position and the batch it was taken at (train/checkpoint/resize_policy.py)
                  "samples": self.counters["samples"], "global_batch": self.cfg.data.batch_size,
                  "dp_size": self.strategy.dp_world_size})
        self.counters["checkpoint_seconds"] += time.perf_counter() - began

    def drain_saves(self) -> None:
        """Wait for the checkpoint being written behind training (run.async_checkpoint), if any."""
        if self.pending is not None:
            began, pending, self.pending = time.perf_counter(), self.pending, None
            pending.wait()
            self.counters["checkpoint_seconds"] += time.perf_counter() - began
