"""Calibration: measured constants make a valid profile; refinement fits runs it is given."""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import yaml

from paraloom.cli import main
from paraloom.cli.options import link_timers
from paraloom.config import Config
from paraloom.config.errors import UserError
from paraloom.perfmodel.cost.device import DISPATCH, without_dispatch
from paraloom.perfmodel.cost.step_time import estimate
from paraloom.perfmodel.from_config import predictable
from paraloom.perfmodel.hardware import Hardware, Link, load_hardware
from paraloom.perfmodel.measure.calibrate import build_profile, measure_compute
from paraloom.perfmodel.measure.cpu_host import measure_host
from paraloom.perfmodel.measure.profile import profile_model
from paraloom.perfmodel.plan import Plan
from paraloom.perfmodel.runs.finished import measured_step_seconds, unusable
from paraloom.perfmodel.runs.refine import refine

PHASES = ("fwd", "bwd")
OP_CLASSES = ("matmul", "conv", "attention", "other")


def test_compute_micro_benchmarks_give_positive_rates():
    rates = measure_compute(threads=1)
    assert set(rates) == {"matmul", "conv", "attention", "other", "bandwidth"}
    assert all(v > 0 for v in rates.values())
    assert rates["matmul"] > 1e8  # any CPU multiplies faster than 0.1 GFLOP/s


def test_profile_from_measurements_round_trips_and_caps_efficiency():
    rates = {"matmul": 4e10, "conv": 2e10, "attention": 1e10, "other": 8e10, "bandwidth": 1e10}
    hw = build_profile(rates, Link("lo", 1e9, 1e-5), Link("emu", 1.25e8, 5e-5), name="here",
                       devices_per_node=1, host_cores=2)
    assert hw.device.peak_flops["fp32"] == 4e10
    assert hw.device.efficiency == {"matmul": 1.0, "conv": 0.5, "attention": 0.25, "other": 1.0}
    assert hw.constants["host_cores"] == 2.0
    assert Hardware.from_yaml(hw.to_yaml()) == hw


def test_host_micro_benchmarks_give_each_ops_dispatch():
    before = torch.get_num_threads()
    host = measure_host(threads=1 if before > 1 else 2, min_s=0.005)
    assert set(host) == {f"{DISPATCH}.{c}.{phase}" for c in OP_CLASSES for phase in PHASES}
    assert all(v > 0 for v in host.values())
    assert torch.get_num_threads() == before  # as it found them


def test_a_cpus_dispatch_adds_to_its_arithmetic_op_by_op():
    """On a CPU the core that computes an op also dispatches it: a profile with dispatch costs
    charges each layer its ops' count times their cost per class and phase, on top of its roofline
    (on a GPU the host only bounds a layer from below: test_device_profile)."""
    model = profile_model("cnn:input=1x8x8,classes=10,hidden=128,channels=32")
    hw = load_hardware("v100-10gbe")
    cost = {"matmul": 1.0, "conv": 2.0, "attention": 3.0, "other": 4.0}  # seconds an op, twice in backward
    per_op = {f"{DISPATCH}.{c}.{phase}": cost[c] * (2 if phase == "bwd" else 1)
              for c in OP_CLASSES for phase in PHASES}
    dispatching = replace(hw, constants={**hw.constants, **per_op})
    ops = sum(n * cost[c] * (1 + phase) for layer in model.layers
              for phase, counts in enumerate((layer.fwd_ops, layer.bwd_ops)) for c, n in counts.items())
    assert ops > 0
    with_it = estimate(model, dispatching, Plan(dp=1, microbatches=2), 64).breakdown["compute"]
    arithmetic = estimate(model, hw, Plan(dp=1, microbatches=2), 64).breakdown["compute"]
    assert with_it == pytest.approx(arithmetic + 2 * ops)  # each micro-batch dispatches its ops
    assert without_dispatch(dispatching) == hw


def _fake_run(tmp_path, name, overrides, seconds):
    """A finished run directory as `paraloom train` leaves it: config.yaml and summary.json."""
    run = tmp_path / name
    run.mkdir()
    cfg = Config.from_dict(overrides)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    (run / "summary.json").write_text(json.dumps({"world_size": 1, "step_seconds": seconds,
                                                  "samples_per_second": cfg.data.batch_size / seconds}))
    return run


