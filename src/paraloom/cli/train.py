"""`paraloom train`: check the config and the cluster options, launch the workers, print the summary."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from paraloom.cli.options import cluster_from_options, link_timers
from paraloom.config import load_config
from paraloom.config.errors import Interrupted, UserError
from paraloom.config.help import section_keys
from paraloom.run import prestart


def keys_epilog() -> str:
    """`paraloom train --help`'s epilog: every config key with its type, default and meaning."""
    lines = ["Config sections and keys (default), set with --set section.key=value:"]
    for section, rows in section_keys().items():
        lines.append(f"  {section}:")
        lines += [f"    {key} [{kind}] = {default!r}  {text}" for key, kind, default, text in rows]
    return "\n\n".join(["\b\n" + "\n".join(lines)])


def train(
    config: Annotated[Path | None, typer.Argument(help="YAML config file (optional)")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", metavar="SECTION.KEY=VALUE", help="override one config key (repeatable)")] = None,
    nproc: Annotated[int | None, typer.Option(
        help="worker processes (parallel.nproc); per node on a cluster, where it defaults to 1")] = None,
    cluster: Annotated[str | None, typer.Option(
        help="run on the emulated cluster NAME (`paraloom cluster up`), one worker per node")] = None,
    emulate: Annotated[str | None, typer.Option(
        metavar="NODESxRATE", help="bring up an emulated cluster for this run, e.g. 4x1gbit")] = None,
    trace: Annotated[bool, typer.Option(
        "--trace", help="write a Chrome trace per rank (run.trace=true); see `paraloom report`")] = False,
    resume: Annotated[Path | None, typer.Option(
        metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest whole checkpoint")] = None,
    inject: Annotated[list[str] | None, typer.Option(
        metavar="FAULT", help="inject a fault (repeatable): kill:rank=1,step=30, hang:rank=2,"
                              "step=10, nan:rank=0,step=5, slow:rank=1,factor=2.0, "
                              "slow:rank=random,factor=2.0")] = None,
    restart_from_scratch: Annotated[bool, typer.Option(
        "--restart-from-scratch", help="with --resume: train the run again from step 0 in its directory, "
                                       "moving its checkpoints, metrics and records into "
                                       "RUN_DIR/discarded-<time>/")] = False,
) -> None:
    """Train a model with local worker processes; writes runs/<name>/."""
    started_at = time.time()
    if resume is not None:
        if config is not None:
            raise UserError("give a config file or --resume RUN_DIR, not both: "
                            "a resumed run keeps its config")
        config = _resumable(resume) / "config.yaml"
    overrides = _overrides(set_, nproc, on_nodes=bool(cluster or emulate), trace=trace)
    if resume is not None:
        overrides += _left_behind(config, overrides)
    cfg = load_config(config, overrides)
    if inject:
        import dataclasses

        joined = "; ".join(part for part in [cfg.run.inject, *inject] if part)
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, inject=joined))
    if cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UserError("run.tensorboard=true needs the tensorboard package: pip install tensorboard")
    _check_device(cfg)
    node_range = cfg.run.node_range()  # without a cluster: as many local nodes (cluster/local.py)
    # the run directory's lock (run/directory.py), held until the command ends: taken here for --resume
    # (refused at once where another process holds it, or where no checkpoint is whole), in _train_on
    # for a new run, whose name is settled there
    held = contextlib.ExitStack()
    resumed = _take_resumed(held, resume, cfg, overrides, inject or [], restart=restart_from_scratch)
    with held, cluster_from_options(cluster, emulate, local_nodes=node_range[1] if node_range else None) \
            as nodes, _stopping_forkserver():
        forks, calibrates = _forks_here(cfg, nodes), _calibrates_first(cfg)
        if forks and not calibrates:
            prestart.start()  # CPU workers here: their server imports beside this launcher's imports
        world = cfg.parallel.nproc * (nodes.nodes if nodes else 1)
        if nodes and cfg.parallel.mode == "ps":  # on a cluster the servers take processes of their own
            world -= cfg.ps.servers
            if world < 1:
                raise UserError(f"ps.servers={cfg.ps.servers} leaves no worker on {nodes.describe()}; "
                                "give the cluster more nodes than servers")
        cfg.validate_world(world)
        from paraloom.config.fault_specs import check_lost_nodes, parse_faults

        check_lost_nodes(parse_faults(cfg.run.inject) if cfg.run.inject else [], cfg.run.node_range(),
                         nodes.nodes if nodes else None)
        if cfg.run.nodes is not None and cfg.run.max_restarts < 1:
            raise UserError(f"run.nodes={cfg.run.nodes} goes on through restarts: give run.max_restarts >= 1")
        from paraloom.run.preflight import preflight  # torch, as launching would; the stack where needed

        preflight(cfg, world, resume=resume)
        emulated = nodes if hasattr(nodes, "spec") else None  # an emulated cluster, not local nodes
        profile = _calibrate_once(cfg, emulated)
        if forks and calibrates:
            prestart.start()  # only now: the first-use calibration measured a machine at rest
        summary, run_dir = _train_on(cfg, nodes, world, started_at, resumed, held=held,
                                     profile=profile if emulated else None)
    print_summary(summary, run_dir)
    print_contract(summary.get("contract"))


def _calibrate_once(cfg, emulated=None) -> Path | None:
    """`run.hardware=auto`: the profile the run predicts itself from, measured on first use and cached
    (its path, None where there is none): the GPU's where the run goes to GPUs, else the CPU's; on
    an emulated cluster, the CPU's with its links measured across one of that rate."""
    if cfg.run.hardware != "auto":
        return None
    from paraloom.config.sections import threads_per_worker
    from paraloom.perfmodel.measure.calibrate import calibrate_once
    from paraloom.perfmodel.measure.machine_profile import calibrate_gpu_once

    console = Console(stderr=True)

    def say(line: str) -> None:
        console.print(f"paraloom: {line}", highlight=False)

    try:
        if _on_gpus(cfg):
            return calibrate_gpu_once(progress=say)
        return calibrate_once(threads_per_worker(cfg.parallel.nproc), progress=say, timers=link_timers(),
                              cluster=emulated)
    except Exception as exc:  # noqa: BLE001 (the run goes on without predicting itself)
        say(f"note: calibrating this machine failed ({type(exc).__name__}: {exc}); the run will not "
            "predict itself")
        return None


def _check_device(cfg) -> None:
    """`run.device=cuda` on a machine with no GPU torch can use: refused before anything starts
    (torch is imported only where no GPU device file settles it)."""
    if cfg.run.device != "cuda" or prestart.gpu_visible():
        return
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"run.device=cuda but no CUDA device is visible to torch {torch.__version__}; use "
                        "run.device=cpu (or auto)")


