"""bench.harness: each rank's result comes back by rank; a failed run keeps what its ranks saved."""

import os

import pytest

from paraloom.bench.harness import PartialResults, launch, resolve
from paraloom.config.errors import WorkersFailed


def _echo(options, save):
    return {"rank": int(os.environ["RANK"]), "x": options["x"],
            "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}


def _save_then_fail(options, save):
    save({"rank": int(os.environ["RANK"])})
    if os.environ["RANK"] == "1":
        raise ValueError("boom after saving")
    return {"rank": int(os.environ["RANK"]), "done": True}


def test_each_ranks_result_comes_back_by_rank():
    results = launch(f"{__name__}:_echo", {"x": 7}, nproc=2)
    assert results == {r: {"rank": r, "x": 7, "ifname": "lo"} for r in range(2)}


def test_a_failed_run_keeps_what_was_saved_only_when_asked():
    with pytest.raises(PartialResults, match="boom after saving") as failure:
        launch(f"{__name__}:_save_then_fail", {}, nproc=2, keep_partial=True)
    assert failure.value.results[1] == {"rank": 1}
    assert isinstance(failure.value.error, WorkersFailed)


def test_a_worker_name_is_module_colon_function():
    with pytest.raises(ValueError, match="package.module:function"):
        resolve("paraloom.bench.allreduce_sweep.measure")
