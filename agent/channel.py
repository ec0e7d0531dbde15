"""The agent's end of the Unix telemetry socket: a listening SOCK_SEQPACKET socket.

Connections, not datagrams, for two reasons a shared node forced on us:
- Fairness. A Unix datagram socket has one receive queue of `net.unix.max_dgram_qlen`
  (10 by default) messages for every sender together: one user's flood kept it full and
  another user's ranks lost 83 % of their telemetry. Each connection has its own
  queue, so a flood fills only the flooder's, and the receiver (agent.receiver) serves
  every sending user in turn.
- Identity fixed when it is sent. A datagram's sender was looked up when the agent
  read it; a sender that had exited by then left its pid free for another process,
  which the agent then took for the rank. The kernel records a connection's peer at
  `connect()`, and the agent pins that very process with a pidfd as it accepts
  (`SO_PEERPIDFD`, Linux >= 6.5; before that `pidfd_open` of the `SO_PEERCRED` pid,
  checked against the still-open connection; see docs/security.md).

The socket file is created with mode 0666 so that ranks of any user can connect (the
agent takes their identity from the kernel, not from the file's permissions), in a
directory that must not be writable by others: whoever can write the directory can
replace the socket and impersonate the agent to the ranks (see docs/security.md).
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import stat
import struct
from pathlib import Path

from clusterpulse.agent.identity import Sender, SubordinateIds, real_uid, start_time

_UCRED = struct.Struct("iII")  # struct ucred: pid_t pid; uid_t uid; gid_t gid
SO_PEERPIDFD = 77  # Linux >= 6.5 (Python 3.11's socket module has no name for it)
BACKLOG = 512


class ChannelError(OSError):
    """The socket cannot be set up; the text says why and what to do."""


def bind_unix(path: str) -> socket.socket:
    """The listening socket at `path`, non-blocking (the receiver polls it)."""
    p = Path(path)
    try:
        p.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as err:
        raise ChannelError(f"cannot create {p.parent}: {err.strerror}") from None
    st = p.parent.stat()
    if st.st_mode & (stat.S_IWOTH | stat.S_IWGRP) or st.st_uid not in (0, os.geteuid()):
        raise ChannelError(f"{p.parent} is writable by other users (or owned by one): they "
                           "could replace the "
                           "telemetry socket and impersonate the agent; use a directory "
                           "only the agent's user can write (e.g. /run/clusterpulse)")
    remove_stale_socket(path, "another agent")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(path)
        os.chmod(path, 0o666)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def remove_stale_socket(path: str, who: str) -> None:
    """Clear `path` for a new socket: a socket nobody answers on (left by a process that
    died) is removed; a live one (`who` is listening) or anything that is not a socket
    is an error, never deleted."""
    p = Path(path)
    if p.is_socket():
        if _someone_listens(path):
            raise ChannelError(f"{who} is listening on {path}")
        p.unlink()
    elif p.exists() or p.is_symlink():
        raise ChannelError(f"{path} exists and is not a socket")


def _someone_listens(path: str) -> bool:
    """Whether a live socket of any kind answers at `path` (an older agent used a
    datagram socket there; gRPC's are streams)."""
    for kind in (socket.SOCK_SEQPACKET, socket.SOCK_DGRAM, socket.SOCK_STREAM):
        probe = socket.socket(socket.AF_UNIX, kind)
        probe.settimeout(1.0)  # a live listener whose backlog is full (frozen) blocks
        try:
            probe.connect(path)
            return True
        except (TimeoutError, BlockingIOError):  # there, its backlog full (EAGAIN) or
            return True                            # not answering: never deleted
        except OSError:  # refused: stale; EPROTOTYPE: the other kind
            continue
        finally:
            probe.close()
    return False


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected, as the kernel recorded them at
    `connect()`, in the agent's PID namespace (pid 0: a namespace it cannot see)."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(raw)


def _peer_pidfd(conn: socket.socket, pid: int) -> int | None:
    """A pidfd for the connected process: the kernel's own (SO_PEERPIDFD, the very
    process that connected), else one opened by pid (which may since have been reused:
    the caller checks the connection still has a peer). None: nothing can be pinned."""
    try:
        fd = conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
        if fd >= 0:
            return fd
    except OSError as err:
        if err.errno == errno.ESRCH:  # the process that connected is gone
            return None
        # ENOPROTOOPT: a kernel before 6.5; fall back to the pid
    if pid <= 0:
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def _exited(pidfd: int) -> bool:
    """A pidfd polls readable once its process has exited."""
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))


def _peer_gone(conn: socket.socket) -> bool:
    p = select.poll()
    p.register(conn, select.POLLHUP | select.POLLRDHUP)
    return any(ev & (select.POLLHUP | select.POLLRDHUP) for _, ev in p.poll(0))


def identify(conn: socket.socket, subids: SubordinateIds | None = None) -> Sender:
    """Who connected: a verified Sender when the kernel named a process that is still
    the one that connected, pinned by its start time; otherwise unverified (evidence,
    never a target or a witness of anything).

    The start time is read while the pidfd pins the process and checked alive after:
    if the process had exited, its pid may belong to another by then, and the start
    time read would be the other's. Without SO_PEERPIDFD (Linux < 6.5) the pidfd is
    opened by pid, which may already be another process's: the peer end must still be
    open and the process must run as the uid that connected. A pid reused by a process
    of the same user is the one window left, and it gives that user nothing: the agent
    would signal a process the user could signal itself (a root process on a pid the
    user freed, the attack, is refused).
    """
    pid, uid, gid = peer_credentials(conn)
    unverified = Sender(pid=pid, uid=uid, gid=gid)
    pidfd = _peer_pidfd(conn, pid)
    if pidfd is None:
        return unverified
    try:
        started = start_time(pid)
        if (started is None or real_uid(pid) != uid or _exited(pidfd)
                or _peer_gone(conn)):
            return unverified
        return Sender(pid=pid, uid=uid, gid=gid, start_time=started, verified=True,
                      account=subids.account(uid) if subids is not None else -1)
    finally:
        os.close(pidfd)


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
