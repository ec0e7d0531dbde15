"""What the agent knows about the trainer ranks on its node, learnt from telemetry.

Bounded whatever arrives: at most `max_ranks` entries, each of fixed size; ranks that
stop talking are forgotten after `grace_s`, long enough that their growing heartbeat
age is exported (and alerted on) first.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.backends.sim import Activity


@dataclass
class RankState:
    run: str
    rank: int
    local_rank: int = -1
    world_size: int = 0
    pid: int = 0
    gpu: int = -1
    addr: tuple[str, int] | None = None
    first_seen: float = 0.0
    last_seen: float = 0.0  # monotonic time of the last datagram of any kind
    last_progress: float = 0.0  # monotonic time of the last completed step (or start)
    phase: str = "start"
    values: dict[str, float] = field(default_factory=dict)
    step: int = -1
    restarts: int = 0
    steps_total: int = 0
    last_counted_step: int = -1
    # rates for the GPU simulator, from consecutive cumulative counters
    sync_bytes_per_s: float = 0.0
    host_bytes_per_s: float = 0.0
    _prev: tuple[float, float, float] | None = None  # (t, sync bytes, host bytes)
    acks: set[str] = field(default_factory=set)
    # The collective the rank is blocked in ("" when none), from its heartbeat.
    collective: str = ""


class RankRegistry:
    def __init__(self, max_ranks: int = 1024, grace_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_ranks = max_ranks
        self.grace_s = grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int], RankState] = {}
        self.rejected_full = 0

    def update(self, msg: dict[str, Any], addr: tuple[str, int] | None) -> RankState | None:
        """Fold one validated message in; None if the registry is full of other ranks."""
        key = (msg["run"], msg["rank"])
        now = self._clock()
        with self._lock:
            r = self._ranks.get(key)
            if r is None:
                if len(self._ranks) >= self.max_ranks:
                    self.rejected_full += 1
                    return None
                r = self._ranks[key] = RankState(run=key[0], rank=key[1], first_seen=now,
                                                 last_progress=now)
            for name in ("local_rank", "world_size", "pid", "gpu", "restarts"):
                if name in msg:
                    setattr(r, name, msg[name])
            r.addr = addr
            r.last_seen = now
            if msg["type"] == "step" or msg.get("event") == "start":
                r.last_progress = now
            if "phase" in msg:
                r.phase = msg["phase"]
            if msg.get("event") == "exit":
                r.phase = "exited"  # a clean finish: its growing age is not a hang
            if "collective" in msg:
                r.collective = msg["collective"]
            if "step" in msg:
                if msg["type"] == "step" and msg["step"] != r.last_counted_step:
                    r.steps_total += 1  # heartbeats carry the step too; count step messages
                    r.last_counted_step = msg["step"]
                r.step = msg["step"]
            for k, v in msg.items():
                if isinstance(v, int | float) and not isinstance(v, bool) and k not in (
                    "v", "rank", "local_rank", "world_size", "pid", "gpu", "step", "restarts"
                ):
                    r.values[k] = float(v)
            r.acks.update(msg.get("acks", []))
            if "sync_bytes_total" in msg or "host_bytes_total" in msg:
                sync = r.values.get("sync_bytes_total", 0.0)
                host = r.values.get("host_bytes_total", 0.0)
                if r._prev is not None and now > r._prev[0]:
                    dt = now - r._prev[0]
                    r.sync_bytes_per_s = max(0.0, (sync - r._prev[1]) / dt)
                    r.host_bytes_per_s = max(0.0, (host - r._prev[2]) / dt)
                r._prev = (now, sync, host)
            return r

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
