"""The loop's checkpoints as one component: when to save, saving (at once, or behind training),
resuming (at the saved size or another), and the record of each resume and resize.

The loop holds a CheckpointManager (as torchtitan's trainer holds its checkpointer) and hands it what a
checkpoint holds; `resume` gives back what it restored (a Restored), which the loop takes in.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paraloom.comm.collectives import default_timeout
from paraloom.comm.objects import broadcast_text
from paraloom.config import Config
from paraloom.config.errors import UserError
from paraloom.optim.ema import WeightAverage
from paraloom.perfmodel.runs.contract import replan
from paraloom.train.checkpoint.records import PROGRESS, record_resize, record_resume, reported_steps
from paraloom.train.checkpoint.store import (
    PendingSave,
    agree_on_checkpoint,
    load_parts,
    manifest_of,
    save_checkpoint,
    step_dir,
)
from paraloom.train.strategies.base import Strategy


@dataclasses.dataclass(frozen=True)
class Restored:
    """What a resume read back for the loop."""

    step: int  # the last step the checkpoint had done
    counters: dict[str, Any]  # the loop's counters as saved (samples, traffic, seconds, ...)


class CheckpointManager:
    """One rank's checkpoints: saved and resumed collectively over the strategy's checkpoint group.

    `strategy` gives and takes its own state; `ema` (optim.ema's average, or None) is saved beside it;
    the RNG states are saved and restored here. `total_steps`: the run's last step, always saved;
    `per_epoch`: its steps in an epoch."""

    def __init__(self, cfg: Config, strategy: Strategy, run_dir: Path | None, *, rank: int,
                 device: torch.device, is_main: bool, total_steps: int, per_epoch: int,
                 ema: WeightAverage | None) -> None:
        self.cfg, self.strategy, self.run_dir = cfg, strategy, run_dir
        self.rank, self.device, self.is_main = rank, device, is_main
        self.total_steps, self.per_epoch, self.ema = total_steps, per_epoch, ema
        self.pending: PendingSave | None = None  # run.async_checkpoint: the checkpoint being written
        # DCP writes from a thread of its own: its collectives get a gloo group of their own
        self.async_group = dist.new_group(backend="gloo", timeout=default_timeout()) \
            if cfg.run.async_checkpoint else None

    # ---- resuming

    def resume(self) -> Restored | None:
        """Load the newest whole checkpoint of the run directory, if any (collective), and give back its
        step and counters. One that another number or layout of ranks saved loads where the strategy
        can carry its state over (resize_refusal)."""
        group = self.strategy.checkpoint_group
        found = agree_on_checkpoint(self.run_dir, group=group, grid=self.strategy.grid_record())
        restored = None
        if found is not None:
            step, saved_world, same_grid = found
            self.refuse_finished(step)
            self.refuse_another_strategy(step)
            world = dist.get_world_size(group)
            resized = saved_world != world or not same_grid
            refusal = self.strategy.resize_refusal() if resized else None
            if refusal is not None:
                layout = f"{saved_world} ranks, this run has {world}" if saved_world != world else \
                    f"another layout of {world} ranks ({self.strategy.grid_record()} now)"
                raise UserError(f"the checkpoint of step {step} in {self.run_dir} was saved by {layout}: "
                                f"{refusal}")
            restored = self._load(step, saved_world, resized)
            if self.is_main:
                size = f" (saved by {saved_world} ranks, resumed on {world})" if resized else ""
                print(f"paraloom: resuming from checkpoint step {restored.step} of {self.total_steps}{size}",
                      file=sys.stderr)
            if resized and self.is_main and self.run_dir is not None:
                self._record_resize(step, saved_world, world)
        if self.is_main and self.run_dir is not None and (self.run_dir / PROGRESS).exists():
            # an earlier attempt trained here
            record_resume(self.run_dir, 0 if restored is None else restored.step)
        return restored

    def refuse_finished(self, step: int) -> None:
        """One line, not "resuming from checkpoint step 110 of 46" and a run that trains nothing (and writes
        its summary again), where the checkpoint of `step` leaves nothing to train: past this run's last
        step (the config changed), or at it in a run that already reported there (summary.json). A run
        stopped after its last checkpoint and before reporting goes on to report (collective)."""
        total = self.total_steps
        if step < total:
            return
        if step == total:
            group = self.strategy.checkpoint_group
            reported = None
            if dist.get_rank(group) == 0 and self.run_dir is not None:
                reported = str(reported_steps(self.run_dir))
            if broadcast_text(reported, group) != str(step):
                return
        optim = self.cfg.optim
        ends = f"optim.epochs={optim.epochs} of {self.per_epoch} steps" + \
            (f", optim.max_steps={optim.max_steps}" if optim.max_steps is not None else "")
        where = f"the checkpoint of step {step} in {self.run_dir} is past this run's last step, {total} " \
            f"({ends})" if step > total else \
            f"the run in {self.run_dir} finished at its last step, {total} ({ends})"
        raises = []  # each limit that ends the run by the checkpoint's step, and how far to raise it
        if optim.epochs * self.per_epoch <= step:
            raises.append(("optim.epochs", step // self.per_epoch))
        if optim.max_steps is not None and optim.max_steps <= step:
            raises.append(("optim.max_steps", step))
        raise UserError(f"nothing is left to train: {where}; to train on, raise "
                        + " and ".join(f"{key} above {value}" for key, value in raises)
                        + f" with --set: paraloom train --resume {self.run_dir} "
                        + " ".join(f"--set {key}=..." for key, _ in raises))

    def refuse_another_strategy(self, step: int) -> None:
        """One line, not a missing key deep in the load, when a kind of parallelism this strategy cannot
        carry on from saved `step`."""
        saved_by, name = manifest_of(step_dir(self.run_dir, step)).get("strategy"), self.strategy.name
        if saved_by is not None and saved_by not in self.strategy.resumes_from:  # older ones do not say
            raise UserError(f"the checkpoint of step {step} in {self.run_dir} was saved by a "
                            f"{saved_by.replace('_', ' ')} run, and this run is {name.replace('_', ' ')}: "
                            "resume it with the parallel settings it was saved with, or set another "
                            "run.out_dir to start afresh")

    def _load(self, step: int, saved_world: int, resized: bool) -> Restored:
        """Read the checkpoint of `step` into the strategy, the weight average and the RNG states."""
        saved_grid = manifest_of(step_dir(self.run_dir, step)).get("grid") if resized else None
        sources = self.strategy.resize_sources(saved_world, saved_grid) if resized else [self.rank]
        shared, (local, *others) = load_parts(self.run_dir, step, sources, self.device,
                                              self.strategy.checkpoint_group,
                                              make_sharded=self.strategy.make_sharded)
        restored = Restored(step=int(local.pop("step")), counters=local.pop("counters", {}))
        rng = local.pop("rng")
        self._load_weight_average(local.pop("ema", None), resized and (saved_grid is not None or
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
        return restored

    def _load_weight_average(self, state: dict[str, Any] | None, regridded: bool) -> None:
        """optim.ema's average from the checkpoint: every data-parallel replica's is the same, so any
        rank's serves another size; a stage's or a slice's serves only its own place in the grid."""
        if self.ema is None:
            return
        own = self.strategy.checkpoint_namespace()
        if own is not None and state is not None:
            regridded = regridded or own not in state  # another tp or pp than it was saved with
            state = state.get(own, state)
        if state is None or regridded:
            why = "holds no weight average (it was saved without optim.ema)" if state is None else \
                "cut the model another way (the weight average resumes only on the grid it was saved with)"
            raise UserError(f"optim.ema={self.cfg.optim.ema}: the checkpoint in {self.run_dir} {why}; "
                            "set another run.out_dir to start afresh")
        self.ema.load_state_dict(state)

    def _record_resize(self, step: int, saved_world: int, world: int) -> None:
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

    # ---- saving

    def saves_after(self, step: int) -> bool:
        """Whether a checkpoint follows `step` (run.checkpoint_every, and the last step)."""
        every = self.cfg.run.checkpoint_every
        return self.run_dir is not None and (step == self.total_steps or bool(every) and step % every == 0)

    def save(self, step: int, state: dict[str, Any], counters: dict[str, Any]) -> float:
        """Write the checkpoint of `step` (collective over the strategy's checkpoint group): the strategy's
        `state` (its "shared" part written once), the loop's `counters`, the RNG states and the weight
        average. Returns the seconds it held training up."""
        began = time.perf_counter()
        shared = state.pop("shared", None)
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        local = {"step": step, "counters": dict(counters), "rng": rng, **state}
        if self.ema is not None:
            own = self.strategy.checkpoint_namespace()  # a tp slice's or a stage's average kept apart
            local["ema"] = {own: self.ema.state_dict()} if own is not None else self.ema.state_dict()
        self.drain()  # one checkpoint in flight at most (its wait is part of this save's time)
        self.pending = save_checkpoint(
            self.run_dir, step, local=local, shared=shared if self.is_main else None,
            keep=self.cfg.run.keep_checkpoints, group=self.strategy.checkpoint_group,
            async_group=self.async_group, seal_behind=True,
            meta={"saved_at": time.time(), "strategy": self.strategy.name,
                  "grid": self.strategy.grid_record(),
                  # the data position and the batch it was taken at (checkpoint/resize_policy.py)
                  "samples": counters["samples"], "global_batch": self.cfg.data.batch_size,
                  "dp_size": self.strategy.dp_world_size})
        return time.perf_counter() - began

    def drain(self) -> float:
        """Wait for the checkpoint being written behind training (run.async_checkpoint), if any; the
        seconds waited."""
        if self.pending is None:
            return 0.0
        began, pending, self.pending = time.perf_counter(), self.pending, None
        pending.wait()
        return time.perf_counter() - began

