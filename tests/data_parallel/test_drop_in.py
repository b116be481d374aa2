"""paraloom.DataParallel as a drop-in for torch DDP: ordinary DDP scripts with only the import changed.

The scripts are examples/ddp_classifier.py and examples/ddp_language_model.py. Each is loaded
as it is (torch's DDP) and as a copy whose DDP import line is replaced by paraloom's; the ranks
train both in one process group and the final parameters must agree.
"""

import importlib.util
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers

from paraloom import DataParallel, DistributedOptimizer
from paraloom.config.choices import ALL_REDUCE_ALGORITHMS

ROOT = Path(__file__).resolve().parents[2]
TORCH_IMPORT = "from torch.nn.parallel import DistributedDataParallel as DDP"
PARALOOM_IMPORT = "from paraloom import DataParallel as DDP"
SCRIPTS = ("ddp_classifier", "ddp_language_model")
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # import torch._dynamo once, before forking


def _source(name: str, engine: str) -> str:
    text = (ROOT / "examples" / f"{name}.py").read_text()
    assert text.count(TORCH_IMPORT) == 1
    return text if engine == "torch" else text.replace(TORCH_IMPORT, PARALOOM_IMPORT)


def _load(name: str, engine: str, where: Path):
    """The script as a module: as written (torch) or with its one import changed (paraloom)."""
    path = where / f"{name}_{engine}.py"
    path.write_text(_source(name, engine))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    where = tmp_path_factory.mktemp("ddp_scripts")
    return {(name, engine): _load(name, engine, where)
            for name in SCRIPTS for engine in ("torch", "paraloom")}


# every synchronous scheduler x algorithm of the plain loop; priority and the sharded optimizer
# through DistributedOptimizer
VARIANTS = {f"{s}-{a}": ({"scheduler": s, "algorithm": a}, None)
            for s in ("wait_free", "fifo") for a in ALL_REDUCE_ALGORITHMS}
VARIANTS["priority"] = ({"scheduler": "priority", "partition_mb": 0.01, "credit_mb": 0.02},
                        DistributedOptimizer)
VARIANTS["shard_optimizer"] = ({"shard_optimizer": True}, DistributedOptimizer)
VARIANTS["tiny_buckets"] = ({"bucket_cap_mb": 1e-6}, None)


def _train_all(rank, world, torch_script, paraloom_script, optimizer, accumulate, variants):
    torch.set_num_threads(1)
    kwargs = {"steps": 4, "optimizer": optimizer, "accumulate": accumulate}
    out = {"ddp": torch_script.train(**kwargs)}
    for name in variants:
        options, wrap = VARIANTS[name]
        out[name] = paraloom_script.train(**kwargs, ddp_options=options, wrap_optimizer=wrap)
    return out


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("optimizer, accumulate, variants", [
    ("sgd", 1, list(VARIANTS)),
    ("adamw", 1, ["wait_free-native", "fifo-ring", "priority", "shard_optimizer"]),
    ("sgd", 2, ["wait_free-native", "wait_free-halving_doubling", "priority"]),
    ("adamw", 2, ["wait_free-native", "tiny_buckets"]),
])
def test_only_the_import_changed_trains_like_ddp(scripts, name, optimizer, accumulate, variants):
    results = run_workers(_train_all, 2, scripts[name, "torch"], scripts[name, "paraloom"], optimizer,
                          accumulate, variants, timeout=120)
    for out in results:
        for variant in variants:
            torch.testing.assert_close(out[variant], out["ddp"], msg=lambda m, v=variant: f"{v}: {m}")


def _copies_and_state(rank, world, path):
    torch.manual_seed(0)
    model = DataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                             torch.nn.Linear(8, 2)))
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()  # set_to_none: the gradients are re-bound to the buckets, not copied
        model(torch.randn(6, 4, generator=torch.Generator().manual_seed(step * 10 + rank))).sum().backward()
        opt.step()
    keys = list(model.state_dict())
    ddp.load_state_dict(model.state_dict())  # paraloom's checkpoint in DDP's format loads into DDP
    model.load_state_dict(ddp.state_dict())  # and back
    if rank == 0:
        torch.save(model.module.state_dict(), path)
    dist.barrier()
    loaded = torch.load(path, weights_only=True)  # buffers are each rank's own after the last forward
    same = all(torch.equal(loaded[k], v) for k, v in model.module.state_dict().items()) if rank == 0 else True
    return model.copies, keys, list(ddp.state_dict()), same


