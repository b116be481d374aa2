"""Step time of paraloom's data-parallel schedulers and sync modes against torch DDP, in one group."""

from __future__ import annotations

import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

VARIANTS = ("ddp", "ddp_view", "fifo", "wait_free", "priority", "auto", "one_step_delay", "local_sgd")
# ddp_view: DDP with gradient_as_bucket_view; the last four are paraloom's engine with
# comm.scheduler=priority, comm.scheduler=auto (its trials run before the timed steps, as more
# warm-up), comm.sync=one_step_delay, comm.sync=local_sgd (H = 4). On request:
# drop_in and priority_drop_in run wait_free and priority through DDP's own loop
# (zero_grad(); backward(); optimizer.step(), priority's optimizer a DistributedOptimizer)
DROP_IN = ("drop_in", "priority_drop_in")
OPT_IN = ("auto_bucket",)  # run when asked for (--variants): up to 40 more trial steps a round than auto
# also on request, "A>B" (A, B of SWITCHABLE): the engine built for A runs as many steps as auto's
# trials, then is switched to B as auto switches (engine.relayout) and timed under B: whether a
# scheduler reached by switching runs as fast as the same one built fresh
SWITCHABLE = ("fifo", "wait_free", "priority")
ENGINE_KWARGS = {"fifo": {"scheduler": "fifo"}, "wait_free": {"scheduler": "wait_free"},
                 "priority": {"scheduler": "priority"}, "auto": {"scheduler": "auto"},
                 "auto_bucket": {"scheduler": "auto", "bucket_mb": "auto"},  # comm.bucket_mb=auto too
                 "one_step_delay": {"sync": "one_step_delay"},
                 "local_sgd": {"sync": "local_sgd", "local_steps": 4},
                 "drop_in": {"scheduler": "wait_free"}, "priority_drop_in": {"scheduler": "priority"}}


def _model(hidden: int, depth: int):
    from paraloom.models import MLP

    return MLP((1, 8, 8), 10, hidden=hidden, depth=depth)


