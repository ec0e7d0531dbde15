"""The agent's end of the Unix datagram telemetry socket.

The socket file is created with mode 0666 so that ranks of any user can send (the
agent takes their identity from the kernel, not from the file's permissions), in a
directory that must not be writable by others: whoever can write the directory can
replace the socket and impersonate the agent to the ranks (see docs/security.md).
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
from pathlib import Path

from clusterpulse.agent import protocol
from clusterpulse.agent.identity import Sender, from_credentials

_UCRED = struct.Struct("iII")  # struct ucred: pid_t pid; uid_t uid; gid_t gid


class ChannelError(OSError):
    """The socket cannot be set up; the text says why and what to do."""


def bind_unix(path: str) -> socket.socket:
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
    if p.is_socket():
        # A stale socket from an agent that died: nobody answers on it any more.
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            p.unlink()
        else:
            raise ChannelError(f"another agent is listening on {path}")
        finally:
            probe.close()
    elif p.exists():
        raise ChannelError(f"{path} exists and is not a socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o666)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    except OSError:
        sock.close()
        raise
    return sock


def receive_unix(sock: socket.socket) -> tuple[bytes, object, Sender]:
    """One datagram, the address to reply to, and who the kernel says sent it."""
    data, ancdata, _flags, addr = sock.recvmsg(protocol.MAX_DATAGRAM_BYTES + 1,
                                                socket.CMSG_SPACE(_UCRED.size))
    sender = Sender()
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS \
                and len(payload) >= _UCRED.size:
            sender = from_credentials(*_UCRED.unpack(payload[:_UCRED.size]))
    return data, addr, sender


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
