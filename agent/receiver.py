"""The telemetry receive loop: every sending user served in turn, nothing waited on.

One thread multiplexes the listening socket and every rank's connection (agent.channel)
with epoll. Each round it reads at most `PER_OWNER_BUDGET` messages per sending user
(uid, as the kernel says; every unverified sender shares one bucket), spread over that
user's ready connections, so a user who floods gets the same share as one who sends a
heartbeat a second, and the flood waits in the flooder's own connection queue.

Replies (pending commands, the simulated GPU slowdown) are sent without waiting: a
sender that does not read its replies loses them (counted as `reply_dropped`), and
never slows the loop. A hung job's stopped ranks, or a user's sockets that never read,
used to cost 0.2 s per reply and starved every other job's heartbeats.

UDP (`HOST:PORT`) is one socket with no identity: all of it is the unverified bucket.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from clusterpulse.agent import channel, protocol
from clusterpulse.agent.identity import Sender

log = logging.getLogger(__name__)

PER_OWNER_BUDGET = 32  # messages per sending user per round
SELECT_TIMEOUT_S = 0.2
ACCEPTS_PER_ROUND = 64
MAX_CONNECTIONS = 4096
# A rank holds one connection; a user's ranks are capped by the registry
# (RankRegistry.max_per_owner), so more connections than that buy nothing but descriptors.
MAX_CONNECTIONS_PER_OWNER = 300
_SEND_FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL

# (data, reply address or None, sender) -> the reply to send back, if any
Handler = Callable[[bytes, object, Sender], "bytes | None"]


@dataclass
class _Conn:
    sock: socket.socket
    sender: Sender
    owner: str


class TelemetryReceiver:
    def __init__(self, sock: socket.socket, handle: Handler,
                 counts: collections.Counter[str], unix: bool) -> None:
        self._sock = sock
        self._handle = handle
        self._counts = counts
        self._unix = unix
        self._sel = selectors.DefaultSelector()
        self._conns: dict[int, _Conn] = {}
        self._per_owner: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()  # guards the last round's time for readers
        self._last_round = time.monotonic()
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, None)
        if unix:
            _raise_descriptor_limit()

    # -- what the exporter reads ------------------------------------------------------
    def lag_seconds(self) -> float:
        """Seconds since the loop last finished a round (<= ~0.2 s when healthy): a
        stalled loop is every rank on the node going silent, which the heartbeat
        alerts would blame on the ranks."""
        with self._lock:
            return max(0.0, time.monotonic() - self._last_round)

    def connections(self) -> dict[str, int]:
        """Open rank connections by sending user ("uid:N" or "unverified")."""
        return {k: v for k, v in self._per_owner.items() if v}

    # -- the loop -----------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.round()
            except Exception:  # a bug here must not end telemetry for the node
                self._counts["internal_error"] += 1
                log.exception("telemetry receive round failed")

    def round(self, timeout: float = SELECT_TIMEOUT_S) -> None:
        """Wait for input at most `timeout`, then serve each ready user's share."""
        ready: dict[str, list[_Conn | None]] = collections.defaultdict(list)
        for key, _ in self._sel.select(timeout):
            if key.data is None:  # the listening (or UDP) socket
                if self._unix:
                    self._accept()
                else:
                    ready["unverified"].append(None)
            else:
                ready[key.data.owner].append(key.data)
        for conns in ready.values():
            self._serve_owner(conns)
        with self._lock:
            self._last_round = time.monotonic()

    def _serve_owner(self, conns: list[_Conn | None]) -> None:
        budget = PER_OWNER_BUDGET
        while budget > 0 and conns:
            for c in list(conns):
                if not self._serve_one(c):
                    conns.remove(c)
                    continue
                budget -= 1
                if budget == 0:
                    return

    def _serve_one(self, c: _Conn | None) -> bool:
        """Read and handle one message of `c` (None: the UDP socket); False when there
        was none (or the connection closed)."""
        sock = self._sock if c is None else c.sock
        try:
            if c is None:
                data, addr = sock.recvfrom(protocol.MAX_DATAGRAM_BYTES + 1)
                sender = Sender()  # UDP: nobody vouches for the sender
            else:
                data, addr, sender = sock.recv(protocol.MAX_DATAGRAM_BYTES + 1), None, c.sender
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            if c is not None:
                self._close(c)
            return False
        if c is not None and not data:  # the rank closed its end
            self._close(c)
            return False
        reply = self._handle(data, addr, sender)
        if reply is not None:
            try:
                if c is None:
                    if addr:
                        sock.sendto(reply, _SEND_FLAGS, addr)
                else:
                    sock.send(reply, _SEND_FLAGS)
            except BlockingIOError:  # it does not read its replies: never wait for it
                self._counts["reply_dropped"] += 1
            except OSError:
                self._counts["reply_failed"] += 1
        return True

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_ROUND):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # EMFILE and kin: the backlog waits for room
                self._counts["connection_refused_descriptors"] += 1
                log.warning("cannot accept a telemetry connection: %s", err.strerror)
                return
            try:
                sender = channel.identify(conn)
            except OSError:
                conn.close()
                continue
            owner = sender.owner_key
            if (len(self._conns) >= MAX_CONNECTIONS
                    or self._per_owner[owner] >= MAX_CONNECTIONS_PER_OWNER):
                self._counts["connection_refused_quota"] += 1
                conn.close()
                continue
            conn.setblocking(False)
            c = _Conn(conn, sender, owner)
            self._conns[conn.fileno()] = c
            self._per_owner[owner] += 1
            self._sel.register(conn, selectors.EVENT_READ, c)

    def _close(self, c: _Conn) -> None:
        if self._conns.pop(c.sock.fileno(), None) is None:
            return
        self._per_owner[c.owner] -= 1
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(c.sock)
        c.sock.close()

    def close(self) -> None:
        for c in list(self._conns.values()):
            self._close(c)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(self._sock)
        self._sel.close()


def _raise_descriptor_limit() -> None:
    """One descriptor per rank connection: lift the soft limit to the hard one (a
    default soft limit of 1024 is a few hundred ranks and a flood)."""
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = MAX_CONNECTIONS + 256 if hard == resource.RLIM_INFINITY else min(
            hard, MAX_CONNECTIONS + 256)
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
