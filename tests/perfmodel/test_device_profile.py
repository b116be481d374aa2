"""`paraloom calibrate --device`: a device's micro-benchmarks become a profile the planner predicts with.

The GPU itself is measured by `make test-gpu` and benchmarks/gpu.py; here the same code runs on the
CPU with small sizes (the figures are the CPU's, the arithmetic the same).
"""

import time
from dataclasses import replace

import pytest
import torch

import paraloom.perfmodel.measure.device_profile as dp
from paraloom.cli import main
from paraloom.perfmodel.cost.step_time import estimate
from paraloom.perfmodel.hardware import Hardware, device_preset, load_hardware
from paraloom.perfmodel.measure.profile import profile_model
from paraloom.perfmodel.measure.specs import build_from_spec
from paraloom.perfmodel.plan import Options, Plan

TINY = {"matmul": 64, "conv": (2, 4, 8), "attention": (1, 2, 32, 8), "elements": 2**12}


@pytest.fixture(scope="module")
def measured():
    return dp.measure_device(torch.device("cpu"), sizes=TINY, min_s=0.002, buckets_mb=(0.25, 1))


def test_the_micro_benchmarks_cover_every_dtype_class_and_codec(measured):
    from paraloom.compress import COMPRESSORS

    assert set(measured["compute"]) == {"fp32", "bf16"}
    for rates in measured["compute"].values():
        assert set(rates) == {"matmul", "conv", "attention", "other", "bandwidth"}
        assert all(v > 0 for v in rates.values())
    assert set(measured["host"]) == {"matmul", "conv", "attention", "other"}
    assert all(costs["fwd"] > 0 and costs["bwd"] >= 0 for costs in measured["host"].values())
    assert set(measured["optimizers"]) == {"sgd", "momentum", "adam"}
    assert set(measured["codecs"]) == {"0.25MB", "1MB"}
    assert set(measured["codecs"]["1MB"]) == set(COMPRESSORS)
    assert measured["capacity"] > 2**30


def test_a_preset_keeps_its_peaks_and_the_measured_rates_are_what_the_model_uses(measured):
    measured = {**measured, "codecs": {"25MB": measured["codecs"]["1MB"]}}
    hw, comparison = dp.device_profile(measured, preset="h100")
    sheet = device_preset("h100")
    assert hw.device.peak_flops == sheet.peak_flops  # efficiencies read as fractions of the data sheet
    bf16 = measured["compute"]["bf16"]
    assert comparison["main_dtype"] == "bf16"
    assert hw.device.efficiency["conv"] == pytest.approx(min(1.0, bf16["conv"] / sheet.peak_flops["bf16"]))
    assert comparison["efficiency"]["fp32"]["matmul"]["assumed"] == sheet.efficiency["matmul"]
    for dtype, rates in measured["compute"].items():
        for op_class in ("matmul", "conv", "attention", "other"):
            assert hw.achieved_flops(dtype, op_class) == rates[op_class]  # not peak x efficiency
    # a dtype not measured: the data sheet's peak at the main dtype's measured efficiency
    assert hw.achieved_flops("fp16", "matmul") == sheet.peak_flops["fp16"] * hw.device.efficiency["matmul"]
    assert hw.constants["codec_s_per_byte.topk"] == pytest.approx(1 / measured["codecs"]["25MB"]["topk"])
    assert hw.devices_per_node == hw.nics_per_node == 8  # InfiniBand: an adapter per GPU, as the preset
    assert "not measured" in hw.intra.name and "not measured" in hw.inter.name
    assert Hardware.from_yaml(hw.to_yaml()) == hw


def test_without_a_preset_the_measured_matmul_is_the_peak(measured):
    hw, comparison = dp.device_profile({**measured, "device": "Some Accelerator"})
    assert comparison["preset"] is None and hw.devices_per_node == 1
    assert hw.device.peak_flops["fp32"] == measured["compute"]["fp32"]["matmul"]
    assert hw.device.efficiency["matmul"] == 1.0


