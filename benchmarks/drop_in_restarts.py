"""Restarts of an ordinary DDP script under torchrun, with torch's DDP and with paraloom's drop-in.

examples/ddp_snapshot.py (PyTorch's DDP tutorial in shape: a snapshot every epoch, resumed from at
start) runs under `torchrun --standalone --nproc-per-node 2 --max-restarts 1`, as written and with its
DDP import changed to `from paraloom import DataParallel as DDP`. Once a snapshot is written, one
worker (ranks 0 and 1 in turn) is killed with SIGKILL a random moment into the next epoch; a run
recovers when torchrun exits 0 within the timeout and the final parameters equal those of an
uninterrupted run of the same script. Repeats alternate between the two scripts.

    python benchmarks/drop_in_restarts.py --repeats 10 --json benchmarks/results/drop_in_restarts.json
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "ddp_snapshot.py"
TORCH_IMPORT = "from torch.nn.parallel import DistributedDataParallel as DDP"
PARALOOM_IMPORT = "from paraloom import DataParallel as DDP"
ENGINES = ("ddp", "paraloom")
EPOCHS, KILL_AFTER = 10, 2  # epochs in all; the kill comes in the epoch after this snapshot


def write_script(engine: str, where: Path) -> Path:
    """examples/ddp_snapshot.py as written (ddp) or with its DDP import changed (paraloom)."""
    text = SCRIPT.read_text()
    assert text.count(TORCH_IMPORT) == 1
    path = where / f"ddp_snapshot_{engine}.py"
    path.write_text(text if engine == "ddp" else text.replace(TORCH_IMPORT, PARALOOM_IMPORT))
    return path


def _workers(tag: str) -> dict[int, int]:
    """Global rank -> pid of the workers whose environment carries `tag` (torchrun's own process has
    no RANK)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"DROP_IN_RESTARTS_TAG={tag}".encode() in env:
            rank = next((item[5:] for item in env if item.startswith(b"RANK=")), None)
            if rank is not None:
                found[int(rank)] = int(pid)
    return found


def torchrun_command(script: Path, epochs: int) -> list[str]:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    return [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", str(script),
            str(epochs), "1"]


