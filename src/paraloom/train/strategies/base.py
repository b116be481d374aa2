"""What a strategy is: the base class every strategy extends, and what one step returns.

A strategy holds only what differs between kinds of parallelism: placing the model on this rank's
groups (its constructor, `Strategy(cfg, data, device=, timeline=)`, after the loop has seeded
torch), one training step, evaluation, its checkpoint state and its summary fields; the loop
(train/loop.py) does the rest. The implementations live in this package, beside the loop, rather than in the
packages of their parallelism: they speak the loop's language (steps, checkpoint state, summary
fields, the recipe of optimizer and loss), which engines, schedules and servers know nothing of.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from paraloom.comm.collectives import CommStats
from paraloom.config import Config
from paraloom.config.choices import registrar
from paraloom.data_parallel.engine_from_config import make_engine
from paraloom.optim.recipe import Recipe
from paraloom.topology import RankGroups
from paraloom.trace import Timeline, trace_modules

# every strategy class by its `name`, filled by `register_strategy` as its module is imported;
# paraloom.train.strategies imports the modules paraloom.config.choices.STRATEGY_ENTRIES names
REGISTERED, register_strategy = registrar("strategy")


class StepResult(NamedTuple):
    stepped: bool  # False: the non-finite guard skipped the update (alike on every rank)
    loss: torch.Tensor | None  # this rank's share of the batch loss, for `Strategy.loss_value`
    compute_seconds: float  # forward and backward computation of this rank, waits excluded
    scaler_skip: bool = False  # a skip that was fp16's loss scaler backing off (not a bad step)
    terms: dict[str, float] | None = None  # this step's seconds by term (perfmodel/runs/contract.py)


class Strategy(ABC):
    """One kind of parallelism; a subclass sets the attributes and implements the abstract methods
    (a subclass that leaves one out cannot be built)."""

    name: str  # its key in the registry (train/strategies/__init__.py), kept in each checkpoint's manifest
    resumes_from: tuple[str, ...]  # the strategies whose checkpoints it carries on from (`name`s)
    model: nn.Module  # this rank's part of the model, unwrapped: what traces and faults hook
    group: dist.ProcessGroup | None = None  # the ranks that run the loop: metrics, evaluation
    checkpoint_group: dist.ProcessGroup | None = None  # every rank of the run: checkpoints
    dp_rank: int  # this rank's shard of every global batch, out of `dp_world_size`
    dp_world_size: int
    drop_last = False  # True: an epoch's short last batch is skipped (fixed micro-batch shapes)
    serves = False  # True on a rank that serves the others (a parameter server), taking no step
    peer_key = 0  # ranks of equal keys do the same work: their timings are compared (train/health.py)
    lockstep = True  # False: the ranks of `group` do not wait for each other every step (ASP, SSP)
    skips_alone = False  # True: a rank's non-finite step is its own (a worker's push), not every rank's

    def begin(self) -> None:  # noqa: B027 (a default that does nothing, not a forgotten method)
        """After any resume, before the first step."""

    @abstractmethod
    def train_step(self, x: torch.Tensor, y: torch.Tensor, global_count: int, *, scale: float, step: int,
                   saving: bool) -> StepResult:
        """Forward, backward, sync and update of 1-based `step` on this rank's shard `x`, `y` of a
        global batch of `global_count` samples, its summed loss weighed by `scale` (dp_world_size /
        global_count; 0 for a padding sample, see data/sampler.py); `saving`: a checkpoint follows."""

    @abstractmethod
    def loss_value(self, result: StepResult, global_count: int) -> float:
        """The step's mean loss (a collective over `group` where needed)."""

    @abstractmethod
    def take_comm(self) -> tuple[int, float]:
        """(bytes, seconds) of training communication since the last call."""

    @abstractmethod
    def learning_rate(self) -> float:
        """The optimizer's learning rate now (for the metrics)."""

    def metrics(self) -> dict[str, Any]:
        """This strategy's own fields of a metrics line."""
        return {}

    def loss_scale(self) -> float | None:
        """fp16's loss scale now (None: no loss scaling)."""
        return None

    def epoch_end(self) -> float | Callable[[], float] | None:
        """run.eval_every_epoch: test accuracy now, or a callable that gives it after training."""
        return None

    @abstractmethod
    def finish(self) -> dict[str, Any]:
        """After the last step: land every update, evaluate; {"test_accuracy": ..., ...}."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict on global rank 0 (collective), None elsewhere."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """This rank's checkpoint state; a key "shared" holds state equal on every rank (written once)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what `state_dict` gave (its "shared" part as rank 0 wrote it)."""

    def grid_record(self) -> list[int] | None:
        """How the ranks are laid out (a checkpoint's manifest keeps it): another layout is a resize."""
        return None

    def checkpoint_namespace(self) -> str | None:
        """Where ranks hold different tensors under one name as DTensors (a fully sharded tp slice or
        pipeline stage), the key this rank's part of the checkpoint is kept under, so that they stay
        apart (the strategy's state and the weight average); None: every name is one tensor."""
        return None

    def make_sharded(self, name: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """The DTensor, of this run's layout, that a checkpoint's sharded entry `name` loads into."""
        raise RuntimeError(f"{type(self).__name__} keeps no sharded state, yet the checkpoint holds {name}")

    def resize_refusal(self) -> str | None:
        """Why this run cannot resume a checkpoint that another number of ranks saved (None: it can)."""
        return f"{type(self).__name__.removesuffix('Strategy')} runs resume only at the size they saved with"

    def resize_sources(self, saved_world: int, saved_grid: list[int] | None) -> list[int]:
        """The saved ranks whose own parts a resized resume reads (rank 0's first); `saved_grid`: the
        layout they had (grid_record's)."""
        return [0]

    def load_resized(self, state: dict[str, Any], saved_world: int, others: list[dict[str, Any]]) -> None:
        """Load a checkpoint that `saved_world` ranks saved (see resize_refusal): `state` holds rank 0's
        part and the shared one, `others` the parts of the other `resize_sources`."""
        raise RuntimeError(self.resize_refusal())

    def summary(self) -> dict[str, Any]:
        """Summary fields (collective over `group`); they override the loop's."""
        return {}

    def serve(self, save: Callable[[int, dict[str, Any]], None]) -> dict[str, Any]:
        """A serving rank's whole run; `save(step, state)` writes a checkpoint (collective)."""
        raise RuntimeError(f"{type(self).__name__} has no serving ranks")

    def close(self) -> None:  # noqa: B027 (as begin)
        """Release what the strategy holds (hooks, threads)."""


class EngineStrategy(Strategy):
    """A strategy that syncs through the data-parallel engine (`engine`, `stats`, `recipe`)."""

    cfg: Config
    device: torch.device

    def attach_engine(self, groups: RankGroups, timeline: Timeline | None, *, total_steps: int,
                      guard_group: dist.ProcessGroup | None = None,
                      comm_group: dist.ProcessGroup | None = None, **recipe: Any) -> None:
        """Trace `model`, wrap it in the engine `comm.*` asks for over `groups`' dp group (the
        non-finite guard's flag on `guard_group`), and make the recipe of its optimizer."""
        cfg = self.cfg
        if timeline is not None:
            trace_modules(self.model, timeline)  # the bare model: its layers, not the engine's wrapper
        self.stats = CommStats()
        self.engine = make_engine(self.model, cfg.comm, groups, self.stats, timeline, cfg.optim,
                                  comm_group=comm_group)
        if cfg.guard.nan:
            self.engine.guard_nonfinite(group=guard_group)
        self.recipe = Recipe(cfg, self.model.parameters(), total_steps=total_steps, device=self.device,
                             **recipe)
        self.optimizer = self.recipe.optimizer

    def take_comm(self) -> tuple[int, float]:
        comm = self.stats.take()
        return comm.bytes, comm.seconds

    def comm_mark(self) -> tuple:
        """The engine's running comm, encode and decode seconds, for `timed_step`; on a GPU also an
        event recorded on the stream now (its kernels are timed by events, never by a sync)."""
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return self.stats.seconds, self.stats.encode_seconds, self.stats.decode_seconds, event

    def timed_step(self, began: float, computed: float, mark: tuple,
                   busy: float | None = None) -> tuple[bool, dict[str, Any]]:
        """The engine's step after forward and backward (`computed` seconds from `began`, `mark` taken
        at `began`): (stepped, the step's compute, communication, codec and update seconds; on a GPU,
        `gpu_events` too: start, backward's end and the step's end on the stream). A pipeline gives
        its stages' `busy` seconds (its last backward's wait for the data-parallel sync included):
        compute is then what they computed, and the rest of `computed` its bubble."""
        stats, start = self.stats, mark[3]
        waited = stats.seconds - mark[0]  # blocked in communication during backward
        middle = _event() if start is not None else None
        stepped = self.engine.step(self.optimizer)  # synchronize, update, zero the gradients (bucket views)
        now = self.comm_mark()
        comm, encode, decode = (a - b for a, b in zip(now[:3], mark[:3], strict=True))
        update = time.perf_counter() - began - computed - (comm - waited)
        terms = {"compute": computed - waited - encode, "communication": comm - decode,
                 "codec": encode + decode, "update": update}
        if busy is not None:
            own = max(0.0, busy - waited - encode)
            terms["bubble"], terms["compute"] = max(0.0, terms["compute"] - own), own
        if start is not None:
            terms["gpu_events"] = (start, middle, now[3])
        return stepped, terms

    def learning_rate(self) -> float:
        return self.recipe.learning_rate()

    def loss_scale(self) -> float | None:
        return self.recipe.scaler.scale if self.recipe.scaler is not None else None

    def close(self) -> None:
        self.engine.close()


def _event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
