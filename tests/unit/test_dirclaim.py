"""One job at a time in a checkpoint directory (trainer.dirclaim): another job's live
claim is waited for, then refused by name; a claim released, gone stale (its holder
killed outright) or this job's own (a restart) lets the start in at once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterpulse.trainer.dirclaim import (
    CLAIM_FILE,
    DISPLACED_FILE,
    DirectoryClaim,
    DirectoryInUse,
)

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


MADE: list[DirectoryClaim] = []


@pytest.fixture(autouse=True)
def released_at_the_end():
    """Every claim `second` made is released after its test: its heartbeat thread would
    beat for the rest of the session."""
    yield
    while MADE:
        MADE.pop().release()


def second(tmp_path: Path, job: str = "job-2/second-run", stale_s: float = 1.0) -> DirectoryClaim:
    MADE.append(DirectoryClaim(tmp_path, "second-run", job, heartbeat_s=0.1, stale_s=stale_s))
    return MADE[-1]


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


def other_claim(**changed) -> dict:
    """A claim of another node's process (its hostname and PID namespace inode may be
    this one's: another kernel's boot id), its clock an hour ahead of this one."""
    return {"job": "rdzv:other/first-run", "run": "first-run", "host": socket.gethostname(),
            "pid": os.getpid(), "boot": "another-kernel", "pidns": "pid:[4026531836]",
            "heartbeat_unix": time.time() + 3600, "released": False, **changed}


def another_hosts_claim(tmp_path: Path, age_s: float) -> None:
    """A holder on another node, its last heartbeat `age_s` ago on the file system's
    clock (its mtime), its own clock an hour ahead (what it wrote in the claim)."""
    (tmp_path / CLAIM_FILE).write_text(json.dumps(other_claim()))
    then = time.time() - age_s
    os.utime(tmp_path / CLAIM_FILE, (then, then))


def test_another_hosts_claim_is_judged_by_the_file_systems_clock(tmp_path):
    """Its age is the claim's mtime against a file written now beside it: the holder's
    clock (an hour ahead here) is not the reader's, and skew of 20 s made a dead
    holder look alive and the job fail."""
    another_hosts_claim(tmp_path, age_s=5)
    with pytest.raises(DirectoryInUse, match=rf"pid {os.getpid()} on {socket.gethostname()}, "
                                             "its last heartbeat 5 s"):
        second(tmp_path, stale_s=45).take(0)
    another_hosts_claim(tmp_path, age_s=50)  # its node died: stale
    second(tmp_path, stale_s=45).take(0)
    assert claim_of(tmp_path)["job"] == "job-2/second-run"


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_holder_taken_over_while_stale_stops_and_its_late_beat_loses(tmp_path):
    """A heartbeat that stalled past the limit (a hung mount, a full disk, a
    partition) let another job in; when it came back its late write landed over that
    job's claim, and the newcomer, which had already resumed, was the one that
    stopped. Now the newcomer writes over the late beat of the holder it displaced,
    and the displaced one stops: `lost`, no more writes, and its release frees no one."""
    old = DirectoryClaim(tmp_path, "first-run", "job-1/first-run", heartbeat_s=3600)
    old.take(0)  # its heartbeat thread stalls: the first beat is an hour away
    try:
        os.utime(tmp_path / CLAIM_FILE, (time.time() - 60, time.time() - 60))  # stale
        new = DirectoryClaim(tmp_path, "second-run", "job-2/second-run", heartbeat_s=0.05)
        new.take(0)
        try:
            old._write()  # the stalled holder's late beat lands over the new claim
            wait_for(lambda: claim_of(tmp_path)["job"] == "job-2/second-run",
                     "the newcomer writes over the displaced holder's late beat")
            assert new.lost is None
            old._beat_once()
            assert old.lost is not None and old.lost["run"] == "second-run"
            record = json.loads((tmp_path / DISPLACED_FILE).read_text())
            assert [r["displaced"][0] for r in record] == ["job-1/first-run"]
        finally:
            new.release()
    finally:
        old.release()
    assert claim_of(tmp_path)["job"] == "job-2/second-run"  # the old one freed nothing
    assert claim_of(tmp_path)["released"] is True  # the newcomer's own release


def test_a_holder_whose_successor_came_and_went_does_not_take_the_directory_back(tmp_path):
    """Another job took over from a stalled holder and has since released the
    directory: the holder, back, wrote over that and went on as if it had never lost it."""
    mine = DirectoryClaim(tmp_path, "first-run", "job-1/first-run", heartbeat_s=3600)
    mine.take(0)
    (tmp_path / CLAIM_FILE).write_text(json.dumps(other_claim(released=True)))
    mine._beat_once()
    assert mine.lost is not None and claim_of(tmp_path)["boot"] == "another-kernel"
    mine.release()


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
        claim = second(tmp_path, stale_s=600)
        claim.take(0)
        claim.release()
    for text in ('[{"displaced": [["a"]], "by": {}}]', '{"a": 1}', "[1, 2]", "[[]"):
        (tmp_path / DISPLACED_FILE).write_text(text)  # the takeovers' record
        claim = second(tmp_path, stale_s=600)
        claim.take(0)
        assert claim.still_held()
        claim.release()


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
    assert job_id(multi) == "rdzv:slurm-881@h:29400"
    monkeypatch.setenv(JOB_ID_ENV, first)  # what the launcher hands each torchrun
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a-new-uuid-per-torchrun")
    assert job_identity("llm") == f"{first}/llm"
    monkeypatch.delenv(JOB_ID_ENV)
    assert job_identity("llm") == "a-new-uuid-per-torchrun/llm"
    # torchrun's default --rdzv-id is every such job's: this process alone, then
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert job_identity("llm") == f"{socket.gethostname()}:{os.getpid()}/llm"


def test_a_displaced_holders_late_beat_and_release_free_nothing(tmp_path, capsys):
    """A stalled holder's late beat landed over its successor's claim and its release,
    at exit, then marked it released: a third job walked in while the successor ran,
    and the successor stopped. The takeover is recorded apart from the claim."""
    stalled = DirectoryClaim(tmp_path, "first-run", "job-1/first-run", heartbeat_s=3600)
    stalled.take(0)
    os.utime(tmp_path / CLAIM_FILE, (time.time() - 60, time.time() - 60))  # stale
    successor = DirectoryClaim(tmp_path, "second-run", "job-2/second-run", heartbeat_s=3600)
    successor.take(0)
    stalled._write()  # its late beat
    stalled.release()  # and its exit
    assert claim_of(tmp_path)["job"] == "job-1/first-run"
    assert claim_of(tmp_path)["released"] is False
    with pytest.raises(DirectoryInUse):
        second(tmp_path, job="job-3/third-run").take(0)
    assert successor._beat_once() and successor.lost is None
    assert claim_of(tmp_path)["job"] == "job-2/second-run"
    successor.release()


def test_a_restart_refuses_another_runs_claim_at_once_and_waits_for_its_own(tmp_path,
                                                                           capsys):
    """torchrun restarts a refused rank: another run's holder refused its first start
    already, so the restart does not wait again; a claim of its own run may be its own
    previous round's (plain torchrun's rendezvous id `none`), which goes stale."""
    (tmp_path / CLAIM_FILE).write_text(json.dumps(other_claim(run="theirs")))
    with pytest.raises(DirectoryInUse):
        second(tmp_path, stale_s=600).take(30, restart=True)
    assert "waiting" not in capsys.readouterr().err
    (tmp_path / CLAIM_FILE).write_text(json.dumps(other_claim(run="second-run")))
    with pytest.raises(DirectoryInUse):
        second(tmp_path, stale_s=600).take(0.3, restart=True)
    assert "waiting up to 0 s" in capsys.readouterr().err


RIVAL = """
import sys, time
from pathlib import Path
from clusterpulse.trainer.dirclaim import DirectoryClaim, DirectoryInUse
claim = DirectoryClaim(Path(sys.argv[1]), "run", "job-1/run", heartbeat_s=0.05)
try:
    claim.take(0)
