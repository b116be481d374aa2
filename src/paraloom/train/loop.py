"""The one training loop: what every run does, whatever its parallelism; a Strategy does the rest.

Seeding, the data and its sharding, fault injection, the non-finite guard's bookkeeping, tracing,
progress, metrics and TensorBoard, evaluation, checkpoints and resume, restart bookkeeping,
saving the model and the summary live here, once. With a run directory, a run checkpoints every
`run.checkpoint_every` steps and after its last step, and starts from the newest whole checkpoint
it finds there (an elastic restart or `--resume`).
"""

from __future__ import annotations

import sys
import time
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from paraloom.comm.objects import broadcast_text, gather_floats
from paraloom.config import Config
from paraloom.config.errors import UserError
from paraloom.config.fault_specs import parse_faults
from paraloom.data import DataSets, ShardedBatchSampler, collate, load_data
from paraloom.files import write_json
from paraloom.optim.ema import WeightAverage
from paraloom.perfmodel.runs import history
from paraloom.perfmodel.runs.contract import TERMS, Contract, load_or_predict, report
from paraloom.topology import node_count
from paraloom.trace import Timeline
from paraloom.train.checkpoint.manager import CheckpointManager
from paraloom.train.checkpoint.records import ProgressMarker, read_resumes
from paraloom.train.checkpoint.resize_policy import resized_config
from paraloom.train.faults import FaultInjector
from paraloom.train.guards import PeerFailure, TooManyBadSteps, is_comm_failure, peer_failure
from paraloom.train.health import Health
from paraloom.train.loss_eval import planned_steps, steps_per_epoch
from paraloom.train.metrics import MetricsLogger, memory_mb, save_state
from paraloom.train.progress import TrainProgress
from paraloom.train.strategies import make_strategy
from paraloom.train.strategies.base import StepResult, Strategy


def shared_run_dir(run_dir: Path | None) -> Path | None:
    """Global rank 0's run directory, on every rank (under torchrun only rank 0 is given it)."""
    text = broadcast_text(str(run_dir.resolve()) if run_dir is not None and dist.get_rank() == 0 else None)
    return Path(text) if text is not None else None


def train(cfg: Config, run_dir: Path | None, *, device: torch.device,
          started_at: float | None = None) -> dict[str, Any]:
    """Run the whole job on this rank; rank 0 writes the run directory and returns the summary."""
    started_at = time.time() if started_at is None else started_at
    torch.manual_seed(cfg.run.seed)
    run_dir = shared_run_dir(run_dir)
    if cfg.run.trace and run_dir is None:
        raise UserError("run.trace=true needs a run directory; give train() one on rank 0")
    data = load_data(cfg)
    cfg = resized_config(cfg, run_dir, len(data.train))  # run.resize_policy
    timeline = Timeline(dist.get_rank()) if cfg.run.trace else None
    strategy = make_strategy(cfg, data, device=device, timeline=timeline)
    try:
        loop = Loop(cfg, strategy, data, run_dir, device=device, timeline=timeline, started_at=started_at)
        if not strategy.serves:
            return loop.run()
        served = strategy.serve(loop.save)
        loop.drain_saves()  # a serving rank's last checkpoint is whole before it reports
        return served
    finally:
        strategy.close()


