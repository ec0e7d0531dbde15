"""The agent: a collection loop, a telemetry receiver, and the state they publish.

Two threads, each on its own schedule. The collection thread reads the backend every
`interval_s` and swaps in a new immutable snapshot; the receiver thread folds rank
datagrams into the rank registry and answers each with the rank's pending commands
and (simulated) GPU slowdown. HTTP handlers only read.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from dataclasses import dataclass, field

from agent import protocol
from agent.audit import AuditLog
from agent.backends import Backend
from agent.backends.sim import SimBackend
from agent.commands import CommandBook
from agent.ranks import RankRegistry
from agent.sample import GpuSample

log = logging.getLogger(__name__)


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
                 interval_s: float = 1.0, telemetry_addr: tuple[str, int] | None = None) -> None:
        self.backend = backend
        self.node = node
        self.ranks = ranks
        self.audit = audit
        self.interval_s = interval_s
        self.commands = CommandBook(ranks, audit, node)
        self.snapshot = Snapshot()
        self.telemetry_counts: collections.Counter[str] = collections.Counter()
        self.internal_errors = 0
        self.links = None  # NIC port health (agent.links.NicCounters), set by the CLI
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sock: socket.socket | None = None
        if telemetry_addr is not None:
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            self._sock.bind(telemetry_addr)
            self._sock.settimeout(0.2)

    def collection_errors(self) -> dict[str, int]:
        errors = self.backend.errors()
        if self.internal_errors:
            errors["internal"] = errors.get("internal", 0) + self.internal_errors
        return errors

    @property
    def telemetry_port(self) -> int | None:
        return self._sock.getsockname()[1] if self._sock else None

    def start(self) -> None:
        self.collect_once()
        targets = [("collect", self._collect_loop)]
        if self._sock is not None:
            targets.append(("telemetry", self._receive_loop))
        for name, fn in targets:
            t = threading.Thread(target=fn, name=f"agent-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
        self.backend.close()

    # -- collection -----------------------------------------------------------------
    def collect_once(self) -> Snapshot:
        t0 = time.perf_counter()
        last_success = self.snapshot.last_success
        try:
            gpus = self.backend.collect()
            last_success = time.time()
        except Exception:  # a backend bug must not end monitoring of the node
            log.exception("collection failed")
            self.internal_errors += 1
            gpus = self.snapshot.gpus
        self.ranks.expire()
        self.commands.tick()
        self.snapshot = Snapshot(gpus=gpus, timestamp=time.time(),
                                 duration_s=time.perf_counter() - t0,
                                 cycles=self.snapshot.cycles + 1, last_success=last_success)
        return self.snapshot

    def _collect_loop(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            next_at += self.interval_s
            self.collect_once()
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind (slow NVML): skip missed ticks, don't burst
                next_at = time.monotonic()
                delay = 0
            self._stop.wait(delay)

    # -- telemetry ------------------------------------------------------------------
    def handle_datagram(self, data: bytes, addr: tuple[str, int] | None) -> bytes | None:
        """Validate and record one datagram; the reply for its sender, if any."""
        try:
            msg = protocol.decode(data)
        except protocol.MalformedMessage as err:
            self.telemetry_counts[f"malformed_{err}"] += 1
            return None
        r = self.ranks.update(msg, addr)
        if r is None:
            self.telemetry_counts["dropped_registry_full"] += 1
            return None
        self.telemetry_counts["accepted"] += 1
        reply: dict = {"type": "agent", "node": self.node}
        if isinstance(self.backend, SimBackend) and r.gpu >= 0:
            reply["slowdown"] = round(self.backend.slowdown(r.gpu), 4)
        pending = self.commands.pending_for(r.run, r.rank)
        if pending:
            reply["commands"] = pending
        return protocol.encode(reply)

    def _receive_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                data, addr = self._sock.recvfrom(protocol.MAX_DATAGRAM_BYTES + 1)
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            reply = self.handle_datagram(data, addr)
            if reply is not None:
                try:
                    self._sock.sendto(reply, addr)
                except OSError:
                    self.telemetry_counts["reply_failed"] += 1