@pytest.mark.parametrize("dispatch", [0.0, 2e-5])
def test_refine_recovers_a_compute_scale_and_an_overhead(tmp_path, dispatch):
    """With a CPU's dispatch costs in the profile, the scale applies to the arithmetic alone: the
    dispatch is measured per op, and efficiency does not change it."""
    hw = load_hardware("v100-10gbe")
    hw = replace(hw, constants={**hw.constants, **{f"{DISPATCH}.{c}.{phase}": dispatch
                                                   for c in OP_CLASSES for phase in PHASES}})
    small = {"model": {"name": "mlp", "hidden": 256}, "parallel": {"nproc": 1}}
    large = {"model": {"name": "mlp", "hidden": 2048}, "parallel": {"nproc": 1}}
    truth = []
    for overrides in (small, large):  # a machine 3x slower than the profile, plus 2 ms per step
        what = predictable(Config.from_dict(overrides), 1)
        e = estimate(profile_model(what.spec), hw, what.plan, what.global_batch, what.options)
        bare = estimate(profile_model(what.spec), without_dispatch(hw), what.plan, what.global_batch,
                        what.options)
        assert (e.breakdown["compute"] > bare.breakdown["compute"]) == (dispatch > 0)
        truth.append(e.step_s + 2 * bare.breakdown["compute"] + 0.002)
    runs = [_fake_run(tmp_path, "small", small, truth[0]), _fake_run(tmp_path, "large", large, truth[1])]
    refined, points = refine(hw, runs)
    assert refined.constants["step_overhead_s"] == pytest.approx(0.002, rel=1e-3)
    for run, seconds in zip(runs, truth, strict=True):
        what = predictable(Config.from_dict(yaml.safe_load((run / "config.yaml").read_text())), 1)
        e = estimate(profile_model(what.spec), refined, what.plan, what.global_batch, what.options)
        assert e.step_s == pytest.approx(seconds, rel=1e-2)  # the roofline max() may switch sides
    assert len(points) == 2


def test_refine_takes_the_median_of_a_configurations_repeats(tmp_path):
    """The small MLP run three times, one of them 5 ms slow (a busy stretch of the machine): the
    fit sees its median, and the overhead stays 2 ms (a mean would have made it 3.7 ms)."""
    hw = load_hardware("v100-10gbe")
    small = {"model": {"name": "mlp", "hidden": 256}, "parallel": {"nproc": 1}}
    large = {"model": {"name": "mlp", "hidden": 2048}, "parallel": {"nproc": 1}}
    truth = []
    for overrides in (small, large):
        what = predictable(Config.from_dict(overrides), 1)
        e = estimate(profile_model(what.spec), hw, what.plan, what.global_batch, what.options)
        truth.append(e.step_s + 2 * e.breakdown["compute"] + 0.002)
    runs = [_fake_run(tmp_path, f"small{i}", small, truth[0] + slow)
            for i, slow in enumerate((0.0, 0.005, 0.0))]
    refined, points = refine(hw, [*runs, _fake_run(tmp_path, "large", large, truth[1])])
    assert refined.constants["step_overhead_s"] == pytest.approx(0.002, rel=1e-3)
    assert len(points) == 4


def test_refine_takes_a_parameter_servers_cpu_per_message_from_a_ps_run(tmp_path):
    """2 workers, 1 server of 17 slices, 100 steps, 10 MB pushed and pulled per worker and step on
    one node: 2 GB moved at 1 ns a byte leave 3.4 s - 2 s = 1.4 s for 3,400 requests: 412 us each."""
    hw = load_hardware("v100-10gbe")
    hw = replace(hw, constants={**hw.constants, "tcp_cpu_s_per_byte.intra": 1e-9})
    single = _fake_run(tmp_path, "single", {"model": {"name": "mlp"}, "parallel": {"nproc": 1}}, 0.02)
    ps = _fake_run(tmp_path, "ps", {"model": {"name": "mlp"}, "parallel": {"nproc": 2, "mode": "ps"}}, 0.04)
    summary = json.loads((ps / "summary.json").read_text())
    summary.update({"steps": 100, "workers": 2, "servers": 1, "nodes": 1, "comm_bytes_per_step": 1e7,
                    "servers_stats": [{"cpu_seconds": 3.4, "slices": 17}]})
    (ps / "summary.json").write_text(json.dumps(summary))
    refined, points = refine(hw, [single, ps])
    assert refined.constants["ps.server_s_per_message"] == pytest.approx(1.4 / 3400)
    assert points[-1]["server_cpu_s_per_step"] == pytest.approx(0.034)
    alone, _ = refine(hw, [single])
    assert refined.constants["step_overhead_s"] == alone.constants["step_overhead_s"]  # not in that fit
    assert "ps.server_s_per_update" not in refined.constants  # that server did not time its updates


