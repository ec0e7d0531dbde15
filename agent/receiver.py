"""The telemetry receive loop: every sending user served in turn, nothing waited on.

One thread multiplexes the listening socket and every rank's connection (agent.channel)
with epoll. Each round it reads the same share of messages from every sending user
with messages waiting (the uid the kernel names, or the owner of the subordinate uid
range it falls in; every unverified sender shares one bucket), spread over that
user's ready connections: at most `PER_OWNER_BUDGET`, and fewer when many users wait
so that a round stays within `ROUND_BUDGET` messages (one each at the least). A user
who floods gets the same share as one who sends a heartbeat a second, the flood waits
in the flooder's own connection queues, and a round stays short however many users
(or subordinate uids) send.

A round that leaves a user's messages waiting (a flood) is followed by a pause as long
as the round took (`_yield_after`), so that a flood cannot take the whole interpreter
from the scrape and the collection.

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
from clusterpulse.agent.identity import Sender, SubordinateIds

log = logging.getLogger(__name__)

PER_OWNER_BUDGET = 32  # messages per sending user per round, at most
ROUND_BUDGET = 1024  # messages per round, unless more users than that wait (one each)
SELECT_TIMEOUT_S = 0.2
MAX_PAUSE_S = 0.05  # the longest pause after a round that left a backlog (_yield_after)
ACCEPTS_PER_ROUND = 1024  # the backlog drained each round: a churn must not starve ranks
MAX_CONNECTIONS = 4096
# A rank holds one connection; a user's ranks are capped by the registry
# (RankRegistry.max_per_owner), so more connections than that buy nothing but descriptors.
MAX_CONNECTIONS_PER_OWNER = 300
CONNECTION_SERIES = 10  # users named in the connections gauge; the rest are "other"
_SEND_FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL

# (data, reply address or None, sender) -> the reply to send back, if any
Handler = Callable[[bytes, object, Sender], "bytes | None"]


class _OverQuota(Exception):
    pass


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
        self._subids = SubordinateIds()
        self._rotation = 0
        self._lock = threading.Lock()  # guards what the exporter reads
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
        """Open rank connections by sending user ("uid:N" or "unverified"): the users
        with the most, and "other" for the rest (one series per user would be
        unbounded: a user may hold many subordinate uids)."""
        with self._lock:
            counts = collections.Counter(self._per_owner)
        top = dict(counts.most_common(CONNECTION_SERIES))
        rest = sum(counts.values()) - sum(top.values())
        return {**top, **({"other": rest} if rest else {})}

    # -- the loop -----------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            cpu = time.thread_time()
            try:
                backlog = self.round()
            except Exception:  # a bug here must not end telemetry for the node
                self._counts["internal_error"] += 1
                log.exception("telemetry receive round failed")
                continue
            if backlog:
                self._yield_after(time.thread_time() - cpu, stop)

    def _yield_after(self, spent_s: float, stop: threading.Event) -> None:
        """After a round that left a user's messages waiting (a flood), leave the
        interpreter to the agent's other threads for as long as the round held it.

        A flood keeps every round full and the loop never blocked: it took a whole core
        of the agent, and held the GIL but for the instants of its system calls, so the
        scrape's thread waited for it at each of its own. Paused, a flood costs the
        agent about half a core at most and the GIL is free half the time; what waits
        is the flooder's own queue, and every other user is still served each round.
        Beside a flood on the shared 2-core machine (load 10-48, 5 alternating pairs)
        the slowest of 24 /metrics answers was 0.17-0.50 s, against 0.35-1.27 s
        without the pause (lower in 4 of the 5 pairs; docs/benchmarks.md)."""
        stop.wait(min(spent_s, MAX_PAUSE_S))

    def round(self, timeout: float = SELECT_TIMEOUT_S) -> bool:
        """Wait for input at most `timeout`, then serve each ready user's share; True
        when a user had more than its share waiting (the loop is not keeping up with
        someone)."""
        ready: dict[str, list[_Conn | None]] = collections.defaultdict(list)
        for key, _ in self._sel.select(timeout):
            if key.data is None:  # the listening (or UDP) socket
                if self._unix:
                    self._accept()
                else:
                    ready["unverified"].append(None)
            else:
                ready[key.data.owner].append(key.data)
        owners = list(ready)
        if owners:  # who goes first changes each round
            self._rotation = (self._rotation + 1) % len(owners)
            owners = owners[self._rotation:] + owners[:self._rotation]
        share = max(1, min(PER_OWNER_BUDGET, ROUND_BUDGET // max(1, len(owners))))
        backlog = False
        for owner in owners:
            backlog |= self._serve_owner(ready[owner], share)
        with self._lock:
            self._last_round = time.monotonic()
        return backlog

    def _serve_owner(self, conns: list[_Conn | None], budget: int) -> bool:
        """Serve up to `budget` messages of one user's ready connections; True when the
        budget ran out (more of the user's may be waiting)."""
        if len(conns) > budget:  # which of a user's connections go first rotates too
            k = self._rotation % len(conns)
            conns[:] = conns[k:] + conns[:k]
        while budget > 0 and conns:
            for c in list(conns):
                if not self._serve_one(c):
                    conns.remove(c)
                    continue
                budget -= 1
                if budget == 0:
                    return True
        return False

    def _serve_one(self, c: _Conn | None) -> bool:
        """Read and handle one message of `c` (None: the UDP socket); False when there
        was none (or the connection closed)."""
        sock = self._sock if c is None else c.sock
        try:
            if c is None:
                data, addr = sock.recvfrom(protocol.MAX_DATAGRAM_BYTES + 1)
                sender = Sender()  # UDP: nobody vouches for the sender
            else:
                data, addr, sender = _recv_from_rank(sock), None, c.sender
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
                # the quota first, from the kernel's record alone: a user over it costs
                # no pidfd and no /proc read
                _, uid, _ = channel.peer_credentials(conn)
                if self._per_owner[f"uid:{self._subids.account(uid)}"] >= \
                        MAX_CONNECTIONS_PER_OWNER:
                    raise _OverQuota
                sender = channel.identify(conn, self._subids)
                owner = sender.owner_key
                if self._per_owner[owner] >= MAX_CONNECTIONS_PER_OWNER or \
                        not self._room_for(owner):
                    raise _OverQuota
            except _OverQuota:
                self._counts["connection_refused_quota"] += 1
                conn.close()
                continue
            except OSError:
                conn.close()
                continue
            conn.setblocking(False)
            c = _Conn(conn, sender, owner)
            self._conns[conn.fileno()] = c
            with self._lock:
                self._per_owner[owner] += 1
            self._sel.register(conn, selectors.EVENT_READ, c)

    def _room_for(self, owner: str) -> bool:
        """Below the total cap; at it, a connection of the user holding the most makes
        room for a user holding fewer (else a few users' full quotas lock every other
        user's new ranks out)."""
        if len(self._conns) < MAX_CONNECTIONS:
            return True
        biggest, most = max(self._per_owner.items(), key=lambda kv: kv[1])
        if biggest == owner or most <= self._per_owner[owner] + 1:
            return False
        victim = next(c for c in reversed(self._conns.values()) if c.owner == biggest)
        self._counts["connection_evicted_for_fairness"] += 1
        self._close(victim)
        return True

    def _close(self, c: _Conn) -> None:
        if self._conns.pop(c.sock.fileno(), None) is None:
            return
        with self._lock:
            self._per_owner[c.owner] -= 1
            if self._per_owner[c.owner] <= 0:
                del self._per_owner[c.owner]
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(c.sock)
        c.sock.close()

    def close(self) -> None:
        for c in list(self._conns.values()):
            self._close(c)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(self._sock)
        self._sel.close()


def _recv_from_rank(sock: socket.socket) -> bytes:
    """One message of a rank's connection (b"": the rank closed it, nothing is left).

    A rank reads the agent's replies only at its consensus boundary, so it nearly
    always leaves with some unread; the kernel then reports ECONNRESET on the agent's
    end, once, ahead of the messages the rank sent before it left and still queued
    there: a graceful restart's acknowledgement and the rank's exit event, sent
    milliseconds before it goes. Nothing of the rank's was lost, so reading goes on;
    taking the reset for the end of the connection dropped them whenever the agent was
    slower than the rank's exit (a loaded node), and the command showed a rank that
    never acknowledged."""
    try:
        return sock.recv(protocol.MAX_DATAGRAM_BYTES + 1)
    except ConnectionResetError:  # said once: what follows is the rank's, then the end
        return sock.recv(protocol.MAX_DATAGRAM_BYTES + 1)


def _raise_descriptor_limit() -> None:
    """One descriptor per rank connection: lift the soft limit to the hard one (a
    default soft limit of 1024 is a few hundred ranks and a flood)."""
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = MAX_CONNECTIONS + 256 if hard == resource.RLIM_INFINITY else min(
            hard, MAX_CONNECTIONS + 256)
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
