"""Run directories: `runs/<name>/` with the resolved config, run by one process at a time (a lock held
for the run's whole life); an existing run is never overwritten, and a resume records what it changes."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import sys
import time
from pathlib import Path

from paraloom.config import Config, dump_config
from paraloom.config.errors import UserError

LOCK = ".lock"  # flock'ed by the process that runs the directory, which writes its PID into it
HISTORY = "config_history.jsonl"  # a line per resume: when, from which checkpoint, the overrides given
DISCARDED = "discarded-"  # --restart-from-scratch moves the earlier attempt into discarded-<time>/
# what a launcher writes before the workers start: the config, the lock, node logs, the run's prediction
# of itself (perfmodel/runs/contract.py: made by the launcher for a run on an emulated cluster)
PREPARED = {"config.yaml", LOCK, "nodes", "prediction.json"}
KEPT = {"config.yaml", LOCK, HISTORY}  # what a restart from scratch leaves where it is


class RunLock:
    """This process's hold on a run directory: an exclusive `flock` on RUN_DIR/.lock, whose text is the
    holder's PID. The kernel lets go when the holder dies, so the file a killed run leaves holds nothing
    (a PID file alone would); `release` (or the end of a `with` block) lets go before, and one dropped
    unreleased holds it until the process ends.

    `wait_s`: how long to wait for a holder to let go (a restarted rank 0, while the loader workers its
    dead predecessor forked, which share its lock, exit)."""

    def __init__(self, run_dir: Path, *, wait_s: float = 0.0, refusal: str = "") -> None:
        self.path = run_dir
        try:  # a descriptor exec'ed programs do not inherit (Python's default)
            self.fd: int | None = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UserError(f"cannot lock run directory {str(run_dir)!r}: {exc.strerror}") from None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                holder = _pid_in(self.fd)
                os.close(self.fd)
                raise UserError(_in_use(run_dir, holder, refusal)) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # while still held: no later holder's PID is cut
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _pid_in(fd: int) -> str:
    return os.pread(fd, 32, 0).decode(errors="replace").strip()


def _in_use(run_dir: Path, holder: str, refusal: str) -> str:
    by = f"process {holder}" if holder.isdigit() else "another process"  # one that has not written it yet
    return (f"run directory {str(run_dir)!r} is in use by {by} (a paraloom run or resume of it, which "
            f"holds {LOCK}): one run at a time in a directory; {refusal or 'wait for it to end, or stop it'}")


def holder(run_dir: Path) -> str | None:
    """The PID of the process that holds `run_dir` ('' where it has not written it yet), or None where
    none does; the lock file is not made where there is none."""
    try:
        fd = os.open(run_dir / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _pid_in(fd)
    finally:
        os.close(fd)


def default_name(cfg: Config, world: int) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    layout = f"{cfg.parallel.mode}{world}"
    if cfg.parallel.model_parallel and cfg.parallel.mode != "layers":
        try:
            dp, tp, pp = cfg.grid(world)
            layout = f"dp{dp}tp{tp}pp{pp}"
        except UserError:
            pass  # the grid is refused later, with its own message
    # a user's package.module:factory without the colon (paths, PYTHONPATH lists, scp, TensorBoard), its
    # end if long: the name stays within run.name's 100 characters
    model, data = (name.replace(":", ".")[-32:].lstrip(".-") for name in (cfg.model.name, cfg.data.name))
    return f"{model}-{data}-{layout}-{stamp}"


def claim_run_dir(cfg: Config, path: Path | None = None, *, world: int | None = None) -> RunLock:
    """Create the run directory, take its lock and write `config.yaml` (with the final run name) into it;
    the lock is held until released. `path`: the directory (default: run.out_dir/run.name, or a new
    name). One that holds only what PREPARED names (a launcher made it, or its run stopped before
    writing anything) is taken; one that holds a run, or that another process holds, is refused."""
    refusal = "choose another run.name, or wait for that run to end"
    if path is None and cfg.run.name is None:
        path = _make_new(Path(cfg.run.out_dir), default_name(cfg, world or cfg.parallel.nproc))
    else:
        path = Path(cfg.run.out_dir) / cfg.run.name if path is None else path
        if path.exists():  # looked at before anything is made in it (it may be no run directory at all)
            pid = holder(path)
            if pid is not None:
                raise UserError(_in_use(path, pid, refusal))
            _refuse_a_run(path)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create run directory {str(path)!r}: {exc.strerror}") from None
    lock = RunLock(path, refusal=refusal)
    try:
        _refuse_a_run(path)  # again, held: a run may have come and gone since the first look
        _write_config(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=path.name)), path)
    except BaseException:
        lock.release()
        raise
    return lock


def _make_new(base: Path, name: str) -> Path:
    """A new folder `name` under `base`, made by this call alone (a generated run name: of two launchers
    that start in the same second, one makes `name`, the other `name-2`)."""
    suffix = 1
    while True:
        path = base / (name if suffix == 1 else f"{name}-{suffix}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            suffix += 1
        except OSError as exc:
            raise UserError(f"cannot create run directory {str(path)!r}: {exc.strerror}") from None


def _refuse_a_run(path: Path) -> None:
    if any(p.name not in PREPARED for p in path.iterdir()):
        raise UserError(f"run directory {str(path)!r} already holds a run; choose another run.name "
                        "(or remove it)")


def new_run_dir(cfg: Config, path: Path | None = None, *, world: int | None = None) -> Path:
    """Create the run directory and write `config.yaml` into it, as claim_run_dir does, for a process
    that runs it (rank 0 under a user's torchrun, a script): its lock is held until the process ends."""
    return claim_run_dir(cfg, path, world=world).path


def _write_config(cfg: Config, run_dir: Path) -> None:
    """config.yaml, replaced whole: a reader sees the old config or the new."""
    tmp = run_dir / "config.yaml.tmp"
    dump_config(cfg, tmp)
    os.replace(tmp, run_dir / "config.yaml")


@dataclasses.dataclass
class Resume:
    """A `--resume` of a run directory, held (its lock) and checked before anything in it is written."""

    lock: RunLock
    step: int | None  # the newest whole checkpoint's step; None where the run wrote none (or `restart`)
    overrides: list[str]  # --set's (and --nproc's, --trace's) as given
    inject: list[str]  # --inject's
    restart: bool  # --restart-from-scratch

    @property
    def run_dir(self) -> Path:
        return self.lock.path

    def __enter__(self) -> Resume:
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()

    def begin(self, cfg: Config) -> Path:
        """Write what this resume changes, as its workers are about to start (every check passed): with
        `restart` the earlier attempt moved aside; `cfg` into config.yaml where overrides changed it (a
        later plain --resume goes on with them); a line into config_history.jsonl. Returns the run
        directory."""
        run_dir, record = self.run_dir, {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "step": self.step,
                                         "overrides": self.overrides}
        if self.inject:
            record["inject"] = self.inject
        if self.restart:
            discarded = _discard(run_dir)
            record["discarded"] = discarded.name if discarded else None
            _say(f"starting {run_dir} again from step 0 (--restart-from-scratch): "
                 + (f"its earlier checkpoints, metrics and records are in {discarded}" if discarded
                    else "it held no checkpoint, metrics or records"))
        elif self.step is None:
            _say(f"{run_dir} holds no checkpoint (its run stopped before writing one): training starts from "
                 "step 0")
        if self.overrides or self.inject:
            _write_config(cfg, run_dir)
            _say(f"resuming with {' '.join([*self.overrides, *(f'--inject {f}' for f in self.inject)])}: "
                 f"recorded in {run_dir / 'config.yaml'} and {HISTORY}")
        with open(run_dir / HISTORY, "a") as history:
            history.write(json.dumps(record) + "\n")
        return run_dir


def resume_run(run_dir: Path, cfg: Config, *, overrides: list[str], inject: list[str],
               restart: bool = False) -> Resume:
    """Take `run_dir` for `paraloom train --resume` with `cfg` (its config with `overrides` and `inject`)
    and find the checkpoint it goes on from, before any worker starts. Refused in one line, with nothing
    written: where another process holds it; where it has checkpoints and none is whole (a run that would
    start again from step 0, over them), unless `restart` (--restart-from-scratch: Resume.begin moves
    them aside); where the run finished at its newest checkpoint and nothing changes (a changed config
    the workers check: CheckpointManager.refuse_finished)."""
    for override in overrides:
        if override.split("=", 1)[0].strip() in ("run.name", "run.out_dir"):
            raise UserError(f"--set {override}: a resumed run keeps its directory ({run_dir}); drop it, or "
                            "start a new run")
    lock = RunLock(run_dir, refusal="wait for it to end, or stop it, and resume again")
    try:
        step = None if restart else whole_checkpoint(run_dir)
        if step is not None and not overrides and not inject:
            _refuse_finished(run_dir, cfg, step)
    except BaseException:
        lock.release()
        raise
    return Resume(lock, step, list(overrides), list(inject), restart)


def _refuse_finished(run_dir: Path, cfg: Config, step: int) -> None:
    """A run that reported at its newest checkpoint, resumed with its config as it was: nothing is left."""
    from paraloom.train.checkpoint.records import reported_steps

    if reported_steps(run_dir) != step:
        return
    max_steps = cfg.optim.max_steps
    limit, value = ("optim.max_steps", max_steps) if max_steps is not None and max_steps <= step else \
        ("optim.epochs", cfg.optim.epochs)  # the one that ended it
    raise UserError(f"nothing is left to train: the run in {run_dir} finished at step {step}, its newest "
                    f"checkpoint (summary.json); to train on, raise {limit} (now {value}) with --set: "
                    f"paraloom train --resume {run_dir} --set {limit}=...")


def whole_checkpoint(run_dir: Path) -> int | None:
    """The step of the newest whole checkpoint of `run_dir` (checked as the workers check it: every file
    against the manifest's SHA-256), or None where there is none. Checkpoints that are all damaged are
    refused, each named with what is wrong with it."""
    from paraloom.train.checkpoint.store import candidates, verify

    rejected = []
    for path in candidates(run_dir):
        problem = verify(path)
        if problem is None:
            return int(path.name.removeprefix("step-"))  # candidates: step-<digits>
        rejected.append(f"{path.name}: {problem}")
    if rejected:
        raise UserError(f"--resume {str(run_dir)!r}: no checkpoint is whole, so the run cannot go on "
                        f"({'; '.join(rejected)}); nothing was changed. To train it again from step 0 "
                        f"in this directory: paraloom train --resume {run_dir} --restart-from-scratch "
                        f"(moves the damaged checkpoints and the metrics into {DISCARDED}<time>/)")
    return None


def _discard(run_dir: Path) -> Path | None:
    """Move everything an earlier attempt wrote (checkpoints, metrics, records, summary, traces) into
    RUN_DIR/discarded-<time>/, deleting nothing; that folder, or None where there was nothing."""
    moving = [p for p in run_dir.iterdir() if p.name not in KEPT and not p.name.startswith(DISCARDED)]
    if not moving:
        return None
    target = _make_new(run_dir, DISCARDED + time.strftime("%Y%m%d-%H%M%S"))
    for path in moving:
        path.rename(target / path.name)
    return target


def _say(line: str) -> None:
    print(f"paraloom: {line}", file=sys.stderr)
