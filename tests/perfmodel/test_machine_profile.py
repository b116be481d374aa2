"""This machine's cached profiles: one per thread count for CPU workers, one for its GPUs, each made
on first use; a GPU run is never priced from the CPU's rates."""

import sys

import pytest
import torch
from test_contract import SMALL

from paraloom.cli import train as cli_train
from paraloom.config import load_config
from paraloom.perfmodel import calibrate, machine_profile
from paraloom.perfmodel.contract import load_or_predict
from paraloom.perfmodel.hardware import load_hardware
from paraloom.perfmodel.machine_profile import (
    cached_path,
    cached_source,
    calibrate_gpu_once,
    resolve_hardware,
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PARALOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PARALOOM_HARDWARE", raising=False)
    return tmp_path / "cache"


def test_a_gpu_run_reads_the_gpus_profile_never_the_cpus(cache, tmp_path):
    cpu, gpu = cached_path(1), cached_path(1, "cuda")
    assert gpu.name.endswith("-cuda.yaml") and gpu == cached_path(4, "cuda") and cpu != gpu
    cache.mkdir()
    cpu.write_text(load_hardware("a100-ib-hdr").to_yaml())
    assert resolve_hardware("auto", 1).name == "a100-ib-hdr"
    assert resolve_hardware("auto", 1, "cuda") is None and cached_source("auto", 1, "cuda") is None
    (tmp_path / "run").mkdir()
    skipped = load_or_predict(tmp_path / "run", load_config(None, SMALL), 2, 1, "cuda")
    assert "terms" not in skipped and "no hardware profile" in skipped["skipped"]
    gpu.write_text(load_hardware("h100-ib-ndr").to_yaml())
    assert resolve_hardware("auto", 1, "cuda").name == "h100-ib-ndr"
    (tmp_path / "gpu_run").mkdir()
    predicted = load_or_predict(tmp_path / "gpu_run", load_config(None, SMALL), 2, 1, "cuda")
    assert predicted["hardware"] == "h100-ib-ndr" and predicted["hardware_file"] == str(gpu)


def _writes(yaml_text, *lines):
    """A stand-in for `paraloom calibrate --device cuda --out OUT`: prints `lines`, writes the profile."""
    script = ("import sys\nfor line in sys.argv[3:]: print(line)\n"
              "open(sys.argv[1], 'w').write(sys.argv[2])")
    return lambda out: [sys.executable, "-c", script, str(out), yaml_text, *lines]


def test_the_gpu_is_calibrated_once_in_a_process_of_its_own(cache, monkeypatch):
    commands = []
    fake = _writes(load_hardware("h100-ib-ndr").to_yaml(), "measuring compute in bf16", "a table")
    monkeypatch.setattr(machine_profile, "gpu_calibration_command",
                        lambda out: commands.append(out) or fake(out))
    said = []
    path = calibrate_gpu_once(said.append)
    assert path == cached_path(0, "cuda") and resolve_hardware("auto", 2, "cuda").name == "h100-ib-ndr"
    assert said[0].startswith("calibrating this machine's GPU once") and "  measuring compute in bf16" in said
    assert "a table" not in " ".join(said)  # the measuring lines are relayed, the rest is not
    assert calibrate_gpu_once(said.append) == path and len(commands) == 1  # once
    assert sorted(p.name for p in cache.iterdir()) == [path.name]  # no staging file left
    monkeypatch.setenv("PARALOOM_HARDWARE", "h200-ib-ndr")
    assert calibrate_gpu_once(said.append) is None  # the environment names the profile


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: its calibration would succeed")
def test_a_failed_gpu_calibration_says_why_and_leaves_nothing(cache):
    # the real command, on a machine where torch sees no GPU: its one-line error is the reason
    with pytest.raises(RuntimeError, match="no CUDA device is visible"):
        calibrate_gpu_once(lambda _: None)
    assert not cached_path(0, "cuda").exists() and list(cache.iterdir()) == []


def test_train_calibrates_the_device_its_workers_train_on(cache, monkeypatch, capsys):
    calls = []

    def gpu(progress):
        calls.append("gpu")
        raise RuntimeError("paraloom: error: --device 'cuda': no CUDA device is visible")

    monkeypatch.setattr(machine_profile, "calibrate_gpu_once", gpu)
    monkeypatch.setattr(calibrate, "calibrate_once", lambda threads, progress: calls.append("cpu"))
    cli_train._calibrate_once(load_config(None, ["run.device=cpu"]))
    assert calls == ["cpu"]
    calls.clear()
    cli_train._calibrate_once(load_config(None, ["run.device=cuda"]))
    assert calls == ["gpu"]  # a failure is a note: never the CPU's rates for a GPU run
    err = capsys.readouterr().err
    assert "calibrating this machine failed" in err and "no CUDA device is visible" in err
    calls.clear()
    monkeypatch.setattr(cli_train.prestart, "gpu_visible", lambda: False)
    cli_train._calibrate_once(load_config(None, ["run.device=auto"]))  # no GPU here: the CPU's
    assert calls == ["cpu"]
    cli_train._calibrate_once(load_config(None, ["run.device=cuda", "run.hardware=none"]))
    assert calls == ["cpu"]  # nothing to calibrate