def test_no_copies_and_state_dicts_in_ddps_format(tmp_path):
    for copies, keys, ddp_keys, same in run_workers(_copies_and_state, 2, str(tmp_path / "model.pt")):
        assert copies == 0  # optimizer.zero_grad() sets .grad to None every step, yet nothing is copied
        assert keys == ddp_keys and all(k.startswith("module.") for k in keys)
        assert same


def _conv_net() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                              torch.nn.Conv2d(8, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4))
    net = net.to(memory_format=torch.channels_last)
    net[5].weight = torch.nn.Parameter(torch.randn(8 * 6 * 6, 4).t() * 0.05)  # a transposed weight
    return net


def _strided_parameters(rank, world):
    import warnings
    out = {}
    for name, wrap in (("ddp", torch.nn.parallel.DistributedDataParallel), ("paraloom", DataParallel)):
        model = wrap(_conv_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                g = torch.Generator().manual_seed(step * 10 + rank)
                x = torch.randn(4, 3, 8, 8, generator=g).to(memory_format=torch.channels_last)
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
        out[name] = ([p.detach().clone() for p in model.module.parameters()],
                     [(p.grad.stride(), p.stride()) for p in model.module.parameters()],
                     [str(w.message) for w in caught if "layout" in str(w.message)])
    out["copies"] = model.copies
    return out


def test_channels_last_and_transposed_parameters_accumulate_in_their_buckets():
    """Bucket views take a dense parameter's strides (as DDP's do), so a channels_last model's
    gradients land in the bucket without a copy or torch's layout-contract warning."""
    for out in run_workers(_strided_parameters, 2):
        params, strides, layout_warnings = out["paraloom"]
        assert [p.is_contiguous() for p in params].count(False) >= 3  # two convs and the transposed weight
        assert all(g == p for g, p in strides) and not layout_warnings and out["copies"] == 0
        torch.testing.assert_close(params, out["ddp"][0])


def _misuse(rank, world, case):
    torch.manual_seed(rank if case == "different" else 0)
    model = torch.nn.Linear(3, 2)
    try:
        if case == "different":
            DataParallel(model, init_sync=False)
        elif case == "plain_step":
            engine = DataParallel(model, sync="one_step_delay")
            opt = torch.optim.SGD(engine.parameters(), lr=0.1)
            engine(torch.randn(2, 3)).sum().backward()
            opt.step()
        elif case == "refused_argument":
            DataParallel(model, mixed_precision=object())
    except (RuntimeError, ValueError) as exc:
        return str(exc)
    finally:
        dist.barrier()  # no rank leaves (and tears the group down) while another is still joining it
    return "no error"


@pytest.mark.parametrize("case, fix", [
    ("different", "init_sync=True"),
    ("plain_step", "DistributedOptimizer"),
    ("refused_argument", "mixed_precision"),
])
def test_misuse_names_the_fix(case, fix):
    for message in run_workers(_misuse, 2, case):
        assert fix in message, message


def _signature_and_positional(rank, world):
    model = torch.nn.Linear(3, 2)
    engine = DataParallel(model, None, None, 0, True, True, None, 25)  # DDP's positional order
    return engine.module is model, engine.forward_sync_buffers


def test_ddp_positional_arguments_and_signature():
    """DDP's arguments bind in the installed torch's order (positionally or by name); paraloom's own
    are keywords of DataParallel's signature, with the comm.* config's defaults."""
    import inspect

    from paraloom.config import CommConfig
    from paraloom.data_parallel import ddp_args

    ddp = list(inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters)
    assert list(ddp_args.DDP_SIGNATURE.parameters)[1:] == ddp
    ours = inspect.signature(DataParallel).parameters
    kinds = [p.kind for p in ours.values()]
    assert list(ours)[0] == "module" and kinds[1] == inspect.Parameter.VAR_POSITIONAL
    assert kinds[-1] == inspect.Parameter.VAR_KEYWORD
    assert ours["bucket_mb"].default == CommConfig().bucket_mb and ours["scheduler"].default == "wait_free"
    assert not set(ours) & set(ddp[1:])  # no name of DDP's is taken by paraloom's options
    assert run_workers(_signature_and_positional, 2) == [(True, True)] * 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", SCRIPTS)
def test_torchrun_runs_the_changed_script(tmp_path, name):
    script = tmp_path / f"{name}.py"
    script.write_text(_source(name, "paraloom"))
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    proc = subprocess.run([torchrun, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                           "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(script), "--steps", "3",
                           "--save", str(tmp_path / "model.pt")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained 3 steps on 2 ranks" in proc.stdout
    assert torch.load(tmp_path / "model.pt", weights_only=True)


def _uneven(rank, world):
    model = DataParallel(torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2 + rank):  # the last rank has one batch more than the others
        opt.zero_grad()
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
    return "done"


def test_uneven_inputs_are_a_clear_error():
    with pytest.raises(AssertionError, match="same number of batches"):
        run_workers(_uneven, 2, timeout=5)


def _hooked(rank, world, hook_name):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from paraloom.compress import ddp_hook

    out = []
    for wrapper in (torch.nn.parallel.DistributedDataParallel, DataParallel):
        torch.manual_seed(0)
        model = wrapper(torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3)))
        if hook_name == "allreduce":
            state, hook = None, default_hooks.allreduce_hook
        elif hook_name == "fp16":
            state, hook = None, default_hooks.fp16_compress_hook
        else:
            state, hook = ddp_hook(hook_name)
        model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).square().mean().backward()
            opt.step()
        if state is not None:
            state.close()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("hook_name", ["allreduce", "fp16", "bf16"])
