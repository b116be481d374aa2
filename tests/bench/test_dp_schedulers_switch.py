"""benchmarks/dp_schedulers.py's "A>B" variants: built as A, switched to B after auto's trial steps."""

import torch
from distributed import run_workers

from paraloom.bench.dp_schedulers import _variant
from paraloom.data_parallel.auto import TRIAL_STEPS


def _schedulers_over_steps(rank, world):
    options = {"hidden": 16, "depth": 2, "bucket_mb": 25.0}
    step, engine, _, _ = _variant(options, "priority>wait_free", rank, traced=False)
    g = torch.Generator().manual_seed(rank)
    seen = []
    for _ in range(TRIAL_STEPS + 2):
        step(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g))
        seen.append(engine.scheduler)
    engine.finish()
    engine.close()
    return seen


def test_a_switched_variant_runs_the_first_scheduler_for_the_trial_steps_then_the_second():
    for seen in run_workers(_schedulers_over_steps, 2, timeout=120):
        assert seen == ["priority"] * TRIAL_STEPS + ["wait_free"] * 2
