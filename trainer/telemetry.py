"""The rank side of the telemetry channel: fire-and-forget messages to the node agent.

Never blocks and never raises into the training loop: the socket is non-blocking and
every OS error is counted and swallowed.

Over a Unix socket (`unix:/run/clusterpulse/telemetry.sock`, the default) the rank
holds one SOCK_SEQPACKET connection to the agent: message boundaries as with
datagrams, but a queue of its own, so another user's flood cannot crowd it out, and
an identity the kernel fixes at `connect()` (agent.channel). Replies come back on the
connection, which nobody but the agent's end can write to, so a forged "restart" from
another local process never reaches `poll()`. A send that finds the connection's
queue full drops the sample (the agent is busy); when the agent restarts the
connection breaks and the link connects to the new one on a later send. An agent of
an older release listens on a datagram socket: the link falls back to one (the
kernel then accepts datagrams to it only from the agent's socket).

Over UDP (`HOST:PORT`, kept for setups without a shared socket file) the socket is
also connected, so replies from other ports are dropped by the kernel, but UDP
carries no sender identity: the agent never signals a rank it only knows over UDP. A
host name there is looked up by a thread of the link's own, never on the send path
(`AgentLink._look_up`).

Each message carries the UUID(s) of the rank's GPU so that the agent names the
physical GPU whatever CUDA_VISIBLE_DEVICES renumbered.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import select
import socket
import threading
import time
from typing import Any

from clusterpulse.agent import protocol
from clusterpulse.agent.validate import is_digits

log = logging.getLogger(__name__)

AgentAddr = str | tuple[str, int]
DEFAULT_SOCKET_PATH = protocol.DEFAULT_SOCKET_PATH
_RECONNECT = {errno.ECONNREFUSED, errno.ENOENT, errno.ENOTCONN, errno.EDESTADDRREQ,
              errno.EPIPE, errno.ECONNRESET}
_SEND_FLAGS = socket.MSG_NOSIGNAL  # a broken connection is an error to count, not SIGPIPE
# A UDP agent's host name is looked up off the send path: the link waits this long for
# the first answer (the "start" event goes to the agent found), then retries every
# LOOKUP_RETRY_S, doubled after each failure up to LOOKUP_RETRY_MAX_S.
LOOKUP_WAIT_S = 1.0
LOOKUP_RETRY_S = 1.0
LOOKUP_RETRY_MAX_S = 30.0


class AgentLink:
    def __init__(self, addr: AgentAddr | None, local_rank: int | None = None) -> None:
        self.addr = addr
        self.sent = 0
        self.failed = 0
        self._unencodable = False  # warned about a message that is not JSON
        self._sock: socket.socket | None = None
        self._connected = False
        self._kind = socket.SOCK_SEQPACKET
        self._lock = threading.Lock()
        # what the socket connects to: the path, or a numeric (ip, port); None while a
        # UDP host name is still being looked up (`_look_up`)
        self._target: AgentAddr | None = addr if isinstance(addr, str) else _numeric(addr)
        self._closing = threading.Event()
        if local_rank is None:
            env = os.environ.get("LOCAL_RANK", "0")
            local_rank = int(env) if is_digits(env) else 0
        self.gpu_uuids = rank_gpu_uuids(local_rank)
        if addr is None:
            return
        self._open()
        if self._target is None:
            looked_up = threading.Event()
            threading.Thread(target=self._look_up, args=(looked_up,), name="agent-lookup",
                             daemon=True).start()
            looked_up.wait(LOOKUP_WAIT_S)  # a working resolver answers in time for "start"
        else:
            self._connect()

    def _open(self) -> None:
        if isinstance(self.addr, str):
            self._sock = socket.socket(socket.AF_UNIX, self._kind)
            if self._kind == socket.SOCK_DGRAM:
                self._sock.bind("")  # autobind: an abstract name the agent can reply to
        else:
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def _connect(self) -> None:
        assert self._sock is not None and self._target is not None
        try:
            self._sock.connect(self._target)
            self._connected = True
        except OSError as err:  # agent not there yet: try again on a later send
            self._connected = False
            if not isinstance(self.addr, str):
                return
            if err.errno == errno.EPROTOTYPE and self._kind == socket.SOCK_SEQPACKET:
                self._kind = socket.SOCK_DGRAM  # an older agent's datagram socket
                self._reopen()
                self._connect()
            elif self._kind == socket.SOCK_DGRAM:
                # the older agent is gone (maybe upgraded): a connection next time
                self._kind = socket.SOCK_SEQPACKET
                self._reopen()
            else:
                # a failed connect leaves a connection socket unusable: a new one next time
                self._reopen()

    def _reopen(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._open()

    def _look_up(self, looked_up: threading.Event) -> None:
        """Resolve a UDP agent's host name (its own thread, retried with a growing
        delay until it resolves or the link closes), then connect to the address found.

        A lookup can take seconds: a resolver that does not answer, a name that does not
        exist yet (the agent's service not created). connect() with the name looked it
        up on every send while it did not resolve, in the training loop's thread and
        under the lock the heartbeat thread waits on: every step was that late. Sends
        before the name resolves are dropped, as with no agent; once resolved it is
        kept (connect() of a numeric address needs no lookup)."""
        assert isinstance(self.addr, tuple)
        delay = LOOKUP_RETRY_S
        while not self._closing.is_set():
            try:
                found = socket.getaddrinfo(*self.addr, socket.AF_INET, socket.SOCK_DGRAM)
            except (OSError, UnicodeError):  # gaierror; a label idna cannot encode
                found = []
            if found:
                with self._lock:
                    if self._sock is not None:
                        self._target = found[0][4]
                        self._connect()
                looked_up.set()
                return
            looked_up.set()
            self._closing.wait(delay)
            delay = min(delay * 2, LOOKUP_RETRY_MAX_S)

    def send(self, msg: dict[str, Any], wait_s: float = 0.0) -> None:
        """Send one message. With `wait_s`, a full queue (EAGAIN: the agent is busy) is
        waited on for at most that long; samples use 0 and are dropped instead."""
        if self._sock is None:
            return
        if self.gpu_uuids and "gpu_uuids" not in msg:
            msg = {**msg, "gpu_uuids": self.gpu_uuids}
        try:
            data = protocol.encode(msg)
        except (TypeError, ValueError):
            data = self._encode_without_bad_fields(msg)
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:  # the training loop and the heartbeat thread both send
                outcome = self._try_send(data)
            if outcome == "sent":
                self.sent += 1
                return
            left = deadline - time.monotonic()
            sock = self._sock
            if outcome == "full" and left > 0 and sock is not None:
                # poll, not select: a training process may hold > 1024 descriptors
                waiter = select.poll()
                try:
                    waiter.register(sock, select.POLLOUT)
                    waiter.poll(left * 1000)
                except (OSError, ValueError):  # closed or replaced meanwhile
                    pass
                continue
            self.failed += 1
            return

    def _encode_without_bad_fields(self, msg: dict[str, Any]) -> bytes:
        """The message less the fields JSON has no form for (one the caller added to
        `Pulse.extra`), NaN and infinities included (the agent refuses the message that
        holds one), warned about once. Raised, such a field stopped the training
        loop, or the heartbeat thread for good; dropping the whole message instead
        silenced every step and heartbeat while it stayed (the agent then takes a live
        rank for a dead one)."""
        kept, dropped = {}, []
        for key, value in msg.items():
            try:
                protocol.encode({key: value})
            except (TypeError, ValueError):
                dropped.append(key)
            else:
                kept[key] = value
        if not self._unencodable:
            self._unencodable = True
            log.warning("field(s) %s of a %r message to the agent are not JSON and are "
                        "left out (every value must be a finite number, str, bool, list or "
                        "dict)", ", ".join(sorted(dropped)), msg.get("type"))
        return protocol.encode(kept)

    def _try_send(self, data: bytes) -> str:
        if self._sock is None:  # closed meanwhile
            return "closed"
        try:
            if not self._connected:
                if self._target is None:  # the host name is being looked up
                    return "no_agent"
                self._connect()  # a path or a numeric address: no lookup
                if not self._connected:
                    return "no_agent"
            self._sock.send(data, _SEND_FLAGS)
            return "sent"
        except BlockingIOError:
            return "full"
        except OSError as err:  # agent gone, ...: drop the message, never the step
            if err.errno in _RECONNECT:
                self._disconnected()
            return "error"

    def _disconnected(self) -> None:
        """The agent went away (it stopped, restarted, or was upgraded from a datagram
        socket): connect afresh next time, trying a connection first."""
        self._connected = False
        if isinstance(self.addr, str):
            self._kind = socket.SOCK_SEQPACKET
            self._reopen()  # a connection socket cannot connect twice

    def poll(self) -> list[dict[str, Any]]:
        """Replies from the agent that arrived since the last poll (non-blocking)."""
        out: list[dict[str, Any]] = []
        with self._lock:
            if self._sock is None or not self._connected:
                return out
            for _ in range(64):
                try:
                    data = self._sock.recv(protocol.MAX_DATAGRAM_BYTES)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    break
                if not data and self._kind == socket.SOCK_SEQPACKET:
                    self._disconnected()  # end of the connection: the agent closed it
                    break
                try:
                    msg = json.loads(data)
                except (ValueError, RecursionError):
                    continue
                if isinstance(msg, dict) and msg.get("type") == "agent":
                    out.append(msg)
        return out

    def close(self) -> None:
        """Close, having read what is left of the agent's replies (never waiting: the
        socket is non-blocking). Unread replies at close make Linux report ECONNRESET to
        the agent ahead of this rank's last messages, its exit event among them; the
        agent reads on past it (agent.receiver), but need not meet it at all."""
        self._closing.set()  # a lookup still retrying stops
        with self._lock:
            if self._sock is not None:
                if self._connected and self._kind == socket.SOCK_SEQPACKET:
                    with contextlib.suppress(OSError):  # BlockingIOError: none left
                        while self._sock.recv(1):  # a record's rest is discarded with it
                            pass
                self._sock.close()
                self._sock = None
            self._connected = False


def _numeric(addr: tuple[str, int] | None) -> tuple[str, int] | None:
    """`addr` if its host is an IPv4 address, which connect() takes without a lookup;
    None for a host name (or no address)."""
    if addr is None:
        return None
    try:
        socket.inet_pton(socket.AF_INET, addr[0])
    except OSError:
        return None
    return addr


def parse_agent_addr(text: str | None) -> AgentAddr | None:
    """"unix:/run/clusterpulse/telemetry.sock" -> path; "127.0.0.1:9401" -> (host, port)
    (UDP); "" or "none" -> None (telemetry off). Raises ValueError on anything else."""
    if not text or text.lower() == "none":
        return None
    return protocol.parse_address(text)


def rank_gpu_uuids(local_rank: int) -> list[str]:
    """The UUID(s) of this rank's GPU, as NVML names them ("GPU-..."), or [] on CPU.

    CUDA numbers the visible devices from 0 whatever CUDA_VISIBLE_DEVICES says, so
    local_rank is an index into the *visible* list, not a physical GPU index. torch
    reports the device's UUID directly; without CUDA, a UUID listed in
    CUDA_VISIBLE_DEVICES at that position is used.
    """
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
               if v.strip()]
    try:
        import torch

        if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
            uuid = str(torch.cuda.get_device_properties(local_rank).uuid)
            return [uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"]
    except Exception:  # no CUDA build, driver trouble: fall back to the environment
        pass
    if 0 <= local_rank < len(visible) and visible[local_rank].startswith(("GPU-", "MIG-")):
        return [visible[local_rank]]
    return []