def test_ddp_comm_hooks_run_in_the_engine_as_in_ddp(hook_name):
    """torch's default hooks and paraloom's own (`ddp_hook`), registered as on DDP, give DDP's result."""
    for ddp, ours in run_workers(_hooked, 2, hook_name):
        torch.testing.assert_close(ours, ddp)


def test_ddp_arguments_without_a_process_group():
    """device_ids must name the module's device; DDP's aliases cannot be given twice."""
    from paraloom.data_parallel import ddp_args

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="move the module to that device first"):
        ddp_args.resolve(ddp_args.bind(model, (), {"device_ids": [0]}))
    with pytest.raises(ValueError, match="not both"):
        ddp_args.resolve(ddp_args.bind(model, (), {"bucket_cap_mb": 5}), bucket_mb=3)
    resolved = ddp_args.resolve(ddp_args.bind(model, (), {"broadcast_buffers": False}))
    assert not resolved["forward_sync_buffers"] and not resolved["init_sync_buffers"]
    assert ddp_args.resolve(ddp_args.bind(model, (), {"device_ids": ["cpu"]}))["device_ids"] == ["cpu"]
    with pytest.raises(TypeError, match="no_such_argument"):  # as torch refuses it
        ddp_args.bind(model, (), {"no_such_argument": 1})


def _dcp_between(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def trained(wrapper, seed):
        torch.manual_seed(seed)
        model = wrapper(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2)))
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))).sum().backward()
        opt.step()
        opt.zero_grad()
        return model, opt

    ddp, ddp_opt = trained(torch.nn.parallel.DistributedDataParallel, 0)
    model_sd, optim_sd = get_state_dict(ddp, ddp_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    ours, opt = trained(DataParallel, 1)
    model_sd, optim_sd = get_state_dict(ours.module, opt)  # the wrapped module: DDP's keys
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(ours.module, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return ([torch.equal(a, b) for a, b in zip(ours.parameters(), ddp.parameters(), strict=True)],
            opt.state_dict()["state"][0]["step"].item())


def test_a_ddp_distributed_checkpoint_loads_through_the_wrapped_module(tmp_path):
    """torch.distributed.checkpoint's state-dict helpers drop DDP's `module.` prefix by its class;
    given `model.module`, paraloom's keys are the same, and a DDP-written checkpoint loads."""
    for equal, step in run_workers(_dcp_between, 2, str(tmp_path / "dcp")):
        assert all(equal) and step == 1


def _attributes(rank, world):
    out = []
    for wrapper in (torch.nn.parallel.DistributedDataParallel, DataParallel):
        torch.manual_seed(0)
        model = wrapper(torch.nn.Linear(3, 2), broadcast_buffers=False, find_unused_parameters=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = [model.process_group is dist.group.WORLD,
                model.broadcast_buffers, model.find_unused_parameters]
        for step in range(4):  # accumulate two micro-batches by DDP's attribute, as some libraries do
            model.require_backward_grad_sync = step % 2 == 1
            x = torch.randn(2, 3, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).square().sum().backward()
            seen.append(model.require_backward_grad_sync)
            if step % 2:
                opt.step()
                opt.zero_grad()
        out.append((seen, [p.detach().clone() for p in model.parameters()]))
    return out


def test_ddps_attributes_read_and_set_as_on_ddp():
    """process_group, broadcast_buffers, find_unused_parameters read as on DDP; require_backward_grad_sync
    set to False accumulates locally, as DDP's no_sync() does by it."""
    for (ddp_seen, ddp_params), (seen, params) in run_workers(_attributes, 2):
        assert seen == ddp_seen == [True, False, True, False, True, False, True]
        torch.testing.assert_close(params, ddp_params)