def _variant(options: dict[str, Any], variant: str, rank: int, traced: bool):
    """(step function, engine, timeline or None, trace path or None) of one variant, built afresh."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from paraloom.data_parallel import DataParallel, DistributedOptimizer
    from paraloom.data_parallel.auto import TRIAL_STEPS

    torch.manual_seed(0)
    model = _model(options["hidden"], options["depth"])
    timeline = trace_path = None
    if traced and not variant.startswith("ddp"):
        from paraloom.trace import Timeline, trace_modules

        timeline = Timeline(rank)
        trace_modules(model, timeline)
        trace_path = Path(options["trace_dir"]) / variant / f"rank{rank}.json"
    if variant.startswith("ddp"):
        engine = DDP(model, bucket_cap_mb=options["bucket_mb"], gradient_as_bucket_view=variant == "ddp_view")
    else:
        kwargs = {"bucket_mb": options["bucket_mb"], **ENGINE_KWARGS[variant.partition(">")[0]],
                  **options.get("engine_options", {}).get(variant, {})}
        engine = DataParallel(model, timeline=timeline, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if variant == "priority_drop_in":
        optimizer = DistributedOptimizer(optimizer, engine)

    then = variant.partition(">")[2]
    until_switch = [TRIAL_STEPS if then else -1]  # steps left under A, for "A>B"

    def step(x, y):
        if until_switch[0] == 0:
            engine.relayout(then)
        until_switch[0] -= 1
        if variant in DROP_IN or variant.startswith("ddp"):  # torch's loop
            optimizer.zero_grad(set_to_none=variant in DROP_IN)
            F.cross_entropy(engine(x), y).backward()
            optimizer.step()
        else:
            F.cross_entropy(engine(x), y).backward()
            engine.step(optimizer)

    return step, engine, timeline, trace_path


def measure(options: dict[str, Any], save=None) -> dict[str, Any]:
    """One rank's part: every variant, round after round; returns the median step times.

    Every variant trains the same model from the same seed on the same digits shards. Per variant
    and round, `warmup` steps run untimed, then `steps` steps run back to back (no barrier between
    them: one-step-delay SGD and the priority scheduler overlap a step's communication with the
    next step's computation) and end with `finish()`; the slowest rank's mean step time of the round
    is kept, and the median over rounds reported. Alongside: the compute time of a step (no
    communication) and the time of one native all-reduce of all gradients, whose maximum is the
    physical bound of a step that synchronizes every step.
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from paraloom.data import ShardedBatches, load_dataset
    from paraloom.data_parallel.auto import BUCKET_SIZES, TRIAL_STEPS, trial_steps

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    split = load_dataset("digits")
    batches = ShardedBatches(len(split.y_train), options["batch"], rank=rank, world=world, seed=0)
    trials = {"auto": TRIAL_STEPS,  # steps before the choice (then at most every bucket size, 25 MB included)
              "auto_bucket": TRIAL_STEPS + trial_steps(len(BUCKET_SIZES))}
    longest = options["warmup"] + trials["auto_bucket"]  # auto's trials at most, then the usual warm-up
    order = [idx for e in range(100) for idx, _ in batches.epoch(e)][: longest + options["steps"]]

    def timed(step_fn, finish=None, timeline=None, trace_path=None, warmup: int = options["warmup"]) -> float:
        """Mean step time of `steps` back-to-back steps after `warmup` untimed ones, slowest rank."""
        for idx in order[:warmup]:
            step_fn(split.x_train[idx], split.y_train[idx])
        if finish is not None:
            finish()
        dist.barrier()
        if timeline is not None:
            timeline.active = True
        start = time.perf_counter()
        for idx in order[warmup:warmup + options["steps"]]:
            step_fn(split.x_train[idx], split.y_train[idx])
        if finish is not None:
            finish()
        seconds = torch.tensor((time.perf_counter() - start) / options["steps"], dtype=torch.float64)
        if timeline is not None:
            timeline.active = False
            timeline.write(trace_path)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return float(seconds)

    samples: dict[str, list[float]] = {}
    torch.manual_seed(0)
    bare = _model(options["hidden"], options["depth"])
    bare_optimizer = torch.optim.SGD(bare.parameters(), lr=0.01, momentum=0.9)

    def local_step(x, y):
        bare_optimizer.zero_grad(set_to_none=False)
        F.cross_entropy(bare(x), y).backward()
        bare_optimizer.step()

    grads = torch.zeros(sum(p.numel() for p in bare.parameters()))
    n_params = grads.numel()
    # variants take turns, round after round, so a drifting machine favours none of them
    for round_index in range(options["rounds"]):
        samples.setdefault("compute", []).append(timed(local_step))
        samples.setdefault("allreduce", []).append(timed(lambda x, y: dist.all_reduce(grads)))
        for variant in options["variants"]:
            traced = bool(options.get("trace_dir")) and round_index == options["rounds"] - 1
            step, engine, timeline, trace_path = _variant(options, variant, rank, traced)
            finish = None if variant.startswith("ddp") else engine.finish
            warmup = options["warmup"] + trials.get(variant, TRIAL_STEPS if ">" in variant else 0)
            samples.setdefault(variant, []).append(timed(step, finish, timeline, trace_path, warmup))
            if variant in trials:  # which one it settled on, round by round
                chosen = engine.auto.chosen
                samples.setdefault(f"{variant}_chose", []).append(
                    chosen["scheduler"] + (f" {chosen['bucket_mb']:g} MB" if chosen.get("bucket_mb") else ""))
                samples.setdefault(f"{variant}_trials", []).append(dict(chosen["seconds"]))  # what it saw
            if not variant.startswith("ddp"):
                engine.close()
    chose = {key: samples.pop(key) for key in ("auto_chose", "auto_bucket_chose", "auto_trials",
                                               "auto_bucket_trials") if key in samples}
    results = {name: statistics.median(times) for name, times in samples.items()}
    dist.destroy_process_group()
    return {"world_size": world, "params": n_params, "seconds": results, **chose}


def run(*, cluster=None, nproc: int = 2, hidden: int = 2048, depth: int = 3, batch: int = 64,
        steps: int = 10, warmup: int = 3, rounds: int = 2, bucket_mb: float = 25.0,
        variants: tuple[str, ...] = VARIANTS, trace_dir: str | None = None,
        engine_options: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Launch `measure` on `cluster` (one worker per node) or on `nproc` loopback workers; adds the
    bound (max of compute and all-reduce) and every variant's ratio to DDP and to wait_free."""
    from paraloom.bench.harness import launch

    options = {"hidden": hidden, "depth": depth, "batch": batch, "steps": steps, "warmup": warmup,
               "rounds": rounds, "bucket_mb": bucket_mb, "variants": list(variants),
               "trace_dir": trace_dir, "engine_options": engine_options or {}}
    out = launch(f"{__name__}:measure", options, cluster=cluster, nproc=nproc, prefix="paraloom-dpbench-")[0]
    seconds = out["seconds"]
    out["bound"] = max(seconds["compute"], seconds["allreduce"])
    out["ratio_vs_ddp"] = {v: seconds[v] / seconds["ddp"] for v in variants if "ddp" in seconds}
    out["ratio_vs_wait_free"] = {v: seconds[v] / seconds["wait_free"] for v in variants
                                 if "wait_free" in seconds}
    return out
