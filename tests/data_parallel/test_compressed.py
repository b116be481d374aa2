"""DataParallel with gradient compression: every compressor under every scheduler, bytes counted exactly."""

import math

import pytest
import torch
from distributed import run_workers
from dp_reference import reference, setup, steps

from paraloom.config.choices import COMPRESSORS as COMPRESSOR_NAMES
from paraloom.config.errors import UserError
from paraloom.data_parallel import DataParallel
from paraloom.train.loss_eval import batch_loss

TINY = 1e-6  # MB: one bucket per parameter tensor
SCHEDULERS = {"fifo": {"scheduler": "fifo"}, "wait_free": {"scheduler": "wait_free"},
              "priority": {"scheduler": "priority", "partition_mb": 0.004}}


def _train(rank, world, kwargs, count=20, opt_name="adam"):
    split, model, optimizer = setup("mlp", opt_name)
    engine = DataParallel(model, bucket_mb=TINY, first_bucket_mb=TINY, **kwargs)
    losses, sizes = [], [piece.stop - piece.start for pieces in engine.pieces for piece in pieces]
    engine.stats.take()
    for idx, n in steps(100, rank, world, count=count):
        loss, loss_sum = batch_loss(engine, split.x_train[idx], split.y_train[idx], scale=world / n)
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
    ({"compressor": "nope"}, "comm.compressor='nope' is not valid"),
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


def test_dgc_takes_over_sgd_momentum():
    """DGC's momentum correction replaces SGD's momentum; with Adam it runs without momentum."""
    from paraloom.compress.dgc import dgc_options
    from paraloom.config import CommConfig, Config, OptimConfig
    from paraloom.optim.recipe import Recipe

    def make_optimizer(optim, params, comm=None):
        cfg = Config(optim=optim, comm=comm or CommConfig())
        return Recipe(cfg, params, total_steps=1, device=torch.device("cpu")).optimizer

    params = [torch.nn.Parameter(torch.zeros(3))]
    dgc, plain = CommConfig(compressor="dgc"), CommConfig(compressor="topk")
    sgd, adam = OptimConfig(name="sgd", momentum=0.8), OptimConfig(name="adam")
    assert dgc_options(dgc, sgd) == {"momentum": 0.8}
    assert dgc_options(dgc, adam) == {"momentum": 0.0}
    assert dgc_options(plain, sgd) is None
    assert make_optimizer(sgd, params, dgc).param_groups[0]["momentum"] == 0.0
    assert make_optimizer(sgd, params, plain).param_groups[0]["momentum"] == 0.8
    assert make_optimizer(sgd, params).param_groups[0]["momentum"] == 0.8


def _options_merge(rank, world):
    from paraloom.config import CommConfig

    engine = DataParallel(torch.nn.Linear(4, 2), comm=CommConfig(compressor="dgc", density=0.5),
                          compressor_options={"momentum": 0.0})
    return engine.compressor.density, engine.compressor.momentum


def test_explicit_compressor_options_join_the_configs():
    assert run_workers(_options_merge, 1) == [(0.5, 0.0)]


# ---- PowerSGD as the engine's reducer


def test_powersgd_segments_cover_pieces_with_full_rows_as_matrices():
    from paraloom.data_parallel.bucket import Bucket, cut_pieces
    from paraloom.data_parallel.lowrank import Segment, piece_segments

    weight, bias = torch.nn.Parameter(torch.zeros(4, 5)), torch.nn.Parameter(torch.zeros(3))
    bucket = Bucket.build(0, [bias, weight])  # bias at [0, 3), weight rows at 3, 8, 13, 18
    whole = cut_pieces([bucket], None)[0][0]
    assert piece_segments(whole) == [Segment(0, 3), Segment(3, 23, rows=4)]
    parts = cut_pieces([bucket], 4 * 9)[0]  # pieces of 9 elements: [0, 9) [9, 18) [18, 23)
    assert [piece_segments(p) for p in parts] == [
        [Segment(0, 3), Segment(3, 8, rows=1), Segment(8, 9)],  # bias, weight row 0, part of row 1
        [Segment(0, 4), Segment(4, 9, rows=1)],  # rest of row 1, row 2
        [Segment(0, 5, rows=1)],  # row 3
    ]


def _powersgd_one_step(rank, world):
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    engine = DataParallel(model, compressor="powersgd", compressor_options={"rank": 2, "start_iter": 0})
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    # this rank's own gradient (autograd.grad leaves .grad and the engine's hooks alone); by the
    # time backward returns the engine has averaged .grad, as DDP does
    local = list(torch.autograd.grad(model(x).square().sum(), list(model.parameters())))
    engine(x).square().sum().backward()
    engine.step(optimizer)
    keys = list(engine.compressor.state.errors)
    engine.close()
    return before, local, [p.detach().clone() for p in model.parameters()], keys


def test_powersgd_reducer_matches_the_algorithm_step_by_step():
    """Two ranks, one step from iteration 0: the weight's update is P^ (sum Q)^T / 2 as computed by
    PowerSGDState on each rank's own gradient, the bias (1-D) is averaged plainly."""
    from paraloom.compress.powersgd import PowerSGDState

    results = run_workers(_powersgd_one_step, 2)
    (before, _, after, keys), grads = results[0], [r[1] for r in results]
    assert keys == [1]  # bucket 0, segment 1 (the weight; the bias is segment 0)
    states = [PowerSGDState(rank=2, start_iter=0) for _ in results]
    p_sum = sum(s.p_matrices(1, g[0]) for s, g in zip(states, grads, strict=True))
    q_sum = sum(s.q_matrices(1, p_sum) for s in states)
    weight_avg = states[0].decompress(1, q_sum, grads[0][0].shape) / 2
    torch.testing.assert_close(after[0], before[0] - weight_avg, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after[1], before[1] - (grads[0][1] + grads[1][1]) / 2)
    for other in results[1:]:
        torch.testing.assert_close(other[2], after, rtol=0, atol=0)
    assert not torch.allclose(weight_avg, (grads[0][0] + grads[1][0]) / 2, atol=1e-3)  # it did compress


def test_powersgd_priority_with_a_hand_written_algorithm_is_refused():
    with pytest.raises(UserError, match="powersgd with comm.scheduler=priority needs comm.algorithm=native"):
        from paraloom.config import CommConfig

        CommConfig(compressor="powersgd", scheduler="priority", algorithm="ring")
