"""The `paraloom` command line; user errors become one line on stderr and exit code 2."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from paraloom import cli_perf
from paraloom.config import load_config
from paraloom.config_help import section_keys
from paraloom.errors import UserError, WorkersFailed

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Parallel deep-learning training on PyTorch.")


@app.callback()
def _root() -> None:
    """Parallel deep-learning training on PyTorch."""


def _keys_epilog() -> str:
    lines = ["Config sections and keys (default), set with --set section.key=value:"]
    for section, rows in section_keys().items():
        lines.append(f"  {section}:")
        lines += [f"    {key} [{kind}] = {default!r}  {text}" for key, kind, default, text in rows]
    return "\n\n".join(["\b\n" + "\n".join(lines)])


@app.command(epilog=_keys_epilog())
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
) -> None:
    """Train a model with local worker processes; writes runs/<name>/."""
    started_at = time.time()
    if resume is not None:
        if config is not None:
            raise UserError("give a config file or --resume RUN_DIR, not both: "
                            "a resumed run keeps its config")
        config = _resumable(resume) / "config.yaml"
    overrides = list(set_ or [])
    if nproc is not None:
        if nproc < 1:
            raise UserError(f"--nproc {nproc} must be at least 1")
        overrides.append(f"parallel.nproc={nproc}")
    elif cluster or emulate:
        overrides.append("parallel.nproc=1")
    if trace:
        overrides.append("run.trace=true")
    cfg = load_config(config, overrides)
    if inject:
        import dataclasses

        joined = "; ".join(part for part in [cfg.run.inject, *inject] if part)
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, inject=joined))
    if cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UserError("run.tensorboard=true needs the tensorboard package: pip install tensorboard")
    with _cluster_from_options(cluster, emulate) as nodes:
        world = cfg.parallel.nproc * (nodes.nodes if nodes else 1)
        if nodes and cfg.parallel.mode == "ps":  # on a cluster the servers take processes of their own
            world -= cfg.ps.servers
            if world < 1:
                raise UserError(f"ps.servers={cfg.ps.servers} leaves no worker on {nodes.describe()}; "
                                "give the cluster more nodes than servers")
        cfg.validate_world(world)
        _check_fault_steps(cfg, world)
        summary, run_dir = _train_on(cfg, nodes, world, started_at, resume)
    print_summary(summary, run_dir)


def _resumable(run_dir: Path) -> Path:
    if not (run_dir / "config.yaml").is_file():
        what = "does not exist" if not run_dir.exists() else "is not a run directory (no config.yaml)"
        raise UserError(f"--resume {str(run_dir)!r} {what}; give runs/<name> of an earlier `paraloom train`")
    return run_dir


def _check_fault_steps(cfg, world: int) -> None:
    """Injected faults must name a step the run reaches (the data set's size decides how many)."""
    if cfg.run.inject is None:
        return
    import dataclasses

    from paraloom.data import load_dataset
    from paraloom.train.faults import check_faults, parse_faults
    from paraloom.train.trainer import planned_steps

    data = dataclasses.asdict(cfg.data)
    size = len(load_dataset(data.pop("name"), **data).y_train)
    check_faults(parse_faults(cfg.run.inject), world, planned_steps(cfg, size))


@contextlib.contextmanager
def _cluster_from_options(name: str | None, emulate: str | None):
    """The cluster a command runs on: none (loopback), an existing one, or one made for it."""
    if name and emulate:
        raise UserError("give --cluster or --emulate, not both")
    if emulate is None:
        if name is None:
            yield None
            return
        from paraloom.cluster import EmulatedCluster

        yield EmulatedCluster.attach(name)
        return
    from paraloom.cluster import EmulatedCluster, list_clusters, parse_emulate

    spec = parse_emulate(emulate, name=_free_cluster_name(list_clusters()))
    with EmulatedCluster(spec) as made:
        yield made


def _free_cluster_name(existing) -> str:
    return next(f"emu{i}" for i in range(1000) if f"emu{i}" not in existing)


def _train_on(cfg, nodes, world: int, started_at: float, resume: Path | None = None):
    from paraloom.rundir import new_run_dir

    run_dir = resume if resume is not None else new_run_dir(cfg, world=world)
    where = f"on {nodes.describe()}" if nodes else "on this machine"
    Console(stderr=True).print(f"paraloom: {world} workers {where}, {cfg.model.name} on {cfg.data.name}, "
                               f"run directory {run_dir}", highlight=False, soft_wrap=True)
    if nodes is None:
        from paraloom.launch import launch_local

        return launch_local(cfg, run_dir, started_at=started_at), run_dir
    from paraloom.cluster.launch import torchrun_on_cluster

    torchrun_on_cluster(nodes, ["paraloom.worker", str(run_dir / "config.yaml"), "--run-dir",
                                str(run_dir), "--started-at", repr(started_at)],
                        log_dir=run_dir / "nodes", nproc_per_node=cfg.parallel.nproc,
                        max_restarts=cfg.run.max_restarts)
    return json.loads((run_dir / "summary.json").read_text()), run_dir


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(
        metavar="RUN_DIR", help="run directory written by `paraloom train --trace`")],
    out: Annotated[Path | None, typer.Option(
        metavar="PNG", help="timeline image (default: RUN_DIR/timeline.png)")] = None,
) -> None:
    """Draw a run's traced timeline (and its metrics, when logged) as PNG images."""
    if not run_dir.is_dir():
        what = "is not a directory" if run_dir.exists() else "does not exist"
        raise UserError(f"run directory {str(run_dir)!r} {what}; give runs/<name> from `paraloom train`")
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{str(run_dir)!r} is not a run directory (no config.yaml); "
                        "give runs/<name> from `paraloom train`")
    traces = sorted((run_dir / "trace").glob("rank*.json"), key=_rank_of)
    if not traces:
        raise UserError(f"no trace in {run_dir}: train with --trace")
    if out is not None and not out.parent.is_dir():
        raise UserError(f"--out {str(out)!r}: directory {str(out.parent)!r} does not exist")
    from paraloom.trace.plots import render_metrics, render_timeline

    print(render_timeline(traces, out or run_dir / "timeline.png", title=run_dir.name))
    if (run_dir / "metrics.jsonl").is_file():
        print(render_metrics(run_dir / "metrics.jsonl", run_dir / "metrics.png", title=run_dir.name))


