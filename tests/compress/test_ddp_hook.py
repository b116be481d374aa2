"""The DDP comm hook: equals plain DDP, keeps ranks identical, counts wire bytes, issues from one thread."""

import math
import threading

import pytest
import torch
import torch._dynamo  # noqa: F401 - DDP imports it lazily; importing it here spares every forked rank ~2 s
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import paraloom.compress.ddp as hook_module
from paraloom.compress.base import COMPRESSORS
from paraloom.compress.ddp import compression_hook, ddp_hook, hook_names
from paraloom.config.errors import UserError

CAP_MB = 0.002  # ~2 KB: after DDP's first-step rebuild the 1860 parameters fall into two buckets
ALL_NAMES = ["fp16", "bf16", "qsgd", "onebit", "efsign", "topk", "randomk", "dgc", "powersgd"]
OPTIONS = {"topk": {"density": 0.1}, "randomk": {"density": 0.1}, "dgc": {"density": 0.1},
           "powersgd": {"rank": 1, "start_iter": 2}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-rank random inputs; targets from a fixed linear teacher, so the loss can fall."""
    x = torch.randn(16, 20, generator=torch.Generator().manual_seed(1000 * step + rank))
    teacher = torch.randn(20, 4, generator=torch.Generator().manual_seed(7)) / math.sqrt(20)
    return x, x @ teacher


def _train(rank, name, options, steps, lr=0.1, spy=None):
    """Train a DDP model `steps` steps; name None is plain DDP. Returns (params, losses, state)."""
    model = DistributedDataParallel(_model(), bucket_cap_mb=CAP_MB)
    state = None
    if name is not None:
        state, hook = ddp_hook(name, **options)
        model.register_comm_hook(state, spy or hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = _batch(rank, step)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if state is not None:
        state.close()
    return [p.detach().clone() for p in model.parameters()], losses, state


def _hooked_and_plain(rank, world, name, options, steps=5):
    hooked, _, _ = _train(rank, name, options, steps)
    plain, _, _ = _train(rank, None, {}, steps)
    return hooked, plain


def _trained(rank, world, name, options, steps, lr=0.1):
    params, losses, state = _train(rank, name, options, steps, lr=lr)
    return params, losses, state.bytes, state.calls


# ---- names -----------------------------------------------------------------------------------------

def test_names_cover_every_compressor():
    assert hook_names() == ["none", "powersgd", *sorted(COMPRESSORS)]
    assert set(ALL_NAMES) | {"none"} == set(hook_names())


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(UserError) as caught:
        ddp_hook("gzip")
    for name in hook_names():
        assert name in str(caught.value)


def test_none_takes_no_options():
    with pytest.raises(UserError, match="no options"):
        ddp_hook("none", density=0.1)


def test_ddp_accepts_the_hook_annotations():
    """DDP compares the bucket and return annotations with the real objects, not strings."""
    assert compression_hook.__annotations__["bucket"] is dist.GradBucket
    assert compression_hook.__annotations__["return"] == torch.futures.Future[torch.Tensor]


# ---- equivalence with plain DDP ----------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 4])
def test_none_equals_plain_ddp(world):
    for hooked, plain in run_workers(_hooked_and_plain, world, "none", {}):
        for a, b in zip(hooked, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("world", [2, 4])
def test_fp16_is_close_to_plain_ddp(world):
    for hooked, plain in run_workers(_hooked_and_plain, world, "fp16", {}):
        for a, b in zip(hooked, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("world", [2, 4])
def test_powersgd_that_compresses_nothing_equals_plain_ddp(world):
    """rank 64: P and Q would outgrow every matrix, so every gradient goes plainly."""
    options = {"rank": 64, "start_iter": 0}
    for hooked, plain in run_workers(_hooked_and_plain, world, "powersgd", options):
        for a, b in zip(hooked, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---- every compressor --------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", ALL_NAMES)
def test_every_compressor_keeps_ranks_identical(name, world):
    results = run_workers(_trained, world, name, OPTIONS.get(name, {}), 5)
    first = results[0][0]
    for params, losses, nbytes, calls in results:
        assert all(math.isfinite(loss) for loss in losses)
        assert nbytes > 0 and calls >= 5
        for a, b in zip(params, first, strict=True):
            assert torch.isfinite(a).all()
            assert torch.equal(a, b)


def test_powersgd_from_step_zero_at_four_ranks_learns():
    """torch's own hook launches Q's all-reduce from a callback and breaks gloo here; this one must not."""
    results = run_workers(_trained, 4, "powersgd", {"rank": 2, "start_iter": 0}, 30, lr=0.3)
    for params, losses, _, _ in results:
        assert sum(losses[-5:]) < 0.6 * sum(losses[:5]), losses
        for a, b in zip(params, results[0][0], strict=True):
            assert torch.equal(a, b)


# ---- wire bytes and ordering ---------------------------------------------------------------------------

def _topk_bytes(rank, world, density):
    sizes: list[list[int]] = []

    def spy(state, bucket):
        sizes[-1].append(bucket.buffer().numel())
        return compression_hook(state, bucket)

    model = DistributedDataParallel(_model(), bucket_cap_mb=CAP_MB)
    state, _ = ddp_hook("topk", density=density)
    model.register_comm_hook(state, spy)
    totals = []
    for step in range(2):  # step 0: one bucket of everything; step 1: DDP's rebuilt buckets
        sizes.append([])
        x, y = _batch(rank, step)
        F.mse_loss(model(x), y).backward()
        totals.append(state.bytes)
    state.close()
    expected = [sum(state.compressor.payload_bytes(n) for n in step) for step in sizes]
    return sizes, totals, expected


@pytest.mark.parametrize("density", [0.01, 0.3])
def test_topk_wire_bytes_are_the_payloads(density):
    for sizes, totals, expected in run_workers(_topk_bytes, 2, density):
        assert len(sizes[0]) == 1 and len(sizes[1]) >= 2  # the test covers both layouts
        assert sizes[0][0] == sum(sizes[1])
        per_step = [totals[0], totals[1] - totals[0]]
        assert per_step == expected
        assert per_step == [sum(8 * math.ceil(density * n) for n in step) for step in sizes]


def _issuing_threads(rank, world, name, options):
    seen: list[str] = []
    real_reduce, real_gather = dist.all_reduce, hook_module._all_gather_flat

    def reduce(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return real_reduce(*args, **kwargs)

    def gather(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return real_gather(*args, **kwargs)

    dist.all_reduce, hook_module._all_gather_flat = reduce, gather  # this forked rank's copy only
    try:
        _, _, state = _train(rank, name, options, 4)
    finally:
        dist.all_reduce, hook_module._all_gather_flat = real_reduce, real_gather
    alive = [t.name for t in threading.enumerate() if t.name == "paraloom-ddp-hook"]
    return seen, state.calls, alive


@pytest.mark.parametrize("name, options", [("none", {}), ("topk", {"density": 0.1}),
                                           ("powersgd", {"rank": 1, "start_iter": 1})])
def test_one_thread_issues_every_collective(name, options):
    for seen, calls, alive in run_workers(_issuing_threads, 2, name, options):
        assert len(seen) == calls > 0
        assert set(seen) == {"paraloom-ddp-hook"}
        assert alive == []  # close() stopped it


def _failing(rank, world):
    model = DistributedDataParallel(_model(), bucket_cap_mb=CAP_MB)
    state, hook = ddp_hook("topk", density=0.1)
    model.register_comm_hook(state, hook)

    def broken(tensor, key):
        raise RuntimeError("compressor broke")

    state.compressor.compress = broken
    x, y = _batch(rank, 0)
    try:
        F.mse_loss(model(x), y).backward()
    except RuntimeError as exc:
        message = str(exc)
    else:
        message = None
    state.close()
    return message


def test_a_failing_bucket_reaches_backward():
    [message] = run_workers(_failing, 1)
    assert message is not None and "compressor broke" in message
