"""The agent: a collection loop, a telemetry receiver, and the state they publish.

Two threads, each on its own schedule. The collection thread reads the backend every
`interval_s` and swaps in a new immutable snapshot; the receiver thread
(agent.receiver) folds rank messages into the rank registry and answers each with the
rank's pending commands and (simulated) GPU slowdown, never waiting on a sender. HTTP
handlers only read.
"""

from __future__ import annotations

import collections
import functools
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from clusterpulse.agent import channel, protocol
from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.backends import Backend, CollectionFailed
from clusterpulse.agent.backends.sim import SimBackend
from clusterpulse.agent.commands import CommandBook
from clusterpulse.agent.identity import Sender
from clusterpulse.agent.logsetup import Throttle
from clusterpulse.agent.ranks import RankRegistry, Refused
from clusterpulse.agent.receiver import TelemetryReceiver
from clusterpulse.agent.sample import GpuSample

log = logging.getLogger(__name__)
FOLLOW_UP_EVERY_S = 1.0  # at most: a hard restart's SIGKILL is due 5 s after its SIGTERM
MALFORMED_LOG_EVERY_S = 60.0  # at most one warning per malformed_<why> in this time
# How long start() waits for the first collection: long enough for a healthy node's
# (GPU facts in the first scrape, in the start line), bounded for a hung one's.
FIRST_COLLECTION_WAIT_S = 10.0


@dataclass(frozen=True)
class Snapshot:
    gpus: list[GpuSample] = field(default_factory=list)
    timestamp: float = 0.0
    duration_s: float = 0.0
    cycles: int = 0
    # Unix time of the last collection whose backend call returned: what the staleness
    # metric ages from (a stuck or failing backend leaves it behind).
    last_success: float = 0.0