def _rank_of(path: Path) -> tuple[int, str]:
    digits = path.stem.removeprefix("rank")
    return (int(digits) if digits.isdigit() else -1, path.name)


cluster_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                          help="Emulated cluster: network namespaces joined by shaped links (needs root).")
app.add_typer(cluster_app, name="cluster")


@cluster_app.command("up")
def cluster_up(
    nodes: Annotated[int, typer.Option(help="number of nodes (network namespaces)")] = 4,
    bandwidth: Annotated[str, typer.Option(help="each node's link, each way: 100mbit, 1gbit")] = "1gbit",
    name: Annotated[str, typer.Option(help="cluster name (1-8 lowercase letters or digits)")] = "default",
    latency: Annotated[str | None, typer.Option(help="not available here: netem is missing")] = None,
) -> None:
    """Bring an emulated cluster up; it stays up until `paraloom cluster down`."""
    from paraloom.cluster import ClusterSpec, EmulatedCluster, parse_rate

    if latency is not None:
        raise UserError("--latency needs the netem qdisc, which this kernel does not have; "
                        "links are shaped in bandwidth only")
    made = EmulatedCluster(ClusterSpec(nodes, parse_rate(bandwidth), name)).up()
    print(f"up: {made.describe()}")


@cluster_app.command("down")
def cluster_down(
    name: Annotated[str | None, typer.Option(help="cluster to remove (default: every cluster)")] = None,
) -> None:
    """Stop everything running on an emulated cluster and remove its namespaces."""
    from paraloom.cluster import EmulatedCluster, list_clusters

    targets = [EmulatedCluster.attach(name)] if name else list(list_clusters().values())
    for target in targets:
        target.down()
        print(f"down: {target.name}")
    if not targets:
        print("no emulated cluster is up")


