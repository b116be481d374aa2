"""DataParallel with gradient compression: every compressor under every scheduler, bytes counted exactly."""

import math

import pytest
import torch
from distributed import run_workers
from dp_reference import reference, setup, steps

from paraloom.config import COMPRESSOR_NAMES
from paraloom.data_parallel import DataParallel
from paraloom.errors import UserError
from paraloom.train.trainer import batch_loss

TINY = 1e-6  # MB: one bucket per parameter tensor
SCHEDULERS = {"fifo": {"scheduler": "fifo"}, "wait_free": {"scheduler": "wait_free"},
              "priority": {"scheduler": "priority", "partition_mb": 0.004}}


def _train(rank, world, kwargs, count=20, opt_name="adam"):
    split, model, optimizer = setup("mlp", opt_name)
    engine = DataParallel(model, bucket_mb=TINY, first_bucket_mb=TINY, **kwargs)
    losses, sizes = [], [piece.stop - piece.start for pieces in engine.pieces for piece in pieces]
    engine.stats.take()
    for idx, n in steps(100, rank, world, count=count):
        loss, loss_sum = batch_loss(engine, split.x_train[idx], split.y_train[idx], global_count=n,
                                    dp_world_size=world)
        loss.backward()
        engine.step(optimizer)
        losses.append(loss_sum.item() / n)
    engine.finish()
    engine.close()
    stats = engine.stats.take()
    return [p.detach().clone() for p in model.parameters()], losses, stats.bytes / count, sizes


@pytest.mark.parametrize("compressor", COMPRESSOR_NAMES)
def test_every_compressor_under_every_scheduler(compressor):
    runs = {name: run_workers(_train, 2, {"compressor": compressor, **options})
            for name, options in SCHEDULERS.items()}
    for results in runs.values():
        params, _, wire_bytes, sizes = results[0]
        torch.testing.assert_close(results[1][0], params, rtol=0, atol=0)  # every rank holds one model
        assert wire_bytes < 4 * sum(sizes)  # less than fp32 would send
        if compressor == "fp16":
            assert wire_bytes == 2 * sum(sizes)
        if compressor == "topk":  # values and int32 indices of the top 1% of every piece
            assert wire_bytes == sum(8 * math.ceil(0.01 * n) for n in sizes)
    # fifo and wait_free compress the same buckets in the same order; only timing differs
    torch.testing.assert_close(runs["wait_free"][0][0], runs["fifo"][0][0], rtol=0, atol=0)


def test_fp16_without_error_feedback_tracks_uncompressed_training():
    ref = reference("mlp", "sgd", 100, count=10)[2]
    for params, *_ in run_workers(_train, 3, {"compressor": "fp16"}, 10, "sgd"):
        torch.testing.assert_close(params, ref, rtol=1e-2, atol=2e-3)


def test_hand_written_collectives_carry_compressed_payloads_too():
    results = run_workers(_train, 3, {"compressor": "efsign", "algorithm": "ring"})
    for params, *_ in results[1:]:
        torch.testing.assert_close(params, results[0][0], rtol=0, atol=0)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"compressor": "nope"}, "comm.compressor='nope' is not known"),
    ({"compressor": "topk", "sync": "one_step_delay"}, "not with one_step_delay or shard_optimizer"),
    ({"compressor": "fp16", "shard_optimizer": True}, "not with one_step_delay or shard_optimizer"),
])
def test_unsupported_combinations_are_refused(kwargs, message):
    def body(rank, world):
        try:
            DataParallel(torch.nn.Linear(2, 2), **kwargs)
        except UserError as exc:
            return str(exc)
        return "no error"

    for got in run_workers(body, 1):
        assert message in got
