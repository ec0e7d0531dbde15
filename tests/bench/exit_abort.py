"""Reproduction harness for the exit-time abort ("terminate called without an active
exception", seen in 4 of 37 instrumented runs with attach_ddp): runs the instrumented
DDP tutorial (or, with --trainer, the reference trainer's fault-free 2-rank DDP run
with checkpoints, as the recovery tests' baseline) N times under torchrun and counts
runs that did not end cleanly. Ranks run with Python's faulthandler on, so an abort
prints every thread's Python stack; each failed run's output is kept under --keep.

    python -m tests.bench.exit_abort --runs 40
    python -m tests.bench.exit_abort --runs 40 --agent --concurrent 2   # as reported:
        # ranks talking to a real agent, on a machine busy with other runs
    python -m tests.bench.exit_abort --runs 60 --trainer --keep /tmp/aborts
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.support.procs import REPO, start_agent_cli
from tests.support.torchrun import torchrun_cmd


def one_run(tmp: Path, i: int, agent: str, trainer: bool, keep: Path | None
            ) -> tuple[int, bool]:
    if trainer:
        ckpt = tmp / f"run{i}"
        ckpt.mkdir()
        cmd = torchrun_cmd(2, 0, ["--preset", "tiny", "--steps", "40", "--ckpt-every", "10",
                                  "--ckpt-dir", str(ckpt), "--agent", agent,
                                  "--parallel", "ddp"])
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", str(REPO / "examples" / "ddp_tutorial.py"), "1", "1",
               "--snapshot", str(tmp / f"s{i}.pt")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CLUSTERPULSE_AGENT": agent,
           "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    out = p.stdout + p.stderr
    if p.returncode != 0 and keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        (keep / f"run{i}.log").write_text(out)
    return p.returncode, "terminate called" in out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=40, help="runs (default: 40)")
    ap.add_argument("--agent", action="store_true",
                    help="start a real agent and send the ranks' telemetry to it")
    ap.add_argument("--concurrent", type=int, default=1,
                    help="runs at a time, to load the machine (default: 1)")
    ap.add_argument("--trainer", action="store_true",
                    help="run the reference trainer (40 steps, checkpoints) instead of the "
                         "tutorial")
    ap.add_argument("--keep", type=Path, help="folder for the output of each failed run")
    a = ap.parse_args()
    bad = aborts = done = 0
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        proc, address = None, "none"
        if a.agent:
            proc, _, address = start_agent_cli(tmp, "abort-node", gpus=2)
        try:
            with ThreadPoolExecutor(max(1, a.concurrent)) as pool:
                for rc, aborted in pool.map(
                        lambda i: one_run(tmp, i, address, a.trainer, a.keep), range(a.runs)):
                    done += 1
                    bad += rc != 0
                    aborts += aborted
                    print(f"run {done}/{a.runs}: exit {rc}{' ABORT' if aborted else ''}",
                          flush=True)
        finally:
            if proc is not None:
                proc.stop()
    print(f"RESULT runs={a.runs} trainer={a.trainer} agent={a.agent} "
          f"concurrent={a.concurrent} failed={bad} terminate_called={aborts}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