def test_refine_takes_a_servers_updates_apart_from_its_messages(tmp_path):
    """The same run, its server having timed 0.7 s of its 3.4 s in 1,700 optimizer steps (BSP: 17
    slices, 100 clocks): 412 us a request becomes 0.7 s / 3,400 = 206 us, and 412 us an update."""
    hw = load_hardware("v100-10gbe")
    hw = replace(hw, constants={**hw.constants, "tcp_cpu_s_per_byte.intra": 1e-9})
    ps = _fake_run(tmp_path, "ps", {"model": {"name": "mlp"}, "parallel": {"nproc": 2, "mode": "ps"}}, 0.04)
    summary = json.loads((ps / "summary.json").read_text())
    summary.update({"steps": 100, "workers": 2, "servers": 1, "nodes": 1, "comm_bytes_per_step": 1e7,
                    "servers_stats": [{"cpu_seconds": 3.4, "slices": 17, "updates": 1700,
                                       "update_cpu_seconds": 0.7}]})
    (ps / "summary.json").write_text(json.dumps(summary))
    refined, _ = refine(hw, [ps])
    assert refined.constants["ps.server_s_per_message"] == pytest.approx(0.7 / 3400)
    assert refined.constants["ps.server_s_per_update"] == pytest.approx(0.7 / 1700)


def test_refine_takes_the_synchronous_steps_own_cost_from_a_data_parallel_run(tmp_path):
    """Three 2-worker runs measured 3, 9 and 2 ms past the model's compute, update and overhead plus
    the 4 ms they waited for gradients: sync_overhead_s = 3 ms (the median), and the compute fit
    ignores the runs."""
    hw = load_hardware("v100-10gbe")
    single = _fake_run(tmp_path, "single", {"model": {"name": "mlp"}, "parallel": {"nproc": 1}}, 0.02)
    dp_cfg = {"model": {"name": "mlp"}, "parallel": {"nproc": 2}}
    what = predictable(Config.from_dict(dp_cfg), 2)
    alone, _ = refine(hw, [single])
    e = estimate(profile_model(what.spec), alone, what.plan, what.global_batch, what.options)
    rest = e.step_s - e.breakdown["dp_comm_exposed"]
    runs = []
    for i, sync in enumerate((0.003, 0.009, 0.002)):  # the median of three, not their mean (4.7 ms)
        dp = _fake_run(tmp_path, f"dp{i}", dp_cfg, rest + 0.004 + sync)
        summary = json.loads((dp / "summary.json").read_text())
        summary.update({"world_size": 2, "comm_seconds_per_step": 0.004})
        (dp / "summary.json").write_text(json.dumps(summary))
        runs.append(dp)
    refined, points = refine(hw, [single, *runs])
    assert refined.constants["sync_overhead_s"] == pytest.approx(0.003)
    dp = runs[0]
    assert refined.constants["step_overhead_s"] == alone.constants["step_overhead_s"]
    again, _ = refine(refined, [dp])  # a profile that already holds the constant gives it again
    assert again.constants["sync_overhead_s"] == pytest.approx(0.003)


def _dp_run(tmp_path, name, cfg, seconds):
    run = _fake_run(tmp_path, name, cfg, seconds)
    summary = json.loads((run / "summary.json").read_text())
    summary.update({"world_size": 2, "comm_seconds_per_step": 0.004})
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def _priority(partition_mb):
    return {"model": {"name": "mlp"}, "parallel": {"nproc": 2},
            "comm": {"scheduler": "priority", "partition_mb": partition_mb}}


def _units_and_base(hw, cfg):
    """The model's step for `cfg` without a piece cost, and the units the cost is charged in."""
    what = predictable(Config.from_dict(cfg), 2)
    spec = profile_model(what.spec)
    base = estimate(spec, hw, what.plan, what.global_batch, what.options).step_s
    charged = replace(hw, constants={**hw.constants, "piece_overhead_s": 1e-3})
    return (estimate(spec, charged, what.plan, what.global_batch, what.options).step_s - base) / 1e-3, base


