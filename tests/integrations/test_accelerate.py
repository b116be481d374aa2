"""examples/accelerate_comm_hook.py under `accelerate launch`, 2 CPU processes: it trains and compresses."""

import os
import re
import socket
import sys

import pytest

pytest.importorskip("accelerate", reason="needs accelerate: pip install paraloom[accelerate]")

from scripts import ROOT, run_command  # noqa: E402

EXAMPLE = ROOT / "examples" / "accelerate_comm_hook.py"
RESULT = re.compile(r"(\w+): 2 processes, (\d+) updates, loss ([\d.]+) -> ([\d.]+), "
                    r"sent (\d+) bytes \(fp32 gradients: (\d+)\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["powersgd", "engine"])
def test_accelerate_example_trains_and_compresses(tmp_path, mode):
    # HF_HOME: no accelerate config of this machine's user may change the launch
    env = {**os.environ, "HF_HOME": str(tmp_path), "GLOO_SOCKET_IFNAME": "lo"}
    proc = run_command([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                        "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                        "--dynamo_backend", "no",
                        "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
                        str(EXAMPLE), mode], timeout=90, env=env)
    found = RESULT.search(proc.stdout)
    assert found, proc.stdout + proc.stderr[-3000:]
    name, updates, first, last, sent, fp32 = found.groups()
    assert name == mode and int(updates) > 30
    assert float(last) < 0.7 * float(first)
    # PowerSGD at rank 2 after 2 plain steps (the hook), or after 10 (the engine's default start)
    assert 0 < int(sent) < 0.5 * int(fp32)
