"""One scenario for every framework integration's test: a job of that framework
(tests/support/*_job.py, steered through files in a control folder) under
clusterpulse-train with a real agent and warm ranks, through a compute straggler, a
data straggler, a crash (resumed from the framework's own periodic checkpoint) and a
graceful checkpoint-restart."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from clusterpulse.detection.causes import attribute
from tests.conftest import start_agent
from tests.support.procs import wait_until
from tests.support.torchrun import launcher_cmd, start_logged, stop_group


def run_through_faults(tmp_path: Path, job: Path, args: list[str], preload: str,
                       run: str) -> str:
    """Run `job ARGS --control DIR --run-id RUN` on 2 ranks through the four faults
    (the job saves a checkpoint of its framework's own every few steps),
    checking what the agent sees of each; the job's log once it has finished."""
    control = tmp_path / "control"
    control.mkdir()
    running, server = start_agent(tmp_path)
    log = tmp_path / "job.log"
    p = start_logged(launcher_cmd(2, 1, [*args, "--control", str(control), "--run-id", run],
                                  script=str(job), preload=[preload]), log, tmp_path,
                     {"CLUSTERPULSE_AGENT": running.telemetry})
    try:
        def ranks() -> dict:
            return {r.rank: r for r in running.agent.ranks.of_run(run)}

        def flagged(rank: int) -> bool:
            return ranks()[rank].values.get("straggler_flagged") == 1

        wait_until(lambda: len(ranks()) == 2 and min(r.step for r in ranks().values()) > 20,
                   240, "both ranks past step 20")
        # 1. a compute straggler: rank 1's forward is slow; rank 0 waits in the all-reduce
        (control / "slow_compute_1").touch()
        wait_until(lambda: flagged(1) and not flagged(0), 120, "rank 1 flagged")
        v = ranks()[1].values
        assert v["compute_seconds"] > 0.15 and v["data_wait_seconds"] < 0.05, v
        (control / "slow_compute_1").unlink()
        wait_until(lambda: not flagged(1), 120, "rank 1's flag to clear")
        # 2. a data straggler: rank 0's samples load slowly; the wait is input, not
        # compute; rank 1 waits for it in a collective (wherever the framework runs
        # one: the HF Trainer's between steps, DDP's in the step): sync wait, not input
        (control / "slow_data_0").touch()
        wait_until(lambda: flagged(0) and not flagged(1), 120, "rank 0 flagged")
        v0, v1 = ranks()[0].values, ranks()[1].values
        assert v0["data_wait_seconds"] > 0.08 and v1["data_wait_seconds"] < 0.05, (v0, v1)
        assert v0["compute_seconds"] < v0["data_wait_seconds"], v0
        assert v1["sync_wait_seconds"] > 0.05, v1
        assert attribute(_own(v0), _own(v1)) == "data_loading", (v0, v1)
        assert v0["data_wait_seconds"] > 0.2 * v0["step_seconds"], v0  # the alert rule's
        (control / "slow_data_0").unlink()
        # 3. a crash before any graceful restart: SIGKILL of rank 0, restarted by
        # torchrun (its one failure restart) from the framework's own periodic save
        before = {r.pid for r in ranks().values()}
        os.kill(ranks()[0].pid, signal.SIGKILL)
        try:
            wait_until(lambda: log.read_text().count("resuming from") >= 1, 240,
                       "the resume after the crash")
        except AssertionError as err:  # what the launcher and the ranks said since
            raise AssertionError(f"{err}\n--- job log ---\n{log.read_text()[-6000:]}") from None
        def stepping_again() -> bool:  # the new processes (the old ones' entries stay)
            live = running.agent.ranks.live_of_run(run)
            return len(live) == 2 and all(r.pid not in before and r.process_steps > 2
                                          for r in live)
        wait_until(stepping_again, 120, "both ranks stepping again")
        # 4. a graceful checkpoint-restart: every rank saves, acknowledges and resumes
        r = running.post(f"/v1/runs/{run}/actions", {"action": "checkpoint-restart",
                                                     "reason": "test", "requested_by": "ops"})
        assert r.status_code == 202, r.text
        cid = r.json()["id"]
        wait_until(lambda: running.get(f"/v1/commands/{cid}").json()["state"] == "completed",
                   240, "the graceful command to complete")
        status = running.get(f"/v1/commands/{cid}").json()
        assert status["acknowledged"] == [0, 1] and status["resumed"] == [0, 1], status
        (control / "fast").touch()  # the rest of the epoch at full speed
        assert p.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        stop_group(p)
        server.shutdown()
        running.agent.stop()
    text = log.read_text()
    assert "graceful restart 1: relaunching" in text
    return text


def _own(v: dict) -> dict:
    """A rank's figures as detection's cause chain reads them: its own time is its
    compute and its data wait, not the wait for its peers."""
    return {"own_seconds": v["compute_seconds"] + v["data_wait_seconds"],
            "data_seconds": v["data_wait_seconds"]}


def assert_last_resume_loaded_only_its_batches(text: str, resumed_at: int, batches: int,
                                               batch_size: int) -> None:
    """The attempt that finished, resumed after step `resumed_at`, loaded the samples of
    the steps it trained (one batch of slack for a prefetch), not the skipped ones: a
    resume that read its way to the position loads the whole epoch's."""
    reads = {int(r): int(n) for r, n in re.findall(r"reads rank=(\d) samples=(\d+)", text)}
    assert sorted(reads) == [0, 1], text[-3000:]
    allowed = (batches - resumed_at + 1) * batch_size
    assert all(n <= allowed for n in reads.values()), (reads, allowed)
