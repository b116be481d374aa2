"""A failed node's error carries the end of its log (the log's directory may be gone by then)."""

import subprocess
import sys

import pytest

from paraloom.cluster.torchrun import _wait_all
from paraloom.config.errors import WorkersFailed


def test_failed_node_error_quotes_its_log(tmp_path):
    (tmp_path / "node1.log").write_text("".join(f"line {i}\n" for i in range(40)) + "the cause\n")
    ok = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    bad = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        with pytest.raises(WorkersFailed) as info:
            _wait_all([ok, bad], tmp_path)
    finally:
        ok.kill()
        ok.wait()
    assert info.value.exitcode == 3
    message = str(info.value)
    assert "node 1 failed (exit code 3)" in message and message.endswith("the cause")
    assert "line 10\n" not in message and "line 39" in message  # the tail only
