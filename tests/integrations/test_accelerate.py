"""Accelerate with paraloom, 2 CPU processes: examples/accelerate_comm_hook.py under `accelerate launch`
trains and compresses; a `paraloom.DataParallel` goes through Accelerate's own checkpoint calls."""

import importlib
import os
import re
import socket
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("accelerate", reason="needs accelerate: pip install paraloom[accelerate]")

from distributed import run_workers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from scripts import ROOT, run_command  # noqa: E402

import paraloom  # noqa: E402

EXAMPLE = ROOT / "examples" / "accelerate_comm_hook.py"
RESULT = re.compile(r"(\w+): 2 processes, (\d+) updates, loss ([\d.]+) -> ([\d.]+), "
                    r"sent (\d+) bytes \(fp32 gradients: (\d+)\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["powersgd", "engine"])
def test_accelerate_example_trains_and_compresses(tmp_path, mode):
    # HF_HOME: no accelerate config of this machine's user may change the launch
    env = {**os.environ, "HF_HOME": str(tmp_path), "GLOO_SOCKET_IFNAME": "lo"}
    proc = run_command([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                        "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                        "--dynamo_backend", "no",
                        "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
                        str(EXAMPLE), mode], timeout=90, env=env)
    found = RESULT.search(proc.stdout)
    assert found, proc.stdout + proc.stderr[-3000:]
    name, updates, first, last, sent, fp32 = found.groups()
    assert name == mode and int(updates) > 30
    assert float(last) < 0.7 * float(first)
    # PowerSGD at rank 2 after 2 plain steps (the hook), or after 10 (the engine's default start)
    assert 0 < int(sent) < 0.5 * int(fp32)


# ---- a paraloom.DataParallel through Accelerate's own checkpoint calls (paraloom.integrations.accelerate)

def _as_launched(rank: int, world: int) -> None:
    """The environment `accelerate launch` / torchrun give each process (the group is already up)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += 1
        return self.body(x)


def _trained(accelerator, scheduler: str):
    """A wrapped Net, its optimizer and data prepared through `prepare`, after 3 steps."""
    from paraloom.integrations.accelerate import prepare

    torch.manual_seed(0)
    engine = paraloom.DataParallel(Net().to(accelerator.device), scheduler=scheduler)
    sgd = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
    optimizer = paraloom.DistributedOptimizer(sgd, engine)
    data = DataLoader(TensorDataset(torch.randn(24, 8), torch.randint(0, 4, (24,))), batch_size=4)
    prepared, optimizer, data = prepare(accelerator, engine, optimizer, data)
    assert prepared is engine  # not wrapped again in DDP
    for _, (x, y) in zip(range(3), data, strict=False):
        accelerator.backward(F.cross_entropy(engine(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return engine


def _round_trip(rank, world, directory: str):
    from accelerate import Accelerator

    _as_launched(rank, world)
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == world
    # priority: the last step's update is deferred until the next forward; the save lands it
    engine = _trained(accelerator, "priority")
    accelerator.save_state(directory)
    accelerator.wait_for_everyone()  # rank 0 writes
    saved = {key: value.clone() for key, value in engine.state_dict().items()}
    with torch.no_grad():
        for value in engine.state_dict().values():
            value.zero_()
    accelerator.load_state(directory)
    restored = engine.state_dict()
    accelerator.save_model(engine, f"{directory}/model")
    accelerator.wait_for_everyone()
    written = load_file(f"{directory}/model/model.safetensors")
    return {"saved": saved, "restored": restored, "written": written, "bare": engine.module.state_dict(),
            "unwrapped": accelerator.unwrap_model(engine) is engine.module,
            "state_dict": list(accelerator.get_state_dict(engine))}


def test_save_state_and_load_state_hold_a_wrapped_model(tmp_path):
    for result in run_workers(_round_trip, 2, str(tmp_path)):
        # saved under the engine's own keys (DDP's `module.` prefix), the last update landed
        assert set(result["saved"]) == {f"module.{key}" for key in result["bare"]}
        assert any(value.abs().sum() > 0 for value in result["saved"].values())
        for key, value in result["saved"].items():
            torch.testing.assert_close(result["restored"][key], value, msg=lambda m, key=key: f"{key}: {m}")
        # save_model, unwrap_model and get_state_dict see the bare module, as through DDP
        assert result["unwrapped"]
        assert sorted(result["written"]) == sorted(result["bare"]) == sorted(result["state_dict"])
        for key, value in result["bare"].items():
            torch.testing.assert_close(result["written"][key], value)


def _bf16(rank, world):
    from accelerate import Accelerator

    _as_launched(rank, world)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    engine = _trained(accelerator, "fifo")
    inner = []
    engine.module.body[0].register_forward_hook(lambda module, args, out: inner.append(out.dtype))
    out = engine(torch.randn(2, 8))
    bare = accelerator.unwrap_model(engine, keep_fp32_wrapper=False)
    plain = bare(torch.randn(2, 8))
    return inner, out.dtype, plain.dtype


def test_mixed_precision_reaches_the_wrapped_module():
    for inner, out, plain in run_workers(_bf16, 2):
        # bf16 inside, fp32 out, as Accelerate's DDP path gives; unwrapping without the wrapper: plain fp32
        assert (inner, out, plain) == ([torch.bfloat16, torch.float32], torch.float32, torch.float32)


def _without_cpu_flag(rank, world):
    from accelerate import Accelerator

    from paraloom.integrations.accelerate import prepare

    _as_launched(rank, world)
    accelerator = Accelerator()  # no GPU here: Accelerate sees no distributed setup
    engine = paraloom.DataParallel(Net())
    with pytest.raises(ValueError) as caught:
        prepare(accelerator, engine)
    return str(caught.value)


def test_an_accelerator_without_cpu_on_a_cpu_machine_is_refused():
    for message in run_workers(_without_cpu_flag, 2):
        assert message == ("the Accelerator counts 1 process of the 2 started, so it would not shard the "
                           "data: without GPUs, give Accelerator(cpu=True) (or set ACCELERATE_USE_CPU=1 for "
                           "the launch)")


BASE = {"distributed_type": "MULTI_CPU", "mixed_precision": "no", "dynamo_backend": "NO",
        "model_parallel": False, "num_processes": 2, "world_size": 2}


@pytest.mark.parametrize(("change", "words"), [
    ({}, None),
    ({"mixed_precision": "bf16", "distributed_type": "MULTI_GPU"}, None),
    ({"distributed_type": "DEEPSPEED"}, "Accelerate's DeepSpeed wraps or shards the model itself"),
    ({"distributed_type": "FSDP"}, "Accelerate's FSDP wraps or shards the model itself"),
    ({"model_parallel": True}, "leave parallelism_config out"),
    ({"mixed_precision": "fp8"}, "give mixed_precision='bf16' or 'fp16'"),
    ({"dynamo_backend": "INDUCTOR"}, "dynamo_backend='inductor' compiles the model"),
    ({"num_processes": 4}, "the Accelerator counts 4 processes and torch.distributed 2"),
])
def test_settings_accelerate_applies_itself_are_refused_in_one_line(change, words):
    from paraloom.integrations.accelerate import refusal

    why = refusal(**{**BASE, **change})
    if words is None:
        assert why is None
    else:
        assert words in why and "\n" not in why


def test_without_accelerate_the_import_names_the_extra(monkeypatch):
    from paraloom.integrations import MissingExtra

    monkeypatch.setitem(sys.modules, "accelerate", None)
    monkeypatch.setitem(sys.modules, "accelerate.utils", None)
    monkeypatch.delitem(sys.modules, "paraloom.integrations.accelerate", raising=False)
    missing = r'^accelerate is not installed: pip install "paraloom\[accelerate\]"$'
    with pytest.raises(MissingExtra, match=missing):
        importlib.import_module("paraloom.integrations.accelerate")
