"""One job at a time in a checkpoint directory: rank 0's claim, kept alive by a
heartbeat.

Two jobs given one `--ckpt-dir` (a copied batch script, a job submitted twice) wrote
over each other unseen: the second one's start removed the first one's checkpoint in
flight (`clean_temporaries`), took its newest checkpoint for its own, and both
published, pruned and rewrote the run's accounting in the one directory. A crash of
either then resumed from the other's weights.

Rank 0 (the one that publishes, prunes and keeps the accounting) claims the directory
in `owner.json` before it reads or changes anything there: its job, run, host and pid,
rewritten every HEARTBEAT_S by a thread of its own. Another rank 0 starts there only
where the claim is its own job's (a restart: the same torchrun rendezvous id and run),
was released (its holder ended, whatever way Python ended), or has gone stale (no
heartbeat for STALE_S: its holder was killed outright, or its node died). Otherwise
it waits up to `--ckpt-lock-wait` for one of those, then refuses, naming the holder.

Why not a lock (fcntl/flock): a lock cannot tell a restart of the same job from
another job. An elastic job's new round whose rank 0 moved to another node, while
the old rank 0 lives on behind a network partition, was refused and the job failed
where it had gone on; on NFSv3 a dead client's lock outlives it until its node
reboots; some mounts (`nolock`, `local_lock`, Lustre's `localflock`) grant locks on
each node alone, silently. A heartbeat only says what a lock meant here: that a
process of another job is alive and writing to this directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

CLAIM_FILE = "owner.json"
JOB_ID_ENV = "CLUSTERPULSE_JOB_ID"  # set by clusterpulse-train for its torchruns
HEARTBEAT_S = 10.0
STALE_S = 45.0  # four missed heartbeats: a slow NFS write is not a dead holder
# Two starts at once: each writes its claim, then reads it back this much later; a
# rival's read and write are milliseconds apart, so the later writer is the one both see
VERIFY_S = 0.2


class DirectoryInUse(Exception):
    """Another job's live claim outlasted the wait: the start is refused (exit 2, as a
    bad setting is)."""


def job_identity(run: str) -> str:
    """This job, as its restarts share it, with the run id: clusterpulse-train's job id
    (JOB_ID_ENV: the same across the torchruns it relaunches), else torchrun's
    rendezvous id (the same in every round of an elastic job and every restart torchrun
    makes; one per `--standalone` torchrun), else this process alone."""
    job = (os.environ.get(JOB_ID_ENV) or os.environ.get("TORCHELASTIC_RUN_ID")
           or f"{socket.gethostname()}:{os.getpid()}")
    return f"{job}/{run}"


def read_claim(path: Path) -> tuple[dict, float] | None:
    """The claim at `path` and when it was last written (its mtime, on the clock of
    the file system that holds it), or None where there is none to honour (none yet,
    or one that is not a claim: a damaged file is no reason to stop a job). Read
    through one open descriptor: NFS revalidates a file's attributes on open, where a
    bare stat may answer from a cache a minute old."""
    try:
        with open(path, "rb") as f:
            claim, mtime = json.loads(f.read()), os.fstat(f.fileno()).st_mtime
    except (OSError, ValueError, RecursionError):
        return None
    fields = {"job": str, "run": str, "host": str, "pid": int, "pidns": str}
    ok = isinstance(claim, dict) and all(isinstance(claim.get(k), t) for k, t in fields.items())
    return (claim, mtime) if ok else None


def disk_now(directory: Path) -> float:
    """Now, on the clock of the file system that holds `directory`: the mtime of a file
    written there. A claim's age is measured on one clock, the one that stamped it:
    nodes' clocks disagree (20 s of skew made a dead holder look alive and the job
    fail; a reader 45 s ahead would take every live claim for stale)."""
    probe = directory / f".owner-clock.{socket.gethostname()}.{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"now")
            return os.fstat(fd).st_mtime
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError:
        return time.time()


def pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def describe(claim: dict, age: float) -> str:
    return (f"run {claim['run']!r}, pid {claim['pid']} on {claim['host']}, its last "
            f"heartbeat {max(0.0, age):.0f} s ago")


class DirectoryClaim:
    """Rank 0's claim on `directory` for job `job`: `take()` at start, `release()` at
    exit; a heartbeat thread keeps it fresh in between. `lost` is the claim of another
    job that took the directory while this one's heartbeat had stopped (a stalled
    mount, a full disk): this job then publishes no checkpoint (trainer.main)."""

    def __init__(self, directory: Path, run: str, job: str, heartbeat_s: float = HEARTBEAT_S,
                 stale_s: float = STALE_S) -> None:
        self.path = directory / CLAIM_FILE
        self.directory, self.run, self.job = directory, run, job
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        self.lost: dict | None = None
        self._me = {"job": job, "run": run, "host": socket.gethostname(),
                    "pid": os.getpid(), "pidns": pid_namespace()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    def blocking(self) -> tuple[dict, float] | None:
        """The claim that keeps this job out, with its age: another job's, not released,
        its heartbeat fresh, and its holder not known dead."""
        got = read_claim(self.path)
        if got is None:
            return None
        claim, mtime = got
        if claim["job"] == self.job or claim.get("released") is True or self._dead(claim):
            return None
        age = disk_now(self.directory) - mtime
        return None if age >= self.stale_s else (claim, age)

    def _dead(self, claim: dict) -> bool:
        """A holder on this host, in this PID namespace, whose process is gone (killed
        outright: nothing released its claim). Elsewhere only its heartbeat can say."""
        if (claim["host"], claim["pidns"]) != (self._me["host"], self._me["pidns"]) \
                or not claim["pidns"]:
            return False
        try:
            os.kill(claim["pid"], 0)
        except ProcessLookupError:
            return True
        except OSError:  # another user's process: alive
            return False
        return False

    def _mine(self, claim: dict) -> bool:
        return all(claim.get(k) == v for k, v in self._me.items())

    def take(self, wait_s: float) -> None:
        """Claim the directory, waiting up to `wait_s` for another job's claim to be
        released or go stale; DirectoryInUse naming its holder if it outlasts that. Two
        starts at once: each writes, then reads back after a moment; the one whose
        claim was overwritten waits as for any holder (the other's is fresh)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        deadline, told = time.monotonic() + wait_s, False
        while True:
            holder = self.blocking()
            if holder is None:
                before = read_claim(self.path)
                self._write()
                if before is not None and before[0]["job"] == self.job:
                    break  # a restart of this job: no other job was let in
                time.sleep(VERIFY_S)  # a rival that read the same claim writes its own
                back = read_claim(self.path)
                if back is None or self._mine(back[0]):
                    break
                holder = (back[0], 0.0)
            if time.monotonic() >= deadline:
                raise DirectoryInUse(
                    f"--ckpt-dir {self.directory} is in use by another job "
                    f"({describe(*holder)}); two jobs in one checkpoint directory overwrite "
                    "each other's checkpoints. Give this one its own --ckpt-dir, or stop "
                    f"that one first (waited {wait_s:.0f} s; {self.path} names it)")
            if not told:
                told = True
                print(f"trainer: waiting up to {wait_s:.0f} s for --ckpt-dir "
                      f"{self.directory}, in use by another job ({describe(*holder)})",
                      file=sys.stderr, flush=True)
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        self._thread = threading.Thread(target=self._beat, name="ckpt-dir-claim",
                                        daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Say the directory is free: the next job starts at once, not a STALE_S later.
        Only this process's own claim: an old rank 0 of this job that ends late does not
        free its successor's."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._thread = None
        got = read_claim(self.path)
        if got is not None and self._mine(got[0]):
            self._write(released=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            got = read_claim(self.path)
            if got is not None and not self._mine(got[0]) and not got[0].get("released"):
                self.lost = got[0]
                log.error("--ckpt-dir %s was claimed by another job or a new round of "
                          "this one (run %r, pid %s on %s) while this process's claim had "
                          "gone stale: it publishes no more checkpoints there (each save "
                          "fails, counted and paged)",
                          self.directory, got[0]["run"], got[0]["pid"], got[0]["host"])
                return
            self._write()

    def _write(self, released: bool = False) -> None:
        claim = {**self._me, "heartbeat_unix": time.time(), "released": released}
        tmp = self.path.with_name(f".{CLAIM_FILE}.{socket.gethostname()}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(claim))
            os.replace(tmp, self.path)  # a reader sees the old claim or the new, whole
        except OSError as err:  # a full disk: the claim goes stale, training goes on
            with contextlib.suppress(OSError):
                tmp.unlink()
            if not self._warned:
                self._warned = True
                log.warning("--ckpt-dir %s: cannot renew this job's claim on it (%s); "
                            "another job could start there", self.directory,
                            err.strerror or err)
