"""DataParallelNaive equals one process on the full batch: losses, gradients and parameters."""

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_workers

from paraloom.config import OptimConfig
from paraloom.data import ShardedBatches, load_dataset
from paraloom.data_parallel import DataParallelNaive
from paraloom.models import build_model
from paraloom.train.trainer import batch_loss, make_optimizer

BATCH, STEPS = 24, 5


def _setup(model_name, opt_name):
    split = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model(model_name, split.input_shape, split.n_classes, hidden=32, channels=4)
    optimizer = make_optimizer(OptimConfig(name=opt_name, lr=0.05 if opt_name == "sgd" else 0.01),
                               model.parameters())
    return split, model, optimizer


def _steps(n, rank=0, world=1):
    shards = ShardedBatches(n, BATCH, rank=rank, world=world, seed=0)
    epochs = (shards.epoch(e) for e in itertools.count())
    return itertools.islice(itertools.chain.from_iterable(epochs), STEPS)


def _reference(model_name, opt_name, n):
    split, model, optimizer = _setup(model_name, opt_name)
    losses, grads = [], None
    for idx, _count in _steps(n):
        loss = F.cross_entropy(model(split.x_train[idx]), split.y_train[idx])
        optimizer.zero_grad()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        losses.append(loss.item())
    return losses, grads, [p.detach().clone() for p in model.parameters()]


def _data_parallel(rank, world, model_name, opt_name, n, algorithm="native"):
    split, model, optimizer = _setup(model_name, opt_name)
    if rank:  # replicas start apart on purpose: the engine must broadcast rank 0's state
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    engine = DataParallelNaive(model, algorithm=algorithm)
    losses, grads = [], None
    for idx, count in _steps(n, rank, world):
        loss, loss_sum = batch_loss(engine, split.x_train[idx], split.y_train[idx],
                                    global_count=count, dp_world_size=world)
        optimizer.zero_grad()
        loss.backward()
        engine.sync_gradients()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        dist.all_reduce(loss_sum)
        losses.append(loss_sum.item() / count)
    return losses, grads, [p.detach().clone() for p in model.parameters()]


# n=100: the 5th step is a short batch of 4; n=98: a batch of 2, so some ranks get no sample
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize(("model_name", "opt_name", "n"),
                         [("cnn", "sgd", 100), ("mlp", "adam", 100), ("mlp", "sgd", 98)])
def test_equals_one_process_on_the_full_batch(world, model_name, opt_name, n):
    ref_losses, ref_grads, ref_params = _reference(model_name, opt_name, n)
    for losses, grads, params in run_workers(_data_parallel, world, model_name, opt_name, n):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        torch.testing.assert_close(grads, ref_grads)
        torch.testing.assert_close(params, ref_params)


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling", "tree", "one_to_all"])
def test_every_all_reduce_algorithm_gives_the_same_training(algorithm):
    ref_losses, ref_grads, ref_params = _reference("mlp", "sgd", 100)
    for losses, grads, params in run_workers(_data_parallel, 3, "mlp", "sgd", 100, algorithm):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        torch.testing.assert_close(grads, ref_grads)
        torch.testing.assert_close(params, ref_params)


def test_counts_one_payload_per_parameter_per_step():
    def body(rank, world):
        model = torch.nn.Linear(4, 3)
        engine = DataParallelNaive(model)
        engine.stats.take()
        model(torch.randn(2, 4)).sum().backward()
        engine.sync_gradients()
        return engine.stats.take()

    for stats in run_workers(body, 2):
        assert stats.calls == 2 and stats.bytes == (4 * 3 + 3) * 4
