"""The planner prices and emits the sharding levels paraloom trains (parallel.shard): memory per rank
shrinks with the level, the gathers cost what the links say, and a Llama-3-70B-shaped model, which
fits no unsharded plan, gets a fully sharded one whose config validates and, scaled down, trains."""

import pytest
import torch
import yaml
from distributed import run_workers

from paraloom.cli import main
from paraloom.config import Config, load_config
from paraloom.config.errors import UserError
from paraloom.perfmodel.cost.memory import stage_memory
from paraloom.perfmodel.cost.step_time import estimate
from paraloom.perfmodel.hardware import load_hardware
from paraloom.perfmodel.measure.profile import profile_model
from paraloom.perfmodel.plan import Options, Plan
from paraloom.perfmodel.planner import grids, variants
from paraloom.train import train

GPT = "gpt:layers=8,hidden=256,heads=4,seq=64"
LLAMA_70B = "gpt:layers=80,hidden=8192,heads=64,seq=8192,vocab=128256"

torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # import torch._dynamo once, before forking


def _state(kinds):
    return kinds["weights"] + kinds["grads"] + kinds["optimizer"] + kinds["buffers"]


def test_a_rank_holds_its_shards_and_the_units_in_flight():
    profile = profile_model(GPT)
    opts, n = Options(optimizer="adam"), profile.n_params
    unit = max(layer.param_count for layer in profile.layers)
    plain = _state(stage_memory(profile, Plan(dp=4), 0, 8, opts))
    assert plain == pytest.approx(n * (4 + 4 + 8 + 4))  # weights, gradients, Adam, the engine's bucket
    assert _state(stage_memory(profile, Plan(dp=4, shard="optimizer"), 0, 8, opts)) == \
        pytest.approx(n * (4 + 4 + 8 / 4 + 4))
    full = _state(stage_memory(profile, Plan(dp=4, shard="full"), 0, 8, opts, shard_size=4))
    # fp32 shards (parameters 1, Adam 2 a quarter-model's n); forward: three units' parameters in flight
    # (computing, its gather, the prefetched one's); backward: the gradient shards, a unit's parameters,
    # its gradient and the reduce-scatter input; both 4n + 12 units here
    assert full == pytest.approx(n + 2 * n + n * 4 / 4 + unit * 4 * 3)
    gradients = _state(stage_memory(profile, Plan(dp=4, shard="gradients"), 0, 8, opts, shard_size=4))
    # backward's start: every unit gathered, a unit's gradient and its reduce-scatter input
    assert gradients == pytest.approx(n + 2 * n + n * 4 + unit * 4 * 2)
    kept = _state(stage_memory(profile, Plan(dp=4, shard="full"), 0, 8,
                               Options(optimizer="adam", reshard_after_forward=False), shard_size=4))
    assert kept == pytest.approx(gradients)
    # accumulating 2 micro-batches: the whole model's unsharded gradients from the second forward on,
    # or (sum-sharded) only their shards
    summed = _state(stage_memory(profile, Plan(dp=4, microbatches=2, shard="full"), 0, 8, opts, shard_size=4))
    assert summed == pytest.approx(n + 2 * n + n * 4 + unit * 4 * 3)
    sharded = Plan(dp=4, microbatches=2, shard="full", shard_accumulate="sharded")
    assert _state(stage_memory(profile, sharded, 0, 8, opts, shard_size=4)) == pytest.approx(full)
    assert sharded.label() == "dp4 m2 full sum-sharded"
    with pytest.raises(UserError, match="shard_accumulate"):
        Plan(dp=4, shard="full", shard_accumulate="sharded")
    assert full < gradients < plain