def _on_gpus(cfg) -> bool:
    """Whether the workers will train on GPUs, as the worker decides it (`run.device`, and for auto
    whether torch sees one; torch is imported only where a GPU device file exists)."""
    if cfg.run.device != "auto":
        return cfg.run.device == "cuda"
    if not prestart.gpu_visible():
        return False
    import torch

    return torch.cuda.is_available()


@contextlib.contextmanager
def _stopping_forkserver():
    """A forkserver started early (`prestart`) is stopped however the command ends."""
    try:
        yield
    finally:
        prestart.stop()


def _forks_here(cfg, nodes) -> bool:
    """Whether the workers are CPU workers on this machine, forked from a forkserver
    (`launch.launch_local`), as far as can be told before importing torch: no cluster or local
    nodes, and `run.device=cpu` or no GPU device to be seen."""
    return nodes is None and (cfg.run.device == "cpu" or not prestart.gpu_visible())


def _calibrates_first(cfg) -> bool:
    """Whether this run measures the machine first (`run.hardware=auto`, nothing cached yet)."""
    from paraloom.config.sections import threads_per_worker
    from paraloom.perfmodel.measure.machine_profile import cached_path

    if cfg.run.hardware != "auto" or os.environ.get("PARALOOM_HARDWARE"):
        return False
    return not cached_path(threads_per_worker(cfg.parallel.nproc)).is_file()


def _take_resumed(held: contextlib.ExitStack, run_dir: Path | None, cfg, overrides: list[str],
                  inject: list[str], *, restart: bool):
    """`--resume RUN_DIR`'s Resume (run/directory.py), its lock given to `held`; None for a new run."""
    if run_dir is None:
        if restart:
            raise UserError("--restart-from-scratch starts the run given with --resume RUN_DIR again; give "
                            "--resume RUN_DIR")
        return None
    from paraloom.run.directory import resume_run

    return held.enter_context(resume_run(run_dir, cfg, overrides=overrides, inject=inject, restart=restart))


def _overrides(set_: list[str] | None, nproc: int | None, *, on_nodes: bool, trace: bool) -> list[str]:
    """The command's options as config overrides, after its `--set`s."""
    overrides = list(set_ or [])
    if nproc is not None:
        if nproc < 1:
            raise UserError(f"--nproc {nproc} must be at least 1")
        overrides.append(f"parallel.nproc={nproc}")
    elif on_nodes:
        overrides.append("parallel.nproc=1")
    if trace:
        overrides.append("run.trace=true")
    return overrides


