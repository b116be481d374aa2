"""The `paraloom` command line: one module per command group, assembled here.

User errors become one line on stderr and exit code 2, with no traceback.
"""

from __future__ import annotations

import sys

import typer

from paraloom.cli import bench, cluster, perf, report, train
from paraloom.config.errors import UserError, WorkersFailed

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Parallel deep-learning training on PyTorch.")


@app.callback()
def _root() -> None:
    """Parallel deep-learning training on PyTorch."""


app.command(epilog=train.keys_epilog())(train.train)
app.command()(report.report)
app.add_typer(cluster.cluster_app, name="cluster")
app.add_typer(bench.bench_app, name="bench")
app.command()(perf.plan)
app.command()(perf.calibrate)
app.command()(perf.history)


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
