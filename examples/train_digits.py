"""Run the digits job from Python: the same code path as `paraloom train`."""

import time

from paraloom.config import load_config
from paraloom.run.directory import new_run_dir
from paraloom.run.launch import launch_local

if __name__ == "__main__":  # workers are spawned: keep the launch under the main guard
    cfg = load_config("examples/digits_dp.yaml", ["optim.epochs=4"])
    cfg.validate_world(cfg.parallel.nproc)
    summary = launch_local(cfg, new_run_dir(cfg), started_at=time.time())
    print(f"test accuracy {summary['test_accuracy']:.3f} in {summary['wall_seconds']:.1f} s")
