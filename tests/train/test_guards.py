"""NaN/Inf guard: a bad gradient on one rank skips the step on every rank, and nothing is poisoned."""

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers

from paraloom.data_parallel import DataParallel, DataParallelNaive
from paraloom.train.guards import is_comm_failure, peer_failure


def _guarded_steps(rank, world, options, naive, flag_group=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    engine = DataParallelNaive(model) if naive else DataParallel(model, **options)
    if flag_group:  # the flag path: a one-byte all-reduce per step on the given group
        engine.guard_nonfinite(group=torch.distributed.new_group([0, 1]))
    else:
        engine.guard_nonfinite()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    y = torch.tensor([0, 1, 2, 0])
    outcomes, snapshots = [], []
    for step in range(4):
        loss = F.cross_entropy(engine(x), y)
        if step == 1 and rank == world - 1:
            loss = loss * float("nan")  # only the last rank's gradients go bad
        before = [p.detach().clone() for p in model.parameters()]
        loss.backward()
        outcomes.append(engine.step(optimizer))
        after = [p.detach().clone() for p in model.parameters()]
        snapshots.append(all(torch.equal(a, b) for a, b in zip(before, after, strict=True)))
    engine.close()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    residual_ok = True
    memory = getattr(getattr(engine, "compressor", None), "memory", None)
    if memory is not None:
        residual_ok = all(bool(torch.isfinite(t).all()) for t in memory.residual.values())
    return outcomes, snapshots, finite, residual_ok, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("options,naive,flag_group",
                         [({}, False, False), ({"scheduler": "fifo"}, False, False), ({}, False, True),
                          ({"scheduler": "priority", "partition_mb": 0.0005}, False, False),
                          ({"compressor": "topk", "compressor_options": {"density": 0.5}}, False, False),
                          ({"compressor": "fp16"}, False, False), ({}, True, False)],
                         ids=["wait_free", "fifo", "wait_free_flag", "priority", "topk", "fp16", "naive"])
def test_nan_on_one_rank_skips_the_step_everywhere(options, naive, flag_group):
    results = run_workers(_guarded_steps, 2, options, naive, flag_group)
    for outcomes, unchanged, finite, residual_ok, _ in results:
        assert outcomes == [True, False, True, True]
        if "scheduler" not in options:  # priority applies each update in the next forward
            assert unchanged == [False, True, False, False]  # the skipped step left the parameters alone
        assert finite and residual_ok
    for a, b in zip(results[0][4], results[1][4], strict=True):
        assert torch.equal(a, b)
    if "scheduler" in options:  # the same three updates as wait_free's
        plain = run_workers(_guarded_steps, 2, {}, False)
        for a, b in zip(results[0][4], plain[0][4], strict=True):
            torch.testing.assert_close(a, b)


def _collectives_per_step(rank, world, guarded, options=None):
    calls = []
    real = torch.distributed.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    engine = DataParallel(model, first_bucket_mb=0.0, **(options or {}))
    if guarded:
        engine.guard_nonfinite()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.distributed.all_reduce = counting
    try:
        F.cross_entropy(engine(torch.randn(4, 8)), torch.tensor([0, 1, 2, 0])).backward()
        engine.step(optimizer)
    finally:
        torch.distributed.all_reduce = real
    return len(calls), len(engine.buckets)


@pytest.mark.parametrize("options", [{}, {"compressor": "bf16"}], ids=["plain", "bf16"])
def test_the_guard_on_averaged_gradients_adds_no_collective(options):
    """Plain averaging checks the sums every rank already holds: no flag all-reduce, no barrier."""
    for guarded, unguarded in zip(run_workers(_collectives_per_step, 2, True, options),
                                  run_workers(_collectives_per_step, 2, False, options), strict=True):
        assert guarded == unguarded
        assert guarded[0] == guarded[1]  # one all-reduce per bucket, nothing else


def test_the_local_flag_is_a_sum_check():
    from paraloom.optim.finite import not_finite

    nan, inf = float("nan"), float("inf")
    cases = ([1.0, -2.0], [nan, 0.0], [inf, 1.0], [inf, -inf], [3e38, 3e38])
    flags = [bool(not_finite(torch.tensor(v))) for v in cases]
    assert flags == [False, True, True, True, True]  # the last: finite, but its sum leaves float32's range
    half = torch.full((100_000,), 60000.0, dtype=torch.float16)  # its fp16 sum overflows, float32's not
    assert not bool(not_finite(half))


def test_the_exact_check_confirms_a_sum_that_left_the_range():
    """A parameter server's push: dropped for a NaN or Inf, kept when only its sum overflowed."""
    from paraloom.optim.finite import is_finite

    nan, inf = float("nan"), float("inf")
    cases = ([1.0, -2.0], [nan, 0.0], [inf, 1.0], [3e38, 3e38])
    assert [is_finite(torch.tensor(v)) for v in cases] == [True, False, False, True]


def _accumulated_nan(rank, world, bad_microbatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 3))
    engine = DataParallel(model)
    engine.guard_nonfinite()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    for micro in range(3):  # micro-batches 0 and 1 accumulate under no_sync, 2 is the synced one
        loss = F.cross_entropy(engine(x), y)
        if micro == bad_microbatch and rank == 0:
            loss = loss * float("inf")
        if micro < 2:
            with engine.no_sync():
                loss.backward()
        else:
            loss.backward()
    return engine.step(optimizer)


