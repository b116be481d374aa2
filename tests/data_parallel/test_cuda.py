"""The engine and the training loop on a GPU (marked cuda: `make test-gpu` runs them on a GPU
machine; they are skipped where no CUDA device is visible).

Equivalence is checked within one device: the engine's run against a plain loop on the same GPU,
deterministic kernels, fp32 tolerances as on CPU. Across devices (CPU against GPU) kernels differ,
so the command-line runs are judged by what they learn. One GPU holds one NCCL rank; two ranks
share it under gloo, which takes CUDA tensors for its collectives.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from dp_reference import setup, steps

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
ENGINES = {
    "fifo": {"scheduler": "fifo"},
    "wait_free": {"scheduler": "wait_free"},
    "priority": {"scheduler": "priority", "partition_mb": 0.004, "credit_mb": 0.004},
    "shard_optimizer": {"shard_optimizer": True},
    "local_sgd": {"sync": "local_sgd", "local_steps": 2},
}


def _deterministic() -> torch.device:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call
    torch.use_deterministic_algorithms(True, warn_only=True)  # cuDNN's deterministic kernels
    torch.backends.cudnn.benchmark = False
    return torch.device("cuda", torch.cuda.current_device())


def _train(rank, world, options, plain, optimizer_name="adam"):
    """STEPS steps of the cnn on digits on this rank's GPU, through the engine (or, with `plain`, a
    plain loop on the whole batch); losses and parameters come back on the CPU."""
    from paraloom.data_parallel import DataParallel
    from paraloom.train.loss_eval import batch_loss

    device = _deterministic()
    split, model, optimizer = setup("cnn", optimizer_name)  # Adam makes its state on the GPU
    model.to(device)
    x, y = split.x_train.to(device), split.y_train.to(device)
    engine = model if plain else DataParallel(model, bucket_mb=0.01, first_bucket_mb=0.01, **options)
    losses = []
    for idx, count in steps(100, 0 if plain else rank, 1 if plain else world, count=STEPS):
        loss, loss_sum = batch_loss(engine, x[idx.to(device)], y[idx.to(device)],
                                    scale=(1 if plain else world) / count)
        loss.backward()
        if plain:
            optimizer.step()
            optimizer.zero_grad()
        else:
            engine.step(optimizer)
            dist.all_reduce(loss_sum)
        losses.append(float(loss_sum) / count)
    if not plain:
        engine.finish()
        engine.close()
    assert all(p.device == device for p in model.parameters())
    return losses, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("variant", list(ENGINES))
def test_engine_on_one_gpu_equals_the_plain_loop(variant):
    """World size 1 under NCCL: the engine's hooks, buckets and scheduler all run (no one-rank shortcut)."""
    (losses, params), = run_workers(_train, 1, ENGINES[variant], False, backend="nccl", timeout=180)
    (ref_losses, ref_params), = run_workers(_train, 1, {}, True, backend="nccl", timeout=180)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    torch.testing.assert_close(params, ref_params)


def test_two_ranks_share_one_gpu_under_gloo():
    """Each rank's half batch runs other cuDNN kernels than the whole batch (another summation order),
    so gradients differ in their last bits. Adam's step, about lr whatever a gradient's size, turns
    that into weight differences up to lr (seen on an H200: 2.4e-5 and 1.6e-4 after 8 steps, on
    near-zero gradients); SGD keeps them as small as the gradients': this test runs SGD."""
    results = run_workers(_train, 2, ENGINES["wait_free"], False, "sgd", backend="gloo", timeout=180)
    (ref_losses, ref_params), = run_workers(_train, 1, {}, True, "sgd", backend="nccl", timeout=180)
    for losses, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        torch.testing.assert_close(params, ref_params, atol=1e-5, rtol=1e-4)


def test_join_and_unused_parameters_on_gpu_tensors_as_ddp():
    """join() (uneven ranks, BatchNorm buffers, ZeroRedundancyOptimizer beside the model) and
    find_unused_parameters with their flags and maps on the GPU: two ranks share it under gloo,
    DDP beside paraloom on the same ranks (test_join.py and test_unused.py on CUDA tensors)."""
    import test_join
    import test_unused

    for zero in (False, True):
        for ddp, ours in run_workers(test_join._against_ddp, 2, False, 1, {}, True, zero, "cuda",
                                     backend="gloo", timeout=180):
            torch.testing.assert_close(ours, ddp)
    for (ddp_params, ddp_none), (params, none) in run_workers(test_unused._against_ddp, 2, False, True, {},
                                                              "cuda", backend="gloo", timeout=180):
        assert none == ddp_none
        torch.testing.assert_close(params, ddp_params)


