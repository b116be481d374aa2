"""The emulated cluster for real: namespaces, shaped links, runs across them, and cleanup."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from scripts import run_script

from paraloom.cli import main
from paraloom.cluster import ClusterSpec, EmulatedCluster, list_clusters, parse_rate
from paraloom.cluster.torchrun import link_throughput

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parents[2]


def _ours(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def _name() -> str:
    return f"t{os.getpid() % 10000}{int(time.monotonic() * 10) % 100}"


def test_links_are_shaped_and_down_removes_everything():
    spec = ClusterSpec(2, parse_rate("100mbit"), _name())
    with EmulatedCluster(spec) as cluster:
        assert list_clusters()[spec.name].spec == spec
        assert len(_ours(f"plm-{spec.name}-")) == 3  # two nodes and the bridge
        mbps = max(link_throughput(cluster, 4 << 20))
        assert 0.85 * 12.5 <= mbps <= 1.02 * 12.5  # 100 Mbit/s = 12.5 MB/s, less TCP/IP headers
        peer = "('::ffff:10.98.0.2', 0, 0, 0)"  # as a dual-stack socket sees node 1: found by name
        named = subprocess.run([*cluster.exec_prefix(0), sys.executable, "-c",
                                f"import socket; print(socket.getnameinfo({peer}, 0)[0])"],
                               capture_output=True, text=True, timeout=30)
        assert named.stdout.strip() == f"plm-{spec.name}-n1", named.stderr
    assert _ours(f"plm-{spec.name}-") == [] and not list(Path("/etc/netns").glob(f"plm-{spec.name}-*"))


def test_an_error_inside_the_cluster_still_brings_it_down():
    spec = ClusterSpec(3, parse_rate("1gbit"), _name())
    with pytest.raises(RuntimeError, match="inside"), EmulatedCluster(spec):
        assert len(_ours(f"plm-{spec.name}-")) == 4
        raise RuntimeError("failure inside")
    assert _ours(f"plm-{spec.name}-") == []


def test_cli_up_status_down(capsys):
    name = _name()
    try:
        assert main(["cluster", "up", "--nodes", "2", "--bandwidth", "1gbit", "--name", name]) == 0
        assert main(["cluster", "status"]) == 0
        assert f"{name}: 2 nodes, 1gbit links" in capsys.readouterr().out
        assert main(["cluster", "up", "--nodes", "2", "--name", name]) == 2
        assert "already up" in capsys.readouterr().err
    finally:
        assert main(["cluster", "down", "--name", name]) == 0
    assert _ours(f"plm-{name}-") == []
    assert main(["cluster", "down", "--name", name]) == 2  # no longer up
    assert main(["train", "--cluster", name]) == 2
    assert "no emulated cluster" in capsys.readouterr().err
    assert main(["train", "--cluster", name, "--emulate", "2x1gbit"]) == 2
    assert main(["cluster", "up", "--latency", "5ms", "--name", name]) == 2
    assert "netem" in capsys.readouterr().err
    assert _ours(f"plm-{name}-") == []


NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
# prints the installed packages `paraloom cluster up` loads on its way to the root check: the same
# parsing and command, stopped (by --latency) before anything is made
_LOADED_BY_CLUSTER_UP = (
    "import site, sys\n"
    "before = set(sys.modules)\n"
    "from paraloom.cli import main\n"
    "assert main(['cluster', 'up', '--nodes', '2', '--name', 'probe', '--latency', '5ms']) == 2\n"
    "roots = tuple(site.getsitepackages())\n"
    "for name in sorted(set(sys.modules) - before):\n"
    "    mod, where = sys.modules[name], getattr(sys.modules[name], '__file__', None) or ''\n"
    "    if '.' not in name and where.startswith(roots):\n"
    "        print(list(mod.__path__)[0] if hasattr(mod, '__path__') else where)\n")


def _copy_for_anyone(lib: Path) -> None:
    """src/paraloom and the installed packages the CLI needs on its way to the root check, copied
    into `lib` and readable by every user: the checkout (and the venv inside it) may sit in a
    directory only its owner can enter, such as a clone under /root or `mktemp -d`."""
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "src" / "paraloom", lib / "paraloom", ignore=ignore)
    found = subprocess.run([sys.executable, "-c", _LOADED_BY_CLUSTER_UP], capture_output=True, text=True,
                           timeout=60)
    assert found.returncode == 0, found.stderr
    for source in map(Path, found.stdout.split()):
        if source.is_dir():
            shutil.copytree(source, lib / source.name, ignore=ignore)
        else:
            shutil.copy(source, lib / source.name)
    for folder, _, files in os.walk(lib):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)


def _python_for_nobody(cwd: Path) -> str:
    """A Python interpreter of this version that user nobody can run: the venv's `bin/python`
    lies inside the checkout, so try what it points at, then the system's."""
    want = "{}.{}".format(*sys.version_info[:2])
    version = "import sys; print(*sys.version_info[:2], sep='.')"
    candidates = [os.path.realpath(sys.executable), getattr(sys, "_base_executable", ""),
                  shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "",
                  f"/usr/bin/python{want}"]
    for python in dict.fromkeys(filter(None, candidates)):
        try:
            probe = subprocess.run([*NOBODY, python, "-c", version],
                                   capture_output=True, text=True, cwd=cwd, timeout=30)
        except OSError:
            continue
        if probe.returncode == 0 and probe.stdout.strip() == want:
            return python
    pytest.skip(f"no Python {want} interpreter that user nobody can run (tried {candidates})")


