"""How a run stops: a mistake a restart would repeat stops every rank at once, an interrupt stops them
quietly, and no worker outlives its launcher.

A rank that meets a deterministic mistake (a `UserError`, an error of the user's model, data or recipe,
out of memory, a full disk: anything but a peer that went away or too many non-finite steps, which a
restart from the last checkpoint can cure) writes one line to the run's *stop file* and waits. The
launcher watches that file (`watch_stop_file`), stops every worker through torch's elastic agent as it
stops them on a signal, and reports the line with exit code 2; the agent never sees a failure to
restart. Torch-free apart from what a worker already imported, so the launcher can import it first.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

from paraloom.config.errors import UserError

STOP_FILE_ENV = "PARALOOM_STOP_FILE"  # the stop file of a torchrun-started `python -m paraloom.run.worker`
WATCH_SECONDS = 0.05  # how often the launcher looks at the stop file
WAIT_FOR_LAUNCHER_S = 60.0  # how long a rank that wrote the stop file waits to be stopped
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Have the kernel kill this process when its parent dies (Linux's PR_SET_PDEATHSIG): a worker's
    parent is its elastic agent, or the forkserver that exits with the launcher, so a launcher killed
    outright takes its workers with it instead of leaving them to train on unwatched."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request was in place
        os._exit(128 + signal.SIGKILL)


def quiet_on_interrupt() -> None:
    """A worker dies of SIGINT as of SIGTERM, without a traceback: the launcher that received the same
    Ctrl-C says what happened, once, and stops the other workers."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def root_cause(exc: BaseException) -> BaseException:
    """The error a wrapper stands for: DCP's CheckpointException holds each rank's own (a full disk
    while writing is an OSError inside it)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        if isinstance(inner, BaseException):
            return root_cause(inner)
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):  # (error, traceback)
            return root_cause(inner[0])
    return exc


def is_deterministic(exc: BaseException) -> bool:
    """Whether a restart from the last checkpoint would meet `exc` again: everything but a collective
    whose peer went away or timed out, and a run of non-finite steps that began after good ones (a
    restart may outlive it; one that began with the run's first step would come again)."""
    from paraloom.train.guards import PeerFailure, TooManyBadSteps, is_comm_failure

    exc = root_cause(exc)
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    if isinstance(exc, TooManyBadSteps):
        return exc.from_the_start
    if isinstance(exc, (PeerFailure, KeyboardInterrupt, SystemExit)):
        return False
    return isinstance(exc, Exception) and not is_comm_failure(exc)


def describe(exc: BaseException, rank: int) -> str:
    """The one line a deterministic mistake is reported with."""
    from paraloom.train.guards import TooManyBadSteps

    exc = root_cause(exc)
    if isinstance(exc, UserError):
        return str(exc)
    if isinstance(exc, TooManyBadSteps):
        return (f"rank {rank}: {exc}; no step of this attempt was finite, so a restart would repeat it: "
                "check the data and the model for NaN or Inf (or lower optim.lr)")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        where = f" writing {exc.filename}" if exc.filename else ""
        return (f"rank {rank}: no space left on the device{where}; free some space (or point "
                "run.out_dir elsewhere) and resume the run")
    text = " ".join(str(exc).split())
    if isinstance(exc, MemoryError) or "out of memory" in text.lower():
        return (f"rank {rank}: out of memory ({type(exc).__name__}: {text[:300]}); use a smaller model or "
                "data.batch_size, or more workers")
    return (f"rank {rank}: {type(exc).__name__}: {text[:400]}{_where(exc)}; a restart would repeat it, so "
            "the run stopped")


def _where(exc: BaseException) -> str:
    """` (at FILE:LINE)`, the innermost frame outside torch and paraloom: most often the user's code."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and "/paraloom/" not in path and not path.startswith("<"):
            return f" (at {frame.filename}:{frame.lineno})"
    return ""


def stop_run(exc: BaseException, rank: int, stop_file: str | None) -> int:
    """Report a deterministic mistake: with a launcher watching (`stop_file`), write the line there and
    wait to be stopped with the other ranks; without one, print it. Returns the exit code, 2."""
    line = describe(exc, rank)
    if not stop_file:
        print(f"paraloom: error: {line}", file=sys.stderr)
        return 2
    write_stop(Path(stop_file), line, rank)
    deadline = time.monotonic() + WAIT_FOR_LAUNCHER_S
    while time.monotonic() < deadline:  # the launcher's SIGTERM ends this
        time.sleep(0.1)
    print(f"paraloom: error: {line}", file=sys.stderr)  # no launcher came: say it here
    return 2


def write_stop(path: Path, line: str, rank: int) -> None:
    """The first rank to report wins; the file appears whole (written aside, then linked into place)."""
    staged = path.with_name(f"{path.name}.rank{rank}")
    staged.write_text(json.dumps({"rank": rank, "message": line}))
    with contextlib.suppress(FileExistsError):
        os.link(staged, path)
    staged.unlink(missing_ok=True)


def read_stop(path: Path | None) -> str | None:
    """The line a rank reported, if any."""
    if path is None:
        return None
    try:
        return str(json.loads(path.read_text())["message"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def watch_stop_file(path: Path, on_stop: Callable[[], None]) -> Iterator[None]:
    """While inside, call `on_stop` once when a rank writes `path` (from a thread of its own)."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(WATCH_SECONDS):
            if path.exists():
                on_stop()
                return

    thread = threading.Thread(target=watch, name="paraloom-stop-file", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def signal_self() -> None:
    """SIGTERM this process: torch's elastic agent, in the main thread, stops its workers on it."""
    os.kill(os.getpid(), signal.SIGTERM)
