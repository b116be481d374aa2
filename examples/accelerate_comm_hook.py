"""Paraloom in an Accelerate script, on 2 CPU processes:

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_comm_hook.py [MODE]
    torchrun --nproc-per-node 2 examples/accelerate_comm_hook.py [MODE]   # the same, without accelerate's CLI

MODE powersgd (default), topk, fp16, ... (`paraloom.compress.hook_names()`): Accelerate wraps the
model in torch's DDP as usual, and paraloom's compressor becomes that DDP's communication hook,
registered before the first backward. MODE engine: paraloom's own wrapper instead of Accelerate's
DDP (Accelerate has no option to swap the class): wrap the model yourself and prepare it with
`paraloom.integrations.accelerate.prepare`, which Accelerate's `save_state`, `load_state`,
`save_model` and `unwrap_model` then know as they know their DDP. (`--multi_gpu` picks Accelerate's
torchrun launcher; on CPU, `--cpu` alone starts one process unless MPI is set up. Without GPUs,
Accelerate counts the processes only with `Accelerator(cpu=True)`; it then runs on gloo.)
"""

import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paraloom
from paraloom.compress import ddp_hook
from paraloom.data import load_dataset
from paraloom.integrations.accelerate import prepare

HOOK_OPTIONS = {"powersgd": {"rank": 2, "start_iter": 2}, "topk": {"density": 0.05}}

if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "powersgd"
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=2)
    split = load_dataset("digits")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, split.n_classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = DataLoader(TensorDataset(split.x_train, split.y_train), batch_size=32, shuffle=True,
                      generator=torch.Generator().manual_seed(0))
    state = None
    if mode == "engine":
        model = model.to(accelerator.device)
        model = paraloom.DataParallel(model, scheduler="priority", compressor="powersgd")
        optimizer = paraloom.DistributedOptimizer(optimizer, model)  # the priority engine applies the step
        model, optimizer, data = prepare(accelerator, model, optimizer, data)
    else:
        model, optimizer, data = accelerator.prepare(model, optimizer, data)
        state, hook = ddp_hook(mode, **HOOK_OPTIONS.get(mode, {}))
        model.register_comm_hook(state, hook)  # model is a DistributedDataParallel here

    losses, updates = [], 0
    for _epoch in range(3):
        for x, y in data:
            with accelerator.accumulate(model):  # no_sync() on every other micro-batch
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            updates += accelerator.sync_gradients
    if state is not None:
        state.close()
        sent = state.bytes
    else:
        model.close()  # lands the priority engine's last deferred update
        sent = model.stats.bytes

    n = len(losses) // 10
    fp32 = sum(p.numel() * 4 for p in model.parameters()) * updates
    accelerator.print(f"{mode}: {accelerator.num_processes} processes, {updates} updates, "
                      f"loss {sum(losses[:n]) / n:.3f} -> {sum(losses[-n:]) / n:.3f}, "
                      f"sent {sent} bytes (fp32 gradients: {fp32})")
    # destroys the process group while the interpreter is whole: left to exit, gloo's threads can
    # still hold work that the teardown aborts ("terminate called without an active exception")
    accelerator.end_training()