def test_refine_takes_a_priority_pieces_cost_from_priority_runs(tmp_path):
    """A 2-worker fifo run fits sync_overhead_s as before; three 2-worker priority runs measured
    0.2, 0.5 and 0.3 ms per piece past the model (the default MLP in 10 kB pieces):
    piece_overhead_s = 0.3 ms, the median, and the fifo run's fit is left as it was."""
    hw = load_hardware("v100-10gbe")
    fifo_cfg = {"model": {"name": "mlp"}, "parallel": {"nproc": 2}, "comm": {"scheduler": "fifo"}}
    what = predictable(Config.from_dict(fifo_cfg), 2)
    e = estimate(profile_model(what.spec), hw, what.plan, what.global_batch, what.options)
    fifo = _dp_run(tmp_path, "fifo", fifo_cfg, e.step_s - e.breakdown["dp_comm_exposed"] + 0.004 + 0.002)
    alone, _ = refine(hw, [fifo])
    assert alone.constants["sync_overhead_s"] == pytest.approx(0.002)
    unit, base = _units_and_base(alone, _priority(0.01))
    assert unit >= 10  # 10 pieces or more
    runs = [_dp_run(tmp_path, f"prio{i}", _priority(0.01), base + cost * unit)
            for i, cost in enumerate((2e-4, 5e-4, 3e-4))]
    refined, points = refine(hw, [fifo, *runs])
    assert refined.constants["piece_overhead_s"] == pytest.approx(3e-4)
    assert refined.constants["priority_overhead_s"] == 0.0  # one piece size: through the origin
    assert refined.constants["sync_overhead_s"] == pytest.approx(0.002)  # the priority runs are not in it
    assert [p["piece_units"] for p in points[-3:]] == pytest.approx([unit] * 3)


def test_two_piece_sizes_tell_a_pieces_cost_from_the_schedulers_per_step(tmp_path):
    """Runs with 10 kB and 40 kB pieces, both 5 ms a step slower than the model and 0.4 ms per
    piece: the slope gives 0.4 ms and the intercept the 5 ms a step,
    where one size alone charges its pieces with those 5 ms too."""
    hw = load_hardware("v100-10gbe")
    runs, single = [], None
    for mb in (0.01, 0.04):
        unit, base = _units_and_base(hw, _priority(mb))
        runs.append(_dp_run(tmp_path, f"prio{mb}", _priority(mb), base + 0.005 + 4e-4 * unit))
        single = single or 4e-4 + 0.005 / unit
    both = refine(hw, runs)[0].constants
    assert both["piece_overhead_s"] == pytest.approx(4e-4)
    assert both["priority_overhead_s"] == pytest.approx(0.005)
    assert refine(hw, runs[:1])[0].constants["piece_overhead_s"] == pytest.approx(single)
    faster = [_dp_run(tmp_path, f"fast{mb}", _priority(mb), _units_and_base(hw, _priority(mb))[1] + extra)
              for mb, extra in ((0.01, 0.002), (0.04, 0.004))]  # more pieces measured faster: noise
    noisy = refine(hw, faster)[0].constants
    assert noisy["piece_overhead_s"] == 0.0 and noisy["priority_overhead_s"] == pytest.approx(0.003)


def test_a_runs_step_is_the_median_logged_interval_after_the_first(tmp_path):
    run = _fake_run(tmp_path, "dp", {"model": {"name": "mlp"}, "data": {"batch_size": 64}}, 1.0)
    rates = [10.0, 6400.0, 3200.0, 640.0]  # a slow first interval (warm-up), then 10, 20 and 100 ms
    (run / "metrics.jsonl").write_text("".join(json.dumps({"samples_per_s": r}) + "\n" for r in rates))
    assert measured_step_seconds(run) == pytest.approx(0.02)


def test_refine_needs_finished_runs(tmp_path):
    with pytest.raises(UserError, match="not a finished run directory"):
        refine(load_hardware("a100-hdr"), [tmp_path])


def _summary(run, **fields):
    summary = json.loads((run / "summary.json").read_text()) | fields
    (run / "summary.json").write_text(json.dumps(summary))
    return summary


