"""Host reads in the engine's hot path: at most one per step, and only for the non-finite guard.

On a GPU every `.item()`, `.tolist()`, `.cpu()`, `bool(t)`, `float(t)` or `int(t)` of a device
tensor waits for the device to drain; a training step may afford one (the guard's flag), no more.
These tests count such reads on CPU, where they are cheap but the code path is the same, for every
scheduler, sync mode and compressor, over the steady-state steps (backward and `engine.step`), and
name the line of each read when there are too many. They count the reads paraloom's code makes
itself; an operation whose output size depends on the data (`nonzero`, boolean indexing) also
waits for a GPU, and is not counted here (DGC's threshold selection is one).
"""

import contextlib
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from distributed import run_workers
from dp_reference import setup, steps

from paraloom.choices import COMPRESSORS
from paraloom.data_parallel import DataParallel
from paraloom.train.recipe import batch_loss

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
SRC = str(Path(__file__).resolve().parents[2] / "src")
WARMUP, MEASURED = 3, 4  # steps: the priority scheduler profiles its first ones


@contextlib.contextmanager
def counting_host_reads():
    """Count the host reads of tensors that paraloom's own code makes, by file and line."""
    where: Counter[str] = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name, method):
        def read(self, *args, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(SRC):
                where[f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {name}"] += 1
            return method(self, *args, **kwargs)
        return read

    for name, method in saved.items():
        setattr(torch.Tensor, name, counted(name, method))
    try:
        yield where
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def _reads(rank, world, options, guard):
    split, model, optimizer = setup("cnn", "sgd")
    engine = DataParallel(model, bucket_mb=0.01, first_bucket_mb=0.01, **options)
    if guard:
        engine.guard_nonfinite()
    where: Counter[str] = Counter()
    for i, (idx, count) in enumerate(steps(400, rank, world, count=WARMUP + MEASURED)):
        loss, _ = batch_loss(engine, split.x_train[idx], split.y_train[idx], scale=world / count)
        with counting_host_reads() if i >= WARMUP else contextlib.nullcontext(Counter()) as found:
            loss.backward()
            engine.step(optimizer)
        where.update(found)
    engine.finish()
    engine.close()
    return dict(where)


CASES = {
    **{f"scheduler={s}": {"scheduler": s} for s in ("fifo", "wait_free", "priority")},
    "sync=one_step_delay": {"sync": "one_step_delay"},
    "sync=local_sgd": {"sync": "local_sgd", "local_steps": 2},
    "shard_optimizer": {"shard_optimizer": True},
    **{f"compressor={c}": {"compressor": c} for c in COMPRESSORS},
}


@pytest.mark.parametrize("guard", [False, True], ids=["no_guard", "guard"])
@pytest.mark.parametrize("case", list(CASES))
def test_at_most_the_guards_one_host_read_per_step(case, guard):
    for where in run_workers(_reads, 2, CASES[case], guard):
        per_step = sum(where.values()) / MEASURED
        allowed = 1 if guard else 0
        assert per_step <= allowed, f"{per_step:g} host reads a step (at most {allowed}): {where}"
