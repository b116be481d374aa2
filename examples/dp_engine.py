"""Your own loop with paraloom's DataParallel engine, under torchrun:

    torchrun --standalone --nproc-per-node 2 examples/dp_engine.py [VARIANT]

VARIANT: wait_free (default), fifo, priority, one_step_delay or local_sgd.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paraloom import DataParallel, Topology
from paraloom.config import CommConfig
from paraloom.data import ShardedBatches, load_dataset
from paraloom.models import build_model

VARIANTS = {"wait_free": {}, "fifo": {"scheduler": "fifo"}, "priority": {"scheduler": "priority"},
         "one_step_delay": {"sync": "one_step_delay"}, "local_sgd": {"sync": "local_sgd", "local_steps": 4}}

if __name__ == "__main__":
    variant = sys.argv[1] if len(sys.argv) > 1 else "wait_free"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    groups = Topology.for_world(dist.get_world_size()).init_groups()
    split = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("cnn", split.input_shape, split.n_classes)
    engine = DataParallel(model, topology=groups, comm=CommConfig(**VARIANTS[variant]))
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    batches = ShardedBatches(len(split.y_train), 64, rank=groups.dp_rank, world=groups.dp_world_size, seed=0)
    for epoch in range(4):
        for idx, global_count in batches.epoch(epoch):
            # sum over this rank's shard / global batch x ranks: the average over ranks is the global mean
            loss = F.cross_entropy(engine(split.x_train[idx]), split.y_train[idx], reduction="sum")
            (loss * groups.dp_world_size / global_count).backward()
            engine.step(optimizer)  # synchronize, update, zero the gradients
    engine.finish()  # land in-flight communication / deferred updates before reading the model
    engine.close()
    with torch.no_grad():
        accuracy = (model(split.x_test).argmax(1) == split.y_test).float().mean().item()
    if dist.get_rank() == 0:
        print(f"{variant}: test accuracy {accuracy:.3f}")
    dist.destroy_process_group()