def _compressed(rank, world, compressor):
    from paraloom.data_parallel import DataParallel
    from paraloom.train.loss_eval import batch_loss

    device = _deterministic()
    split, model, optimizer = setup("cnn", "sgd")
    model.to(device)
    before = [p.detach().clone() for p in model.parameters()]
    engine = DataParallel(model, bucket_mb=0.01, first_bucket_mb=0.01, compressor=compressor)
    x, y = split.x_train.to(device), split.y_train.to(device)
    losses = []
    for idx, count in steps(400, rank, world, count=STEPS):
        loss, loss_sum = batch_loss(engine, x[idx.to(device)], y[idx.to(device)], scale=world / count)
        loss.backward()
        engine.step(optimizer)
        losses.append(float(loss_sum) / len(idx))
    engine.finish()
    engine.close()
    moved = [not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)]
    return losses, any(moved), all(p.device == device for p in model.parameters())


@pytest.mark.parametrize("compressor", ["fp16", "bf16", "qsgd", "onebit", "efsign", "topk", "randomk", "dgc",
                                        "powersgd"])
def test_every_compressor_trains_on_gpu_tensors(compressor):
    (losses, moved, on_gpu), = run_workers(_compressed, 1, compressor, backend="nccl", timeout=180)
    assert all(torch.isfinite(torch.tensor(losses))) and moved and on_gpu


def _paraloom_train(tmp_path, *args):
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "paraloom", "train", *args, "--set", f"run.out_dir={out}",
           "--set", "run.name=gpu"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    return done, out / "gpu"


