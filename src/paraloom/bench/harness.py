"""Run a benchmark worker on local workers or an emulated cluster; collect each rank's JSON result."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODULE = "paraloom.bench.harness"  # run as `python -m` on every node of an emulated cluster

Save = Callable[[Any], None]


class PartialResults(Exception):
    """A run failed after some ranks had saved a result: `results` holds them by rank, `error` the cause."""

    def __init__(self, results: dict[int, Any], error: BaseException):
        super().__init__(f"{type(error).__name__}: {error}")
        self.results = results
        self.error = error


def launch(worker: str, options: dict[str, Any], *, cluster=None, nproc: int = 4,
           prefix: str = "paraloom-bench-", keep_partial: bool = False) -> dict[int, Any]:
    """Run `worker(options, save)` on every rank; returns each rank's result, by rank.

    `worker` names an importable function, "package.module:function". It runs on `cluster` (one
    torchrun per node, one worker each, restarted up to BENCH_RESTARTS times: a benchmark measures
    from scratch on every attempt) or on `nproc` local workers whose gloo stays on loopback.
    Its return value is its rank's result (JSON-ready); `save(result)` stores one before then, so
    a run that fails later keeps it: with `keep_partial`, such a failure raises PartialResults
    carrying what was saved (without it, or with nothing saved, the failure itself is raised).
    Node logs and results live in a temporary directory, removed on return.
    """
    from paraloom.cluster.torchrun import BENCH_RESTARTS, torchrun_on_cluster
    from paraloom.run.launch import elastic_run

    resolve(worker)  # a wrong name fails here, once, not in every worker
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        results_dir = Path(tmp) / "results"
        results_dir.mkdir()
        try:
            if cluster is not None:
                torchrun_on_cluster(cluster, [MODULE, "--worker", worker, "--options", json.dumps(options),
                                              "--results-dir", str(results_dir)],
                                    log_dir=Path(tmp), max_restarts=BENCH_RESTARTS)
            else:
                elastic_run(run_worker, (worker, options, str(results_dir), "lo"), nproc=nproc)
        except Exception as error:
            saved = collect(results_dir)
            if keep_partial and saved:
                raise PartialResults(saved, error) from error
            raise
        results = collect(results_dir)
    world = cluster.nodes if cluster is not None else nproc
    missing = sorted(set(range(world)) - set(results))
    if missing:
        raise RuntimeError(f"{worker}: ranks {missing} of {world} finished without a result")
    return results


def resolve(worker: str) -> Callable[..., Any]:
    """The function "package.module:function" names."""
    module, _, name = worker.partition(":")
    if not module or not name:
        raise ValueError(f"worker {worker!r}: write it as package.module:function")
    return getattr(importlib.import_module(module), name)


def collect(results_dir: Path) -> dict[int, Any]:
    """Every rank's saved result in `results_dir`, by rank."""
    return {int(path.stem.removeprefix("rank")): json.loads(path.read_text())
            for path in sorted(results_dir.glob("rank*.json"))}


def run_worker(worker: str, options: dict[str, Any], results_dir: str, interface: str | None = None) -> None:
    """One rank: run `worker(options, save)` and save what it returns as this rank's result."""
    if interface:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    path = Path(results_dir) / f"rank{int(os.environ['RANK'])}.json"

    def save(result: Any) -> None:
        part = path.with_suffix(".part")  # renamed into place: a rank killed mid-write leaves no half file
        part.write_text(json.dumps(result))
        os.replace(part, path)

    save(resolve(worker)(options, save))


def main(argv: list[str] | None = None) -> int:
    """Worker entry under torchrun: `python -m paraloom.bench.harness --worker M:F --options JSON
    --results-dir DIR`."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("--worker", required=True, help="package.module:function")
    parser.add_argument("--options", required=True, help="the worker's options, JSON")
    parser.add_argument("--results-dir", required=True, help="where each rank saves its result")
    args = parser.parse_args(argv)
    run_worker(args.worker, json.loads(args.options), args.results_dir)
    return 0


if __name__ == "__main__":
    from paraloom.run.worker import exit_process

    exit_process(main())  # see exit_process: a finished worker must not abort in teardown
