"""The planner: only valid plans, memory limits kept, a recommendation, JSON, plot and a runnable config."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from paraloom.cli import main
from paraloom.config import load_config
from paraloom.config.choices import MODELLED_ALGORITHMS
from paraloom.config.errors import UserError
from paraloom.perfmodel.cost.step_time import estimate
from paraloom.perfmodel.hardware import load_hardware
from paraloom.perfmodel.measure.profile import profile_model
from paraloom.perfmodel.plan import Plan
from paraloom.perfmodel.planner import grids, is_exact, parse_nodes, parse_plan, rank, tp_sizes, variants

GPT = "gpt:layers=4,hidden=64,heads=4,seq=32"
GPT_175B = "gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200"


@pytest.mark.parametrize("spec,preset,nodes,batch", [
    (GPT, "a100-hdr", 2, 64), ("gpt:layers=6,hidden=96,heads=6,seq=16", "v100-25gbe", 3, 48),
    ("mlp:hidden=256", "h100-ib-ndr", 1, 32), ("resnet18", "v100-10gbe", 2, 96)])
def test_plans_respect_divisibility_and_memory(spec, preset, nodes, batch):
    profile, hw = profile_model(spec), load_hardware(preset)
    world = nodes * hw.devices_per_node
    ranked = rank(profile, hw, nodes, batch)
    assert ranked.estimates
    sizes = tp_sizes(spec)
    for e in ranked.estimates:
        p = e.plan
        assert p.dp * p.tp * p.pp == world
        assert batch % (p.dp * p.microbatches) == 0
        assert all(s % p.tp == 0 for s in sizes) and (p.tp == 1 or sizes)
        assert p.pp <= len(profile.layers) and (p.pp == 1 or p.microbatches >= p.pp)
        assert e.fits and e.memory_bytes <= hw.device.mem_capacity
    speeds = [e.samples_per_s for e in ranked.estimates]
    assert all(b <= a * 1.001 for a, b in zip(speeds, speeds[1:], strict=False)), speeds  # fastest first


def test_plans_that_do_not_fit_are_dropped():
    profile, hw = profile_model(GPT_175B, dtype="bf16", recompute="full"), load_hardware("h100-ib-ndr")
    ranked = rank(profile, hw, 8, 1536)  # 64 GPUs: only deep model parallelism fits 175B, or sharding
    assert ranked.dropped > 0
    assert all(e.plan.tp * e.plan.pp >= 32 for e in ranked.estimates if e.plan.shard == "none")
    # fully sharded tp slices fit with less model parallelism, accumulating into the shards
    shallow = [e.plan for e in ranked.estimates if e.plan.tp * e.plan.pp < 32]
    assert shallow and all(p.shard == "full" and p.shard_accumulate == "sharded" for p in shallow)


def test_plan_175b_on_64_to_1024_h100_answers_in_under_30_s(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # a table's rows on one line each
    out = tmp_path / "plan.json"
    start = time.perf_counter()
    code = main(["plan", "--model", GPT_175B, "--cluster", "h100-ib-ndr", "--nodes", "8..128",
                 "--global-batch", "1536", "--dtype", "bf16", "--recompute", "full", "--json", str(out),
                 "--plot", str(tmp_path / "plan.png")])
    elapsed = time.perf_counter() - start
    assert code == 0 and elapsed < 30, elapsed
    report = json.loads(out.read_text())
    assert [b["nodes"] for b in report["by_nodes"]] == [8, 16, 32, 64, 128]
    rec = report["recommended"]
    assert rec["nodes"] in (8, 16, 32, 64, 128) and rec["plan"]["samples_per_s"] > 0
    for entry in report["by_nodes"]:
        for p in entry["plans"]:
            assert {"step_s", "samples_per_s", "memory_bytes", "label"} <= set(p)
    assert (tmp_path / "plan.png").stat().st_size > 10_000
    said = " ".join(capsys.readouterr().out.split())
    assert "recommended:" in said and "the best plan at each node count" in said
    for entry in report["by_nodes"]:  # the curve: each count's best exact plan and its efficiency, a row
        best = next(p for p in entry["plans"] if is_exact(Plan(**p["plan"])))
        figures = (f"{best['step_s'] * 1e3:,.1f}", f"{best['samples_per_s']:,.1f}",
                   f"{entry['efficiency']:.2f}")
        row = " │ ".join((best["label"], *figures))
        assert row in said, row


def test_one_given_plan_is_predicted(tmp_path):
    out = tmp_path / "one.json"
    assert main(["plan", "--model", GPT, "--cluster", "a100-hdr", "--nodes", "1", "--global-batch", "64",
                 "--plan", "dp=2,tp=2,pp=2,microbatches=4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    est = report["estimate"]
    assert est["plan"]["tp"] == 2 and est["label"] == "dp2 tp2 pp2 m4 1f1b wait_free"
    # scaling efficiency against one device, and the model and the step's phases in the JSON
    one = report["one_device"]
    efficiency = est["samples_per_s"] / 8 / one["samples_per_s"]
    assert report["efficiency_vs_one_device"] == pytest.approx(efficiency)
    assert 0 < report["efficiency_vs_one_device"] <= 1.0
    model = report["profile"]
    assert model["parameters"] == profile_model(GPT).n_params
    assert model["flops_per_step"] == pytest.approx(model["forward_flops_per_step"]
                                                    + model["backward_flops_per_step"])
    assert model["backward_flops_per_step"] == pytest.approx(2 * model["forward_flops_per_step"], rel=0.3)
    assert set(est["phases"]) == {"forward", "backward", "update"}
    assert all(v > 0 for v in est["phases"].values())


def test_bad_input_is_one_line_and_exit_2(capsys):
    for args in (["--nodes", "0..4"], ["--plan", "dp=2,zz=1"], ["--model", "nonesuch"],
                 ["--cluster", "tpu-v9"], ["--global-batch", "0"], ["--model", "gpt:layers=1000000"],
                 ["--model", "mlp:depth=100000"]):
        base = {"--model": GPT, "--cluster": "a100-hdr", "--nodes": "1"}
        base.update(dict(zip(args[::2], args[1::2], strict=True)))
        argv = ["plan", *[x for kv in base.items() for x in kv]]
        if "--global-batch" not in base:
            argv += ["--global-batch", "64"]
        assert main(argv) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith("paraloom: error:") and "\n" not in err, err


def test_parsers():
    assert parse_nodes("1..64") == [1, 2, 4, 8, 16, 32, 64] and parse_nodes("3..12") == [3, 6, 12]
    assert parse_nodes("4,2,2") == [2, 4]
    with pytest.raises(UserError):
        parse_nodes("eight")
    assert parse_plan("dp=2,scheduler=fifo").scheduler == "fifo"
    assert grids(1, profile_model("mlp"), load_hardware("a100-hdr"), 1)[0].dp == 1


def test_a_plan_for_a_user_model_emits_its_factories_and_precision(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # own_code.py
    config = tmp_path / "best.yaml"
    assert main(["plan", "--model", "own_code:make_model:width=32", "--data", "own_code:make_data:n=12",
                 "--cluster", "a100-hdr", "--nodes", "1", "--global-batch", "8", "--dtype", "bf16",
                 "--exact-only", "--emit", str(config)]) == 0
    cfg = load_config(str(config), [])
    assert cfg.run.precision == "bf16"
    assert (cfg.model.name, cfg.model.options) == ("own_code:make_model", {"width": 32})
    assert (cfg.data.name, cfg.data.options, cfg.data.batch_size) == ("own_code:make_data", {"n": 12}, 8)
    assert main(["plan", "--model", "own_code:make_model", "--cluster", "a100-hdr", "--nodes", "1",
                 "--emit", str(config)]) == 2  # a bare nn.Module needs --data for its example input


def test_a_train_config_is_planned_as_its_flags_would_be_and_emitted_with_its_recipe(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"precision": "bf16", "seed": 3},
        "model": {"name": "gpt", "n_layers": 4, "d_model": 64, "n_heads": 4, "recompute": "selective"},
        "data": {"name": "text", "seq_len": 32, "batch_size": 48},
        "optim": {"name": "sgd", "momentum": 0.0, "lr": 0.05, "clip_norm": 1.0},
        "comm": {"compressor": "fp16"}}))
    spec = "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=256"
    common = ["--cluster", "h100-ib-ndr", "--nodes", "1..2"]
    by_config, by_flags = tmp_path / "config.json", tmp_path / "flags.json"
    assert main(["plan", str(config), *common, "--json", str(by_config)]) == 0
    assert main(["plan", "--model", spec, "--global-batch", "48", "--dtype", "bf16", "--recompute",
                 "selective", "--optimizer", "sgd", *common, "--json", str(by_flags)]) == 0
    assert json.loads(by_config.read_text()) == json.loads(by_flags.read_text())
    # an option wins over the config; --emit keeps what the config says beside the plan's choices
    emitted = tmp_path / "planned.yaml"
    assert main(["plan", str(config), "--set", "optim.lr=0.02", "--global-batch", "64", *common,
                 "--plan", "tp=2", "--emit", str(emitted)]) == 0
    cfg = load_config(str(emitted), [])
    assert cfg.comm.compressor == "none"  # the plan's choice, as it was priced, and said
    assert "# note: comm.compressor=fp16 replaced by the plan's none" in emitted.read_text()
    assert (cfg.parallel.tp, cfg.data.batch_size, cfg.run.precision, cfg.run.seed) == (2, 64, "bf16", 3)
    cfg.validate_world(cfg.parallel.nproc)
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.clip_norm, cfg.model.recompute) == ("sgd", 0.02, 1.0,
                                                                                          "selective")
    ps = tmp_path / "ps.yaml"  # a plan whose strategy has no use for a key the config set leaves it out
    assert main(["plan", str(config), *common, "--plan", "dp=4,servers=2", "--emit", str(ps)]) == 0
    assert "# note: parallel.mode" not in ps.read_text()  # the config left it to its default
    sync = tmp_path / "sync.yaml"
    config.write_text(config.read_text().replace("compressor: fp16", "sync: one_step_delay"))
    assert main(["plan", str(config), *common, "--plan", "dp=4,servers=2", "--emit", str(sync)]) == 0
    assert "# note: comm.sync left out: dp4 ps2 bsp has no use for it" in sync.read_text()
    assert "comm.sync=one_step_delay replaced" not in sync.read_text()  # said once: left out
    assert load_config(str(sync), []).comm.sync == "sync"
    servers = tmp_path / "servers.yaml"  # a parameter-server config planned as all-reduce: its ps.* go
    config.write_text(config.read_text().replace("sync: one_step_delay", "compressor: none") +
                      "parallel: {mode: ps}\nps: {servers: 1, consistency: ssp}\n")
    assert main(["plan", str(config), *common, "--plan", "dp=4", "--emit", str(servers)]) == 0
    text = servers.read_text()
    assert "# note: ps.servers left out" in text and "# note: ps.consistency left out" in text
    assert "# note: parallel.mode=ps replaced by the plan's dp" in text
    assert load_config(str(servers), []).parallel.mode == "dp"
    # the model named twice, or not at all
    assert main(["plan", str(config), "--model", spec, *common]) == 2
    assert main(["plan", *common]) == 2


def test_emitted_config_trains_as_it_is(tmp_path):
    hw = tmp_path / "two.yaml"
    hw.write_text(yaml.safe_dump({"name": "two-cpus", "device": "v100", "devices_per_node": 2,
                                  "intra": "nvlink2", "inter": "10gbe"}))
    config = tmp_path / "best.yaml"
    assert main(["plan", "--model", GPT, "--cluster", str(hw), "--nodes", "1", "--global-batch", "16",
                 "--exact-only", "--emit", str(config)]) == 0
    cfg = load_config(str(config), [])
    cfg.validate_world(cfg.parallel.nproc)
    assert cfg.model.name == "gpt" and cfg.model.n_layers == 4 and cfg.data.batch_size == 16
    done = subprocess.run([sys.executable, "-m", "paraloom", "train", str(config),
                           "--set", "optim.max_steps=2", "--set", "data.text_bytes=20000",
                           "--set", f"run.out_dir={tmp_path}",
                           "--set", "run.checkpoint_every=0"], capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_planner_offers_interleaved_pipelines_and_emits_them(tmp_path):
    profile = profile_model("gpt:layers=8,hidden=64,heads=4,seq=32")
    plans = grids(4, profile, load_hardware("h100-ib-ndr"), 64)
    interleaved = [p for p in plans if p.schedule == "interleaved_1f1b"]
    assert interleaved
    assert all(p.microbatches % p.pp == 0 and p.pp * p.virtual_stages <= 10 for p in interleaved)
    assert {p.virtual_stages for p in interleaved} == {2, 4}
    out = tmp_path / "best.yaml"
    assert main(["plan", "--model", "gpt:layers=8,hidden=64,heads=4,seq=32", "--cluster", "h100-ib-ndr",
                 "--nodes", "1", "--global-batch", "64", "--emit", str(out),
                 "--plan", "pp=2,microbatches=4,schedule=interleaved_1f1b,virtual_stages=2"]) == 0
    assert "virtual_stages: 2" in out.read_text() and "interleaved_1f1b" in out.read_text()


def test_another_systems_tree_is_priced_for_a_plan_but_never_offered_or_emitted(tmp_path, capsys):
    hw = load_hardware("a100-hdr")
    assert all(p.algorithm not in MODELLED_ALGORITHMS for p in variants(Plan(dp=16), exact_only=False))

    def comm(model: str, algorithm: str) -> float:
        est = estimate(profile_model(model), hw, Plan(dp=16, algorithm=algorithm), 512)
        return est.breakdown["dp_comm_total"]

    # a small model's all-reduce is latency: 2 log2 16 = 8 hops against the ring's 30
    assert 0 < comm("mlp", "double_binary_tree") < comm("mlp", "ring")
    # a large one's is bandwidth: 2 S/B against the ring's 2 (n-1)/n S/B
    big = "gpt:layers=4,hidden=2048,heads=16,seq=128"
    assert comm(big, "ring") < comm(big, "double_binary_tree") < comm(big, "reduction_tree")
    with pytest.raises(UserError, match="plan algorithm"):
        Plan(dp=2, algorithm="butterfly")
    assert main(["plan", "--model", "mlp", "--cluster", "a100-hdr", "--nodes", "2", "--global-batch", "512",
                 "--plan", "dp=16,algorithm=double_binary_tree", "--emit", str(tmp_path / "x.yaml")]) == 2
    assert "prices but paraloom does not run" in capsys.readouterr().err


def test_parameter_servers_are_host_processes_not_devices(capsys):
    """A parameter server runs beside the workers on their nodes' CPUs: eight GPUs train as eight
    workers with two servers, and the planner offers such plans on the devices there are."""
    assert Plan(dp=8, servers=2).devices == 8
    assert main(["plan", "--model", "mlp", "--cluster", "v100-25gbe", "--nodes", "1", "--global-batch", "256",
                 "--plan", "dp=8,servers=2"]) == 0
    ranked = rank(profile_model("mlp"), load_hardware("v100-25gbe"), 1, 256)
    assert any(e.plan.servers and e.plan.dp == 8 for e in ranked.estimates)
    assert all(e.plan.devices <= 8 for e in ranked.estimates)


def test_a_whole_replicas_micro_batches_are_emitted_as_accumulation(tmp_path):
    """The plan was priced with its micro-batches' activations; the run must accumulate as many."""
    out = tmp_path / "dp.yaml"
    assert main(["plan", "--model", "gpt:layers=4,hidden=64,heads=4,seq=32", "--cluster", "h100-ib-ndr",
                 "--nodes", "1", "--global-batch", "64", "--plan", "dp=8,microbatches=4",
                 "--emit", str(out)]) == 0
    cfg = load_config(str(out), [])
    assert cfg.strategy == "data_parallel" and cfg.optim.accumulate == 4
    cfg.validate_world(8)
