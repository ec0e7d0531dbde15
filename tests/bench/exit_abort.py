"""Reproduction harness for the exit-time abort ("terminate called without an active
exception", seen in 4 of 37 instrumented runs with attach_ddp): runs the instrumented
DDP tutorial N times under torchrun and counts runs that did not end cleanly.

    python -m tests.bench.exit_abort --runs 40
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.procs import REPO


def one_run(tmp: Path, i: int) -> tuple[int, bool]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", str(REPO / "examples" / "ddp_tutorial.py"), "1", "1",
           "--snapshot", str(tmp / f"s{i}.pt")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CLUSTERPULSE_AGENT": "none",
           "PYTHONPATH": str(REPO)}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    out = p.stdout + p.stderr
    return p.returncode, "terminate called" in out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=40, help="runs (default: 40)")
    a = ap.parse_args()
    bad = aborts = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.runs):
            rc, aborted = one_run(Path(tmp), i)
            bad += rc != 0
            aborts += aborted
            print(f"run {i + 1}/{a.runs}: exit {rc}{' ABORT' if aborted else ''}", flush=True)
    print(f"RESULT runs={a.runs} failed={bad} terminate_called={aborts}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