def test_the_prediction_follows_the_measured_rates_and_codecs(measured):
    hw, _ = dp.device_profile(measured, preset="h100")
    profile = profile_model("gpt:layers=2,hidden=64,heads=4,seq=32", dtype="bf16")
    base = estimate(profile, hw, Plan(dp=1), 8)
    halved = replace(hw, constants={k: v / 2 if k.startswith("flops.bf16.") else v
                                    for k, v in hw.constants.items()})
    slower = estimate(profile, halved, Plan(dp=1), 8)
    assert slower.breakdown["compute"] == pytest.approx(2 * base.breakdown["compute"], rel=0.05)
    # a GPU plan's codec cost is the measured seconds per byte times the gradient
    plan = Plan(dp=2, compressor="topk")
    codec = estimate(profile, hw, plan, 8, Options()).breakdown["codec"]
    assert codec == pytest.approx(hw.constants["codec_s_per_byte.topk"] * profile.n_params * 4.0)


@pytest.mark.parametrize(("name", "preset"), [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"),
    ("Tesla V100-SXM2-32GB", "v100"),
    ("Tesla V100-PCIE-32GB", "v100-pcie"), ("Tesla T4", "t4"), ("NVIDIA L4", "l4"), ("NVIDIA A10", "a10"),
    ("AMD Instinct MI300X", "mi300x"), ("NVIDIA GeForce RTX 4090", None),
])
def test_a_devices_name_picks_its_data_sheet(name, preset):
    assert dp.preset_for(name) == preset


