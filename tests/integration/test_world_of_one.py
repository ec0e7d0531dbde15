"""A world of one (issues #26 item 5, #31): the README's recipe tried on a one-GPU
workstation, `torchrun --nproc-per-node 1 examples/ddp_tutorial.py 20 5`, failed in
DistributedSampler ("Default process group has not been initialized"): init_distributed
made no process group for one rank. One rank now gets a real group of size one, and
the reference trainer goes through a graceful restart and a crash with it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.procs import REPO
from tests.support.torchrun import run_trainer

pytestmark = pytest.mark.integration

CKPT = ["--ckpt-every", "10"]


def test_the_readme_recipe_runs_with_one_process(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=1", "--monitor-interval=0.2",
           str(REPO / "examples" / "ddp_tutorial.py"), "2", "1",
           "--snapshot", str(tmp_path / "s.pt")]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                       env={**os.environ, "OMP_NUM_THREADS": "1",
                            "PYTHONPATH": str(REPO), "CLUSTERPULSE_AGENT": "none"})
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert "done: 128 steps" in log, log[-3000:]  # 2048 samples / 32, two epochs


def test_one_rank_survives_a_graceful_restart_and_a_crash(tmp_path):
    """Under a plain torchrun: a graceful restart at step 10 (exit 42, relaunched by
    torchrun), then a crash at step 25 of the next attempt, resumed from step 20, ends
    bit-exactly where a run without faults ends, each attempt on a process group of
    its own (without one DCP warned it was "assuming the intent is to save in a
    single process")."""
    clean = run_trainer(tmp_path / "clean", nproc=1, steps=30, args=CKPT)
    assert clean.returncode == 0, clean.log[-3000:]
    r = run_trainer(tmp_path / "faults", nproc=1, steps=30, max_restarts=2,
                    args=[*CKPT, "--inject", "graceful:step=10",
                          "--inject", "crash:rank=0:step=25:attempt=1"])
    assert r.returncode == 0, r.log[-3000:]
    assert [(x["cause"], x["resume_step"]) for x in r.summary["restarts"]] == [
        ("checkpoint-restart", 10), ("failure", 20)], r.summary
    assert r.summary["world_size"] == 1 and r.digest == clean.digest
    for run in (clean, r):
        assert "assuming the intent is to save in a single process" not in run.log, \
            run.log[-3000:]
