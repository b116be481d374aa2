"""DataParallelNaive equals one process on the full batch: losses, gradients and parameters."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from dp_reference import reference, setup, steps

from paraloom.data_parallel import DataParallelNaive
from paraloom.train.loss_eval import batch_loss


def _data_parallel(rank, world, model_name, opt_name, n, algorithm="native"):
    split, model, optimizer = setup(model_name, opt_name)
    if rank:  # replicas start apart on purpose: the engine must broadcast rank 0's state
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    engine = DataParallelNaive(model, algorithm=algorithm)
    losses, grads = [], None
    for idx, count in steps(n, rank, world):
        loss, loss_sum = batch_loss(engine, split.x_train[idx], split.y_train[idx],
                                    scale=world / count)
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
    ref_losses, ref_grads, ref_params = reference(model_name, opt_name, n)
    for losses, grads, params in run_workers(_data_parallel, world, model_name, opt_name, n):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        torch.testing.assert_close(grads, ref_grads)
        torch.testing.assert_close(params, ref_params)


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling", "tree", "one_to_all"])
def test_every_all_reduce_algorithm_gives_the_same_training(algorithm):
    ref_losses, ref_grads, ref_params = reference("mlp", "sgd", 100)
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