@cluster_app.command("status")
def cluster_status() -> None:
    """List the emulated clusters that are up."""
    from paraloom.cluster import list_clusters

    clusters = list_clusters()
    for c in clusters.values():
        print(c.describe())
    if not clusters:
        print("no emulated cluster is up")


bench_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Benchmarks.")
app.add_typer(bench_app, name="bench")


@bench_app.command("collectives")
def bench_collectives(
    sizes: Annotated[str, typer.Option(help="A..B (x4 steps) or a list: 1KB..64MB, 1MB,16MB")] = "1KB..64MB",
    algorithms: Annotated[str, typer.Option(help="comma-separated all-reduce algorithms")] =
        "native,ring,halving_doubling,tree,one_to_all",
    cluster: Annotated[str | None, typer.Option(help="run on the emulated cluster NAME")] = None,
    emulate: Annotated[str | None, typer.Option(
        metavar="NODESxRATE", help="bring up a cluster for the benchmark, e.g. 4x1gbit")] = None,
    nproc: Annotated[int, typer.Option(help="local workers when on loopback")] = 4,
    max_repeats: Annotated[int, typer.Option(help="timed repeats per point at most")] = 20,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report here")] = None,
) -> None:
    """All-reduce algorithms against the backend's own: time, algbw and busbw per size."""
    from paraloom.comm.algorithms import check_algorithm
    from paraloom.comm.bench import parse_sizes, report_table, run_collectives

    names = [a.strip() for a in algorithms.split(",") if a.strip()]
    for algorithm in names:
        check_algorithm(algorithm)
    size_list = parse_sizes(sizes)
    if nproc < 2:
        raise UserError(f"--nproc {nproc} must be at least 2 for a collective benchmark")
    if max_repeats < 3:
        raise UserError(f"--max-repeats {max_repeats} must be at least 3")
    if json_out is not None and not json_out.parent.is_dir():
        raise UserError(f"--json {str(json_out)!r}: directory {str(json_out.parent)!r} does not exist")
    with _cluster_from_options(cluster, emulate) as nodes:
        report = run_collectives(sizes=size_list, algorithms=names, cluster=nodes, nproc=nproc,
                                 max_repeats=max_repeats)
    Console(width=max(Console().width, 140)).print(report_table(report))
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2) + "\n")


app.command()(cli_perf.plan)
app.command()(cli_perf.calibrate)


def print_summary(summary: dict, run_dir: Path) -> None:
    table = Table(title=f"run {run_dir.name}", show_header=False)
    table.add_row("test accuracy", f"{summary['test_accuracy']:.4f}")
    table.add_row("wall time", f"{summary['wall_seconds']:.1f} s "
                               f"(training {summary['train_seconds']:.1f} s)")
    table.add_row("throughput", f"{summary['samples_per_second']:,.0f} samples/s")
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


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 1 a worker failed, 2 bad input, 130 interrupted)."""
    try:
        result = app(args=argv, prog_name="paraloom", standalone_mode=False)
    except UserError as exc:
        return _fail(str(exc), 2)
    except typer.TyperException as exc:  # usage errors: unknown option, bad value, missing file
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        return _fail(" ".join(message.split()), getattr(exc, "exit_code", 2))
    except WorkersFailed as exc:
        return _fail(str(exc), 2 if exc.exitcode == 2 else 1)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    return result if isinstance(result, int) else 0


def _fail(message: str, code: int) -> int:
    print(f"paraloom: error: {message}", file=sys.stderr)
    return code


def entry() -> None:
    sys.exit(main())
