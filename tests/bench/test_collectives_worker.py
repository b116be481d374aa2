"""bench.collectives on loopback: every row carries its wall and CPU seconds, for the dtype asked for."""

import pytest

from paraloom.bench.allreduce_sweep import run_collectives


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rows_time_the_asked_dtype_with_cpu_seconds(dtype):
    report = run_collectives(sizes=[1 << 16, 1 << 20], algorithms=["native", "ring"], nproc=2,
                             min_repeats=3, max_repeats=3, budget_s=0.05, progress=False, dtype=dtype)
    assert report["config"]["dtype"] == dtype
    rows = report["results"]
    assert [(r["bytes"], r["algorithm"]) for r in rows] == [
        (1 << 16, "native"), (1 << 16, "ring"), (1 << 20, "native"), (1 << 20, "ring")]
    for r in rows:
        # each rank's process time (gloo's threads included) while the collective ran: some, and no
        # more than its two threads could spend in the wall time plus a scheduler tick
        assert 0 < r["cpu_seconds"] <= 2 * r["seconds"] + 0.02, r
