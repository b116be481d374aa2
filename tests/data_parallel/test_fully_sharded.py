"""Fully sharded data parallelism (parallel.shard gradients / full / hybrid) on torch's fully_shard.

Units are found as the config asks (pure tests); the zoo's GPT trains through the one loop at dp 2,
3 (uneven shards) and 4, hybrid and gradients, with accumulation and clipping, to one process's
losses and parameters; what a rank holds shrinks with the level; mistakes are refused in one line.
(A model defined in a test module, not an nn.Sequential, is tested in tests/train/test_user_code.py.)
"""

import json
import shutil

import pytest
import torch
from distributed import run_workers
from torch import nn
from torch.testing import assert_close

from paraloom.config import load_config
from paraloom.config.errors import UserError
from paraloom.data_parallel.fully_sharded import find_units
from paraloom.models import build_model
from paraloom.train import train

GPT = ["model.name=gpt", "data.name=text", "data.seq_len=16", "data.text_bytes=20000", "model.d_model=32",
       "model.n_heads=4", "model.n_layers=3", "data.batch_size=12", "optim.max_steps=4", "optim.name=adamw",
       "optim.lr=0.01", "optim.accumulate=2", "optim.clip_norm=0.5", "run.checkpoint_every=0",
       "run.save_model=true", "run.log_every=1",
       # the key bias's gradient is zero up to rounding (softmax ignores a shift); Adam's default eps
       # of 1e-8 would turn that noise, which differs with the order of sums, into updates of order lr
       "optim.options.eps=1e-6"]
TOL = {"rtol": 2e-4, "atol": 2e-5}  # sums in another order (shards, micro-batches), 4 AdamW steps

torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # import torch._dynamo once, before forking


# ---- units (no process group)

class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


