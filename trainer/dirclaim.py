"""One job at a time in a checkpoint directory: rank 0's claim, kept alive by a
heartbeat.

Two jobs given one `--ckpt-dir` (a copied batch script, a job submitted twice) wrote
over each other unseen: the second one's start removed the first one's checkpoint in
flight (`clean_temporaries`), took its newest checkpoint for its own, and both
published, pruned and rewrote the run's accounting in the one directory. A crash of
either then resumed from the other's weights.

Rank 0 (the one that publishes, prunes and keeps the accounting) claims the directory
in `owner.json` before it reads or changes anything there: its job, run, host, pid,
kernel and PID namespace, rewritten every HEARTBEAT_S by a thread of its own. Another
rank 0 starts there only where the claim is its own job's (a restart: `job_identity`),
was released (its holder ended through Python's exit), is of a process known dead
(`_dead`), or has gone stale (no heartbeat for STALE_S on the file system's clock: its
node died). Otherwise it waits up to `--ckpt-lock-wait` for one of those, then
refuses, naming the holder. A holder taken over while stale stops writing there
(`DirectoryClaim.lost`).

Why not a lock (fcntl/flock): a lock cannot tell a restart of the same job from
another job. An elastic job's new round whose rank 0 moved to another node, while
the old rank 0 lives on behind a network partition, was refused and the job failed
where it had gone on; on NFSv3 a dead client's lock outlives it until its node
reboots; some mounts (`nolock`, `local_lock`, Lustre's `localflock`) grant locks on
each node alone, silently. A heartbeat only says what a lock meant here: that a
process of another job is alive and writing to this directory.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

from clusterpulse.trainer.restart import write_atomically

log = logging.getLogger(__name__)

CLAIM_FILE = "owner.json"
# The holders takeovers displaced (the newest DISPLACED_KEPT): apart from the claim,
# so that a displaced holder's late beats, which land over the claim, cannot erase them
DISPLACED_FILE = "owner.displaced.json"
DISPLACED_KEPT = 16
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
    makes; one per `--standalone` torchrun; not its default "none"), else this process
    alone (a restart by torchrun is then told by its predecessor being dead, `_dead`)."""
    launch = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if launch == "none":  # torchrun's default --rdzv-id: every such job's, not one job's
        launch = ""
    job = os.environ.get(JOB_ID_ENV) or launch or f"{socket.gethostname()}:{os.getpid()}"
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
    fields = {"job": str, "run": str, "host": str, "pid": int, "boot": str, "pidns": str}
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


def kernel_and_pid_namespace() -> tuple[str, str]:
    """This kernel's boot id and this process's PID namespace: a pid names the same
    process only where both are the same (hostnames repeat: containers' fixed names,
    images all called "localhost"; the first PID namespace has the same inode on every
    host); ("", "") where they cannot be read."""
    try:
        return (Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                os.readlink("/proc/self/ns/pid"))
    except OSError:
        return "", ""


def identity(claim: dict) -> tuple[object, ...]:
    """The process a claim is of: its job as well as its pid (a restart's rank 0 can
    have its predecessor's pid in another container), and where that pid means
    something. Comparable with what `displaced` records read back from JSON."""
    return tuple(claim.get(k) for k in ("job", "host", "pid", "boot", "pidns"))


def describe(claim: dict, age: float) -> str:
    """The holder as an operator finds it: run, pid and host, and how alive it is."""
    return (f"run {claim['run']!r}, pid {claim['pid']} on {claim['host']}, its last "
            f"heartbeat {max(0.0, age):.0f} s ago")


