"""What the agent knows about the trainer ranks on its node, learnt from telemetry.

Bounded whatever arrives: at most `max_ranks` entries, at most `max_per_owner` of them
held by one user (uid, as the kernel reports it; all unverified UDP senders share one
bucket) and `max_per_process` by one process, each entry of fixed size (known numeric
fields only, a bounded ring of acknowledgements). Ranks that stop talking are
forgotten after `grace_s`, long enough that their growing heartbeat age is exported
(and alerted on) first. An entry whose process has exited still counts toward its
user's quota, and makes room at once for that user's next rank, never another
user's: a crashed rank is the evidence its alert reads, and one user whose
processes register and exit must not be able to push it out.

Ownership: a (run, rank) belongs to the process that registered it. While that
process lives (same pid *and* start time), messages for that (run, rank) from any
other sender are refused; once it has exited (torchrun restarted the worker) a new
process of the same user takes over. Another user's process never does until the
entry has expired.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from clusterpulse.agent import identity
from clusterpulse.agent.backends.sim import Activity
from clusterpulse.agent.identity import Sender
from clusterpulse.agent.protocol import EXITED, NUMBER_FIELDS, OWN_TIMEOUT_PHASES, RESTARTING

MAX_ACKS_KEPT = 32
# Values that describe the job rather than the process that sent them: a restarted
# worker keeps them until it says otherwise (CheckpointStale ages the checkpoint time).
JOB_FIELDS = frozenset({"checkpoint_step", "checkpoint_timestamp_seconds", "goodput_ratio",
                        "loss"})
# Step intervals kept per rank for their 99th percentile (the steady hang threshold is a
# multiple of it): 512 puts an evaluation every 50 steps ~10 times in the window, and
# costs 4 KB a rank (4 MB at the registry's 1,024).
STEP_INTERVALS_KEPT = 512
# How long after a rank's owner was last heard from only its user may speak for that
# (run, rank): a torchrun restart brings the job's next worker within seconds.
OTHER_USER_WAIT_S = 60.0
# Phases in which a completed step's interval is not the loop's own pace: loading or
# saving a checkpoint (their own timeouts; leaving them restarts the age), gone.
_NO_INTERVAL_PHASES = OWN_TIMEOUT_PHASES | {EXITED, RESTARTING}


class StepIntervals:
    """The times between a rank's last completed steps, as the agent saw them arrive,
    and their 99th percentile.

    An interval is what the rank's progress age reaches before the step completes: the
    step and whatever the loop does between steps (an evaluation every N steps, logging,
    a blocking collective of the user's). The trainer's step time leaves that out, and
    Prometheus samples a last-step gauge once a scrape: a 15 s evaluation between two
    1 s steps never showed in it, and every evaluation paged JobStalled. Counted here
    at every step, a pause that recurs in more than 1 % of the steps is in the p99
    whatever the step time or the scrape interval. A ring of at most
    STEP_INTERVALS_KEPT, grown as steps come (a rank's memory stays bounded)."""

    __slots__ = ("_next", "_p99", "_ring")

    def __init__(self) -> None:
        self._ring = array("d")
        self._next = 0  # where the next interval goes once the ring is full
        self._p99: float | None = None  # cached until the next interval

    def add(self, seconds: float) -> None:
        if len(self._ring) < STEP_INTERVALS_KEPT:
            self._ring.append(seconds)
        else:
            self._ring[self._next] = seconds
            self._next = (self._next + 1) % STEP_INTERVALS_KEPT
        self._p99 = None

    def __len__(self) -> int:
        return len(self._ring)

    def p99(self) -> float | None:
        """The nearest-rank 99th percentile (None before any interval): the largest
        of fewer than 100, the 6th largest of 512. Computed at most once per new
        interval (a scrape renders every rank each collection cycle)."""
        if self._p99 is None and self._ring:
            srt = sorted(self._ring)
            self._p99 = srt[math.ceil(0.99 * len(srt)) - 1]
        return self._p99


class Refused(Exception):
    """Why a message was not folded in; the text is a counter label."""


@dataclass
class RankState:
    run: str
    rank: int
    sender: Sender = field(default_factory=Sender)
    local_rank: int = -1
    world_size: int = 0
    gpu: int = -1
    gpu_uuids: tuple[str, ...] = ()
    addr: Any = None  # where replies go: the kernel-given sender address
    # the user of the first kernel-verified process that spoke for this (run, rank):
    # the job's. Its next process takes the rank back from another user's (`update`).
    home: str | None = None
    first_seen: float = 0.0
    last_seen: float = 0.0  # monotonic time of the last message of any kind
    # monotonic time of the last completed step, of the start, or of leaving a phase
    # with its own timeout (start, checkpoint)
    last_progress: float = 0.0
    phase: str = "start"
    values: dict[str, float] = field(default_factory=dict)
    step: int = -1
    restarts: int = 0
    # whether the trainer has said its restart count: until then (a rank that reports
    # before its process group is up sends none) 0 is a default, not a count, and
    # exported it made a moved rank's new series read 0 then 4 (RestartLoop: "4 restarts")
    restarts_known: bool = False
    steps_total: int = 0
    last_counted_step: int = -1
    # Steps completed by the process that holds the rank now: a restarted process has
    # resumed once it has completed one (its heartbeats before that carry the old step).
    process_steps: int = 0
    # rates for the GPU simulator, from consecutive cumulative counters
    sync_bytes_per_s: float = 0.0
    host_bytes_per_s: float = 0.0
    _prev: tuple[float, float, float] | None = None  # (t, sync bytes, host bytes)
    acks: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_ACKS_KEPT))
    # The collective the rank is blocked in ("" when none), from its heartbeat.
    collective: str = ""
    # Its pace, for the steady hang threshold: kept across its processes (a restarted
    # worker runs the same loop, evaluations and all).
    step_intervals: StepIntervals = field(default_factory=StepIntervals)

    @property
    def pid(self) -> int:
        """The kernel-reported pid (0 when unverified): never a number from a payload."""
        return self.sender.pid if self.sender.verified else 0

    def new_process(self, now: float) -> None:
        """Another process holds the rank now (a restarted worker, maybe on another GPU
        after the ranks were renumbered): nothing the old one judged or was doing is
        its successor's (a straggler flag, a checkpoint in progress, a blocked
        collective, per-process counters and rates); what describes the job stays. It
        is starting (phase `start`, its age from now) until it says otherwise: the old
        process's `checkpoint`, kept until the new one's first phase, with its
        collective count back at 0, read as a rank holding its peers in a save."""
        self.phase, self.last_progress = "start", now
        self.process_steps = 0
        self.values = {k: v for k, v in self.values.items() if k in JOB_FIELDS}
        self.collective = ""
        self._prev = None
        self.sync_bytes_per_s = self.host_bytes_per_s = 0.0


