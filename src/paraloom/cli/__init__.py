"""The `paraloom` command line: one module per command group, assembled here.

User errors become one line on stderr and exit code 2, with no traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading

import typer

from paraloom.cli import bench, cluster, perf, report, train
from paraloom.config.errors import Interrupted, UserError, WorkersFailed

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
    """Entry point; returns the exit code (0 ok, 1 a worker failed, 2 bad input, 130 interrupted by
    SIGINT, 143 by SIGTERM)."""
    try:
        with _terminate_as_interrupt():
            result = app(args=argv, prog_name="paraloom", standalone_mode=False)
    except Interrupted as exc:
        print(f"paraloom: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except UserError as exc:
        return _fail(str(exc), 2)
    except typer.TyperException as exc:  # usage errors: unknown option, bad value, missing file
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        return _fail(" ".join(message.split()), getattr(exc, "exit_code", 2))
    except WorkersFailed as exc:
        return _fail(str(exc), 2 if exc.exitcode == 2 else 1)
    except KeyboardInterrupt:
        print("paraloom: interrupted", file=sys.stderr)
        return 130
    return result if isinstance(result, int) else 0


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM unwinds the command as Ctrl-C does (clusters come down, forkservers stop) and exits
    143; torch's elastic agent puts a handler of its own in place while it runs workers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupted(signum: int, _frame: object) -> None:
        raise Interrupted("interrupted", signum)

    before = signal.signal(signal.SIGTERM, interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _fail(message: str, code: int) -> int:
    print(f"paraloom: error: {message}", file=sys.stderr)
    return code


def entry() -> None:
    code = main()
    if code >= 128:
        # interrupted: every process, cluster and server of the run is stopped by now, and what the
        # interpreter's own teardown adds is C++ destructors of torch's distributed objects, one of
        # which now and then never returned after an agent stopped by a signal (seen 2 in ~15 runs);
        # the launcher leaves as a worker does (run/worker.py's exit_process)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
