"""Shared reference for data-parallel tests: one process, full batch, mean loss."""

import itertools

import torch
import torch.nn.functional as F

from paraloom.data import ShardedBatches, load_dataset
from paraloom.models import build_model
from paraloom.optim import make_optimizer

BATCH = 24


def setup(model_name, opt_name):
    split = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model(model_name, split.input_shape, split.n_classes, hidden=32, channels=4)
    optimizer = make_optimizer(opt_name, model.parameters(), lr=0.05 if opt_name == "sgd" else 0.01,
                               momentum=0.9)
    return split, model, optimizer


def steps(n, rank=0, world=1, count=5):
    shards = ShardedBatches(n, BATCH, rank=rank, world=world, seed=0)
    epochs = (shards.epoch(e) for e in itertools.count())
    return itertools.islice(itertools.chain.from_iterable(epochs), count)


def reference(model_name, opt_name, n, count=5):
    split, model, optimizer = setup(model_name, opt_name)
    losses, grads = [], None
    for idx, _count in steps(n, count=count):
        loss = F.cross_entropy(model(split.x_train[idx]), split.y_train[idx])
        optimizer.zero_grad()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        losses.append(loss.item())
    return losses, grads, [p.detach().clone() for p in model.parameters()]