def _owners_last_words(owner: Sender, sender: Sender) -> bool:
    """A message the kernel says came from the owner's pid and user, whose process was
    gone by the time the agent read it: the owner's last words (its `exit` event), not
    another process's (a pid reused by a live process reads as verified, and differs)."""
    return (owner.verified and not sender.verified and sender.pid > 0
            and (sender.pid, sender.uid) == (owner.pid, owner.uid))


class RankRegistry:
    def __init__(self, max_ranks: int = 1024, grace_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic,
                 max_per_owner: int | None = None, max_per_process: int = 64,
                 alive: Callable[[Sender], bool] = identity.still_running) -> None:
        self.max_ranks = max_ranks
        self.max_per_owner = max_per_owner or max(1, max_ranks // 4)
        self.max_per_process = max_per_process
        self.grace_s = grace_s
        self._clock = clock
        self._alive = alive
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int], RankState] = {}
        self.rejected_full = 0

    def update(self, msg: dict[str, Any], addr: Any,
               sender: Sender | None = None) -> RankState | None:
        """Fold one validated message in; None if the registry is full of other ranks.

        Raises Refused when the (run, rank) belongs to another live process or the
        sender is over its quota.
        """
        sender = sender or Sender()
        key = (msg["run"], msg["rank"])
        now = self._clock()
        with self._lock:
            r = self._ranks.get(key)
            if r is not None and r.sender != sender and _owners_last_words(r.sender, sender):
                sender = r.sender  # the owner's own messages, read after it exited
            elif r is not None and r.sender != sender:
                # the job's user taking its rank back from another user's process (one
                # that took it while the job's next worker was slow to come: a node
                # replaced, a long rendezvous), alive or not (a review: locked out)
                home_again = (sender.verified and r.home == sender.owner_key
                              and r.sender.owner_key != r.home)
                if r.sender.verified and self._alive(r.sender) and not home_again:
                    raise Refused("owned_by_other_process")
                if not sender.verified and r.sender.verified:
                    # an unverified sender never replaces a kernel-verified owner
                    raise Refused("owned_by_other_process")
                if (r.sender.verified and sender.owner_key != r.sender.owner_key
                        and not home_again and now - r.last_seen < OTHER_USER_WAIT_S):
                    # a restarted worker runs as the job's user, within seconds: another
                    # user's process would speak for the job (its step, its phase, its
                    # refusals). Not for the entry's whole grace: a later job of another
                    # uid (a shared default run id, a pod with another uid mapping) was
                    # refused for 5 minutes (a review)
                    raise Refused("owned_by_other_user")
                self._check_quota(sender, replacing=key)
                r.sender = sender  # the previous owner exited: a restarted worker
                r.new_process(now)
            if r is None:
                self._check_quota(sender)
                if len(self._ranks) >= self.max_ranks and not self._evict_dead(sender, 1):
                    self.rejected_full += 1
                    return None
                r = self._ranks[key] = RankState(run=key[0], rank=key[1], sender=sender,
                                                 first_seen=now, last_progress=now)
            if r.home is None and sender.verified:
                r.home = sender.owner_key
            self._fold(r, msg, now)
            r.addr = addr
            return r

    def _check_quota(self, sender: Sender, replacing: tuple[str, int] | None = None) -> None:
        """Refuse a sender over its share. Entries of the user's exited processes count
        toward it, and are dropped (oldest first) to make room for its live ones: a
        user's next run must not wait for the last one's ranks to expire, and its
        churn must not fill the registry with them (then evicting others')."""
        held = [r for k, r in self._ranks.items()
                if k != replacing and r.sender.owner_key == sender.owner_key]
        if len(held) >= self.max_per_owner:
            live = [r for r in held if not r.sender.verified or self._alive(r.sender)]
            if len(live) >= self.max_per_owner:
                raise Refused("owner_quota")
            self._evict_dead(sender, len(held) - self.max_per_owner + 1, replacing)
            held = live
        if sender.verified and sum(r.sender == sender for r in held) >= self.max_per_process:
            raise Refused("process_quota")

    def _evict_dead(self, sender: Sender, count: int,
                    keep: tuple[str, int] | None = None) -> bool:
        """Drop up to `count` entries (not `keep`, the one being taken over) of
        `sender`'s user whose verified process has exited, the least recently heard
        first; whether any was dropped. Never another user's: its crashed rank stays
        (evidence) until it expires."""
        dead = sorted((r.last_seen, k) for k, r in self._ranks.items()
                      if k != keep and r.sender.owner_key == sender.owner_key
                      and r.sender.verified and not self._alive(r.sender))
        for _, k in dead[:count]:
            del self._ranks[k]
        return bool(dead)

    @staticmethod
    def _fold(r: RankState, msg: dict[str, Any], now: float) -> None:
        if msg.get("restarts", r.restarts) != r.restarts:
            r.new_process(now)  # a new attempt (also where senders are unverified)
        for name in ("local_rank", "world_size", "gpu", "restarts"):
            if name in msg:
                setattr(r, name, msg[name])
        r.restarts_known = r.restarts_known or "restarts" in msg
        if "gpu_uuids" in msg:
            r.gpu_uuids = tuple(msg["gpu_uuids"])
        r.last_seen = now
        if msg["type"] == "step" or msg.get("event") == "start":
            if (msg["type"] == "step" and msg.get("step") != r.last_counted_step
                    and r.process_steps > 0 and r.phase not in _NO_INTERVAL_PHASES):
                # Not a process's first step: it counts from the start or the end of
                # loading, and holds one-time set-up (compilation, communicators).
                r.step_intervals.add(now - r.last_progress)
            r.last_progress = now
        if "phase" in msg:
            if r.phase in OWN_TIMEOUT_PHASES and msg["phase"] not in OWN_TIMEOUT_PHASES:
                # Loading or saving a checkpoint has its own (absolute) timeout; counting
                # that time against the next step's steady threshold paged a rank that
                # had loaded for 8 s the moment its first step began (RankHung in a
                # graceful restart on a loaded machine), and ranks after a 12 s save.
                r.last_progress = now
            r.phase = msg["phase"]
        if msg.get("event") == "exit":
            outcome = msg.get("outcome", "finished")
            if outcome in ("finished", "preempted"):
                r.phase = EXITED  # a clean finish or a preemption: its growing age is no hang
            elif outcome == "checkpoint-restart":
                # saved and leaving on purpose: until it is gone and a new process takes
                # the rank over, its tear-down (destroying the process group, exiting)
                # is part of the restart, not a step that hangs
                r.phase, r.last_progress = RESTARTING, now
        if "collective" in msg:
            r.collective = msg["collective"]
        if "step" in msg:
            if msg["type"] == "step" and msg["step"] != r.last_counted_step:
                r.steps_total += 1  # heartbeats carry the step too; count step messages
                r.process_steps += 1
                r.last_counted_step = msg["step"]
            r.step = msg["step"]
        for k in NUMBER_FIELDS.intersection(msg):  # the only values kept: a fixed set
            r.values[k] = msg[k]
        for a in msg.get("acks", ()):
            if a not in r.acks:
                r.acks.append(a)
        if "sync_bytes_total" in msg or "host_bytes_total" in msg:
            sync = r.values.get("sync_bytes_total", 0.0)
            host = r.values.get("host_bytes_total", 0.0)
            if r._prev is not None and now > r._prev[0]:
                dt = now - r._prev[0]
                r.sync_bytes_per_s = max(0.0, (sync - r._prev[1]) / dt)
                r.host_bytes_per_s = max(0.0, (host - r._prev[2]) / dt)
            r._prev = (now, sync, host)

    def expire(self) -> list[RankState]:
        now = self._clock()
        with self._lock:
            gone = [k for k, r in self._ranks.items() if now - r.last_seen > self.grace_s]
            return [self._ranks.pop(k) for k in gone]

    def snapshot(self) -> list[RankState]:
        with self._lock:
            return sorted(self._ranks.values(), key=lambda r: (r.run, r.rank))

    def of_run(self, run: str) -> list[RankState]:
        return [r for r in self.snapshot() if r.run == run]

    def live_of_run(self, run: str) -> list[RankState]:
        """The run's ranks whose process may still run: an entry whose verified process
        has exited is kept for its evidence, but is no longer a rank here (after a
        relaunch its number may belong to a process on another node)."""
        return [r for r in self.of_run(run) if not r.sender.verified or self._alive(r.sender)]

    def age(self, r: RankState) -> float:
        """Seconds since the rank last made progress: a hung rank's heartbeat thread
        keeps it known and alive, but this age grows."""
        return max(0.0, self._clock() - r.last_progress)

    def activity(self, gpu: int) -> Activity:
        """The load the ranks bound to `gpu` put on it (for the GPU simulator)."""
        act = Activity()
        now = self._clock()
        for r in self.snapshot():
            if r.gpu != gpu or now - r.last_progress > 10.0:
                continue
            step = r.values.get("step_seconds", 0.0)
            compute = r.values.get("compute_seconds", 0.0)
            act.utilization += (compute / step) if step > 0 else 0.5
            act.memory_bytes += r.values.get("memory_bytes", 0.0)
            act.sync_bytes_per_s += r.sync_bytes_per_s
            act.host_bytes_per_s += r.host_bytes_per_s
        act.utilization = min(act.utilization, 1.0)
        return act


def process_alive(pid: int) -> bool:
    """Whether a local process exists: a hung rank is alive but silent."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
