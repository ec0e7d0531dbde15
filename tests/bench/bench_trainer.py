"""Trainer benchmarks: instrumentation overhead, checkpoint blocking (async vs sync),
and recovery time (fault -> first resumed step) for crash and graceful restarts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from tests.bench.table import Row
from tests.conftest import start_agent
from tests.support.procs import REPO
from tests.support.torchrun import run_trainer, start_trainer


def _worker(preset: str, agent: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "tests/bench/trainer_worker.py", agent, tmp, preset]
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        assert line, p.stdout[-2000:] + p.stderr[-3000:]
        return json.loads(line[7:])


def bench_overhead_and_checkpoints() -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp:
        running, server = start_agent(Path(tmp))
        try:
            rows = []
            for preset in ("tiny", "small"):
                r = _worker(preset, running.telemetry)
                rows.append(Row(f"step time with instrumentation ({preset}, 2 ranks DDP)",
                                r["instrumented"] * 1e3, "ms", baseline=r["bare"] * 1e3,
                                baseline_name="same loop bare", budget="ratio <= 1.01"))
            rows.append(Row("consensus exchange (2 floats/rank all_gather, every 5 steps)",
                            r["consensus_ms_per_exchange"], "ms"))
            mib = r["state_bytes"] / 2**20
            rows.append(Row(f"checkpoint blocking, async ({mib:.0f} MiB model+optim, small)",
                            r["ckpt_async_s"] * 1e3, "ms", baseline=r["ckpt_sync_s"] * 1e3,
                            baseline_name="synchronous save", budget="ratio <= 0.10"))
            return rows
        finally:
            server.shutdown()
            running.agent.stop()


def bench_recovery() -> list[Row]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        r = run_trainer(Path(tmp) / "crash", steps=60, max_restarts=2, args=[
            "--ckpt-every", "10", "--sim-compute-seconds", "0.02",
            "--inject", "crash:rank=1:step=35:mode=sigkill"])
        assert r.returncode == 0, r.log[-2000:]
        (restart,) = r.summary["restarts"]
        rows.append(Row("crash (SIGKILL) -> first resumed step", restart["downtime_seconds"], "s"))
        rows.append(Row("crash: steps recomputed (checkpoint every 10)",
                        restart["steps_recomputed"], "steps", budget="<= 10"))
    with tempfile.TemporaryDirectory() as tmp:
        running, server = start_agent(Path(tmp))
        try:
            ckpt = Path(tmp) / "graceful"
            proc = start_trainer(ckpt, Path(tmp) / "log", steps=60, max_restarts=2,
                                 agent=running.telemetry,
                                 args=["--ckpt-every", "10", "--sim-compute-seconds", "0.05"])
            deadline = time.time() + 120
            while time.time() < deadline and not any(
                    x.step >= 12 for x in running.agent.ranks.of_run("graceful")):
                time.sleep(0.1)
            requests.post(f"{running.url}/v1/runs/graceful/actions", timeout=5,
                          headers={"Authorization": f"Bearer {running.token}"},
                          json={"action": "checkpoint-restart", "reason": "bench"})
            assert proc.wait(timeout=300) == 0
            summary = json.loads((ckpt / "summary.json").read_text())
            (restart,) = summary["restarts"]
            rows.append(Row("graceful checkpoint-restart -> first resumed step",
                            restart["downtime_seconds"], "s"))
            rows.append(Row("graceful: steps recomputed", restart["steps_recomputed"], "steps",
                            budget="0"))
        finally:
            server.shutdown()
            running.agent.stop()
    return rows


def run() -> list[Row]:
    return bench_overhead_and_checkpoints() + bench_recovery()