def test_the_units_a_run_cuts_its_model_in_set_what_it_holds_in_flight():
    from paraloom.perfmodel.cost.sharding import unit_count
    from paraloom.perfmodel.from_config import predictable
    from paraloom.perfmodel.measure.profile import shard_unit_sizes, with_units

    profile = profile_model(GPT)
    blocks = shard_unit_sizes(GPT)
    halves = shard_unit_sizes(GPT, "Attention,FeedForward")
    block = max(layer.param_count for layer in profile.layers)
    # every parameter in one unit or the root (last), whichever way the model is cut
    assert sum(blocks) == sum(halves) == profile.n_params
    assert blocks[:-1] == (block,) * 8 and len(halves) == 17
    assert max(halves) == 256 * 1024 + 1024 + 1024 * 256 + 256  # a feed-forward: two linears, 4x wide
    # nested units: each takes its own parameters from the block around it
    assert sum(shard_unit_sizes(GPT, "Block,FeedForward")) == profile.n_params

    def held(units):
        opts = Options(optimizer="adam", shard_units=units)
        return _state(stage_memory(profile, Plan(dp=4, shard="full"), 0, 8, opts, shard_size=4))

    # gathered and reduced: the blocks and the root, by either count; a pipeline stage has a root of its own
    assert unit_count(profile, blocks) == unit_count(profile) == 9
    stage = profile.slice(0, 5)  # the embedding and four blocks
    assert unit_count(stage, blocks) == pytest.approx(1 + 8 * stage.n_params / profile.n_params)
    n = profile.n_params
    assert held(()) == held(blocks) == pytest.approx(n * 4 + block * 4 * 3)
    assert held(halves) == pytest.approx(n * 4 + max(halves) * 4 * 3)
    base = ["model.name=gpt", "data.name=text", "data.seq_len=64", "model.d_model=256", "model.n_heads=4",
            "model.n_layers=8"]
    cfg = load_config(None, [*base, "parallel.shard=full", "parallel.shard_units=Attention,FeedForward"])
    units = with_units(predictable(cfg, 4)).options.shard_units
    assert len(units) == 17 and max(units) == max(halves)
    plain = predictable(load_config(None, base), 4)
    assert with_units(plain) is plain and plain.options.shard_units == ()  # not sharded: not built


def test_fully_sharded_steps_pay_three_model_sizes_on_the_link_and_hybrid_keeps_them_in_a_node():
    profile = profile_model(GPT)
    hw = load_hardware("h100-ib-ndr")
    opts = Options(optimizer="adam")
    ddp = estimate(profile, hw, Plan(dp=16), 64, opts)
    full = estimate(profile, hw, Plan(dp=16, shard="full"), 64, opts)
    hybrid = estimate(profile, hw, Plan(dp=16, shard="hybrid", shard_group=8), 64, opts)
    kept = estimate(profile, hw, Plan(dp=16, shard="gradients"), 64, opts)
    # two gathers and a reduce-scatter against the all-reduce's reduce-scatter and gather
    assert full.breakdown["dp_comm_total"] > ddp.breakdown["dp_comm_total"]
    assert kept.breakdown["dp_comm_total"] < full.breakdown["dp_comm_total"]  # one gather, not two
    assert hybrid.breakdown["dp_comm_total"] < full.breakdown["dp_comm_total"]  # gathers over NVLink
    assert full.memory_bytes < hybrid.memory_bytes < ddp.memory_bytes
    assert full.breakdown["update"] == pytest.approx(ddp.breakdown["update"] / 16)
    assert full.plan.label() == "dp16 full" and hybrid.plan.label() == "dp16 hybrid8"


def test_the_planner_offers_every_level_on_whole_replicas_and_fully_sharded_tp_slices():
    profile = profile_model(GPT)
    hw = load_hardware("h100-ib-ndr")
    plans = grids(16, profile, hw, 64)
    levels = {p.shard for p in plans if p.tp == p.pp == 1 and p.dp == 16}
    assert levels == {"none", "optimizer", "gradients", "full", "hybrid"}
    # tp slices shard over their data-parallel ranks (hybrid: a node's 8 devices hold 4 of them at tp2)
    assert {p.shard for p in plans if p.tp == 2 and p.pp == 1 and p.dp == 8} == \
        {"none", "gradients", "full", "hybrid"}
    # pipeline stages shard over their data-parallel ranks too: full (= gradients there; a node's 8
    # devices hold all 8 of a stage's, so no hybrid)
    assert {p.shard for p in plans if p.tp == 1 and p.pp == 2 and p.dp == 8} == {"none", "full"}
    assert variants(Plan(dp=16, shard="full"), exact_only=False) == [Plan(dp=16, shard="full")]
    for split in ({"tp": 2}, {"pp": 2}):
        with pytest.raises(UserError, match="a fully sharded level"):
            Plan(dp=4, shard="optimizer", **split)
    # a tp2 rank gathers and holds half of what a whole replica's rank does
    opts = Options(optimizer="adam")
    whole = stage_memory(profile, Plan(dp=8, shard="full"), 0, 8, opts, shard_size=8)
    split = stage_memory(profile, Plan(dp=8, tp=2, shard="full"), 0, 8, opts, shard_size=8)
    assert _state(split) == pytest.approx(_state(whole) / 2)
    e = estimate(profile, hw, Plan(dp=8, tp=2, shard="full"), 64, opts)
    assert e.plan.label() == "dp8 tp2 full" and e.breakdown["tp_comm"] > 0
    with pytest.raises(UserError, match="plan shard"):
        Plan(dp=4, shard="zero3")


