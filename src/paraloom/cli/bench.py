"""`paraloom bench collectives`: all-reduce algorithms timed against the backend's own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from paraloom.cli.options import cluster_from_options
from paraloom.config.choices import WIRE_DTYPES
from paraloom.config.errors import UserError
from paraloom.config.rules import check_name

bench_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Benchmarks.")


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
    dtype: Annotated[str, typer.Option(help="the tensors' dtype: float32, float16 or bfloat16")] = "float32",
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report here")] = None,
) -> None:
    """All-reduce algorithms against the backend's own: time, algbw and busbw per size."""
    from paraloom.bench.allreduce_sweep import parse_sizes, report_table, run_collectives
    from paraloom.comm.algorithms import check_algorithm

    names = [a.strip() for a in algorithms.split(",") if a.strip()]
    for algorithm in names:
        check_algorithm(algorithm)
    size_list = parse_sizes(sizes)
    if nproc < 2:
        raise UserError(f"--nproc {nproc} must be at least 2 for a collective benchmark")
    check_name("--dtype", dtype, WIRE_DTYPES)
    if max_repeats < 3:
        raise UserError(f"--max-repeats {max_repeats} must be at least 3")
    if json_out is not None and not json_out.parent.is_dir():
        raise UserError(f"--json {str(json_out)!r}: directory {str(json_out.parent)!r} does not exist")
    with cluster_from_options(cluster, emulate) as nodes:
        report = run_collectives(sizes=size_list, algorithms=names, cluster=nodes, nproc=nproc,
                                 max_repeats=max_repeats, dtype=dtype)
    Console(width=max(Console().width, 140)).print(report_table(report))
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2) + "\n")