class Agent:
    def __init__(self, backend: Backend, node: str, ranks: RankRegistry, audit: AuditLog,
                 interval_s: float = 1.0,
                 telemetry_addr: str | tuple[str, int] | None = None) -> None:
        """`telemetry_addr`: a socket path (Unix SOCK_SEQPACKET, kernel-verified
        senders) or (host, port) for UDP (unverified senders, never signalled); None: no
        telemetry."""
        self.backend = backend
        self.node = node
        self.ranks = ranks
        self.audit = audit
        self.interval_s = interval_s
        self.commands = CommandBook(ranks, audit, node)
        self.snapshot = Snapshot()
        self.telemetry_counts: collections.Counter[str] = collections.Counter()
        self.malformed_lines = Throttle(MALFORMED_LOG_EVERY_S)  # keys: protocol's reasons
        self.internal_errors = 0
        # Unix time the agent began: what the collection age counts from before the
        # first collection has succeeded (one hung at start ages, not reads 0)
        self.started = time.time()
        self._first_collection = threading.Event()
        # NIC port health and queues (agent.links.NicCounters, QueueCounters), set by the CLI
        self.links: list = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sock: socket.socket | None = None
        self._unix_path: str | None = None
        if isinstance(telemetry_addr, str):
            self._sock = channel.bind_unix(telemetry_addr)
            self._unix_path = telemetry_addr
        elif telemetry_addr is not None:
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._sock.bind(telemetry_addr)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        self.receiver: TelemetryReceiver | None = None
        if self._sock is not None:
            self.receiver = TelemetryReceiver(self._sock, self.handle_datagram,
                                              self.telemetry_counts,
                                              unix=self._unix_path is not None)

    def stopped_threads(self) -> list[str]:
        """The agent's threads that ended while it runs (/healthz reports them): a dead
        receiver silences every rank, a dead follow-up loop leaves hung ranks alive."""
        if self._stop.is_set():
            return []
        return [t.name for t in self._threads if not t.is_alive()]

    def collection_errors(self) -> dict[str, int]:
        errors = self.backend.errors()
        if self.internal_errors:
            errors["internal"] = errors.get("internal", 0) + self.internal_errors
        if self.audit.failed_writes:  # records kept in memory until the file takes them
            errors["audit_write"] = self.audit.failed_writes
        return errors

    @property
    def telemetry_port(self) -> int | None:
        """The UDP port (None on a Unix socket or without telemetry)."""
        if self._sock is None or self._unix_path is not None:
            return None
        return self._sock.getsockname()[1]

    @property
    def telemetry_address(self) -> str | None:
        """What ranks pass as --agent / CLUSTERPULSE_AGENT to reach this agent."""
        if self._sock is None:
            return None
        if self._unix_path is not None:
            return f"unix:{self._unix_path}"
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> None:
        """Start the threads, then wait at most FIRST_COLLECTION_WAIT_S for the first
        collection: collected here first, an NVML call that hung at start kept the
        receiver, the follow-ups (a hung rank's restart) and the caller's HTTP server
        from ever starting."""
        self.follow_up()
        targets = [("collect", self._collect_loop), ("follow-up", self._follow_up_loop)]
        if self.receiver is not None:
            targets.append(("telemetry", functools.partial(self.receiver.run, self._stop)))
        for name, fn in targets:
            t = threading.Thread(target=fn, name=f"agent-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        if not self._first_collection.wait(FIRST_COLLECTION_WAIT_S):
            log.warning("the first GPU collection has not ended after %.0f s (a hung NVML "
                        "call?): serving without it", FIRST_COLLECTION_WAIT_S)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self.audit.flush()  # records a full disk held back, if it takes them now
        if self.receiver is not None:
            self.receiver.close()
        if self._sock is not None:
            self._sock.close()
        if self._unix_path is not None:
            channel.unlink_quietly(self._unix_path)
        self.backend.close()

    # -- collection ---------------------------------------------------------------------
    def collect_once(self) -> Snapshot:
        """One collection and one round of follow-ups (at start, and for callers that
        drive the agent themselves); the running agent does each on its own thread."""
        snap = self._collect()
        self.follow_up()
        return snap

    def _collect(self) -> Snapshot:
        t0 = time.perf_counter()
        last_success = self.snapshot.last_success
        try:
            gpus = self.backend.collect()
            last_success = time.time()
        except CollectionFailed as err:  # said and counted by the backend: no traceback
            log.warning("collection failed: %s", err)
            gpus = self.snapshot.gpus
        except Exception:  # a backend bug must not end monitoring of the node
            log.exception("collection failed")
            self.internal_errors += 1
            gpus = self.snapshot.gpus
        self.snapshot = Snapshot(gpus=gpus, timestamp=time.time(),
                                 duration_s=time.perf_counter() - t0,
                                 cycles=self.snapshot.cycles + 1, last_success=last_success)
        self._first_collection.set()
        return self.snapshot

    def follow_up(self) -> None:
        """Expire silent ranks and advance open commands (acks, deadlines, a hard
        restart's SIGKILL). Not in the collection loop: a GPU in trouble can block NVML
        calls for minutes, which is when a hung rank's restart must still happen."""
        try:
            self.ranks.expire()
            self.commands.tick()
        except Exception:  # a bug here must not end the loop: next time may work
            log.exception("command follow-up failed")
            self.internal_errors += 1

    def _collect_loop(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            next_at += self.interval_s
            self._collect()
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind (slow NVML): skip missed ticks, don't burst
                next_at = time.monotonic()
                delay = 0
            self._stop.wait(delay)

    def _follow_up_loop(self) -> None:
        every = min(self.interval_s, FOLLOW_UP_EVERY_S)
        while not self._stop.wait(every):
            self.follow_up()

    # -- telemetry ------------------------------------------------------------------
    def _gpu_index(self, uuids: tuple[str, ...]) -> int | None:
        """The local GPU index of the first reported UUID this node has."""
        by_uuid = {g.uuid: g.index for g in self.snapshot.gpus}
        return next((by_uuid[u] for u in uuids if u in by_uuid), None)

    def _say_malformed(self, why: str, addr: Any, sender: Sender | None) -> None:
        """Warn of a dropped message, naming why and who sent it: the counter alone said
        that something on the node sent garbage (a rank of another protocol version, a
        stray process on the socket), never what. At most one line per reason per
        MALFORMED_LOG_EVERY_S, with the count dropped since, so a flood cannot fill the
        log."""
        count = self.malformed_lines.due(why)
        if not count:
            return
        if sender is not None and sender.uid >= 0:  # the kernel's word (SO_PEERCRED)
            who = f"uid {sender.uid} pid {sender.pid}"
            who += "" if sender.verified else " (unverified: the process may have gone)"
        elif isinstance(addr, tuple) and len(addr) >= 2:
            who = f"{addr[0]}:{addr[1]} (UDP, unverified)"
        else:
            who = "an unknown sender"
        since = f"; {count - 1} more dropped as {why}, unlogged, since the last such " \
            "line" if count > 1 else ""
        log.warning("dropped malformed telemetry (%s) from %s%s", why, who, since)

    def handle_datagram(self, data: bytes, addr: Any,
                        sender: Sender | None = None) -> bytes | None:
        """Validate and record one message; the reply for its sender, if any.

        Never raises: whatever the bytes, the outcome is a counter.
        """
        try:
            msg = protocol.decode(data)
        except protocol.MalformedMessage as err:
            self.telemetry_counts[f"malformed_{err}"] += 1
            self._say_malformed(str(err), addr, sender)
            return None
        try:
            r = self.ranks.update(msg, addr, sender)
        except Refused as why:
            self.telemetry_counts[f"refused_{why}"] += 1
            return None
        if r is None:
            self.telemetry_counts["dropped_registry_full"] += 1
            return None
        if r.gpu_uuids:
            index = self._gpu_index(r.gpu_uuids)
            if index is not None:
                r.gpu = index  # the physical GPU, whatever CUDA_VISIBLE_DEVICES renumbered
        self.telemetry_counts["accepted"] += 1
        if msg.get("event") == "exit" and msg.get("outcome") == "checkpoint-restart":
            self.commands.left_gracefully(r.run, r.rank, r.sender)
        if msg.get("event") == "leave_refused":
            self.commands.leave_refused(r.run, r.rank, msg["command"], msg["reason"],
                                        r.sender)
        reply: dict = {"type": "agent", "node": self.node, "phases": protocol.LATER_PHASES}
        if isinstance(self.backend, SimBackend) and 0 <= r.gpu < self.backend.gpu_count:
            reply["slowdown"] = round(self.backend.slowdown(r.gpu), 4)
        pending = self.commands.pending_for(r.run, r.rank, r.restarts, r.sender)
        if pending:
            reply["commands"] = pending
        return protocol.encode(reply)
