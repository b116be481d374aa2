"""Host reads in the engine's hot path: at most one per step, and only for the non-finite guard.

On a GPU every `.item()`, `.tolist()`, `.cpu()`, `bool(t)`, `float(t)` or `int(t)` of a device
tensor waits for the device to drain; a training step may afford one (the guard's flag), no more.
These tests count such reads on CPU, where they are cheap but the code path is the same, for every
scheduler, sync mode and compressor, over the steady-state steps (backward and `engine.step`), and
name the line of each read when there are too many. They count the reads paraloom's code makes
itself, and the operations whose output size depends on the data (`nonzero`, `masked_select`,
`unique`, indexing with a boolean mask), which wait for a GPU just the same. Code with a path of
its own for the CPU (DGC's selection) is counted on the path it takes on a GPU.
"""

import contextlib
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from distributed import run_workers
from dp_reference import setup, steps

import paraloom.compress.dgc as dgc
from paraloom.config.choices import COMPRESSORS
from paraloom.data_parallel import DataParallel
from paraloom.train.loss_eval import batch_loss

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
DATA_SIZED = ("nonzero", "argwhere", "masked_select", "unique")  # torch.<name> and Tensor.<name>
SRC = str(Path(__file__).resolve().parents[2] / "src")
WARMUP, MEASURED = 3, 4  # steps: the priority scheduler profiles its first ones


def _bool_index(args) -> bool:
    items = args[0] if isinstance(args[0], tuple) else (args[0],)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@contextlib.contextmanager
def counting_host_reads():
    """Count the host reads of tensors, and the operations sized by the data, that paraloom's own
    code makes, by file and line (patched where they live: the engine's threads count too)."""
    where: Counter[str] = Counter()
    patched = [(torch.Tensor, name, None) for name in READS] + \
        [(owner, name, None) for name in DATA_SIZED for owner in (torch, torch.Tensor)] + \
        [(torch.Tensor, "__getitem__", _bool_index)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]

    def counted(name, method, when):
        def call(*args, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(SRC) and (when is None or when(args[1:])):
                where[f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {name}"] += 1
            return method(*args, **kwargs)
        return call

    for (owner, name, when), (_, _, method) in zip(patched, saved, strict=True):
        setattr(owner, name, counted(name, method, when))
    try:
        yield where
    finally:
        for owner, name, method in saved:
            setattr(owner, name, method)


def _reads(rank, world, options, guard):
    dgc.fixed_size = lambda device: True  # the path a GPU takes (a forked worker: nothing to restore)
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
