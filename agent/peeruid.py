"""Which user is at the other end of a TCP connection from this host, as the kernel says.

Per-client limits keyed by address mean nothing for local users: any of them can
connect from any of 127.0.0.0/8's 16 million addresses, or from any address of the
host's own interfaces (eth0, IPoIB, docker0...), and reviews held every worker of the
agent and the remediation webhook that way from one account. The kernel knows the
owner of the connecting socket whenever it is on this host (in this network
namespace); `ss -e` reads it over sock_diag netlink (one exact lookup by the
connection's addresses and ports, no privilege needed), and so does this module.
Remote peers keep their address: another host's users are beyond this kernel's
knowledge, and the lookup finds no local socket for them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct

from clusterpulse.agent.identity import SubordinateIds

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
CLOSED = -1  # uid_of_peer: the peer is on this host and has closed its socket
_HDR = struct.Struct("=IHHII")  # nlmsghdr
# inet_diag_req_v2: family, protocol, ext, pad, states; then inet_diag_sockid:
# sport, dport (big-endian), src[16], dst[16], interface, cookie[2]
_REQ = struct.Struct("=BBBxI")
_SOCKID = struct.Struct(">HH16s16s")
_TAIL = struct.Struct("=III")
_UID_AT = _HDR.size + 4 + _SOCKID.size + _TAIL.size + 12  # inet_diag_msg's idiag_uid


def is_loopback(host: str) -> bool:
    with contextlib.suppress(ValueError):
        addr = ipaddress.ip_address(host)
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return addr.is_loopback
    return False


def _packed(host: str, family: int) -> bytes:
    return socket.inet_pton(family, host).ljust(16, b"\0")


def local_peer_uid(sock: socket.socket) -> int | None:
    """The uid owning the peer's socket of an accepted TCP connection, or None (a
    remote peer, the peer already gone, or no sock_diag in this kernel)."""
    try:
        ours, theirs = sock.getsockname(), sock.getpeername()
    except OSError:
        return None
    return uid_of_peer(theirs, ours)


def uid_of_peer(theirs: tuple, ours: tuple) -> int | None:
    """`local_peer_uid` for a connection known by its two ends, (host, port) each, as
    a web framework reports them (the dashboard's WebSocket); CLOSED for a peer on this
    host that has already closed its socket."""
    try:
        family = socket.AF_INET6 if ":" in str(theirs[0]) else socket.AF_INET
        if family == socket.AF_INET6 and ":" not in str(ours[0]):
            ours = (f"::ffff:{ours[0]}", *ours[1:])
        if family == socket.AF_INET and ":" in str(ours[0]):
            return None
        theirs, ours = (str(theirs[0]), int(theirs[1])), (str(ours[0]), int(ours[1]))
    except (TypeError, ValueError, IndexError):
        return None
    # The peer's own socket: its local end is our remote end.
    try:
        sockid = _SOCKID.pack(theirs[1], ours[1], _packed(theirs[0], family),
                              _packed(ours[0], family))
    except (OSError, ValueError, struct.error):  # not an address of that family
        return None
    body = (_REQ.pack(family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF) + sockid
            + _TAIL.pack(0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE))
    msg = _HDR.pack(_HDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + body
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)
            nl.sendto(msg, (0, 0))
            reply = nl.recv(8192)
    except OSError:
        return None
    if len(reply) < _UID_AT + 4:
        return None
    _, kind, _, _, _ = _HDR.unpack_from(reply)
    if kind != SOCK_DIAG_BY_FAMILY:  # NLMSG_ERROR: no such socket (it went away)
        return None
    uid, inode = struct.unpack_from("=II", reply, _UID_AT)
    if inode == 0:
        # a socket its owner has closed is the kernel's (orphaned, no file: reported as
        # uid 0), so any user's closed connections would have counted as root's; a
        # half-closed one (shutdown) still has its file and its owner
        return CLOSED
    return uid


_SUBIDS = SubordinateIds()


def account_key(uid: int) -> str:
    """`uid:N` of the user accountable for `uid`: a rootless container's or a user
    namespace's subordinate uids (/etc/subuid: 65,536 a user) are their owner's, or
    each would be a client of its own (a review's two uids held every worker)."""
    return f"uid:{_SUBIDS.account(uid)}"


def client_key(sock: socket.socket, addr: object) -> str:
    """What per-client limits count by: `uid:N` for a peer on this host (whatever
    source address it picked), else the peer's address (every loopback one
    `loopback`, should the lookup fail)."""
    uid = local_peer_uid(sock)
    if uid == CLOSED:
        return "closed"  # nobody to serve: SafeServer closes it unread
    if uid is not None:
        return account_key(uid)
    host = addr[0] if isinstance(addr, tuple) and addr else "?"
    return "loopback" if is_loopback(str(host)) else str(host)