class Tied(nn.Module):
    """Not an nn.Sequential; its first and last layers share one weight."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(Pair() for _ in range(3))
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def test_units_are_the_zoos_blocks_a_users_repeated_layers_or_what_the_config_names():
    gpt = build_model("gpt", (8,), 16, n_layers=3, d_model=8, n_heads=2)
    assert [name for name, _ in find_units(gpt)] == ["1", "2", "3"]  # the blocks, not embedding or head
    resnet = build_model("resnet18", (1, 8, 8), 10, width=4)
    assert len(find_units(resnet)) == 8  # its residual blocks
    tied = Tied()
    assert [name for name, _ in find_units(tied)] == ["layers.0", "layers.1", "layers.2"]
    assert [name for name, _ in find_units(tied, "Pair")] == ["layers.0", "layers.1", "layers.2"]
    assert [name for name, _ in find_units(tied, "layers.1.*")] == ["layers.1.a", "layers.1.b"]
    # the tied embedding and output layer are never units: the root holds the one shared weight
    assert [name for name, _ in find_units(tied, "embed,out,layers.0")] == ["layers.0"]
    by_size = [name for name, _ in find_units(tied, "size:0.00005")]  # 52 bytes: each Linear (80)
    assert by_size == [f"layers.{i}.{x}" for i in range(3) for x in "ab"]
    with pytest.raises(UserError, match="'blocks' matches no module of the model; its module classes: "
                                        "Embedding, Linear, ModuleList, Pair"):
        find_units(tied, "blocks")
    with pytest.raises(UserError, match="give a positive size in MB"):
        find_units(tied, "size:big")


def test_sharding_settings_that_cannot_run_are_refused_in_one_line():
    cases = {
        ("parallel.shard=full", "parallel.mode=layers"): "takes parallel.mode=dp, not layers",
        ("parallel.shard=full", "parallel.microbatches=4"): "pipeline settings only with parallel.pp > 1",
        ("parallel.shard=full", "parallel.mode=ps"): "takes parallel.mode=dp, not ps",
        ("parallel.shard=full", "parallel.shard_group=2"): "takes parallel.shard=hybrid, not full",
        ("parallel.shard=full", "comm.shard_optimizer=true"): "already shards the optimizer state",
        ("parallel.shard=full", "comm.scheduler=priority"): "does not use comm.scheduler=priority",
        ("parallel.shard=full", "comm.compressor=topk"): "does not use comm.compressor=topk",
        ("parallel.shard=zero3",): "parallel.shard",
        ("parallel.shard_units=Block",): "does not use parallel.shard_units=Block",
        ("parallel.shard_accumulate=sharded",): "does not use parallel.shard_accumulate=sharded",
        ("parallel.shard=full", "parallel.shard_accumulate=whole"): "parallel.shard_accumulate",
    }
    for settings, message in cases.items():
        with pytest.raises(UserError, match=message):
            load_config(None, list(settings))
    pipelined = load_config(None, ["parallel.shard=full", "parallel.pp=2", "parallel.microbatches=4"])
    assert pipelined.strategy == "fully_sharded"
    assert load_config(None, ["comm.shard_optimizer=true"]).parallel.shard == "optimizer"
    assert load_config(None, ["parallel.shard=optimizer"]).comm.shard_optimizer


# ---- the GPT through the loop, against one process

def _train(rank, world, overrides, run_dir):
    cfg = load_config(None, GPT + list(overrides))
    cfg.validate_world(world)
    return train(cfg, run_dir if rank == 0 else None, device=torch.device("cpu"))


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one")
    run_workers(_train, 1, [], run_dir, timeout=120)
    return _losses(run_dir), torch.load(run_dir / "model.pt", weights_only=True)


LEVELS = {  # name: (ranks, settings)
    "full_dp2": (2, ["parallel.shard=full"]),
    "full_dp3_uneven": (3, ["parallel.shard=full", "parallel.reshard_after_forward=false"]),
    "full_dp4": (4, ["parallel.shard=full", "parallel.shard_prefetch=2"]),
    "hybrid_2x2": (4, ["parallel.shard=hybrid", "parallel.shard_group=2"]),
    "gradients_dp2": (2, ["parallel.shard=gradients"]),
    # each micro-batch reduce-scatters into the shards (parallel.shard_accumulate=sharded)
    "full_dp2_sum_sharded": (2, ["parallel.shard=full", "parallel.shard_accumulate=sharded"]),
    # 2-D: each tp rank's slices (the GPT's TP_PLAN) sharded over its 2 data-parallel ranks
    "full_dp2_tp2": (4, ["parallel.shard=full", "parallel.tp=2"]),
    # x pipeline: each stage sharded over its 2 data-parallel ranks, gathered once a step (1F1B over 3
    # micro-batches of each accumulation run)
    "full_dp2_pp2": (4, ["parallel.shard=full", "parallel.pp=2", "parallel.microbatches=3"]),
}


@pytest.mark.parametrize("name", list(LEVELS))
def test_the_gpt_trains_fully_sharded_as_one_process_does(name, one_process, tmp_path):
    losses, params = one_process
    world, settings = LEVELS[name]
    summaries = run_workers(_train, world, settings, tmp_path, timeout=120)
    assert_close(_losses(tmp_path), losses, **TOL)
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert saved.keys() == params.keys()
    for key, value in params.items():
        assert_close(saved[key], value, **TOL, msg=lambda m, key=key: f"{key}: {m}")
    whole = sum(v.numel() * 4 for v in params.values())
    if "parallel.tp=2" in settings:  # a 2 x 2 mesh of data-parallel shards and tp slices
        shard = summaries[0]["shard"]
        assert shard["mesh"] == [2, 2]
        for held in shard["held_mb_per_rank"]:  # a quarter, and what tp replicates (norms, biases) twice
            assert whole / 4 < held["params"] * 2**20 < whole * 0.3, held
        return
    sent = summaries[0]["comm_bytes_per_step"]
    if "parallel.pp=2" in settings:  # rank 0 holds half of the first stage's pieces
        shard = summaries[0]["shard"]
        assert shard["mesh"] == [2, 2]
        stage = shard["held_mb_per_rank"][0]["params"] * 2**20 * 2
        assert whole / 4 < stage < whole * 3 / 4
        # each unit gathered once a step (a half stage) and reduce-scattered once, not per micro-batch (6
        # a step; the root's embeddings were seen gathered once more: bounded, not pinned)
        assert stage * 1.5 * 0.99 < sent < stage * 2
        return
    # counted one collective at a time: per step, each gather takes a shard and each reduce-scatter a
    # whole gradient (the units' and the root's), in fp32; resharded after forward, a unit is gathered
    # in forward and backward of both micro-batches; kept, at least in each forward (the root was seen
    # gathered once more: bounded, not pinned); summed sharded, both micro-batches reduce-scatter
    group = 2 if name.startswith("hybrid") else world
    whole = sum(v.numel() * 4 for v in params.values())
    reduced = whole * (2 if "shard_accumulate=sharded" in settings[-1] else 1)
    sent = summaries[0]["comm_bytes_per_step"]
    if "reshard_after_forward=false" in " ".join(settings) or name.startswith("gradients"):
        assert 2 * whole / group + reduced <= sent < 4 * whole / group + reduced
    else:
        assert sent == pytest.approx(4 * whole / group + reduced, rel=0.05)
    shard = summaries[0]["shard"]
    assert shard["units"]["count"] == 3 and shard["units"]["names"] == ["1", "2", "3"]
    group = 2 if name.startswith("hybrid") else world
    whole = sum(v.numel() * 4 for v in params.values())
    for held in shard["held_mb_per_rank"]:  # parameters, gradients and AdamW's two moments, sharded
        for kind, copies in (("params", 1), ("grads", 1), ("optimizer", 2)):
            assert held[kind] * 2**20 == pytest.approx(copies * whole / group, rel=0.1), (kind, held)


def test_hybrid_tp_slices_shard_in_groups_and_replicate_across_as_one_process_trains(tmp_path):
    """hybrid x tp2 on 8 ranks: a 2 (replicas) x 2 (shards) x 2 (tp) mesh; a batch of 16, which the 4
    data-parallel ranks' 2 micro-batches split evenly (tensor parallelism's rule)."""
    batch = ["data.batch_size=16"]
    one, run = tmp_path / "one", tmp_path / "run"
    one.mkdir(), run.mkdir()
    run_workers(_train, 1, batch, one, timeout=120)
    summaries = run_workers(_train, 8, [*batch, "parallel.shard=hybrid", "parallel.shard_group=2",
                                        "parallel.tp=2"], run, timeout=180)
    assert summaries[0]["shard"]["mesh"] == [2, 2, 2]
    assert_close(_losses(run), _losses(one), **TOL)
    expected, saved = (torch.load(d / "model.pt", weights_only=True) for d in (one, run))
    for key, value in expected.items():
        assert_close(saved[key], value, **TOL, msg=lambda m, key=key: f"{key}: {m}")


# ---- checkpoints: DCP reshards; a data-parallel run reads the shards whole, and the reverse

def _resume_from(straight, step, out):
    """A run directory holding only `straight`'s checkpoint of `step`: the steps after it are redone."""
    from paraloom.train.checkpoint.store import step_dir

    out.mkdir()
    shutil.copytree(step_dir(straight, step), step_dir(out, step))
    return out