def run_once(script: Path, where: Path, *, kill_rank: int | None, epochs: int = EPOCHS,
             kill_after: int = KILL_AFTER, timeout: float = 120, seed: int = 0, delay: float = 0.15) -> dict:
    """One torchrun of `script` in the fresh folder `where`, with `kill_rank`'s worker killed once
    (None: uninterrupted), up to `delay` seconds (drawn from `seed`) after snapshot `kill_after`.
    Returns exit code, seconds, whether it hung, the killed pid, what the workers printed."""
    where.mkdir(parents=True)
    tag = f"{os.getpid()}-{where.name}-{time.monotonic_ns()}"
    env = {**os.environ, "DROP_IN_RESTARTS_TAG": tag, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    proc = subprocess.Popen(torchrun_command(script, epochs), cwd=where, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    saved = threading.Event()
    marker = f"Epoch {kill_after - 1} | Training snapshot saved"

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if marker in line:
                saved.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    killed = None
    if kill_rank is not None and saved.wait(timeout):
        time.sleep(random.Random(seed).uniform(0.0, delay))  # somewhere in the next epoch
        pid = _workers(tag).get(kill_rank)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            killed = pid
    hung = False
    try:
        proc.wait(max(1.0, timeout - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        hung = True
        for pid in _workers(tag).values():  # PYTHONFAULTHANDLER: each prints where it waits
            os.kill(pid, signal.SIGABRT)
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in _workers(tag).values():  # a worker the agent lost track of
        os.kill(pid, signal.SIGKILL)
    reader.join(5)
    (where / "output.txt").write_text("".join(lines))
    return {"code": proc.returncode, "seconds": round(time.monotonic() - start, 2), "hung": hung,
            "killed": killed, "output": "".join(lines)}


def final_state(where: Path) -> dict[str, torch.Tensor] | None:
    path = where / "model.pt"
    return torch.load(path, weights_only=True) if path.exists() else None


def equal_states(a: dict | None, b: dict | None) -> bool:
    if a is None or b is None or a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) for k in a)


def failure(run: dict) -> str:
    """What went wrong, in a few words: a hang, gloo's connection mesh, or the last error printed."""
    if run["hung"]:
        return "hung past the timeout"
    if run["killed"] is None:
        return "no worker was killed: the run ended before its snapshot"
    lines = run["output"].splitlines()
    mesh = [line for line in lines if "RuntimeError: Gloo connectFullMesh failed" in line]
    if mesh:
        return "restart failed in init_process_group: " + mesh[-1].split("RuntimeError: ", 1)[1][:200]
    said = [line for line in lines if re.search(r"\w+Error: ", line) and "ChildFailedError" not in line]
    return f"exit {run['code']}: " + (said[-1].strip()[:300] if said else "no error printed")


def survivor_error(run: dict) -> str | None:
    """The error the surviving worker of the killed attempt raised: the outermost of its traceback
    (torchrun prefixes a worker's lines with "[rankN]:")."""
    said = [line for line in run["output"].splitlines() if re.match(r"\[rank\d+\]: \w+Error: ", line)]
    return said[-1].strip()[:400] if said else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="killed runs per engine")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--timeout", type=float, default=120, help="seconds before a run counts as hung")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--keep", help="keep every run's folder under this one")
    args = parser.parse_args(argv)
    from common import make_table, write_json
    from rich.console import Console

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="drop-in-restarts-"))
    root.mkdir(parents=True, exist_ok=True)
    scripts = {engine: write_script(engine, root) for engine in args.engines}
    report = {"command": " ".join(torchrun_command(Path("SCRIPT"), EPOCHS)), "epochs": EPOCHS,
              "kill_after_epoch": KILL_AFTER, "repeats": args.repeats, "engines": {}}
    reference = {}
    for engine in args.engines:
        where = root / f"{engine}-uninterrupted"
        run = run_once(scripts[engine], where, kill_rank=None, timeout=args.timeout)
        reference[engine] = final_state(where)
        if reference[engine] is None:
            raise SystemExit(f"the uninterrupted {engine} run failed: {failure(run)}\n"
                             + run["output"][-3000:])
        report["engines"][engine] = {"recovered": 0, "runs": [], "uninterrupted_seconds": run["seconds"]}
    for i in range(args.repeats):
        for engine in args.engines if i % 2 == 0 else args.engines[::-1]:
            where = root / f"{engine}-{i}"
            run = run_once(scripts[engine], where, kill_rank=i % 2, timeout=args.timeout, seed=i)
            equal = equal_states(final_state(where), reference[engine])
            resumed = run["killed"] is not None and "Resuming training from snapshot" in run["output"]
            ok = run["code"] == 0 and resumed and equal
            entry = {"kill_rank": i % 2, "recovered": ok, "seconds": run["seconds"], "resumed": resumed,
                     "equal": equal,
                     "failure": None if ok else failure(run), "survivor_error": survivor_error(run)}
            report["engines"][engine]["recovered"] += ok
            report["engines"][engine]["runs"].append(entry)
            print(f"{engine:9s} run {i}: {'recovered' if ok else 'FAILED ' + entry['failure']} "
                  f"({run['seconds']} s)", flush=True)
            if args.json:
                write_json(args.json, report)
    table = make_table("Recovery after one killed worker (torchrun --max-restarts 1)",
                       ["engine", "recovered", "median s"], left=["engine"])
    for engine, result in report["engines"].items():
        seconds = sorted(r["seconds"] for r in result["runs"])
        table.add_row(engine, f"{result['recovered']}/{args.repeats}",
                      f"{seconds[len(seconds) // 2]:.1f}" if seconds else "-")
    Console().print(table)
    if args.json:
        write_json(args.json, report)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