def test_without_root_it_is_one_line_and_exit_2():
    """Run as user nobody, from a copy of what the CLI needs that every user can read."""
    where = Path(tempfile.mkdtemp(prefix="paraloom-nobody-", dir="/tmp"))
    try:
        os.chmod(where, 0o755)
        _copy_for_anyone(where / "lib")
        env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
        env.update(PYTHONPATH=str(where / "lib"), PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1")
        proc = subprocess.run([*NOBODY, _python_for_nobody(where), "-m", "paraloom", "cluster", "up",
                               "--nodes", "2", "--name", _name()],
                              capture_output=True, text=True, cwd=where, env=env, timeout=60)
    finally:
        shutil.rmtree(where)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "paraloom: error: the emulated cluster needs root or CAP_NET_ADMIN (network namespaces); "
        "run as root"]


def test_train_on_an_emulated_cluster_with_a_hand_written_all_reduce(tmp_path, monkeypatch):
    """Also: the run is priced from this machine's profile for 1 Gbit/s emulated links (cached here
    beforehand, so nothing is calibrated), never from loopback's."""
    from paraloom.config.sections import threads_per_worker
    from paraloom.perfmodel.hardware import load_hardware
    from paraloom.perfmodel.measure.machine_profile import cached_path

    monkeypatch.setenv("PARALOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PARALOOM_HARDWARE")
    profile = cached_path(threads_per_worker(1), link="1gbit")
    profile.parent.mkdir()
    profile.write_text(load_hardware("v100-10gbe").to_yaml())
    before = set(_ours("plm-"))
    proc = subprocess.run(
        [sys.executable, "-m", "paraloom", "train", "--emulate", "2x1gbit", "--set", "optim.max_steps=4",
         "--set", "run.log_every=2", "--set", "comm.algorithm=ring", "--set", "run.name=emu",
         "--set", f"run.out_dir={tmp_path}"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-6000:]
    summary = json.loads((tmp_path / "emu" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4 and summary["comm_bytes_per_step"] > 0
    assert summary["restarts"] == 0 and "paraloom: error" not in proc.stderr  # a prediction is no run
    assert "hostname of the client socket cannot be retrieved" not in proc.stderr  # peers have names
    assert set(_ours("plm-")) == before
    predicted = json.loads((tmp_path / "emu" / "prediction.json").read_text())
    assert predicted["hardware"] == "v100-10gbe" and predicted["hardware_chosen"] == str(profile)
    assert predicted["plan"].startswith("dp2") and "calibrating" not in proc.stderr


def test_parameter_server_traffic_crosses_the_shaped_links(tmp_path):
    """2 workers and a server on 3 nodes at 100 Mbit/s: each step moves 2 x 1.2 MB into the server
    and 2 x 1.2 MB out of it (~0.2 s each way over its link; ~2 ms over loopback)."""
    proc = subprocess.run(
        [sys.executable, "-m", "paraloom", "train", "--emulate", "3x100mbit", "--set", "parallel.mode=ps",
         "--set", "model.name=mlp", "--set", "model.hidden=512", "--set", "model.depth=2",
         "--set", "optim.max_steps=4", "--set", "run.name=ps", "--set", f"run.out_dir={tmp_path}"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    summary = json.loads((tmp_path / "ps" / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["servers"] == 1 and summary["steps"] == 4
    server = summary["servers_stats"][0]
    assert server["slices"] == 3 and server["pushes_applied"] == 8 * 3  # 1.2 MB in slices of <= 0.5 MB
    assert summary["comm_seconds_per_step"] > 0.25, summary["comm_seconds_per_step"]


@pytest.mark.parametrize(("sig", "delay"),
                         [(signal.SIGINT, 1.0), (signal.SIGINT, 6.0), (signal.SIGTERM, 4.0)])
def test_an_interrupted_run_leaves_nothing_behind(tmp_path, sig, delay):
    before = set(_ours("plm-"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "paraloom", "train", "--emulate", "2x1gbit", "--set", "optim.epochs=500",
         "--set", f"run.out_dir={tmp_path}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
        # a background shell (CI may be one) starts us with SIGINT ignored, and children inherit
        # that; a terminal's Ctrl-C reaches a process whose SIGINT is at its default
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while len(set(_ours("plm-")) - before) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(set(_ours("plm-")) - before) == 3
        time.sleep(delay)  # torchrun / the workers are starting inside the namespaces
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # Ctrl-C reaches the whole foreground group
        else:
            os.kill(proc.pid, sig)  # a plain kill reaches paraloom alone
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            for ns in set(_ours("plm-")) - before:  # do not let a failure leak running workers
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
                subprocess.run(["kill", "-9", *pids.split()], capture_output=True)
    assert proc.returncode != 0
    assert set(_ours("plm-")) == before
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left in the session: {left}"


@pytest.mark.timeout(400)
def test_collectives_benchmark_quick(tmp_path):
    out = tmp_path / "c.json"
    run_script("collectives.py", "--quick", "--json", str(out), timeout=330)
    report = json.loads(out.read_text())
    assert report["summary"]["link_MBps"] > 50
    assert set(report["summary"]["busbw_frac_16MB"]) == {
        "native", "ring", "halving_doubling", "tree", "one_to_all"}
    assert all(r["busbw_MBps"] > 0 for r in report["results"])


def test_collective_traffic_really_crosses_the_shaped_links():
    from paraloom.bench.allreduce_sweep import run_collectives

    spec = ClusterSpec(2, parse_rate("100mbit"), _name())
    with EmulatedCluster(spec) as cluster:
        report = run_collectives(sizes=[4 << 20], algorithms=["native", "ring"], cluster=cluster,
                                 min_repeats=3, max_repeats=3, budget_s=0.1, progress=False)
    link = report["link_MBps"]
    assert 10.0 <= link <= 12.8
    for row in report["results"]:  # over loopback this would be ~100x faster
        assert 0.6 * link <= row["busbw_MBps"] <= 1.1 * link, row


@pytest.mark.timeout(400)
def test_dp_schedulers_benchmark_quick(tmp_path):
    out = tmp_path / "dp.json"
    run_script("dp_schedulers.py", "--quick", "--json", str(out), timeout=330)
    report = json.loads(out.read_text())
    summary = report["summary"]
    for key in ("ratio_waitfree_vs_ddp", "ratio_priority_vs_waitfree", "ratio_odsgd_vs_waitfree",
                "ratio_waitfree_vs_ddp_loopback", "balanced_bandwidth_bits"):
        assert summary[key] > 0, key
    assert summary["balanced_bandwidth"].endswith("bit")
    for case in report["cases"].values():
        assert set(case["seconds"]) == {"compute", "allreduce", "ddp", "ddp_view", "fifo", "wait_free",
                                        "priority", "auto", "one_step_delay", "local_sgd"}
        assert case["auto_chose"][0] in ("fifo", "wait_free", "priority")
        assert set(case["auto_trials"][0]) == {"fifo", "wait_free", "priority"}  # what the trials measured
    assert set(summary["ratio_auto_vs_best_fixed"]) == set(report["cases"])


def test_calibration_measures_gloos_all_reduce_per_dtype_on_a_cluster_like_another():
    from paraloom.cli.options import link_timers
    from paraloom.cli.perf import _emulated_like
    from paraloom.perfmodel.measure.calibrate import measure_groups

    with EmulatedCluster(ClusterSpec(2, parse_rate("1gbit"), _name())) as pair:
        with _emulated_like(pair, 3) as trio:
            assert trio.nodes == 3 and trio.spec.rate_bits == pair.spec.rate_bits
            constants = measure_groups(link_timers(), [trio])
    assert len(constants) == 9
    for dtype in ("float32", "float16", "bfloat16"):  # about the 1 Gbit/s link, whatever the dtype
        assert 80e6 < constants[f"allreduce.n3.{dtype}.native.bandwidth"] < 200e6, constants
        assert constants[f"allreduce.n3.{dtype}.native.latency"] >= 0
        assert 0 < constants[f"allreduce.n3.{dtype}.native.cpu_s_per_byte"] < 1e-7  # < 100 ns a byte