@pytest.mark.parametrize("args", [
    ("--nproc", "1"),
    ("--nproc", "1", "--set", "comm.shard_optimizer=true", "--set", "guard.nan=true"),
    ("--nproc", "2", "--set", "comm.backend=gloo"),
], ids=["nccl-1", "nccl-1-sharded", "gloo-2-on-one-gpu"])
def test_paraloom_train_on_cuda(tmp_path, args):
    done, run = _paraloom_train(tmp_path, *args, "--set", "run.device=cuda", "--set", "optim.epochs=3")
    assert done.returncode == 0, done.stderr[-8000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["device"].startswith("cuda")
    assert summary["backend"] == ("gloo" if "comm.backend=gloo" in args else "cpu:gloo,cuda:nccl")
    assert summary["test_accuracy"] > 0.9  # the cnn on digits: about 0.97 after 3 epochs on CPU
    state = torch.load(run / "model.pt", map_location="cpu", weights_only=True)
    assert all(value.device.type == "cpu" for value in state.values())


GPT = ["model.name=gpt", "data.name=text", "data.seq_len=16", "data.text_bytes=4000", "model.d_model=32",
       "model.n_heads=2", "model.n_layers=2", "data.batch_size=8", "optim.max_steps=20",
       "run.save_model=true"]


@pytest.mark.parametrize("grid", [["parallel.tp=2"], ["parallel.pp=2", "parallel.microbatches=2"],
                                  ["parallel.mode=layers"]], ids=["tp2", "pp2", "layers"])
def test_model_parallel_trains_on_one_gpu_under_gloo(tmp_path, grid):
    """Tensor-parallel collectives and a pipeline's sends on CUDA tensors: two ranks share the GPU
    under gloo (NCCL takes one rank per GPU); the loss falls and the gathered model is whole."""
    sets = [arg for item in [*GPT, *grid, "run.device=cuda", "comm.backend=gloo"] for arg in ("--set", item)]
    done, run = _paraloom_train(tmp_path, "--nproc", "2", *sets)
    assert done.returncode == 0, done.stderr[-8000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["device"].startswith("cuda") and summary["steps"] == 20
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0]
    state = torch.load(run / "model.pt", map_location="cpu", weights_only=True)
    assert any(key.endswith("weight") for key in state)


def test_a_gpu_run_predicts_itself_and_measures_its_peak_memory(tmp_path):
    sets = [arg for item in [*GPT, "run.device=cuda", "run.hardware=h200-ib-ndr", "optim.max_steps=40"]
            for arg in ("--set", item)]
    done, run = _paraloom_train(tmp_path, "--nproc", "1", *sets)
    assert done.returncode == 0, done.stderr[-8000:]
    predicted = json.loads((run / "prediction.json").read_text())
    contract = json.loads((run / "summary.json").read_text())["contract"]
    assert contract["predicted"] == predicted and predicted["peak_memory_bytes_per_rank"][0] > 0
    assert contract["measured_peak_memory_bytes_per_rank"][0] > 0 and contract["measured"]["compute"] > 0
    assert "predicted (h200-ib-ndr) and measured" in done.stdout


def test_a_gpu_run_calibrates_the_gpu_on_first_use_and_predicts_itself_from_it(tmp_path):
    """run.hardware=auto on a GPU: the GPU's own profile (calibrate --device cuda), made once and
    cached beside the CPU's, never the CPU's loopback rates."""
    cache = tmp_path / "cache"
    env = {key: value for key, value in os.environ.items() if key != "PARALOOM_HARDWARE"}
    env.update(PYTHONPATH=str(ROOT / "src"), PARALOOM_CACHE_DIR=str(cache))
    items = [*GPT, "run.device=cuda", "optim.max_steps=30", f"run.out_dir={tmp_path / 'runs'}"]
    sets = [arg for item in items for arg in ("--set", item)]
    for name in ("first", "second"):
        done = subprocess.run([sys.executable, "-m", "paraloom", "train", "--nproc", "1", *sets,
                               "--set", f"run.name={name}"], capture_output=True, text=True, timeout=600,
                              env=env)
        assert done.returncode == 0, done.stderr[-8000:]
        calibrated = "calibrating this machine's GPU once" in done.stderr
        assert calibrated == (name == "first"), done.stderr[-4000:]
    profiles = sorted(path.name for path in cache.glob("hardware-*.yaml"))
    assert len(profiles) == 1 and profiles[0].endswith("-cuda.yaml"), profiles  # no CPU calibration
    predicted = json.loads((tmp_path / "runs" / "second" / "prediction.json").read_text())
    assert predicted["hardware_file"] == str(cache / profiles[0])
    assert predicted["hardware"] != "cpu" and "terms" in predicted
    assert "predicted (" in done.stdout


def test_nccl_refuses_more_ranks_than_gpus_in_one_line(tmp_path):
    gpus = torch.cuda.device_count()  # through NVML (conftest): CUDA stays untouched here
    done, _ = _paraloom_train(tmp_path, "--nproc", str(gpus + 1), "--set", "run.device=cuda",
                              "--set", "comm.backend=nccl", "--set", "optim.max_steps=2")
    assert done.returncode == 2
    assert f"NCCL needs a GPU per rank: {gpus + 1} ranks on this node share {gpus}" in done.stderr


def _steady_steps_without_sync(rank, world, options):
    """Steps 4 to 6 of the engine under CUDA's sync debug mode "error": any wait of the host for the
    device (`.item()`, a data-sized op, a blocking copy) raises instead of stalling silently."""
    from paraloom.data_parallel import DataParallel
    from paraloom.train.loss_eval import batch_loss

    device = torch.device("cuda", torch.cuda.current_device())
    split, model, optimizer = setup("cnn", "sgd")
    model.to(device)
    x, y = split.x_train.to(device), split.y_train.to(device)
    engine = DataParallel(model, bucket_mb=0.01, first_bucket_mb=0.01, **options)
    for i, (idx, count) in enumerate(steps(400, rank, world, count=6)):
        xb, yb = x[idx.to(device)], y[idx.to(device)]
        torch.cuda.set_sync_debug_mode("error" if i >= 3 else "default")
        try:
            loss, _ = batch_loss(engine, xb, yb, scale=world / count)
            loss.backward()
            engine.step(optimizer)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    engine.finish()
    engine.close()
    return True


SYNC_FREE = {**ENGINES, "one_step_delay": {"sync": "one_step_delay"},
             **{c: {"compressor": c} for c in ("fp16", "bf16", "qsgd", "onebit", "efsign", "topk", "randomk",
                                               "dgc", "powersgd")}}


@pytest.mark.parametrize("case", list(SYNC_FREE))
def test_steady_steps_never_wait_for_the_gpu(case):
    """Without the non-finite guard a step reads nothing back from the GPU (the guard's one read is
    counted by tests/data_parallel/test_host_reads.py)."""
    assert run_workers(_steady_steps_without_sync, 1, SYNC_FREE[case], backend="nccl", timeout=180) == [True]