def _left_behind(recorded: Path, overrides: list[str]) -> list[str]:
    """A resume on another strategy: its recorded settings the new one does not use go back to their
    defaults (config/sections.py's `left_behind`), said in one line."""
    from paraloom.config.sections import left_behind
    from paraloom.config.yaml_io import read_yaml

    reset = left_behind(read_yaml(recorded), overrides)
    if reset:
        keys = ", ".join(item.partition("=")[0] for item in reset)
        Console(stderr=True).print(f"paraloom: resuming on another strategy: {keys} back to the default "
                                   "(the new strategy does not use them)", highlight=False, soft_wrap=True)
    return reset


def _resumable(run_dir: Path) -> Path:
    if not (run_dir / "config.yaml").is_file():
        what = "does not exist" if not run_dir.exists() else "is not a run directory (no config.yaml)"
        raise UserError(f"--resume {str(run_dir)!r} {what}; give runs/<name> of an earlier `paraloom train`")
    return run_dir


def _train_on(cfg, nodes, world: int, started_at: float, resume=None, *, held: contextlib.ExitStack,
              profile: Path | None = None):
    """Launch the run, here or on `nodes`: `resume` (run/directory.py's Resume), or a new run directory,
    whose lock goes to `held`; `profile`: the cached profile its prediction is made from here, before
    launch, in place of the one its rank 0 would read (an emulated cluster's links)."""
    from paraloom.run.directory import claim_run_dir

    run_dir = resume.begin(cfg) if resume is not None else \
        held.enter_context(claim_run_dir(cfg, world=world)).path
    where = f"on {nodes.describe()}" if nodes else "on this machine"
    Console(stderr=True).print(f"paraloom: {world} workers {where}, {cfg.model.name} on {cfg.data.name}, "
                               f"run directory {run_dir}", highlight=False, soft_wrap=True)
    if profile is not None:  # rank 0 reads it back from the run directory
        from paraloom.config.sections import threads_per_worker
        from paraloom.perfmodel.runs.contract import load_or_predict

        load_or_predict(run_dir, cfg, world, threads_per_worker(cfg.parallel.nproc),
                        "cuda" if _on_gpus(cfg) else "cpu", cached=profile)
    try:
        return _launch(cfg, nodes, run_dir, started_at), run_dir
    except (Interrupted, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        raise Interrupted(_interrupted_at(run_dir), signum) from None
    finally:  # every worker is gone by now: a checkpoint it was writing is never whole
        if not (run_dir / "summary.json").is_file():
            from paraloom.train.checkpoint.store import discard_staging

            discard_staging(run_dir)


def _launch(cfg, nodes, run_dir: Path, started_at: float) -> dict:
    """Rank 0's summary of the run, trained here or on `nodes`."""
    if nodes is None:
        from paraloom.run.launch import launch_local

        return launch_local(cfg, run_dir, started_at=started_at)
    from paraloom.cluster.torchrun import torchrun_on_cluster
    from paraloom.config.fault_specs import parse_faults

    node_range = cfg.run.node_range()
    faults = parse_faults(cfg.run.inject) if cfg.run.inject else []
    lost = {f.node: f.back for f in faults if f.kind == "lose"}
    torchrun_on_cluster(nodes, ["paraloom.run.worker", str(run_dir / "config.yaml"), "--run-dir",
                                str(run_dir), "--run-locked", "--started-at", repr(started_at)],
                        log_dir=run_dir / "nodes", nproc_per_node=cfg.parallel.nproc,
                        max_restarts=cfg.run.max_restarts, min_nodes=node_range[0] if node_range else None,
                        lost=lost)
    return json.loads((run_dir / "summary.json").read_text())


def _interrupted_at(run_dir: Path) -> str:
    """`interrupted at step N; resume with ...`: N the last step rank 0 finished (records.PROGRESS)."""
    from paraloom.train.checkpoint.records import read_progress

    progress = read_progress(run_dir)
    at = f" at step {progress[0]}" if progress else " before the first step"
    return f"interrupted{at}; resume with paraloom train --resume {run_dir}"


def print_summary(summary: dict, run_dir: Path) -> None:
    table = Table(title=f"run {run_dir.name}", show_header=False)
    if summary.get("test_accuracy") is not None:  # none where the model returns its own loss
        table.add_row("test accuracy", f"{summary['test_accuracy']:.4f}")
    if summary.get("ema_val_loss") is not None:  # optim.ema: the weight average, evaluated alike
        accuracy = summary.get("ema_test_accuracy")
        table.add_row("weight average", (f"test accuracy {accuracy:.4f}, " if accuracy is not None else "")
                      + f"validation loss {summary['ema_val_loss']:.3f}")
    table.add_row("wall time", f"{summary['wall_seconds']:.1f} s "
                               f"(training {summary['train_seconds']:.1f} s)")
    table.add_row("throughput", f"{summary['samples_per_second']:,.0f} samples/s" + (
        f", MFU {summary['mfu']:.1%} (predicted {summary['mfu_predicted']:.1%})" if "mfu" in summary else ""))
    if "val_loss" in summary:
        bar = f" (unigram baseline {summary['unigram_loss']:.3f})" if "unigram_loss" in summary else ""
        table.add_row("validation loss", f"{summary['val_loss']:.3f}{bar}")
    if "grid" in summary:
        g = summary["grid"]
        table.add_row("grid", f"dp {g['dp']} x tp {g['tp']} x pp {g['pp']}, {summary['schedule']}, "
                              f"{summary['microbatches']} micro-batches")
        table.add_row("step time", f"{summary['step_seconds'] * 1e3:.1f} ms; bubble per rank "
                                   + " ".join(f"{b:.2f}" for b in summary["bubble_per_rank"]))
        table.add_row("parameters", "MB per rank " + " ".join(
            f"{b / 2**20:.2f}" for b in summary["param_bytes_per_rank"]))
    else:
        table.add_row("communicated", f"{summary['comm_bytes_per_step'] / 1e3:,.1f} kB/step per rank "
                                      f"({summary['comm_seconds_per_step'] * 1e3:.2f} ms/step)")
    table.add_row("run directory", str(run_dir))
    Console().print(table)



def print_contract(contract: dict | None) -> None:
    """The run's prediction of itself beside what it measured, term by term (summary.json's contract)."""
    if not contract or not contract.get("predicted") or "measured" not in contract:
        return
    predicted, measured = contract["predicted"], contract["measured"]
    if "terms" not in predicted:
        reason = predicted.get("skipped") or predicted.get("error")
        Console(stderr=True).print(f"paraloom: no prediction: {reason}", highlight=False)
        return
    from paraloom.perfmodel.runs.contract import CALIBRATED, TERMS, spread_calibrated, spread_miss, stale_hint

    off = set(contract.get("off", []))
    table = Table(title=f"predicted ({predicted['hardware']}) and measured, ms per step")
    for column in ("term", "predicted", "measured", ""):
        table.add_column(column, justify="left" if column in ("term", "") else "right")
    for term in TERMS:
        p, m = predicted["terms"][term] * 1e3, measured[term] * 1e3
        table.add_row(term, f"{p:.2f}", f"{m:.2f}", "off" if term in off else "")
    table.add_row("step", f"{predicted['step_seconds'] * 1e3:.2f}", f"{measured['step'] * 1e3:.2f}",
                  f"{contract['step_error']:+.0%}")
    if "mfu" in contract:  # the model's FLOPs a step over the devices' peak (perfmodel/cost/mfu.py)
        table.add_row("MFU", f"{predicted['mfu']:.1%}", f"{contract['mfu']:.1%}", "")
    Console().print(table)
    err = Console(stderr=True)

    def say(line: str) -> None:
        err.print(f"paraloom: {line}", highlight=False)

    missed = off | set(spread_calibrated(contract))  # off alone, or behind the step's miss together
    passing = [term for term in contract.get("warned", []) if term not in missed]
    if passing:  # off in the medians at the time of the warning, not in the whole run's
        say(f"{', '.join(passing)}: warned during the run, within tolerance over the whole run (the "
            "table): a passing slowdown, not the profile's")
    spread = spread_miss(contract)
    if spread:
        say(spread)
    checked = {}
    if missed and predicted.get("hardware_threads"):  # this machine's CPU profile: which remedy?
        from paraloom.perfmodel.runs.recheck import machine_check

        checked = machine_check(predicted, measured, missed, progress=say)
        for line in checked.values():
            say(line)
    hint, named = stale_hint(predicted), missed & set(CALIBRATED) - set(checked)
    if hint and named and not any(predicted["hardware_file"] in line for line in checked.values()):
        say(hint)  # the profile's age, for terms measured again nowhere (and not said already)
