"""clusterpulse.integrations.lightning on a real Lightning job (tests/support/
lightning_job.py: a tiny model built in code, 2 ranks, gloo) under clusterpulse-train
with a real agent, its ranks started warm (`--preload lightning.pytorch`): a compute
straggler and a data straggler flagged on the right rank with the right figures, a
graceful checkpoint-restart, and a crash; after each resume every rank trains exactly
the batches an uninterrupted run trains at that step (none replayed, none lost)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from torch.utils.data import DistributedSampler

from tests.conftest import start_agent
from tests.support.procs import REPO, wait_until
from tests.support.torchrun import launcher_cmd, start_logged, stop_group

pytestmark = [pytest.mark.integration, pytest.mark.slow]

JOB = REPO / "tests" / "support" / "lightning_job.py"
BATCHES, BATCH_SIZE, WORLD = 400, 4, 2  # per rank per epoch; one epoch


def _expected_index(rank: int, step: int) -> int:
    """The first sample of a step's batch on a rank in an uninterrupted run: Lightning
    deals the training set with a shuffling DistributedSampler (seed 0, epoch 0)."""
    if rank not in _ORDER:
        sampler = DistributedSampler(range(BATCHES * BATCH_SIZE * WORLD), num_replicas=WORLD,
                                     rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(0)
        _ORDER[rank] = list(sampler)
    return _ORDER[rank][(step - 1) * BATCH_SIZE]


_ORDER: dict[int, list[int]] = {}


def test_lightning_job_through_stragglers_graceful_restart_and_crash(tmp_path: Path):
    control = tmp_path / "control"
    control.mkdir()
    running, server = start_agent(tmp_path)
    log = tmp_path / "lightning.log"
    p = start_logged(launcher_cmd(2, 1, [
        "--epochs", "1", "--batches", str(BATCHES), "--batch-size", str(BATCH_SIZE),
        "--checkpoint", str(tmp_path / "last.ckpt"), "--control", str(control),
        "--run-id", "lit", "--step-seconds", "0.05"], script=str(JOB),
        preload=["lightning.pytorch"]), log, tmp_path,
        {"CLUSTERPULSE_AGENT": running.telemetry})
    try:
        def ranks() -> dict:
            return {r.rank: r for r in running.agent.ranks.of_run("lit")}

        def flagged(rank: int) -> bool:
            return ranks()[rank].values.get("straggler_flagged") == 1

        wait_until(lambda: len(ranks()) == 2 and min(r.step for r in ranks().values()) > 20,
                   240, "both ranks past step 20")
        # 1. a compute straggler: rank 1's training_step is slow
        (control / "slow_compute_1").touch()
        wait_until(lambda: flagged(1) and not flagged(0), 120, "rank 1 flagged")
        v = ranks()[1].values
        assert v["compute_seconds"] > 0.15 and v["data_wait_seconds"] < 0.05, v
        (control / "slow_compute_1").unlink()
        wait_until(lambda: not flagged(1), 120, "rank 1's flag to clear")
        # 2. a data straggler: rank 0's samples load slowly; the wait is input, not compute
        (control / "slow_data_0").touch()
        wait_until(lambda: flagged(0) and not flagged(1), 120, "rank 0 flagged")
        v0, v1 = ranks()[0].values, ranks()[1].values
        assert v0["data_wait_seconds"] > 0.08 and v1["data_wait_seconds"] < 0.05, (v0, v1)
        assert v0["compute_seconds"] < v0["data_wait_seconds"], v0
        (control / "slow_data_0").unlink()
        # 3. a graceful checkpoint-restart: every rank saves, acknowledges and resumes
        r = running.post("/v1/runs/lit/actions", {"action": "checkpoint-restart",
                                                  "reason": "test", "requested_by": "ops"})
        assert r.status_code == 202, r.text
        cid = r.json()["id"]
        wait_until(lambda: running.get(f"/v1/commands/{cid}").json()["state"] == "completed",
                   240, "the graceful command to complete")
        status = running.get(f"/v1/commands/{cid}").json()
        assert status["acknowledged"] == [0, 1] and status["resumed"] == [0, 1], status
        # 4. a crash: SIGKILL of rank 0, restarted by torchrun (its one failure restart)
        wait_until(lambda: all(r.process_steps > 2 for r in ranks().values()), 120,
                   "both ranks stepping again")
        os.kill(ranks()[0].pid, signal.SIGKILL)
        wait_until(lambda: log.read_text().count("resuming from") >= 2, 240,
                   "the resume after the crash")
        (control / "fast").touch()
        assert p.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        stop_group(p)
        server.shutdown()
        running.agent.stop()
    text = log.read_text()
    assert "graceful restart 1: relaunching" in text
    assert f"done: {BATCHES} steps" in text
    assert "not resumable" not in text  # Lightning found the loader's position
    # each resume started right after the checkpoint's step, on the batch due there
    trained = [(int(r), int(s), int(i)) for r, s, i in
               re.findall(r"trained rank=(\d) step=(\d+) idx=(\d+)", text)]
    assert trained and all(i == _expected_index(r, s) for r, s, i in trained), \
        [t for t in trained if t[2] != _expected_index(t[0], t[1])][:5]
    resumed = [int(s) for s in re.findall(r"resuming from \S+ at step (\d+)", text)]
    assert len(resumed) == 2, text[-3000:]
    for step in resumed:
        assert (0, step + 1, _expected_index(0, step + 1)) in trained
    last = {}
    for r, s, _ in trained:
        last[r] = s
    assert last == {0: BATCHES, 1: BATCHES}