class DirectoryClaim:
    """Rank 0's claim on `directory` for job `job`: `take()` at start, `release()` at
    exit; a heartbeat thread keeps it fresh in between.

    `lost` names the process that took the directory over from this one while its
    heartbeat had stopped (a stalled mount, a full disk, a partition), or a new round
    of its own job: this process then writes nothing more there (trainer.main). Every
    takeover is recorded in DISPLACED_FILE, apart from the claim: a late heartbeat of a
    displaced holder that lands over the claim is written over again by whoever holds
    it then, and the displaced one, reading the record, stops. Without it the
    newcomer, which had already resumed, was the one that stopped."""

    def __init__(self, directory: Path, run: str, job: str, heartbeat_s: float = HEARTBEAT_S,
                 stale_s: float = STALE_S) -> None:
        self.path = directory / CLAIM_FILE
        self.directory, self.run, self.job = directory, run, job
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        self.lost: dict | None = None
        boot, pidns = kernel_and_pid_namespace()
        self._me = {"job": job, "run": run, "host": socket.gethostname(),
                    "pid": os.getpid(), "boot": boot, "pidns": pidns}
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
        """A holder on this kernel, in this PID namespace, whose process is gone (killed
        outright: nothing released its claim). Elsewhere only its heartbeat can say. A
        pid reused since is taken for the holder alive: its claim then goes stale."""
        here = (self._me["boot"], self._me["pidns"])
        if not all(here) or (claim["boot"], claim["pidns"]) != here:
            return False
        try:
            os.kill(claim["pid"], 0)
        except ProcessLookupError:
            return True
        except (OSError, OverflowError, ValueError):  # another user's; not a pid
            return False
        return False

    def _mine(self, claim: dict) -> bool:
        return identity(claim) == identity(self._me)

    def take(self, wait_s: float, restart: bool = False) -> None:
        """Claim the directory, waiting up to `wait_s` for another job's claim to be
        released or go stale; DirectoryInUse naming its holder if it outlasts that. Two
        starts at once: each writes, then reads back after a moment; the one whose
        claim was overwritten waits as for any holder (the other's is fresh).

        A `restart` (torchrun's, of a rank 0 that failed) waits only for a claim of its
        own run: a holder of another run refused its first start already (torchrun
        restarts a refused rank, --max-restarts times), where a claim of its own run
        can be its own previous round's on another node (plain torchrun without a
        rendezvous id: each process its own job), which goes stale in STALE_S."""
        self.directory.mkdir(parents=True, exist_ok=True)
        deadline, told = time.monotonic() + wait_s, False
        while True:
            holder = self.blocking()
            if holder is None:
                before = read_claim(self.path)
                if before is not None and not before[0].get("released") \
                        and not self._mine(before[0]):
                    self._say_displaced(before[0])
                if not self._write():
                    break  # a directory that takes no claim: unguarded, said once
                if before is not None and before[0]["job"] == self.job:
                    break  # a restart of this job: no other job was let in
                time.sleep(VERIFY_S)  # a rival that read the same claim writes its own
                back = read_claim(self.path)
                if back is None or self._mine(back[0]):
                    break
                if back[0]["job"] == self.job:  # this job twice at once: the later wins
                    raise DirectoryInUse(
                        f"--ckpt-dir {self.directory}: another process of this job "
                        f"({describe(back[0], 0.0)}) claimed it at the same moment")
                holder = (back[0], 0.0)
            if time.monotonic() >= deadline or (restart and holder[0]["run"] != self.run):
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
        stuck, self._thread = self._thread.is_alive(), None
        if stuck or self.lost is not None or self._displaced_by() is not None:
            return  # a beat that lands later would undo it; or it is not ours to free
        got = read_claim(self.path)
        if got is not None and self._mine(got[0]):
            self._write(released=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s) and self._beat_once():
            pass

    def _beat_once(self) -> bool:
        """One heartbeat: renew the claim where it is still this process's."""
        if not self.still_held():
            return False
        self._write()
        return True

    def still_held(self) -> bool:
        """Whether this process still holds the directory, read now (the heartbeat
        asks, and a publish just before it writes: a displaced holder whose mount came
        back published and pruned there for up to a heartbeat). False, and `lost` set,
        where a takeover displaced it, or another process's claim is there that is not
        a late beat (of a holder some takeover displaced, or of a process of this kernel
        that is gone: a restart's stalled predecessor)."""
        if self.lost is not None:
            return False
        displaced = self._displaced()
        got = read_claim(self.path)
        taken = got is not None and not self._mine(got[0]) \
            and identity(got[0]) not in displaced and not self._dead(got[0])
        if identity(self._me) in displaced:
            by = self._displaced_by() or {"run": "?", "pid": "?", "host": "?"}
        elif taken:
            by = got[0]
        else:
            return True
        self.lost = by
        log.error("--ckpt-dir %s was taken over by another job or a new round of this one "
                  "(run %r, pid %s on %s): this process writes no more checkpoints or "
                  "accounting there (each save fails, counted and paged)",
                  self.directory, by["run"], by["pid"], by["host"])
        return False

    def _records(self) -> list[dict]:
        """The takeovers on record; a damaged record (by hand, a torn disk) is none."""
        try:
            records = json.loads((self.directory / DISPLACED_FILE).read_text())
        except (OSError, ValueError, RecursionError):
            return []
        return [r for r in records if isinstance(r, dict) and isinstance(r.get("by"), dict)
                and isinstance(r.get("displaced"), list)
                and all(x is None or isinstance(x, str | int) for x in r["displaced"])] \
            if isinstance(records, list) else []

    def _say_displaced(self, claim: dict) -> None:
        """Record that this process takes over from `claim`'s holder, beside every
        earlier takeover's (a holder displaced two takeovers ago can still land a late
        beat)."""
        record = {"displaced": list(identity(claim)),
                  "by": {k: self._me[k] for k in ("run", "pid", "host")}}
        records = [*self._records(), record][-DISPLACED_KEPT:]
        try:
            write_atomically(self.directory / DISPLACED_FILE, json.dumps(records))
        except OSError as err:
            log.warning("--ckpt-dir %s: cannot record the claim taken over (%s)",
                        self.directory, err.strerror or err)

    def _displaced(self) -> set[tuple[object, ...]]:
        return {tuple(r["displaced"]) for r in self._records()}

    def _displaced_by(self) -> dict | None:
        """Who took over from this process, where a takeover displaced it."""
        for r in reversed(self._records()):
            if tuple(r["displaced"]) == identity(self._me):
                by = r["by"]
                return {"run": str(by.get("run")), "pid": by.get("pid"),
                        "host": str(by.get("host"))}
        return None

    def _write(self, released: bool = False) -> bool:
        """Write this process's claim whole (a rename); False where the disk refuses."""
        claim = {**self._me, "heartbeat_unix": time.time(), "released": released}
        try:
            write_atomically(self.path, json.dumps(claim))  # readers see one claim whole
        except OSError as err:  # a full disk: the claim goes stale, training goes on
            if not self._warned:  # once per episode: a success below ends it
                self._warned = True
                log.warning("--ckpt-dir %s: cannot renew this job's claim on it (%s); "
                            "another job could start there", self.directory,
                            err.strerror or err)
            return False
        self._warned = False
        return True