def test_the_cli_writes_a_profile_and_shows_assumed_beside_measured(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dp, "check_device", lambda text: torch.device("cpu"))
    real = dp.measure_device
    monkeypatch.setattr(dp, "measure_device", lambda device, progress: real(
        device, sizes=TINY, min_s=0.002, buckets_mb=(25,), progress=progress))
    out = tmp_path / "gpu.yaml"
    assert main(["calibrate", "--device", "cuda", "--preset", "h100", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "assumed (preset)" in text and "0.60" in text  # the preset's matmul efficiency
    hw = load_hardware(str(out))
    assert "flops.bf16.matmul" in hw.constants and "codec_s_per_byte.dgc" in hw.constants


@pytest.mark.parametrize(("args", "message"), [
    (["--device", "cuda"], "no CUDA device is visible"),
    (["--device", "cpu"], "measuring a device is for GPUs"),
    (["--device", "cuda", "--emulate", "2x1gbit"], "--device measures one GPU"),
])
def test_calibrate_device_refuses_in_one_line(tmp_path, capsys, args, message):
    if torch.cuda.is_available() and args == ["--device", "cuda"]:
        pytest.skip("a GPU is visible")
    assert main(["calibrate", *args, "--out", str(tmp_path / "x.yaml")]) == 2
    assert message in capsys.readouterr().err


def test_small_layers_wait_on_their_host(measured):
    """A profile counts each layer's ops by class (the same at any batch); with the host's measured
    cost per op (or, without it, a kernel's launch) a layer takes no less than issuing its ops."""
    small = profile_model("gpt:layers=2,hidden=64,heads=4,seq=32")
    assert all(layer.fwd_kernels > 0 and layer.bwd_kernels > 0 for layer in small.layers)
    assert all(sum(layer.fwd_ops.values()) == layer.fwd_kernels for layer in small.layers)
    assert small.layers[1].fwd_ops == small.layers[2].fwd_ops  # two blocks alike
    hw, _ = dp.device_profile(measured, preset="h100")
    assert hw.constants["launch_s"] == measured["launch_s"] > 0
    assert hw.constants["host_s.conv.bwd"] == measured["host"]["conv"]["bwd"]
    per_op = {f"host_s.{c}.{phase}": {"matmul": 1.0, "conv": 2.0, "attention": 3.0, "other": 4.0}[c]
              for c in ("matmul", "conv", "attention", "other") for phase in ("fwd", "bwd")}
    slow = replace(hw, constants={**hw.constants, **per_op})  # seconds an op: host-bound
    est = estimate(small, slow, Plan(dp=1), 8)
    issued = sum(n * {"matmul": 1, "conv": 2, "attention": 3, "other": 4}[c]
                 for layer in small.layers for ops in (layer.fwd_ops, layer.bwd_ops) for c, n in ops.items())
    assert est.breakdown["compute"] == pytest.approx(issued)
    no_host = {k: v for k, v in hw.constants.items() if not k.startswith("host_s.")}
    launch = replace(hw, constants={**no_host, "launch_s": 1.0})  # the fallback: a second a kernel
    kernels = sum(layer.fwd_kernels + layer.bwd_kernels for layer in small.layers)
    assert estimate(small, launch, Plan(dp=1), 8).breakdown["compute"] == pytest.approx(kernels)
    bare = replace(hw, constants={k: v for k, v in no_host.items() if k != "launch_s"})
    assert estimate(small, bare, Plan(dp=1), 8).breakdown["compute"] < est.breakdown["compute"]


def test_the_update_is_torchs_measured_step(measured):
    """Where the device's optimizer steps were measured, the update is their per-parameter and
    per-tensor seconds over the largest stage's share; else its bytes at memory bandwidth."""
    for costs in measured["optimizers"].values():
        assert costs["per_param_s"] > 0 and costs["per_tensor_s"] >= 0
    small = profile_model("gpt:layers=2,hidden=64,heads=4,seq=32")
    hw, _ = dp.device_profile(measured, preset="h100")
    timed = replace(hw, constants={**hw.constants, "update_s_per_param.adam": 1e-6,
                                   "update_s_per_tensor.adam": 1e-3})
    assert small.param_tensors == sum(1 for _ in build_from_spec(small.spec, "meta")[0].parameters())
    est = estimate(small, timed, Plan(dp=1), 8, Options(optimizer="adam"))
    assert est.breakdown["update"] == pytest.approx(small.n_params * 1e-6 + small.param_tensors * 1e-3)
    half = estimate(small, timed, Plan(tp=2), 8, Options(optimizer="adam")).breakdown["update"]
    assert half == pytest.approx(small.n_params / 2 * 1e-6 + small.param_tensors * 1e-3)  # tensors stay
    bare = replace(hw, constants={k: v for k, v in hw.constants.items() if not k.startswith("update_s")})
    bandwidth = estimate(small, bare, Plan(dp=1), 8, Options(optimizer="adam")).breakdown["update"]
    assert bandwidth == pytest.approx(28 * small.n_params / hw.device.mem_bandwidth)


@pytest.mark.parametrize(("timed", "optim"), [("sgd", ["optim.name=sgd", "optim.momentum=0"]),
                                              ("momentum", ["optim.name=sgd", "optim.momentum=0.9"]),
                                              ("adam", ["optim.name=adamw"])])
def test_the_optimizers_timed_are_built_as_a_run_builds_them(timed, optim):
    """The profile's update costs are those of the step a run takes: torch's fused kernel where a run
    uses it, not the class's default implementation (a per-tensor loop on a CPU, foreach on a GPU)."""
    from paraloom.config import load_config
    from paraloom.optim.recipe import Recipe
    from paraloom.perfmodel.measure.microbench import OPTIMIZERS

    params = [torch.zeros(8, requires_grad=True)]
    benchmarked = OPTIMIZERS[timed](params)
    run = Recipe(load_config(None, optim), params, total_steps=1, device=torch.device("cpu")).optimizer
    assert type(benchmarked) is type(run) and benchmarked.defaults["fused"] == run.defaults["fused"] is True


def test_a_rate_counts_finished_calls_not_queued_ones(monkeypatch):
    """On a GPU a call only queues its kernel: the calibration must wait for each call, or it would
    queue thousands of them in its first `min_s` and every sample would then run for minutes."""
    from paraloom.perfmodel.measure import microbench

    queued, run_s = [0], 0.002

    def sync():  # the device finishes what was queued
        time.sleep(queued[0] * run_s)
        queued[0] = 0

    monkeypatch.setattr(microbench, "synchronizer", lambda device: sync)
    began = time.perf_counter()
    rate = microbench.rate(lambda: queued.__setitem__(0, queued[0] + 1), 1.0, repeats=3, min_s=0.02)
    assert time.perf_counter() - began < 1.0
    assert rate == pytest.approx(1 / run_s, rel=0.5)