def test_a_70b_model_that_no_unsharded_plan_fits_gets_a_sharded_plan_that_trains_scaled_down(tmp_path):
    out = tmp_path / "70b.yaml"
    assert main(["plan", "--model", LLAMA_70B, "--cluster", "h100-ib-ndr", "--nodes", "8,16",
                 "--global-batch", "512", "--dtype", "bf16", "--recompute", "full", "--exact-only",
                 "--emit", str(out)]) == 0
    cfg = load_config(str(out), [])
    assert cfg.parallel.shard in ("full", "hybrid") and cfg.model.recompute == "full"
    nodes = int(out.read_text().split(" on ", 1)[1].split(" x ", 1)[0])
    cfg.validate_world(nodes * cfg.parallel.nproc)
    # the same config, the model at the same ratios a thousand times thinner (head size 128 kept),
    # on the 2 processes this machine has
    raw = yaml.safe_load(out.read_text())
    raw["model"].update(n_layers=2, d_model=256, n_heads=2)
    raw["data"].update(seq_len=32, batch_size=8, text_bytes=20000)
    raw["parallel"]["nproc"] = 2
    raw["parallel"].pop("shard_group", None)  # hybrid: shards inside a node's 2 ranks then
    raw["optim"] = {**raw.get("optim", {}), "max_steps": 2}
    raw["run"] = {**raw.get("run", {}), "checkpoint_every": 0, "save_model": False}
    small = Config.from_dict(raw)
    summaries = run_workers(_train, 2, small, tmp_path, timeout=120)
    assert summaries[0]["steps"] == 2 and summaries[0]["shard"]["level"] == cfg.parallel.shard


def _train(rank, world, cfg, run_dir):
    cfg.validate_world(world)
    return train(cfg, run_dir if rank == 0 else None, device=torch.device("cpu"))


def test_a_sharded_pipeline_stage_gathers_once_a_step_and_holds_its_stage_gathered():
    """With pp > 1 each stage is sharded over its data-parallel ranks and its units stay gathered through
    the micro-batches: no gather per micro-batch (the links carry the same bytes at m 4 and 8), and a
    rank holds its stage's shards plus the whole stage gathered."""
    profile = profile_model(GPT)
    hw = load_hardware("h100-ib-ndr")
    opts = Options(optimizer="adam")
    few, many = (estimate(profile, hw, Plan(dp=4, pp=2, microbatches=m, shard="full"), 64, opts)
                 for m in (4, 8))
    assert few.plan.label() == "dp4 pp2 m4 1f1b full"
    assert many.breakdown["dp_comm_total"] == pytest.approx(few.breakdown["dp_comm_total"])
    whole = estimate(profile, hw, Plan(dp=4, microbatches=4, shard="full"), 64, opts)
    assert whole.breakdown["dp_comm_total"] > 2 * few.breakdown["dp_comm_total"]  # a stage, gathered 4x
    stage = profile.slice(0, len(profile.layers) // 2)
    held = _state(stage_memory(stage, Plan(dp=4, pp=2, microbatches=4, shard="full"), 0, 8, opts,
                               shard_size=4))
    n, unit = stage.n_params, max(layer.param_count for layer in stage.layers)
    # fp32 shards and Adam's (1 + 2 quarters), and at backward's start the stage gathered, its
    # unsharded gradients accumulating and a unit's gradient
    assert held == pytest.approx(3 * n + n * 4 + n * 4 + unit * 4)
