"""Parameter-server training: the first ranks are workers, the last `ps.servers` ranks are servers.

Every rank builds the model from the same seed; server i keeps shard i of the flattened
parameters and runs the optimizer on it. Workers pull all shards, compute on their slice of the
global batch, push all shards' gradients (compressed with a fixed-size comm.compressor, if
asked). A request carries a token rank 0 drew for this attempt; servers refuse any other.

A checkpoint is a consistent cut: the pushes of its step carry a snapshot mark, the servers hold
those pushes' replies until every worker's marked push has arrived at every slice -- so each
worker's pushes applied equal its clock -- then every rank writes its part (servers: slices,
optimizer state, clocks, versions; workers: their client state, and through the loop their RNG
and data position). Non-finite pushes are dropped by the servers and counted, never applied.

A run of another number of servers or workers resumes from it (load_resized): each server rebuilds
its slices from every saved server's (parameter_server/resplit.py), the clocks restart at the cut,
and the workers' compressor state starts from zero.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from paraloom.comm.collectives import default_timeout
from paraloom.comm.objects import gather_floats, gather_json
from paraloom.compress.dgc import dgc_options
from paraloom.config import Config
from paraloom.config.errors import UserError
from paraloom.data import DataSets
from paraloom.models.make import make_model
from paraloom.optim import lr_factor
from paraloom.optim.precision import autocast
from paraloom.optim.recipe import schedule_options, server_optimizer
from paraloom.parameter_server.client import PSClient
from paraloom.parameter_server.consistency import staleness_bound
from paraloom.parameter_server.message import PushCodec, draw_token
from paraloom.parameter_server.resplit import recut, saved_slices
from paraloom.parameter_server.server import ParameterServer, serve
from paraloom.parameter_server.shard import flatten_model, slice_layout
from paraloom.parameter_server.throughput import all_workers_throughput
from paraloom.trace import Timeline, trace_modules
from paraloom.train.loss_eval import batch_loss, chunks, evaluate, planned_steps
from paraloom.train.strategies.base import StepResult, Strategy, register_strategy


@register_strategy
class ParameterServerStrategy(Strategy):
    """Workers push gradients to and pull parameters from sharded servers (BSP, ASP or SSP)."""

    name = "parameter_server"
    resumes_from = ("parameter_server",)

    def __init__(self, cfg: Config, data: DataSets, *, device: torch.device,
                 timeline: Timeline | None) -> None:
        if device.type != "cpu":  # config refuses run.device=cuda and the worker picks the CPU
            raise UserError("the parameter_server strategy runs on CPU (gloo) so far; use run.device=cpu")
        self.cfg, self.data, self.device = cfg, data, device
        rank, world = dist.get_rank(), dist.get_world_size()
        self.n_servers = cfg.ps.servers
        self.n_workers = world - self.n_servers
        if self.n_workers < 1:
            raise UserError(f"{world} processes cannot hold {self.n_servers} servers and a worker")
        self.serves = rank >= self.n_workers
        self.lockstep = cfg.ps.consistency == "bsp"
        self.skips_alone = True  # each worker's gradient is its own: the servers drop its push alone
        self.group = dist.new_group(list(range(self.n_workers)), timeout=default_timeout())  # the workers
        # checkpoints' barriers run beside the point-to-point traffic: on a group of their own
        self.checkpoint_group = dist.new_group(list(range(world)), timeout=default_timeout())
        self.dp_rank, self.dp_world_size = min(rank, self.n_workers - 1), self.n_workers
        clip, average = cfg.optim.clip_norm, cfg.ps.consistency == "bsp"
        # BSP clips the mean gradient: the servers sum their slices' squares over a group of their own
        self.norm_group = dist.new_group(list(range(self.n_workers, world)), timeout=default_timeout()) \
            if clip is not None and average and self.n_servers > 1 else None
        self.model = make_model(cfg, data)
        self.total_steps = planned_steps(cfg, len(data.train))
        self.n_params = n_params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        layout = slice_layout(n_params, self.n_servers, max(1, int(cfg.ps.partition_mb * 2**20 / 4)))  # fp32
        self.bounds = [(lo, hi) for _, lo, hi in layout]
        servers = [self.n_workers + server for server, _, _ in layout]  # the rank owning each slice
        token = draw_token()
        options = {**cfg.comm.compressor_options(), **(dgc_options(cfg.comm, cfg.optim) or {})}
        compressor = None if cfg.comm.compressor == "none" else cfg.comm.compressor
        codecs = [PushCodec(hi - lo, compressor, options) for lo, hi in self.bounds]
        if self.serves:
            flat, _ = flatten_model(self.model)
            self.mine = mine = [i for i, owner in enumerate(servers) if owner == rank]  # slot order
            self.slices = [ParameterServer(
                flat[self.bounds[i][0]:self.bounds[i][1]],
                lambda params: server_optimizer(cfg, params, total_steps=self.total_steps,
                                                updates_per_step=1 if average else self.n_workers),
                workers=list(range(self.n_workers)), average=average, token=token, codec=codecs[i],
                slot=slot, bound=staleness_bound(cfg.ps.consistency, cfg.ps.staleness),
                clip_norm=clip if average else None)
                for slot, i in enumerate(mine)]
            return
        if timeline is not None:
            trace_modules(self.model, timeline)
        self.client = PSClient(self.model, servers, bounds=self.bounds, token=token, codecs=codecs)
        self.taken = (0, 0.0)  # wire bytes and wait seconds already reported by take_comm

    # ---- a server

    def serve(self, save: Callable[[int, dict[str, Any]], None]) -> dict[str, Any]:
        """Serve until every worker is done; a snapshot of every slice is a checkpoint of its clock."""
        stats = {"server": dist.get_rank() - self.n_workers,
                 **serve(self.slices, on_snapshot=lambda clock, states: save(clock, {"slices": states}),
                         norm_group=self.norm_group)}
        gather_json(stats, self.checkpoint_group)  # to the workers' summary
        return stats

    # ---- a worker

    def begin(self) -> None:
        client = self.client
        waited = client.wait_seconds
        client.pull()  # the parameters to start from; waits for every server to be up
        if self.cfg.ps.overlap:
            client.attach(self.model)
        self.startup_wait = client.wait_seconds - waited  # servers starting: not training
        self.taken = (client.wire_bytes, client.wait_seconds)
        self.rows = [(time.time(), 0.0)]
        self.cpu_start, self.samples = time.process_time(), 0

    def train_step(self, x: torch.Tensor, y: torch.Tensor, global_count: int, *, scale: float, step: int,
                   saving: bool) -> StepResult:
        client = self.client
        if saving:
            client.mark_snapshot()
        began, waited = time.perf_counter(), client.wait_seconds
        pieces, loss_sum = chunks(x, y, self.cfg.optim.accumulate), 0.0
        clip = self.cfg.optim.clip_norm if self.cfg.ps.consistency != "bsp" else None
        for i, (xs, ys) in enumerate(pieces):
            holds = i < len(pieces) - 1 or clip is not None  # one push, after the clip if any
            with client.holding() if holds else contextlib.nullcontext():
                with autocast(self.device, self.cfg.run.precision):
                    loss, part = batch_loss(self.model, xs, ys, scale=scale, loss=self.data.loss,
                                            smoothing=self.cfg.optim.label_smoothing)
                loss.backward()  # with overlap, each slice's push leaves from here
            loss_sum = part.float() + loss_sum
        computed = time.perf_counter() - began - (client.wait_seconds - waited)  # waiting is not computing
        if clip is not None:  # ASP/SSP: each push clipped by its own norm, at its worker
            client.clip_grad(clip)
        client.push()
        if not self.cfg.ps.overlap and not saving:  # else forward loads each slice when it first needs it
            client.pull()  # the parameters of the next step, as the consistency rule allows
        # (a marked push's replies wait for the checkpoint, which the loop writes after this step)
        self.rows.append((time.time(), float(len(x))))
        self.count, self.samples = len(x), self.samples + global_count
        terms = {"compute": computed, "communication": client.wait_seconds - waited}  # the servers update
        return StepResult(client.last_push_finite, loss_sum, computed, terms=terms)

    def loss_value(self, result: StepResult, global_count: int) -> float:
        """BSP: the global batch's mean loss (the workers step in lockstep anyway); ASP/SSP: this
        worker's slice's, so that logging never makes the workers wait for each other."""
        if self.cfg.ps.consistency != "bsp":
            return float(result.loss) / max(1, self.count)
        total = result.loss.detach().double().reshape(1)
        dist.all_reduce(total, group=self.group)  # metric only, not counted
        return float(total) / global_count

    def take_comm(self) -> tuple[int, float]:
        if self.serves:
            return 0, 0.0
        now = (self.client.wire_bytes, self.client.wait_seconds)
        taken, self.taken = self.taken, now
        return now[0] - taken[0], now[1] - taken[1]

    def learning_rate(self) -> float:
        """The rate the servers' schedule gives this worker's clock (BSP: exactly theirs)."""
        step = min(self.client.clock, self.total_steps)
        return self.cfg.optim.scaled_lr(self.cfg.data.batch_size) * lr_factor(
            step, **schedule_options(self.cfg, self.total_steps))

    def metrics(self) -> dict[str, Any]:
        client = self.client
        row = {"wait_seconds": client.wait_seconds, "wire_bytes": client.wire_bytes,
               "read_staleness": dict(sorted(client.read_staleness.items()))}
        client.read_staleness.clear()  # a histogram per logged interval
        return row

    def epoch_end(self) -> Callable[[], float] | None:
        """Worker 0 keeps the parameters and scores them after training, so that no worker pauses
        (under ASP the others would not)."""
        if dist.get_rank() != 0:
            return None
        self.client.settle()  # this epoch's last replies, waited for as training time
        flat = self.client.flat.clone()
        return lambda: self._accuracy_of(flat)

    @torch.no_grad()
    def _accuracy_of(self, flat: torch.Tensor) -> float:
        final = self.client.flat.clone()
        self.client.flat.copy_(flat)
        accuracy = evaluate(self.model, self.data, None, self.device)["test_accuracy"]
        self.client.flat.copy_(final)
        return accuracy

    def finish(self) -> dict[str, Any]:
        client = self.client
        cpu_seconds = time.process_time() - self.cpu_start
        client.settle()
        dist.barrier(group=self.group)  # every worker's last push is applied: read the final state
        client.pull(fresh=True)
        client.close()
        results = evaluate(self.model, self.data, self.group, self.device)
        waits = gather_floats([client.wait_seconds, cpu_seconds, client.pushes_sent], self.group)
        rows = [torch.zeros(len(self.rows), 2, dtype=torch.float64) for _ in range(self.n_workers)]
        dist.all_gather(rows, torch.tensor(self.rows, dtype=torch.float64), group=self.group)
        self.waits, self.throughput = waits, all_workers_throughput(rows)
        return results

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return self.model.state_dict() if dist.get_rank() == 0 else None

    def state_dict(self) -> dict[str, Any]:
        return {"client": self.client.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.serves:
            for piece, saved in zip(self.slices, state["slices"], strict=True):
                piece.load_state_dict(saved)
        else:
            self.client.load_state_dict(state["client"])

    def grid_record(self) -> list[int]:
        return [self.n_workers, self.n_servers]

    def resize_refusal(self) -> str | None:
        return None  # every slice's state is cut again for the new servers: load_resized

    def resize_sources(self, saved_world: int, saved_grid: list[int] | None) -> list[int]:
        # rank 0 first (the loop's step, counters and RNG); a server: every saved server; a worker: its own
        # saved part, for its counters, if it had one. A checkpoint without a grid (written before
        # parameter-server runs recorded one) had this run's number of servers.
        saved_workers = saved_grid[0] if saved_grid is not None and len(saved_grid) == 2 else \
            max(1, saved_world - self.n_servers)
        if self.serves:
            return [0, *range(saved_workers, saved_world)]
        rank = dist.get_rank()
        return [0] if rank == 0 or rank >= saved_workers else [0, rank]

    def load_resized(self, state: dict[str, Any], saved_world: int, others: list[dict[str, Any]]) -> None:
        """Another number of servers or workers: each new slice is rebuilt from the saved slices
        (parameter_server/resplit.py); every clock, the workers' and the servers' of every worker,
        restarts at the checkpoint's step; a worker keeps its own counters (a new one starts them
        at zero), and its compressor state (error feedback, per old slice) starts from zero."""
        if "client" not in state or (self.serves and any("slices" not in part for part in others)):
            raise UserError("the checkpoint was not saved by a parameter-server run: resume it with the "
                            "parallel.mode that saved it")
        clock = int(state["client"]["clock"])  # the cut: every worker's pushes applied equal the step
        if self.serves:
            saved = saved_slices(others)
            scale = (1, 1) if self.cfg.ps.consistency == "bsp" else (self.n_workers, len(saved[0]["clocks"]))
            states = recut(saved, [self.bounds[i] for i in self.mine], n_params=self.n_params,
                           workers=list(range(self.n_workers)), clock=clock, updates_scale=scale)
            for piece, loaded in zip(self.slices, states, strict=True):
                piece.load_state_dict(loaded)
            return
        if dist.get_rank() == 0 and any(state["client"]["compressors"]):
            print(f"paraloom: note: comm.compressor={self.cfg.comm.compressor}: the workers' error-feedback "
                  f"state starts from zero on {self.n_workers} workers and {self.n_servers} "
                  f"server{'s' * (self.n_servers != 1)} "
                  f"(saved by {saved_world} ranks)", file=sys.stderr)
        own = state["client"] if dist.get_rank() == 0 else others[0]["client"] if others else {}
        counters = ("pushes_sent", "pushes_during_backward", "wire_bytes", "wait_seconds")
        fresh = self.client.state_dict()  # versions at 0 (the first pull reads them), compressors as new
        self.client.load_state_dict({**fresh, **{k: own[k] for k in counters if k in own}, "clock": clock})

    def summary(self) -> dict[str, Any]:
        client, steps = self.client, max(self.client.clock, 1)
        servers = sorted(gather_json(None, self.checkpoint_group), key=lambda s: s["server"])
        return {
            "workers": self.n_workers, "servers": self.n_servers,
            "consistency": self.cfg.ps.consistency, "staleness_bound": self.cfg.ps.staleness,
            "samples_per_second": self.throughput,  # all workers together (see all_workers_throughput)
            "worker0_samples_per_second": self.samples / max(self.rows[-1][0] - self.rows[0][0], 1e-9),
            "wait_seconds_per_worker": [float(w[0]) for w in self.waits],
            "cpu_seconds_per_worker": [float(w[1]) for w in self.waits],
            "pushes_sent_per_worker": [int(w[2]) for w in self.waits],
            "startup_wait_seconds": self.startup_wait,  # worker 0's first read (servers starting)
            "comm_bytes_per_step": client.wire_bytes / steps + 4.0 * sum(hi - lo for lo, hi in self.bounds),
            "push_bytes_per_step": client.wire_bytes / steps,  # per worker, headers included
            "comm_seconds_per_step": client.wait_seconds / steps,
            "servers_stats": servers,
            "pushes_dropped": sum(s.get("dropped", 0) for s in servers),
        }

    def close(self) -> None:
        if not self.serves:
            self.client.detach()
