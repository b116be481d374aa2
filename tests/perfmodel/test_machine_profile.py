"""This machine's cached profiles: one per thread count for CPU workers, one for its GPUs, each made
on first use; a GPU run is never priced from the CPU's rates."""

import json
import sys

import pytest
import torch
from test_contract import SMALL

from paraloom.cli import train as cli_train
from paraloom.cli.options import link_timers
from paraloom.config import load_config
from paraloom.perfmodel.hardware import load_hardware
from paraloom.perfmodel.measure import calibrate, machine_profile
from paraloom.perfmodel.measure.machine_profile import (
    cached_path,
    cached_source,
    calibrate_gpu_once,
    resolve_hardware,
)
from paraloom.perfmodel.runs.contract import load_or_predict


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
    monkeypatch.setattr(calibrate, "calibrate_once", lambda *a, **k: calls.append("cpu"))
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


def test_a_run_on_an_emulated_cluster_is_priced_with_links_measured_across_one(cache, tmp_path, monkeypatch):
    """The launcher calibrates once per link rate, across the cluster it is given (here a stand-in),
    and prices the run from that profile before launch, also when it resizes; loopback's stays."""
    from types import SimpleNamespace

    from paraloom.config.sections import threads_per_worker
    from paraloom.perfmodel.hardware import Link
    from paraloom.perfmodel.runs.contract import replan

    cluster = SimpleNamespace(nodes=2, spec=SimpleNamespace(rate="1gbit"))
    fast, slow = Link("loopback", 1e9, 1e-4), Link("emulated 1gbit", 1.2e8, 2e-4)
    rates = {"matmul": 5e10, "conv": 2e10, "attention": 2e10, "other": 1e9, "bandwidth": 1e10}
    calls = []

    def measure(*, timers, cluster=None, threads=1, name="", progress=lambda _: None):
        calls.append(cluster)
        return calibrate.build_profile(rates, fast, slow if cluster else fast, name=name, devices_per_node=1,
                                       host_cores=2), {}

    monkeypatch.setattr(calibrate, "calibrate", measure)
    said, cfg = [], load_config(None, SMALL)
    threads = threads_per_worker(cfg.parallel.nproc)  # what the launcher measures with
    path = calibrate.calibrate_once(threads, said.append, link_timers(), cluster=cluster)
    assert path == cached_path(threads, link="1gbit") and path.name.endswith(f"-{threads}t-1gbit.yaml")
    assert calls == [cluster]
    assert "across an emulated 1gbit cluster" in said[0]
    assert cli_train._calibrate_once(cfg, cluster) == path  # cached now
    again = calibrate.calibrate_once(threads, said.append, link_timers())
    assert again == cached_path(threads) and calls == [cluster, None]
    terms = {}
    for name, kwargs in (("loopback", {}), ("cluster", {"cached": path})):
        (tmp_path / name).mkdir()
        predicted = load_or_predict(tmp_path / name, cfg, 2, threads, "cpu", **kwargs)
        terms[name] = predicted["terms"]["communication"]
    assert predicted["hardware"].endswith(f"(emulated 1gbit, {threads} threads)")
    assert predicted["hardware_file"] == predicted["hardware_chosen"] == str(path)
    assert predicted["hardware_threads"] == threads  # what the run's end measures again with
    assert terms["cluster"] > 2 * terms["loopback"]  # 1 Gbit/s against 8 Gbit/s
    replan(tmp_path / "cluster", cfg, 2, 3, threads)  # a node joined: still that cluster's links
    again = json.loads((tmp_path / "cluster" / "prediction.json").read_text())
    assert again["hardware"] == predicted["hardware"] and again["hardware_chosen"] == str(path)


def test_a_run_whose_profile_overstates_this_machine_is_told_to_calibrate_again(cache, tmp_path):
    """End to end: a cached CPU profile twenty times this machine's rates prices the run far too
    fast; at its end `paraloom train` measures the machine again and names the file to delete."""
    import os
    import subprocess

    from paraloom.perfmodel.hardware import Link

    rates = {name: 20 * rate for name, rate in calibrate.measure_compute(1).items()}
    link = Link("loopback", 1e9, 1e-4)
    hw = calibrate.build_profile(rates, link, link, name="overstated", devices_per_node=1, host_cores=2)
    cache.mkdir()
    cached_path(1).write_text(hw.to_yaml())  # what 2 workers on 2 cores read: one thread each
    done = subprocess.run([sys.executable, "-m", "paraloom", "train", "--nproc", "2",
                           *[arg for key in [*SMALL, f"run.out_dir={tmp_path}"] for arg in ("--set", key)]],
                          capture_output=True, text=True, timeout=110, env=dict(os.environ, COLUMNS="1000"))
    assert done.returncode == 0, done.stderr[-2000:]
    err = " ".join(done.stderr.split())
    assert "measures the machine again at the run's end to tell which" in err  # the warning, mid-run
    assert "prediction: measuring this machine's rates again" in err
    assert "compute: this machine now computes at" in err and "slower than when it was calibrated" in err
    assert f"delete {cached_path(1)}" in err
    (summary,) = tmp_path.glob("*/summary.json")
    assert "compute" in json.loads(summary.read_text())["contract"]["warned"]  # rank 0's warnings, kept
