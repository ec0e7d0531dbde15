"""The README's recipe, run as is: examples/ddp_tutorial.py (the PyTorch DDP tutorial
script, instrumented) under clusterpulse-train with a real agent, its ranks started warm
(`--preload torch`), through a slow-data rank, a graceful checkpoint-restart and a
crash, ending bit-exactly where an uninterrupted run started cold ends. Also: the
README shows exactly that file."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import start_agent
from tests.support.procs import REPO, wait_until
from tests.support.torchrun import launcher_cmd, start_logged, stop_group

pytestmark = pytest.mark.integration

SCRIPT = REPO / "examples" / "ddp_tutorial.py"
EPOCHS = "60"  # 32 steps each on 2 ranks: long enough for every event below


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _forked_warm(pid: int) -> bool:
    """Whether the rank is a child of the warm-start server (torchrun's forkserver)."""
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return b"forkserver" in Path(f"/proc/{ppid}/cmdline").read_bytes()


def _stall_data_workers(pid: int, stop: threading.Event) -> None:
    """Freeze the rank's DataLoader worker processes most of the time (a stalled input
    pipeline: slow storage, a starved CPU), from outside the script."""
    while not stop.is_set():
        kids = _children(pid)
        for k in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(k, signal.SIGSTOP)
        time.sleep(0.3)
        for k in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(k, signal.SIGCONT)
        time.sleep(0.03)


def _digest(log: str) -> str:
    found = re.findall(r"done: (\d+) steps, parameters ([0-9a-f]{64})", log)
    assert found, log[-4000:]
    return found[-1][1]


def test_readme_shows_exactly_the_tutorial_file():
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"<!-- examples/ddp_tutorial.py -->\n```python\n(.*?)```", readme,
                        re.S)
    assert blocks == [SCRIPT.read_text()]


@pytest.mark.slow
def test_tutorial_through_slow_data_graceful_restart_and_crash(tmp_path):
    clean_log = tmp_path / "clean.log"
    p = start_logged(launcher_cmd(2, 0, [EPOCHS, "2", "--snapshot", str(tmp_path / "c.pt")],
                                  script=str(SCRIPT)), clean_log, tmp_path,
                     {"CLUSTERPULSE_AGENT": "none"})
    try:
        assert p.wait(timeout=900) == 0, clean_log.read_text()[-4000:]
    finally:
        stop_group(p)
    clean = _digest(clean_log.read_text())

    running, server = start_agent(tmp_path)
    log = tmp_path / "tutorial.log"
    p = start_logged(launcher_cmd(2, 1, [EPOCHS, "2", "--snapshot", str(tmp_path / "s.pt"),
                                         "--run-id", "tut"], script=str(SCRIPT),
                                  preload=["torch"]), log, tmp_path,
                     {"CLUSTERPULSE_AGENT": running.telemetry})
    stop = threading.Event()
    try:
        def ranks() -> dict:
            return {r.rank: r for r in running.agent.ranks.of_run("tut")}

        wait_until(lambda: len(ranks()) == 2 and min(r.step for r in ranks().values()) > 20,
                   300, "both ranks past step 20")
        assert all(_forked_warm(r.pid) for r in ranks().values())
        # 1. a slow-data rank: its input wait shows, not as compute
        staller = threading.Thread(target=_stall_data_workers, args=(ranks()[1].pid, stop))
        staller.start()
        wait_until(lambda: ranks()[1].values.get("data_wait_seconds", 0) > 0.1
                   and ranks()[0].values.get("data_wait_seconds", 1) < 0.05, 120,
                   "rank 1's data wait to show (rank 0's to stay small)")
        stop.set()
        staller.join()
        # 2. a graceful checkpoint-restart: every rank resumes, none recomputes
        r = running.post("/v1/runs/tut/actions", {"action": "checkpoint-restart",
                                                  "reason": "test", "requested_by": "ops"})
        assert r.status_code == 202, r.text
        cid = r.json()["id"]
        wait_until(lambda: running.get(f"/v1/commands/{cid}").json()["state"] == "completed",
                   300, "the graceful command to complete")
        status = running.get(f"/v1/commands/{cid}").json()
        assert status["acknowledged"] == [0, 1] and status["resumed"] == [0, 1]
        # 3. a crash (SIGKILL of rank 0), restarted by torchrun with its one failure restart
        pid = ranks()[0].pid
        os.kill(pid, signal.SIGKILL)
        assert p.wait(timeout=900) == 0, log.read_text()[-4000:]
    finally:
        stop.set()
        stop_group(p)
        server.shutdown()
        running.agent.stop()
    text = log.read_text()
    assert "graceful restart 1: relaunching" in text
    assert text.count("Resuming training from snapshot") >= 2  # after graceful, after crash
    assert _digest(text) == clean
