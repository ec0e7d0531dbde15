"""One job at a time in a checkpoint directory (trainer.dirclaim): another job's live
claim is waited for, then refused by name; a claim released, gone stale (its holder
killed outright) or this job's own (a restart) lets the start in at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterpulse.trainer.dirclaim import CLAIM_FILE, DirectoryClaim, DirectoryInUse

# a rank 0 of job "first": claims, beats every 0.1 s, releases on SIGTERM
HOLDER = """
import signal, sys, threading
from pathlib import Path
from clusterpulse.trainer.dirclaim import DirectoryClaim
claim = DirectoryClaim(Path(sys.argv[1]), "first-run", "job-1/first-run", heartbeat_s=0.1)
claim.take(0)
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: done.set())
print("held", flush=True)
done.wait(600)
claim.release()
"""


@pytest.fixture
def holder(tmp_path: Path):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        yield p
    finally:
        p.kill()
        p.wait()


def second(tmp_path: Path, job: str = "job-2/second-run", stale_s: float = 1.0) -> DirectoryClaim:
    return DirectoryClaim(tmp_path, "second-run", job, heartbeat_s=0.1, stale_s=stale_s)


def claim_of(tmp_path: Path) -> dict:
    return json.loads((tmp_path / CLAIM_FILE).read_text())


def test_another_jobs_live_claim_is_waited_for_then_refused_by_name(tmp_path, holder, capsys):
    began = time.monotonic()
    with pytest.raises(DirectoryInUse) as refused:
        second(tmp_path).take(1.5)  # its heartbeat outlives the 1 s staleness: alive
    assert time.monotonic() - began >= 1.5
    message = str(refused.value)
    assert "in use by another job (run 'first-run'" in message, message
    assert f"pid {holder.pid} on " in message and "overwrite each other's" in message
    assert "waiting up to 2 s" in capsys.readouterr().err  # said once while it waited
    assert claim_of(tmp_path)["job"] == "job-1/first-run"  # nothing written over it


def test_a_holder_killed_outright_on_this_host_lets_the_next_job_in_at_once(tmp_path,
                                                                          holder):
    os.kill(holder.pid, signal.SIGKILL)  # nothing released its claim, fresh a moment ago
    holder.wait()
    claim = second(tmp_path, stale_s=600)
    claim.take(0)  # its process is gone: no waiting for the claim to go stale
    try:
        assert claim_of(tmp_path)["job"] == "job-2/second-run"
    finally:
        claim.release()
    assert claim_of(tmp_path)["released"] is True


def another_hosts_claim(tmp_path: Path, age_s: float) -> None:
    """A holder on another node, its last heartbeat `age_s` ago on the file system's
    clock (its mtime), its own clock an hour ahead (what it wrote in the claim)."""
    (tmp_path / CLAIM_FILE).write_text(json.dumps({
        "job": "rdzv:other/first-run", "run": "first-run", "host": "gpu-node-17",
        "pid": 4242, "pidns": "pid:[4026531836]", "heartbeat_unix": time.time() + 3600,
        "released": False}))
    then = time.time() - age_s
    os.utime(tmp_path / CLAIM_FILE, (then, then))


def test_another_hosts_claim_is_judged_by_the_file_systems_clock(tmp_path):
    """Its age is the claim's mtime against a file written now beside it: the holder's
    clock (an hour ahead here) is not the reader's, and skew of 20 s made a dead
    holder look alive and the job fail."""
    another_hosts_claim(tmp_path, age_s=5)
    with pytest.raises(DirectoryInUse, match=r"pid 4242 on gpu-node-17, its last heartbeat 5 s"):
        second(tmp_path, stale_s=45).take(0)
    another_hosts_claim(tmp_path, age_s=50)  # its node died: stale
    second(tmp_path, stale_s=45).take(0)
    assert claim_of(tmp_path)["job"] == "job-2/second-run"


def test_a_job_whose_claim_was_taken_while_it_was_stale_publishes_no_more(tmp_path):
    """A heartbeat that stalled past the limit (a hung mount, a full disk) let another
    job in; when it came back it wrote over that job's claim, and the two alternated,
    neither noticing. Now it sees the other claim, stops and says it has lost."""
    mine = DirectoryClaim(tmp_path, "first-run", "job-1/first-run", heartbeat_s=0.05)
    mine.take(0)
    try:
        another_hosts_claim(tmp_path, age_s=0)  # the other job took it
        deadline = time.monotonic() + 10
        while mine.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mine.lost is not None and mine.lost["host"] == "gpu-node-17"
        time.sleep(0.2)
        assert claim_of(tmp_path)["host"] == "gpu-node-17"  # not written over
    finally:
        mine.release()
    assert claim_of(tmp_path)["released"] is False  # a late release frees no one else's


def test_a_released_claim_lets_the_next_job_in_without_waiting(tmp_path, holder):
    holder.terminate()  # ends as Python ends: released
    holder.wait()
    assert claim_of(tmp_path)["released"] is True
    second(tmp_path, stale_s=600).take(0)  # no waiting for it to go stale
    assert claim_of(tmp_path)["job"] == "job-2/second-run"


def test_a_restart_of_the_same_job_takes_its_own_fresh_claim_at_once(tmp_path, holder):
    os.kill(holder.pid, signal.SIGKILL)  # torchrun's restart: the old rank 0 is gone
    holder.wait()
    second(tmp_path, job="job-1/first-run", stale_s=600).take(0)


def test_a_damaged_claim_stops_no_job(tmp_path):
    for text in ("{not json", '["a list"]', '{"job": 3}', ""):
        (tmp_path / CLAIM_FILE).write_text(text)
        second(tmp_path, stale_s=600).take(0)


def test_the_launchers_torchruns_are_one_job_and_two_launchers_two(monkeypatch):
    """A `--standalone` torchrun draws a new rendezvous id each time: without the
    launcher's job id a graceful relaunch was another job to the claim (its own claim,
    if not released, kept it out for 45 s). A multi-node job is its rendezvous id."""
    from clusterpulse.trainer.dirclaim import JOB_ID_ENV, job_identity
    from clusterpulse.trainer.launch import job_id, parse

    monkeypatch.delenv(JOB_ID_ENV, raising=False)
    single, _ = parse(["--nproc", "2", "--", "--steps", "5"])
    first, other = job_id(single), job_id(single)
    assert first.startswith("launcher:") and first != other
    multi, _ = parse(["--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "h:29400",
                      "--rdzv-id", "slurm-881", "--", "--steps", "5"])
    assert job_id(multi) == "rdzv:slurm-881"
    monkeypatch.setenv(JOB_ID_ENV, first)  # what the launcher hands each torchrun
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a-new-uuid-per-torchrun")
    assert job_identity("llm") == f"{first}/llm"
    monkeypatch.delenv(JOB_ID_ENV)
    assert job_identity("llm") == "a-new-uuid-per-torchrun/llm"
