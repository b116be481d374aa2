"""How fast a run stops: Ctrl-C under dp, pp and ps (and --emulate, root), SIGTERM, a killed launcher,
a mistake a restart would repeat. Seconds from the signal (or the launch) to the launcher's exit and
to the last of its processes gone, medians over interleaved repeats.

    python benchmarks/stopping.py --repeats 3 --json benchmarks/results/stopping.json [--emulate]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import make_table, write_json
from rich.console import Console

SMALL = ["--set", "model.name=mlp", "--set", "model.hidden=32", "--set", "run.checkpoint_every=10",
         "--set", "run.log_every=50", "--set", "run.hardware=none", "--set", "optim.epochs=200"]
CASES = {  # name: (extra arguments, signal sent to the launcher's whole group, or None: the launcher alone)
    "dp, Ctrl-C": ([], signal.SIGINT),
    "pp, Ctrl-C": (["--set", "parallel.pp=2", "--set", "parallel.microbatches=2"], signal.SIGINT),
    "ps, Ctrl-C": (["--set", "parallel.mode=ps"], signal.SIGINT),
    "dp, SIGTERM to the launcher": ([], signal.SIGTERM),
    "dp, SIGKILL of the launcher": ([], signal.SIGKILL),
}
EMULATED = {"dp on --emulate 2x1gbit, Ctrl-C": (["--emulate", "2x1gbit"], signal.SIGINT)}
BAD_MODEL = """
import torch

class Bad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.calls = torch.nn.Linear(64, 10), 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            raise ValueError("no good at the third call")
        return self.lin(x.flatten(1))

def make(**options):
    return Bad()
"""


def tagged(tag: str) -> int:
    """How many processes carry `tag` in their environment (the launcher's, and all it started)."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            count += tag.encode() in Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
    return count


def stop_once(out: Path, name: str, args: list[str], sig: signal.Signals) -> dict[str, float]:
    """Start a run, wait for its step 12, send `sig`; seconds to the launcher's exit and to the last
    process gone, and the exit code."""
    tag = f"paraloom-bench-{name}"
    cmd = [sys.executable, "-m", "paraloom", "train", *SMALL, *args, "--set", f"run.out_dir={out}",
           "--set", f"run.name={name}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, PARALOOM_TEST_TAG=tag))
    progress = out / name / "progress"
    while True:
        try:
            if int(progress.read_text().split()[0]) >= 12:
                break
        except (OSError, ValueError, IndexError):
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{name} ended before step 12:\n{proc.stderr.read()[-3000:]}")
        time.sleep(0.02)
    sent = time.perf_counter()
    if sig == signal.SIGKILL:
        proc.kill()
    elif sig == signal.SIGTERM:
        proc.send_signal(sig)
    else:
        os.killpg(proc.pid, sig)  # what a terminal's Ctrl-C does
    proc.wait()
    exited = time.perf_counter() - sent
    while tagged(tag) and time.perf_counter() - sent < 60:
        time.sleep(0.02)
    return {"exit_s": exited, "all_gone_s": time.perf_counter() - sent, "code": float(proc.returncode)}


def mistake_once(out: Path, name: str) -> dict[str, float]:
    """A model that raises at its third call, run.max_restarts=3: seconds from launch to exit 2."""
    (out / "badmodel.py").write_text(BAD_MODEL)
    env = dict(os.environ, PYTHONPATH=f"{out}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    began = time.perf_counter()
    cmd = [sys.executable, "-m", "paraloom", "train", *SMALL, "--set", "model.name=badmodel:make",
           "--set", "run.max_restarts=3", "--set", f"run.out_dir={out}", "--set", f"run.name={name}"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    return {"exit_s": time.perf_counter() - began, "code": float(done.returncode),
            "restarts": float("resuming" in done.stderr)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--emulate", action="store_true", help="also Ctrl-C on an emulated cluster (root)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/stopping.json"))
    args = parser.parse_args(argv)
    cases = {**CASES, **(EMULATED if args.emulate else {})}
    runs: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="paraloom-stop-bench-") as tmp:
        out = Path(tmp)
        for repeat in range(args.repeats):  # interleaved: every case once per round
            for i, (case, (extra, sig)) in enumerate(cases.items()):
                runs.setdefault(case, []).append(stop_once(out, f"r{repeat}c{i}", extra, sig))
            mistake = mistake_once(out, f"r{repeat}bad")
            runs.setdefault("a model error, run.max_restarts=3", []).append(mistake)
    report = {case: {key: statistics.median(r[key] for r in rows) for key in rows[0]} | {"repeats": len(rows)}
              for case, rows in runs.items()}
    write_json(args.json, {"repeats": args.repeats, "cases": report, "runs": runs})
    table = make_table("how fast a run stops (medians, seconds)", ["case", "exit code", "launcher exits",
                       "all processes gone"], left=["case"])
    for case, row in report.items():
        table.add_row(case, f"{row['code']:.0f}", f"{row['exit_s']:.2f}",
                      f"{row['all_gone_s']:.2f}" if "all_gone_s" in row else "-")
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
