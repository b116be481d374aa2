"""The `paraloom` command line; user errors become one line on stderr and exit code 2."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from paraloom.config import load_config, section_keys
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
    nproc: Annotated[int | None, typer.Option(help="worker processes (parallel.nproc)")] = None,
) -> None:
    """Train a model with local worker processes; writes runs/<name>/."""
    from paraloom.launch import launch_local
    from paraloom.rundir import new_run_dir

    started_at = time.time()
    overrides = list(set_ or [])
    if nproc is not None:
        if nproc < 1:
            raise UserError(f"--nproc {nproc} must be at least 1")
        overrides.append(f"parallel.nproc={nproc}")
    cfg = load_config(config, overrides)
    cfg.validate_world(cfg.parallel.nproc)
    if cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UserError("run.tensorboard=true needs the tensorboard package: pip install tensorboard")
    run_dir = new_run_dir(cfg)
    console = Console(stderr=True)
    console.print(f"paraloom: {cfg.parallel.nproc} workers, {cfg.model.name} on {cfg.data.name}, "
                  f"run directory {run_dir}", highlight=False, soft_wrap=True)
    summary = launch_local(cfg, run_dir, started_at=started_at)
    print_summary(summary, run_dir)


def print_summary(summary: dict, run_dir: Path) -> None:
    table = Table(title=f"run {run_dir.name}", show_header=False)
    table.add_row("test accuracy", f"{summary['test_accuracy']:.4f}")
    table.add_row("wall time", f"{summary['wall_seconds']:.1f} s "
                               f"(training {summary['train_seconds']:.1f} s)")
    table.add_row("throughput", f"{summary['samples_per_second']:,.0f} samples/s")
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