def test_calibrate_from_history_fits_the_runs_it_can_and_passes_over_the_rest(tmp_path, monkeypatch, capsys):
    """History lists a single-worker run, a data-parallel and a parameter-server one (each kind
    printed as what it gave), a run whose model factory no longer imports, one that injected a
    slowdown, and a parameter-server run that served no step: refined from the first
    three, one line counts the other three, and history of those alone is refused in one line."""
    from paraloom.perfmodel.runs import history

    monkeypatch.setenv("PARALOOM_CACHE_DIR", str(tmp_path))
    mlp, ps = {"model": {"name": "mlp"}}, {"nproc": 2, "mode": "ps"}
    stats = {"steps": 100, "workers": 2, "servers": 1, "nodes": 1, "comm_bytes_per_step": 1e7,
             "servers_stats": [{"cpu_seconds": 3.4, "slices": 17}]}
    good = [_fake_run(tmp_path, "single", mlp | {"parallel": {"nproc": 1}}, 0.02),
            _dp_run(tmp_path, "dp", mlp | {"parallel": {"nproc": 2}}, 0.03),
            _fake_run(tmp_path, "ps", mlp | {"parallel": ps}, 0.04)]
    _summary(good[2], **stats)
    bad = [_fake_run(tmp_path, "gone", {"model": {"name": "no_such_package:make_model"}}, 0.02),
           _fake_run(tmp_path, "slowed", mlp | {"run": {"inject": "slow:rank=0,factor=2"}}, 0.05),
           _fake_run(tmp_path, "short", mlp | {"parallel": ps}, 0.04)]
    _summary(bad[2], **stats | {"steps": 0})
    for run in bad[:1] + good + bad[1:]:
        history.record(run, {}, {})
    hw = load_hardware("v100-10gbe")
    assert [unusable(run, hw) for run in good] == [None] * 3
    assert "run.inject=slow:rank=0,factor=2" in unusable(bad[1], hw)
    assert "served no step" in unusable(bad[2], hw)
    idle = _fake_run(tmp_path, "idle", mlp, 0.02)
    _summary(idle, step_seconds=None, samples_per_second=0.0)
    assert "measured no throughput" in unusable(idle, hw)
    out = tmp_path / "refined.yaml"
    assert main(["calibrate", "--from", "history", "--hardware", "v100-10gbe", "--out", str(out)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "--from history: passed over 3 of 6 runs (the first, " in said and "cannot import" in said
    assert f"{good[0]}: measured 20.0 ms/step, predicted before" in said
    assert f"{good[1]}: measured 30.0 ms/step, 4.0 ms of it communicating" in said
    assert f"{good[2]}: a server's CPU " in said and "sync_overhead_s" in load_hardware(str(out)).constants
    (tmp_path / "history.jsonl").unlink()
    for run in bad:
        history.record(run, {}, {})
    assert main(["calibrate", "--from", "history", "--hardware", "v100-10gbe", "--out", str(out)]) == 2
    assert "none of its 3 runs can be fitted to" in capsys.readouterr().err


def test_calibrate_cli_writes_a_profile_plan_can_use(tmp_path, capsys):
    out = tmp_path / "here.yaml"
    assert main(["calibrate", "--out", str(out), "--storage", str(tmp_path)]) == 0
    hw = load_hardware(str(out))
    assert hw.intra.bandwidth > 1e7 and hw.intra.latency >= 0
    assert hw.constants["storage.read_bandwidth"] > 1e6 and list(tmp_path.iterdir()) == [out]
    said = " ".join(capsys.readouterr().out.split())
    assert hw.constants[f"{DISPATCH}.matmul.bwd"] > 0 and " us an op forward, " in said
    assert main(["plan", "--model", "mlp:hidden=512", "--cluster", str(out), "--nodes", "1..2",
                 "--global-batch", "64", "--sample-bytes", "3 KB"]) == 0
    assert "recommended:" in capsys.readouterr().out
    assert main(["calibrate", "--from", str(tmp_path)]) == 2  # --from needs --hardware


class _Nodes:
    def __init__(self, nodes):
        self.nodes = nodes
        self.spec = SimpleNamespace(rate_bits=10**8)  # 100 Mbit/s: bandwidth fitted on 1 MiB and up


def test_groups_are_measured_per_size_and_wire_dtype_with_gloos_own_all_reduce(monkeypatch):
    """Each group's sweeps follow t = c_lat 2e-4 + c_bw S / B exactly, but one dtype's own fit says
    9e-4 s: the group keeps the median of its three fits and refits each dtype's bandwidth with it."""
    from paraloom.perfmodel.cost.network import allreduce_coefficients
    from paraloom.perfmodel.measure import calibrate as cal

    calls = []
    own_fit = {"float32": 1e-4, "float16": 9e-4, "bfloat16": 2e-4}

    def fake_link(timers, cluster, nproc=2, dtype="float32", algorithm="ring"):
        calls.append((cluster.nodes, dtype, algorithm))
        c_lat, c_bw = allreduce_coefficients(cluster.nodes, algorithm)
        bandwidth = 1e8 / cluster.nodes / (2 if dtype != "float32" else 1)
        rows = [{"bytes": 2**k, "seconds": c_lat * 2e-4 + c_bw * 2**k / bandwidth,
                 "cpu_seconds": 2**k * 1e-9 * (1 + (k == 22))} for k in (16, 20, 22, 24)]
        return own_fit[dtype], bandwidth * 1.3, rows  # the sweep's own bandwidth is not kept

    monkeypatch.setattr(cal, "measure_link", fake_link)
    out = cal.measure_groups(link_timers(), [_Nodes(2), _Nodes(4)])
    assert calls == [(n, d, "native") for n in (2, 4) for d in ("float32", "float16", "bfloat16")]
    assert out["allreduce.n2.float32.native.bandwidth"] == pytest.approx(5e7)
    assert out["allreduce.n4.float16.native.bandwidth"] == pytest.approx(1.25e7)
    for n in (2, 4):
        for dtype in own_fit:
            assert out[f"allreduce.n{n}.{dtype}.native.latency"] == 2e-4
    # CPU seconds per byte: the median over the sizes of 1 MiB and up (1, 2, 1 ns)
    assert out["allreduce.n2.float16.native.cpu_s_per_byte"] == pytest.approx(1e-9)
    assert len(out) == 2 * 2 * 3 + 2 * 3


@pytest.mark.parametrize("sizes, message", [("4,x", "node counts separated by commas"),
                                            ("1", "at least 2 nodes"),
                                            ("4", "give --emulate")])
def test_calibrate_group_sizes_are_checked(tmp_path, capsys, sizes, message):
    assert main(["calibrate", "--out", str(tmp_path / "h.yaml"), "--group-sizes", sizes]) == 2
    assert message in capsys.readouterr().err


def test_the_sustained_bandwidth_is_fitted_past_the_emulated_links_burst(monkeypatch):
    """At 10 Gbit/s the token bucket holds 2.5 MB: fit on 40 MB and up, and sweep to 64 MiB; at
    1 Gbit/s (250 KB) on 4 MB and up; at 100 Mbit/s (32 KiB) on 1 MiB and up."""
    from paraloom.perfmodel.measure import calibrate as cal

    def cluster(rate_bits):
        return SimpleNamespace(spec=SimpleNamespace(rate_bits=rate_bits))

    timers = link_timers()
    assert cal.sustained_bytes(timers, None) == cal.sustained_bytes(timers, cluster(10**8)) == 1 << 20
    assert cal.sustained_bytes(timers, cluster(10**9)) == 4 * 10**6
    assert cal.sustained_bytes(timers, cluster(10**10)) == 4 * 10**7
    swept = {}

    def fake_run(sizes, **kw):
        swept["sizes"] = sizes
        rows = [{"bytes": s, "seconds": 1e-4 + s / 1e9} for s in sizes]  # alpha-beta exact: 1 GB/s
        return {"results": rows, "config": {"world_size": 2}}

    timers = replace(timers, collectives=fake_run)
    alpha, bandwidth, _ = cal.measure_link(timers, cluster(10**10), algorithm="native")
    assert swept["sizes"][-1] == 2**26 and bandwidth == pytest.approx(1e9 * 2 * (2 - 1) / 2, rel=0.05)
    cal.measure_link(timers, cluster(10**9), algorithm="native")  # fitted on 4 and 16 MiB
    assert swept["sizes"][-1] == 2**24


def test_a_links_alpha_is_its_floor_and_a_groups_its_median_repeat(monkeypatch):
    """Small sizes' median repeats carry 3 ms of barrier skew; the fastest repeats follow
    t = 2 alpha + S / B with alpha = 50 us. floor=True fits alpha to the fastest repeats; without
    it the skew is part of alpha. Either way the bandwidth comes from the sustained sizes' medians."""
    from paraloom.perfmodel.measure import calibrate as cal

    def fake_run(sizes, **kw):
        rows = [{"bytes": s, "seconds": 1e-4 + s / 1e8 + (3e-3 if s < 1 << 18 else 0.0),
                 "seconds_min": 1e-4 + s / 1e8} for s in sizes]
        return {"results": rows, "config": {"world_size": 2}}

    timers = replace(link_timers(), collectives=fake_run)
    wire = SimpleNamespace(spec=SimpleNamespace(rate_bits=10**8))
    alpha, bandwidth, _ = cal.measure_link(timers, wire, algorithm="ring", floor=True)
    assert alpha == pytest.approx(5e-5, rel=1e-6) and bandwidth == pytest.approx(1e8, rel=1e-3)
    skewed, _, _ = cal.measure_link(timers, wire, algorithm="ring")
    assert skewed > 5e-4