CHECKPOINTED = ["optim.max_steps=6", "run.checkpoint_every=3"]
PIPELINED = ["parallel.pp=2", "parallel.microbatches=3"]


@pytest.mark.parametrize("saved, resumed", [
    ((4, ["parallel.shard=full"]), (2, ["parallel.shard=full"])),
    ((4, ["parallel.shard=full"]), (2, [])),  # full -> none: the shards read whole
    ((2, []), (3, ["parallel.shard=full"])),  # none -> full: whole tensors sharded, unevenly
    # the tp slices' shards read back over 1 data-parallel rank instead of 2
    ((4, ["parallel.shard=full", "parallel.tp=2"]), (2, ["parallel.shard=full", "parallel.tp=2"])),
    # each pipeline stage's shards likewise
    ((4, ["parallel.shard=full", *PIPELINED]), (2, ["parallel.shard=full", *PIPELINED])),
], ids=["full_dp4_to_full_dp2", "full_dp4_to_none_dp2", "none_dp2_to_full_dp3", "full_dp2tp2_to_full_dp1tp2",
        "full_dp2pp2_to_full_dp1pp2"])
def test_a_checkpoint_goes_on_at_another_size_and_level_as_the_straight_run_would(saved, resumed, tmp_path):
    (saved_world, saved_settings), (world, settings) = saved, resumed
    straight = tmp_path / "straight"
    straight.mkdir()
    run_workers(_train, saved_world, [*CHECKPOINTED, *saved_settings], straight, timeout=120)
    expected = torch.load(straight / "model.pt", weights_only=True)
    run_dir = _resume_from(straight, 3, tmp_path / "resumed")
    summaries = run_workers(_train, world, [*CHECKPOINTED, *settings], run_dir, timeout=120)
    assert summaries[0]["steps"] == 6
    assert _losses(run_dir)[-3:] == pytest.approx(_losses(straight)[-3:], rel=2e-4)
    got = torch.load(run_dir / "model.pt", weights_only=True)
    for key, value in expected.items():
        assert_close(got[key], value, **TOL, msg=lambda m, key=key: f"{key}: {m}")