@pytest.mark.parametrize("bad_microbatch", [0, 2])
def test_a_bad_accumulated_micro_batch_skips_the_step(bad_microbatch):
    """Inside no_sync() the check waits for the synced backward; the sum still carries the NaN/Inf."""
    assert run_workers(_accumulated_nan, 2, bad_microbatch) == [False, False]


def test_comm_failures_are_recognised():
    assert is_comm_failure(RuntimeError("[gloo] Timed out waiting 5000ms for recv operation"))
    assert is_comm_failure(RuntimeError("Connection reset by peer"))
    assert not is_comm_failure(ValueError("bad shape"))
    assert not is_comm_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def _silent_peer(rank, world):
    if rank == 1:
        return None  # never checks in
    cause = "Timed out waiting 1000ms" if rank == 0 else "Connection closed by peer [127.0.0.1]:1234"
    return str(peer_failure(RuntimeError(cause), rank=rank, world=world, step=7,
                            operation="gradient all-reduce", timeout_s=1.0))


def test_peer_failure_names_the_silent_rank():
    """Rank 0 timed out waiting; rank 2's connection to rank 1 closed (rank 1 died): only rank 0
    says it waited for comm.timeout_s."""
    message = run_workers(_silent_peer, 3, timeout=30)
    for text in (message[0], message[2]):
        assert text.startswith("rank 1 stopped answering")
        assert "step 7" in text and "gradient all-reduce" in text
    assert "after comm.timeout_s=1 s" in message[0] and "comm.timeout_s" not in message[2]
    assert "when its connection to them failed (Connection closed by peer" in message[2]


def _finite_checks(rank, world):
    engine = DataParallel(torch.nn.Linear(4, 2))
    buffer = engine.buckets[0].buffer
    out = []
    for values in ([1.0, 2.0], [3e38, 3e38], [float("nan"), 1.0], [float("inf"), 1.0],
                   [float("inf"), float("-inf")]):
        buffer.zero_()
        buffer[:2] = torch.tensor(values)
        out.append(engine.gradients_finite())
    engine.close()
    return out


def test_the_finite_check_of_averaged_gradients_is_exact():
    """A finite bucket whose sum overflows is still finite; NaN, Inf and Inf - Inf are not."""
    assert run_workers(_finite_checks, 2) == [[True, True, False, False, False]] * 2
