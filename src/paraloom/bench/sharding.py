"""Fully sharded data parallelism against torch's `fully_shard` and DDP on the zoo's GPT: the worker.

Variants, each built from the same seed on every rank and trained on the same batches:
  "ddp"          torch's DistributedDataParallel, the whole model on every rank;
  "fully_shard"  a bare FSDP2 loop as torch's docs write it: `fully_shard` on every block, then
                 on the root; AdamW; `clip_grad_norm_`;
  "paraloom"     paraloom's fully sharded strategy (train/strategies/fully_sharded.py) at
                 `options["level"]`, its `train_step` called as the loop calls it (units, prefetch,
                 the non-finite guard and clipping included).
"fully_shard_local_clip" (with `--explain`) is the bare loop clipping as paraloom does: squared norms
of the local shards, one all-reduce, no DTensor dispatch; "paraloom_no_prefetch" is paraloom with
`parallel.shard_prefetch=0` (torch's implicit prefetch only); "paraloom_units" is paraloom at
`parallel.shard_units=options["units"]` (units finer than blocks). `speed` times them in turns, a block of
`steps` steps each, for `repeats` rounds, the order alternating (ABC, CBA, ...); per round the
figure is the slowest rank's median step, and the ratio paraloom / fully_shard is taken round by
round. `held` measures, one variant at a time, the bytes of parameters, gradients and optimizer
state a rank holds after a step (its shards, or whole tensors), and the most of those plus their
gather and reduction buffers alive at once during a step, in all and by phase (`_StateWatch`);
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

VARIANTS = ("ddp", "fully_shard", "paraloom")


def _config(options: dict[str, Any], level: str, prefetch: int = 1, units: str = "auto"):
    from paraloom.config import load_config

    shape = options["model"]
    return load_config(None, [
        "model.name=gpt", "data.name=text", f"data.seq_len={shape['seq']}", "data.text_bytes=20000",
        f"model.d_model={shape['width']}", f"model.n_heads={shape['heads']}",
        f"model.n_layers={shape['layers']}", f"data.batch_size={options['batch']}",
        "optim.name=adamw", "optim.lr=0.0003", "optim.clip_norm=1.0", f"parallel.shard={level}",
        f"parallel.shard_prefetch={prefetch}",
        f"parallel.shard_units={units}",
        f"parallel.reshard_after_forward={str(options.get('reshard_after_forward', True)).lower()}",
        f"optim.accumulate={options.get('accumulate', 1)}",
        f"parallel.shard_accumulate={options.get('shard_accumulate', 'unsharded')}",
        # with pipeline stages: each stage sharded over its data-parallel ranks; one micro-batch (torch's
        # FSDPMemTracker refuses a module run twice in a step)
        *([f"parallel.pp={options['pp']}", "parallel.microbatches=1"] if options.get("pp", 1) > 1 else [])])


def _build(variant: str, options: dict[str, Any], level: str = "full"):
    """(step function taking (x, y), the module whose parameters count, the optimizer)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from paraloom.models import build_model

    shape, world = options["model"], dist.get_world_size()
    torch.manual_seed(0)
    if variant.startswith("paraloom"):
        from paraloom.data import load_data
        from paraloom.train.strategies.fully_sharded import FullyShardedStrategy

        pp = 2 if variant == "paraloom_pp2" else 1
        units = options["units"] if variant == "paraloom_units" else "auto"
        cfg = _config({**options, "pp": pp}, level, prefetch=0 if variant == "paraloom_no_prefetch" else 1,
                      units=units)
        strategy = FullyShardedStrategy(cfg, load_data(cfg), device=torch.device("cpu"), timeline=None)
        count = options["batch"] * world
        calls = iter(range(1, 10**9))

        def paraloom_step(x, y):
            strategy.train_step(x, y, count, scale=world / count, step=next(calls), saving=False)

        return paraloom_step, strategy.model, strategy.optimizer
    model = build_model("gpt", (shape["seq"],), shape["vocab"], n_layers=shape["layers"],
                        d_model=shape["width"], n_heads=shape["heads"])
    if variant.startswith("fully_shard"):
        for block in list(model)[1:-1]:
            fully_shard(block)
        fully_shard(model)
        wrapped = model
    else:
        wrapped = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    if variant == "fully_shard_local_clip":
        from paraloom.optim.clip import GlobalNormClip

        clip = GlobalNormClip(1.0, group=dist.group.WORLD)
    else:
        def clip(params):
            torch.nn.utils.clip_grad_norm_(params, 1.0)

    def step(x, y):
        out = wrapped(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        clip(list(model.parameters()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, model, optimizer


def _batches(options: dict[str, Any], rank: int) -> list:
    import torch

    shape = options["model"]
    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randint(0, shape["vocab"], (options["batch"], shape["seq"]), generator=gen),
             torch.randint(0, shape["vocab"], (options["batch"], shape["seq"]), generator=gen))
            for _ in range(4)]


def _block(step, batches: list, count: int) -> float:
    times = []
    for i in range(count):
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    value = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def speed(options: dict[str, Any], save=None) -> dict[str, Any]:
    """One rank: the variants in turns; per round each one's median step (slowest rank)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    batches = _batches(options, dist.get_rank())
    variants = (*VARIANTS, *options.get("explain", ()))
    runs = {v: _build(v, options, options["level"])[0] for v in variants}
    for variant in variants:  # warm-up: first gathers, allocator, optimizer state
        _block(runs[variant], batches, options["warmup"])
    rounds: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(options["repeats"]):
        for variant in (variants if r % 2 == 0 else variants[::-1]):
            rounds[variant].append(_slowest(_block(runs[variant], batches, options["steps"])))
        if save is not None:
            save({"seconds": rounds})
    ratios = [p / f for p, f in zip(rounds["paraloom"], rounds["fully_shard"], strict=True)]
    out = {"seconds": rounds, "ratio_per_round": ratios, "ratio_vs_fully_shard": statistics.median(ratios),
           "ratio_vs_ddp": statistics.median(p / d for p, d in zip(rounds["paraloom"], rounds["ddp"],
                                                                    strict=True)),
           **{f"{v}_step_s": statistics.median(rounds[v]) for v in variants}}
    dist.destroy_process_group()
    return out


def held(options: dict[str, Any], save=None) -> dict[str, Any]:
    """One rank: per variant (and paraloom's levels), bytes of parameters, gradients and optimizer
    state held after a step, and the most bytes of those plus the buffers gathered or reduced for
    them (all-gather and reduce-scatter buffers, unsharded parameters and gradients) alive at once
    during the next step: "peak_state"."""
    import torch
    import torch.distributed as dist

    from paraloom.data_parallel.fully_sharded import held_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    batches = _batches(options, dist.get_rank())
    out: dict[str, Any] = {}
    for name, variant, level in [("ddp", "ddp", "full"), ("fully_shard", "fully_shard", "full"),
                                 *((f"paraloom_{lv}", "paraloom", lv) for lv in options["levels"]),
                                 ("paraloom_full_no_prefetch", "paraloom_no_prefetch", "full"),
                                 *([("paraloom_full_units", "paraloom_units", "full")] if options.get("units")
                                   else []),
                                 *([("paraloom_full_pp2", "paraloom_pp2", "full")] if options.get("pipeline")
                                   else [])]:
        step, model, optimizer = _build(variant, options, level)
        step(*batches[0])
        watch = _StateWatch(model, optimizer)
        with watch:
            step(*batches[1])
        watch.close()
        # after the step, before the next zero_grad: set_to_none left no gradients, so count them
        # as the step held them: one per parameter shard, of the parameter's dtype
        counts = held_bytes(model.parameters(), optimizer)
        counts["grads"] = counts["params"]
        counts["total"] = counts["params"] + counts["grads"] + counts["optimizer"]
        counts["peak_state"] = watch.peak
        counts["peak_state_by_kind"] = watch.peak_by_kind
        counts["peak_state_by_phase"] = watch.phases
        counts["n_params"] = sum(p.numel() for p in model.parameters())  # whole tensors: a stage's with pp
        out[name] = counts
        if save is not None:
            save(out)
        del step, model, optimizer, watch
        gc.collect()
    dist.destroy_process_group()
    return out


class _StateWatch:
    """The most bytes of model state alive at once during a step: torch's memory tracker
    (`torch.distributed._tools`: FSDPMemTracker for a fully sharded model, MemTracker otherwise)
    sorts every tensor allocated into parameters, gradients, optimizer state, all-gather and
    reduce-scatter buffers, activations and temporaries; after every operator it dispatches, the
    state (all but activations, temporaries and inputs) is summed and its largest sum kept, overall
    and per phase of the step: "forward" (from a forward's first module), "backward" (from a unit's
    backward, or the loss's gradient) and "step" (the optimizer's)."""

    SKIPPED = ("Activation", "Temp", "Inputs", "Total")

    def __init__(self, model, optimizer) -> None:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            self.tracker = FSDPMemTracker(model, optimizer)
        else:
            self.tracker = MemTracker()
            self.tracker.track_external(model, optimizer)
        self.peak, self.peak_by_kind, self.phase = 0, {}, "forward"
        self.phases: dict[str, int] = {}
        original = self.tracker._update_peak_stats  # called after every operator the tracker sees

        def update(*args: Any) -> None:
            original(*args)
            self._read()

        self.tracker._update_peak_stats = update
        self.handles = [optimizer.register_step_pre_hook(self._enter("step")),
                        model.register_forward_pre_hook(self._enter("forward"))]
        for module in model.modules():
            self.handles.append(module.register_full_backward_pre_hook(self._enter("backward")))

    def _enter(self, phase: str):
        def hook(*_: Any) -> None:
            self.phase = phase
            self._read()
        return hook

    def __enter__(self):
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.tracker.__exit__(*exc)

    def _read(self) -> None:
        snapshot = self.tracker._curr_mem_snap
        kinds = {str(getattr(k, "value", k)): v for device in snapshot.values() for k, v in device.items()
                 if str(getattr(k, "value", k)) not in self.SKIPPED}
        total = sum(kinds.values())
        self.phases[self.phase] = max(total, self.phases.get(self.phase, 0))
        if total > self.peak:
            self.peak, self.peak_by_kind = total, {**kinds, "phase": self.phase}

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
