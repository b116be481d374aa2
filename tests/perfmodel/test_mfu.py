"""Model FLOPs utilisation (perfmodel/cost/mfu.py): the model's FLOPs are the profile's count, and that
count is the textbook one — Megatron-LM's for the GPT, direct convolutions for a CNN; the peak is every
device's (a CPU host's cores at most); `paraloom plan` gives each plan its MFU."""

import pytest

from paraloom.cli.plan_command import run_plan
from paraloom.perfmodel.cost.mfu import mfu, model_flops_per_sample, peak_flops
from paraloom.perfmodel.hardware import load_hardware
from paraloom.perfmodel.measure.profile import profile_model


def _by_class(profile, phase):
    out = {}
    for layer in profile.layers:
        for op_class, flops in getattr(layer, f"{phase}_flops").items():
            out[op_class] = out.get(op_class, 0.0) + flops
    return out


def test_the_gpts_flops_are_megatrons_count():
    layers, h, seq, vocab = 4, 128, 64, 256
    profile = profile_model(f"gpt:layers={layers},hidden={h},heads=4,seq={seq},vocab={vocab}")
    fwd, bwd = _by_class(profile, "fwd"), _by_class(profile, "bwd")
    linear = 12 * layers * h * h + vocab * h  # the blocks' four projections and the head
    assert fwd["matmul"] == 2 * linear * seq and bwd["matmul"] == 2 * fwd["matmul"]
    assert fwd["attention"] == 4 * layers * seq * seq * h  # QK^T and the weighted sum, every position
    # Narayanan et al. 2021 (eq. 3 without recomputation): 72 l h^2 s (1 + s / 6h + V / 12 l h) a sample;
    # the counted attention backward (2.5x its forward) and elementwise work add 1.4% here
    megatron = 72 * layers * h * h * seq * (1 + seq / (6 * h) + vocab / (12 * layers * h))
    assert model_flops_per_sample(profile) == pytest.approx(megatron, rel=0.02)
    assert model_flops_per_sample(profile) > megatron


def test_a_cnns_flops_are_its_direct_convolutions_and_linears():
    profile = profile_model("cnn")  # (1, 8, 8) images: conv 1->32, conv 32->64, pool, 1024->128->10
    conv1, conv2 = 2 * 9 * 1 * 32 * 64, 2 * 9 * 32 * 64 * 64
    fc1, fc2 = 2 * 1024 * 128, 2 * 128 * 10
    fwd, bwd = _by_class(profile, "fwd"), _by_class(profile, "bwd")
    assert fwd["conv"] == conv1 + conv2 and fwd["matmul"] == fc1 + fc2
    # backward: each weight's gradient and each input's, but the image's (it needs none)
    assert bwd["conv"] == conv1 + 2 * conv2 and bwd["matmul"] == 2 * (fc1 + fc2)
    counted = 2 * conv1 + 3 * (conv2 + fc1 + fc2)
    assert model_flops_per_sample(profile) == pytest.approx(counted, rel=0.01)  # + ReLU, pool, bias


def test_the_peak_is_every_devices_and_a_cpu_host_lends_its_cores_at_most():
    a100 = load_hardware("a100-ib-hdr")
    assert peak_flops(a100, "bf16", 8) == 8 * a100.device.peak("bf16")
    assert peak_flops(a100, "fp32", 2) == 2 * a100.device.peak("fp32")
    cpu = load_hardware("a100-ib-hdr")
    cpu.constants["host_cores"] = 2.0
    assert peak_flops(cpu, "fp32", 4) == peak_flops(cpu, "fp32", 2) == 2 * cpu.device.peak("fp32")
    assert mfu(1e12, 0.5, 4e12) == pytest.approx(0.5) and mfu(1e12, 0.0, 4e12) == 0.0


def test_every_plan_the_planner_ranks_has_its_mfu(tmp_path):
    spec, batch = "gpt:layers=4,hidden=256,heads=4,seq=128", 64
    report = run_plan(model=spec, cluster="a100-ib-hdr", nodes="1,2", global_batch=batch, dtype="bf16",
                      json_out=tmp_path / "plan.json")
    per_sample = model_flops_per_sample(profile_model(spec, dtype="bf16"))
    hw = load_hardware("a100-ib-hdr")
    plans = [p for n in report["by_nodes"] for p in n["plans"]]
    assert plans and report["recommended"]["plan"]["mfu"] > 0
    for p in plans:
        devices = p["plan"]["dp"] * p["plan"]["tp"] * p["plan"]["pp"]
        expected = per_sample * batch / p["step_s"] / (devices * hw.device.peak("bf16"))
        assert p["mfu"] == pytest.approx(expected) and 0 < p["mfu"] < 1
