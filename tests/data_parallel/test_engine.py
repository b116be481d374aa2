"""DataParallel (buckets + scheduler) equals one process on the full batch and the naive engine."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from dp_reference import reference, setup, steps

from paraloom.data_parallel import DataParallel, DataParallelNaive
from paraloom.train.trainer import batch_loss

STEPS = 10
TINY, HUGE = 1e-6, 25.0  # MB: one bucket per parameter / one bucket for the whole model


def _train(rank, world, model_name, opt_name, n, engine_kwargs, naive=False):
    split, model, optimizer = setup(model_name, opt_name)
    engine = DataParallelNaive(model) if naive else DataParallel(model, **engine_kwargs)
    losses, grads, launched_in_backward = [], None, []
    for idx, count in steps(n, rank, world, count=STEPS):
        loss, loss_sum = batch_loss(engine, split.x_train[idx], split.y_train[idx],
                                    global_count=count, dp_world_size=world)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        if not naive:
            launched_in_backward.append(engine._executor.launched)
        engine.sync_gradients()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        dist.all_reduce(loss_sum)
        losses.append(loss_sum.item() / count)
    if not naive:
        engine.close()
        buckets, copies = len(engine.buckets), engine.copies
    else:
        buckets, copies = 0, 0
    return losses, grads, [p.detach().clone() for p in model.parameters()], launched_in_backward, \
        buckets, copies


def _check(results, ref):
    ref_losses, ref_grads, ref_params = ref
    for losses, grads, params, *_ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        torch.testing.assert_close(grads, ref_grads)
        torch.testing.assert_close(params, ref_params)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("scheduler", ["fifo", "wait_free"])
@pytest.mark.parametrize(("opt_name", "bucket_mb"), [("sgd", TINY), ("adam", HUGE)])
def test_equals_one_process_and_the_naive_engine(world, scheduler, opt_name, bucket_mb):
    kwargs = {"scheduler": scheduler, "bucket_mb": bucket_mb, "first_bucket_mb": bucket_mb}
    ref = reference("cnn", opt_name, 100, count=STEPS)
    results = run_workers(_train, world, "cnn", opt_name, 100, kwargs)
    _check(results, ref)
    _check(run_workers(_train, world, "cnn", opt_name, 100, kwargs, True), ref)  # naive agrees too
    launched, buckets, copies = results[0][3], results[0][4], results[0][5]
    assert buckets == (8 if bucket_mb == TINY else 1)  # the cnn has 8 parameter tensors
    assert copies == 0  # gradients stay bucket views: nothing copied per step
    if world > 1 and scheduler == "fifo":
        assert set(launched) == {0}  # nothing launched before backward ends
    if world > 1 and scheduler == "wait_free" and bucket_mb == TINY:
        assert min(launched) >= 7  # all but the last bucket launched while backward ran


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling"])
def test_hand_written_algorithms_from_the_comm_thread(algorithm):
    kwargs = {"scheduler": "wait_free", "bucket_mb": TINY, "first_bucket_mb": TINY, "algorithm": algorithm}
    _check(run_workers(_train, 3, "mlp", "sgd", 98, kwargs), reference("mlp", "sgd", 98, count=STEPS))


class _TiedWithSpare(torch.nn.Module):
    """A tied weight used twice, and a branch that never gets a gradient."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 4, bias=False)
        self.head = torch.nn.Linear(4, 3)
        self.spare = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.relu(self.embed(torch.relu(self.embed(x)))))


def _tied(rank, world, scheduler, accumulate):
    torch.manual_seed(0)
    model = _TiedWithSpare()
    engine = DataParallel(model, scheduler=scheduler, bucket_mb=TINY, first_bucket_mb=TINY)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for _step in range(4):
        x = torch.randn(4 * world, 4, generator=gen)
        mine = x.tensor_split(world)[rank]
        scale = world / len(x)  # averaged over ranks, this is the mean over the global batch
        optimizer.zero_grad(set_to_none=False)
        if accumulate:  # two micro-batches, the first without communication
            first, second = mine.tensor_split(2)
            with engine.no_sync():
                (engine(first).pow(2).sum() * scale).backward()
            (engine(second).pow(2).sum() * scale).backward()
        else:
            (engine(mine).pow(2).sum() * scale).backward()
        engine.sync_gradients()
        optimizer.step()
    engine.close()
    return [p.detach().clone() for p in model.parameters()], model.spare.weight.grad.clone()


@pytest.mark.parametrize("scheduler", ["fifo", "wait_free"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_tied_weights_unused_parameters_and_no_sync(scheduler, accumulate):
    world = 2
    torch.manual_seed(0)
    model = _TiedWithSpare()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for _step in range(4):
        x = torch.randn(4 * world, 4, generator=gen)
        optimizer.zero_grad()
        (model(x).pow(2).sum() / len(x)).backward()
        optimizer.step()
    expected = [p.detach() for p in model.parameters()]
    for params, spare_grad in run_workers(_tied, world, scheduler, accumulate):
        torch.testing.assert_close(params, expected)
        assert torch.count_nonzero(spare_grad) == 0  # never used: reduced as zeros


def test_a_second_backward_without_no_sync_is_an_error():
    def body(rank, world):
        model = torch.nn.Linear(3, 2)
        engine = DataParallel(model)
        engine(torch.randn(2, 3)).sum().backward()
        try:
            engine(torch.randn(2, 3)).sum().backward()
        except RuntimeError as exc:
            return str(exc)
        finally:
            engine.close()
        return "no error"

    for message in run_workers(body, 2):
        assert "no_sync" in message