except DirectoryInUse:
    print("refused", flush=True)
    sys.exit(0)
deadline = time.monotonic() + 20
while claim.lost is None and time.monotonic() < deadline:
    time.sleep(0.02)
print("lost" if claim.lost else "kept", flush=True)
"""


def test_one_job_started_twice_at_once_keeps_one_holder(tmp_path):
    """Two rank 0s of one job (a job id reused) within the read-back's 0.2 s: each
    took the other for the predecessor it displaced and both went on writing. Now the
    one that lost the race is refused at its read-back, or stops at its next beat."""
    rival = subprocess.Popen([sys.executable, "-c", RIVAL, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (tmp_path / CLAIM_FILE).exists(), "the rival's claim")
        mine = DirectoryClaim(tmp_path, "run", "job-1/run", heartbeat_s=0.05)
        mine.take(0)
        assert rival.stdout.readline().strip() in ("refused", "lost")
        assert mine._beat_once() and mine.lost is None
        assert claim_of(tmp_path)["pid"] == os.getpid()
        mine.release()
    finally:
        rival.kill()
        rival.wait()


def test_a_late_beat_two_holders_on_loses_and_its_holder_learns_before_it_publishes(
        tmp_path):
    """Only the holder that took over knew whom it displaced: its successor, having
    taken a released claim, took the displaced holder's late beat for a takeover and
    stopped, and the displaced holder went on. Every takeover is on record for every
    later holder; and the displaced one is told when it asks before a publish, not at
    its next heartbeat (it published and pruned there for up to 10 s)."""
    stalled = DirectoryClaim(tmp_path, "a", "job-a/a", heartbeat_s=3600)
    stalled.take(0)
    os.utime(tmp_path / CLAIM_FILE, (time.time() - 60, time.time() - 60))  # stale
    b = DirectoryClaim(tmp_path, "b", "job-b/b", heartbeat_s=3600)
    b.take(0)
    b.release()  # B ends (a torchrun restart, a finished run)
    c = DirectoryClaim(tmp_path, "c", "job-c/c", heartbeat_s=3600)
    c.take(0)
    stalled._write()  # A's late beat lands over C's claim
    assert not stalled.still_held() and stalled.lost["run"] == "b"  # who displaced it
    assert c._beat_once() and c.lost is None  # C writes over it and goes on
    assert claim_of(tmp_path)["job"] == "job-c/c"
    c.release()
    stalled.release()
    assert claim_of(tmp_path)["job"] == "job-c/c" and claim_of(tmp_path)["released"]