def test_a_sharded_pipeline_checkpoint_resumes_only_at_its_tp_and_pp_said_in_one_line(tmp_path):
    straight = tmp_path / "straight"
    straight.mkdir()
    run_workers(_train, 2, [*CHECKPOINTED, "parallel.shard=full", *PIPELINED, "optim.max_steps=3"], straight,
                timeout=120)
    run_dir = _resume_from(straight, 3, tmp_path / "resumed")
    said = "saved at parallel.tp=1 and parallel.pp=2, this run has tp=1 and pp=1"
    with pytest.raises(AssertionError, match=said):
        run_workers(_train, 2, [*CHECKPOINTED, "parallel.shard=full"], run_dir, timeout=120)


def test_a_sharded_optimizer_checkpoint_is_refused_by_a_fully_sharded_run_in_one_line(tmp_path):
    straight = tmp_path / "straight"
    straight.mkdir()
    run_workers(_train, 2, [*CHECKPOINTED, "parallel.shard=optimizer", "optim.max_steps=3"], straight,
                timeout=120)
    run_dir = _resume_from(straight, 3, tmp_path / "resumed")
    with pytest.raises(AssertionError, match="whose updater keeps state of its own"):
        run_workers(_train, 2, [*CHECKPOINTED, "parallel.shard=full"], run_dir, timeout=120)


def test_bf16_computes_in_gathered_bf16_units_and_keeps_fp32_shards(tmp_path):
    """FSDP's mixed precision, not autocast: the losses follow an autocast bf16 data-parallel run's
    to bf16's precision, and the saved weights are the fp32 shards, gathered."""
    bf16 = ["run.precision=bf16", "optim.max_steps=3"]
    runs = {}
    full = ["parallel.shard=full", "parallel.shard_reduce_dtype=bf16"]
    for name, settings in (("none", []), ("full", full)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        run_workers(_train, 2, [*bf16, *settings], run_dir, timeout=120)
        runs[name] = run_dir
    assert _losses(runs["full"]) == pytest.approx(_losses(runs["none"]), rel=2e-3)
    saved = torch.load(runs["full"] / "model.pt", weights_only=True)
    assert all(value.dtype == torch.float32 for value in saved.values())