class Loop:
    """One rank's run: the step loop and everything around it, for any strategy."""

    def __init__(self, cfg: Config, strategy: Strategy, data: DataSets, run_dir: Path | None, *,
                 device: torch.device, timeline: Timeline | None, started_at: float) -> None:
        self.cfg, self.strategy, self.run_dir = cfg, strategy, run_dir
        self.device, self.timeline, self.started_at = device, timeline, started_at
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        n_train = len(data.train)
        self.per_epoch = steps_per_epoch(cfg, n_train, drop_last=strategy.drop_last)
        if self.per_epoch == 0:
            raise UserError(f"data.batch_size={cfg.data.batch_size} exceeds the {n_train} training samples; "
                            "lower it")
        self.total_steps = planned_steps(cfg, n_train, drop_last=strategy.drop_last)
        # samples an epoch trains on: the data position is counted in samples (run.resize_policy)
        self.epoch_samples = self.per_epoch * cfg.data.batch_size if strategy.drop_last else n_train
        self.sampler = ShardedBatchSampler(n_train, cfg.data.batch_size, rank=strategy.dp_rank,
                                           world=strategy.dp_world_size, seed=cfg.run.seed,
                                           shuffle=cfg.data.shuffle, drop_last=strategy.drop_last)
        self.loader = DataLoader(data.train, batch_sampler=self.sampler, collate_fn=collate,
                                 num_workers=cfg.data.workers, persistent_workers=cfg.data.workers > 0,
                                 pin_memory=device.type == "cuda")
        self.faults = FaultInjector(parse_faults(cfg.run.inject) if cfg.run.inject else [], rank=self.rank,
                                    world_size=dist.get_world_size(strategy.group), seed=cfg.run.seed,
                                    run_dir=run_dir)
        self.step = 0
        self.counters: dict[str, Any] = {"samples": 0, "comm_bytes": 0, "comm_seconds": 0.0, "skipped": 0,
                                         "loss": None, "checkpoint_seconds": 0.0}
        self.epoch_accuracy: list[list[Any]] = []  # [training seconds, test accuracy] after each epoch
        self.ema_epoch_accuracy: list[list[Any]] = []  # the same for the weight average (optim.ema)
        self.operation, self.bad_in_row, self.stepped_here = "start", 0, False
        self.train_peak = 0.0  # bytes a GPU held at most while training (note_peak)
        # optim.ema: built once the strategy has bound its tensors (the engine's flat buffers)
        self.ema = WeightAverage(strategy.model, cfg.optim.ema) if cfg.optim.ema is not None else None
        self.checkpointer = CheckpointManager(cfg, strategy, run_dir, rank=self.rank, device=device,
                                              is_main=self.is_main, total_steps=self.total_steps,
                                              per_epoch=self.per_epoch,
                                              ema=self.ema)
        restored = self.checkpointer.resume()
        if restored is not None:
            self.step = restored.step
            self.counters.update(restored.counters)
        strategy.take_comm()  # loading and the initial broadcast are not a training step's traffic

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Write the checkpoint of `step` with the strategy's `state` (collective); a serving rank's too
        (Strategy.serve)."""
        self.counters["checkpoint_seconds"] += self.checkpointer.save(step, state, self.counters)

    def drain_saves(self) -> None:
        """Wait for the checkpoint being written behind training (run.async_checkpoint), if any."""
        self.counters["checkpoint_seconds"] += self.checkpointer.drain()

    def make_contract(self) -> Contract:
        """The run's prediction of itself (rank 0, before the first step) and this rank's record."""
        cfg, predicted = self.cfg, None
        if self.is_main and self.run_dir is not None:
            workers = self.world - (cfg.ps.servers if cfg.parallel.mode == "ps" else 0)
            predicted = load_or_predict(self.run_dir, cfg, workers, torch.get_num_threads(),
                                        self.device.type)
        return Contract(predicted, tolerance=cfg.run.contract_tolerance, speaks=self.is_main,
                        warmup=min(10, max(1, self.total_steps // 5)))

    # ---- a training rank

    def run(self) -> dict[str, Any]:
        cfg, strategy = self.cfg, self.strategy
        self.logger = MetricsLogger(self.run_dir, tensorboard=cfg.run.tensorboard) \
            if self.is_main and self.run_dir else None
        self.marker = ProgressMarker(self.run_dir) if self.is_main and self.run_dir else None
        self.progress = TrainProgress(self.total_steps, enabled=self.is_main)
        try:
            self.contract = self.make_contract()
            self.health = Health(cfg.run.health_every, strategy.group, key=strategy.peer_key,
                                 lockstep=strategy.lockstep, speaks=self.is_main, last_step=self.total_steps)
            self.stragglers: list[dict[str, Any]] = []  # named since the last metrics line
            strategy.begin()
            self.logged = (self.step, self.counters["samples"], time.perf_counter())
            self.step_end = self.logged[2]
            self.loop_start, self.samples_at_start = time.perf_counter(), self.counters["samples"]
            self.eval_seconds = 0.0
            while self.step < self.total_steps:
                epoch = self.counters["samples"] // self.epoch_samples
                self.run_epoch(epoch)
                if cfg.run.eval_every_epoch and self.step > 0:
                    self.evaluate_epoch()
                    self.step_end = time.perf_counter()  # evaluating is no step's data loading
            self.drain_saves()  # the last checkpoint is whole before the run reports
            self.train_seconds = time.perf_counter() - self.loop_start - self.eval_seconds
            self.note_peak()  # training's: the final evaluation's batches are no step's
            if self.timeline is not None:
                self.timeline.active = False
            self.operation = "final synchronization and evaluation"
            results = strategy.finish()
            if self.ema is not None:  # the weight average, evaluated as the weights are
                with self.ema.applied():
                    averaged = strategy.finish()
                results.update(ema_test_accuracy=averaged["test_accuracy"], ema_val_loss=averaged["val_loss"])
        except Exception as exc:
            if self.world > 1 and is_comm_failure(exc) and \
                    not isinstance(exc, (PeerFailure, TooManyBadSteps)):
                raise peer_failure(exc, rank=self.rank, world=self.world, step=self.step + 1,
                                   operation=self.operation, timeout_s=cfg.comm.timeout_s) from None
            raise
        finally:
            self.progress.close()
            for closing in (self.logger, self.marker):
                if closing is not None:
                    closing.close()
        return self.summarize(results)

    def run_epoch(self, epoch: int) -> None:
        """The steps of `epoch` from the current position: a resumed run takes a straight run's batches
        (one resumed with another global batch, the samples the interrupted epoch has left)."""
        self.sampler.set_epoch(epoch, skip=self.counters["samples"] % self.epoch_samples)
        left = self.total_steps - self.step  # no batch is read past the run's last step
        counts, scales = self.sampler.global_counts()[:left], self.sampler.loss_scales()[:left]
        for (x, y), global_count, scale in zip(islice(self.loader, left), counts, scales, strict=True):
            self.one_step(epoch, x, y, global_count, scale)

    def one_step(self, epoch: int, x: torch.Tensor, y: torch.Tensor, global_count: int, scale: float) -> None:
        step, timeline, fetched = self.step + 1, self.timeline, time.perf_counter()
        self.faults.before_step(step)
        if timeline is not None:  # steps 2 .. 1 + trace_steps (1-based)
            timeline.active = 1 <= self.step <= self.cfg.run.trace_steps
            step_start = timeline.now()
        self.operation = "training step (forward, backward, synchronization, update)"
        copying = time.perf_counter()
        self.faults.delay_data()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        data = fetched - self.step_end + time.perf_counter() - copying
        saving = self.checkpointer.saves_after(step)
        with self.faults.during(step, self.strategy.model):
            result = self.strategy.train_step(x, y, global_count, scale=scale, step=step, saving=saving)
        self.faults.computed(result.compute_seconds - self.faults.slept)
        self.step = step
        self.guard(result)
        if self.ema is not None and result.stepped:
            self.ema.update()
        if timeline is not None:
            timeline.span(f"step {step}", "step", step_start, timeline.now())
        if self.marker is not None:
            self.marker.mark(step)
        self.counters["samples"] += global_count
        if step % self.cfg.run.log_every == 0 or step == self.total_steps:
            self.operation = "metrics reduction"
            self.log(epoch, result, global_count)
        if saving:
            self.operation = "checkpoint"
            self.save(step, self.strategy.state_dict())
        done = self.counters["samples"] - self.samples_at_start
        now = time.perf_counter()
        self.progress.update(step, loss=self.counters["loss"], epoch=epoch,
                             samples_per_s=done / max(now - self.loop_start, 1e-9))
        # waiting for the batch: from the last step's end to this one's start, and the copy
        terms = {**(result.terms or {}), "data": data}
        self.contract.record(now - self.step_end, terms)
        self.operation = "straggler check"
        self.stragglers += self.health.record(step, terms, now - self.step_end)
        self.step_end = now

    def guard(self, result: StepResult) -> None:
        """Count a skipped step; stop after guard.max_bad_steps in a row."""
        if result.stepped:
            self.bad_in_row, self.stepped_here = 0, True
            return
        self.counters["skipped"] += 1
        if result.scaler_skip:  # fp16's loss scale backed off: expected now and then, not a bad step
            return
        self.bad_in_row += 1
        if self.strategy.skips_alone:  # its own, which no other rank reports
            print(f"paraloom: warning: rank {self.rank}: step {self.step} skipped: non-finite gradients",
                  file=sys.stderr)
        elif self.is_main:
            print(f"paraloom: warning: step {self.step} skipped: non-finite gradients", file=sys.stderr)
        limit = self.cfg.guard.max_bad_steps
        if self.bad_in_row >= limit:
            where = self.run_dir / "checkpoints" if self.run_dir else "nowhere (no run directory)"
            raise TooManyBadSteps(f"{self.bad_in_row} steps in a row (up to step {self.step}) had NaN or Inf "
                                  f"gradients; stopping (guard.max_bad_steps={limit}). The last good "
                                  f"checkpoint is the newest in {where}",
                                  from_the_start=not self.stepped_here)

    def log(self, epoch: int, result: StepResult, global_count: int) -> None:
        """One metrics line (collective over the strategy's group where its ranks step in lockstep: the
        loss, every rank's memory; asynchronous workers log their own, so that logging never makes them
        wait for each other)."""
        strategy = self.strategy
        self.counters["loss"] = strategy.loss_value(result, global_count)
        rss = self.gather(memory_mb()[0]) if strategy.lockstep else [memory_mb()[0]]
        comm_bytes, comm_seconds = self.take_comm()
        step, now = self.step, time.perf_counter()
        logged_step, logged_samples, logged_at = self.logged
        steps_since = step - logged_step
        rate = (self.counters["samples"] - logged_samples) / max(now - logged_at, 1e-9)
        if self.logger is not None:
            self.logger.log({"step": step, "epoch": epoch, "loss": self.counters["loss"],
                             "lr": strategy.learning_rate(), "samples_per_s": rate,
                             "comm_bytes": comm_bytes / steps_since,
                             "comm_seconds": comm_seconds / steps_since,
                             "skipped_steps": self.counters["skipped"],
                             "rss_mb": [round(r, 1) for r in rss],
                             **({} if strategy.loss_scale() is None else
                                {"loss_scale": strategy.loss_scale()}),
                             **({"stragglers": self.stragglers} if self.stragglers else {}),
                             **strategy.metrics()})
        self.logged, self.stragglers = (step, self.counters["samples"], now), []
        self.contract.check()

    def take_comm(self) -> tuple[int, float]:
        """The strategy's training traffic since the last call, also added to the run's counters."""
        comm_bytes, comm_seconds = self.strategy.take_comm()
        self.counters["comm_bytes"] += comm_bytes
        self.counters["comm_seconds"] += comm_seconds
        return comm_bytes, comm_seconds

    def gather(self, value: float) -> list[float]:
        """`value` of every rank of the strategy's group, in rank order (collective)."""
        return gather_floats([value], self.strategy.group)[:, 0].tolist()

    def contract_report(self) -> dict[str, Any]:
        """Predicted and measured terms side by side, every rank's medians gathered (collective)."""
        keys = ("step", *TERMS)
        mine = self.contract.medians()
        values = [mine[k] for k in keys] if mine else [float("nan")] * len(keys)  # nan: no step measured
        # a GPU's peak is what torch allocated; a CPU process's resident memory holds the interpreter too
        cuda = self.device.type == "cuda"
        peak = self.train_peak if cuda else float("nan")
        rows = gather_floats([*values, peak], self.strategy.group).tolist()
        per_rank = [None if row[0] != row[0] else dict(zip(keys, row[:-1], strict=True)) for row in rows]
        out = report(self.contract.given, per_rank, tolerance=self.cfg.run.contract_tolerance)
        out["warned"] = sorted(self.contract.warned)  # during the run (rank 0, which writes the summary)
        if cuda:
            out["measured_peak_memory_bytes_per_rank"] = [row[-1] for row in rows]
        return out

    def note_peak(self, *, count: bool = True) -> None:
        """Take a GPU's peak memory since the last call into training's (`count=False`: drop it, an
        evaluation's between epochs)."""
        if self.device.type == "cuda":
            if count:
                self.train_peak = max(self.train_peak, float(torch.cuda.max_memory_allocated(self.device)))
            torch.cuda.reset_peak_memory_stats(self.device)

    def evaluate_epoch(self) -> None:
        self.operation = "evaluation"
        began = time.perf_counter()
        self.note_peak()
        value = self.strategy.epoch_end()
        averaged = None
        if self.ema is not None:  # the average scored as the weights are, in the same pause
            with self.ema.applied():
                averaged = self.strategy.epoch_end()
        self.note_peak(count=False)
        at = began - self.loop_start - self.eval_seconds
        if value is not None:
            self.epoch_accuracy.append([at, value])
        if averaged is not None:
            self.ema_epoch_accuracy.append([at, averaged])
        self.eval_seconds += time.perf_counter() - began

    # ---- the end

    def summarize(self, results: dict[str, Any]) -> dict[str, Any]:
        """The summary (rank 0 writes it), the trace files and the saved model."""
        cfg, strategy, counters, step = self.cfg, self.strategy, self.counters, self.step
        self.take_comm()
        epochs = [[seconds, value() if callable(value) else value]
                  for seconds, value in self.epoch_accuracy]
        resumes = read_resumes(self.run_dir)
        summary = {
            **results,
            "final_loss": counters["loss"], "steps": step, "epochs": cfg.optim.epochs,
            "samples": counters["samples"], "world_size": self.world,
            "nodes": node_count(self.world),  # hosts or emulated nodes: which link the run used
            "wall_seconds": time.time() - self.started_at, "train_seconds": self.train_seconds,
            "samples_per_second": ((counters["samples"] - self.samples_at_start) / self.train_seconds
                                   if self.train_seconds > 0 else 0.0),  # of this process's part of the run
            "comm_bytes_per_step": counters["comm_bytes"] / max(step, 1),
            "comm_seconds_per_step": counters["comm_seconds"] / max(step, 1),
            "skipped_steps": (int(sum(self.gather(counters["skipped"]))) if strategy.skips_alone
                              else counters["skipped"]),  # every rank's own, or the steps all skipped
            "checkpoint_seconds": counters["checkpoint_seconds"],
            "epoch_accuracy": epochs,
            "restarts": resumes["restarts"], "steps_redone": resumes["steps_redone"],
            "resizes": resumes["resizes"],
            "rss_peak_mb_per_rank": self.gather(memory_mb()[1]),
            "device": str(self.device), "backend": dist.get_backend(),
        }
        if self.ema is not None:
            summary["ema_epoch_accuracy"] = self.ema_epoch_accuracy
        summary["contract"] = contract = self.contract_report()
        if "mfu" in contract:  # model FLOPs utilisation, measured and as predicted (perfmodel/cost/mfu.py)
            summary.update(mfu=contract["mfu"], mfu_predicted=contract["predicted"]["mfu"])
        self.health.settle(wait=True)
        # the checks' own cost: the rank that reached them last waited for no one there
        summary.update(stragglers=self.health.named, health_checks=self.health.checks,
                       health_seconds=min(self.gather(self.health.seconds)))
        if strategy.loss_scale() is not None:  # fp16: every rank's scale (they back off alike)
            summary["loss_scale_per_rank"] = self.gather(strategy.loss_scale())
        summary.update(strategy.summary())
        if self.timeline is not None:
            trace_dir = self.run_dir / "trace"
            self.timeline.write(trace_dir / f"rank{self.rank}.json")  # every rank writes its own
            summary["trace_dir"] = str(trace_dir)
        saving = cfg.run.save_model and self.run_dir is not None
        model = strategy.full_state_dict() if saving else None  # collective: on every rank
        averaged = None
        if saving and self.ema is not None:
            with self.ema.applied():  # copied out: a state dict may hold the model's own tensors
                averaged = strategy.full_state_dict()
                averaged = None if averaged is None else {k: v.clone() for k, v in averaged.items()}
        if self.is_main and self.run_dir is not None:
            if model is not None:
                save_state(self.run_dir / "model.pt", model)
            if averaged is not None:
                save_state(self.run_dir / "model_ema.pt", averaged)
            write_json(self.run_dir / "summary.json", summary)
            history.record(self.run_dir, cfg.to_dict(), summary)  # `paraloom history`
        return summary

