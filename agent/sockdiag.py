"""TCP connections and their kernel-measured round-trip times, read like `ss -ti` does.

The kernel keeps, for every TCP socket, a `struct tcp_info`: the smoothed RTT of the
data it sent (tcpi_rtt), when it last sent data, the data segments it sent and how many
it sent again (retransmissions; those the peer reports it already had: D-SACK) and
more. `ss -ti` reads it over a NETLINK_SOCK_DIAG socket (inet_diag); so does this
module, without a subprocess: one dump per address family of the established sockets
of the caller's network namespace, asking for INET_DIAG_INFO. No privilege is needed.

Only the fields this project reads are decoded, at the offsets of the kernel's UAPI
(linux/inet_diag.h, linux/tcp.h), which only ever grows at its end.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_INFO = 2
TCP_ESTABLISHED = 1

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
# inet_diag_req_v2: family, protocol, ext, pad, states, then an inet_diag_sockid
# (sport, dport, src[16], dst[16], if, cookie[2]: 48 bytes, zero = any)
_REQ = struct.Struct("=BBBxI48x")
# inet_diag_msg: family, state, timer, retrans (4 bytes); the sockid's ports (big-endian)
# and addresses (16 raw bytes each), then its interface and cookie; expires, rqueue,
# wqueue, uid; inode
_SOCKID = struct.Struct("!HH16s16s")
_MSG_TAIL = struct.Struct("=IQIIII")  # if, cookie, expires, rqueue, wqueue, uid
_INODE = struct.Struct("=I")
_RTATTR = struct.Struct("=HH")
MSG_SIZE = 4 + _SOCKID.size + _MSG_TAIL.size + _INODE.size  # 72
# struct tcp_info offsets (bytes): tcpi_last_data_sent (ms ago), tcpi_rtt (us),
# tcpi_total_retrans (segments retransmitted over the connection's life, Linux 2.6.x),
# tcpi_data_segs_out (segments sent that carried data, retransmissions included, 4.6),
# tcpi_dsack_dups (retransmissions the peer reported as duplicates with a D-SACK: sent
# again, yet not lost, 4.19)
TCPI_LAST_DATA_SENT, TCPI_RTT = 44, 68
TCPI_TOTAL_RETRANS, TCPI_DATA_SEGS_OUT, TCPI_DSACK_DUPS = 100, 156, 216


@dataclass(frozen=True)
class TcpSocket:
    """One established TCP socket as the kernel describes it."""

    inode: int
    uid: int
    local: str  # address only; an IPv4-mapped IPv6 address is given as IPv4
    remote: str
    rtt_seconds: float  # smoothed RTT of the data it sent
    last_data_sent_seconds: float  # how long ago it last sent data
    retransmitted_segments: int = 0  # tcpi_total_retrans: segments it sent again
    data_segments_sent: int = 0  # tcpi_data_segs_out (0 on a kernel before 4.6)
    duplicate_retransmissions: int = 0  # tcpi_dsack_dups (0 on a kernel before 4.19)


def _address(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return str(ipaddress.IPv4Address(raw[:4]))
    addr = ipaddress.IPv6Address(raw)
    return str(addr.ipv4_mapped or addr)


# (inode, uid) -> whether to decode the socket: a node runs thousands of sockets, the
# job a few, and decoding is most of the cost
Wanted = Callable[[int, int], bool]


def parse(data: bytes, wanted: Wanted | None = None) -> Iterator[TcpSocket | None]:
    """Netlink messages of an inet_diag dump -> its sockets (those `wanted`, if given);
    None at NLMSG_DONE. Raises OSError for an NLMSG_ERROR reply (e.g. a kernel without
    inet_diag)."""
    off = 0
    while off + _NLMSGHDR.size <= len(data):
        length, kind, _, _, _ = _NLMSGHDR.unpack_from(data, off)
        if length < _NLMSGHDR.size:
            return
        body, off_next = off + _NLMSGHDR.size, off + ((length + 3) & ~3)
        if kind == NLMSG_DONE:
            yield None
            return
        if kind == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, body)
            raise OSError(-err, os.strerror(-err))
        if kind == SOCK_DIAG_BY_FAMILY and length - _NLMSGHDR.size >= MSG_SIZE:
            tail = body + 4 + _SOCKID.size
            uid = _MSG_TAIL.unpack_from(data, tail)[5]
            (inode,) = _INODE.unpack_from(data, tail + _MSG_TAIL.size)
            if wanted is None or wanted(inode, uid):
                yield _socket(data, body, off + length, inode, uid)
        off = off_next


def _socket(data: bytes, at: int, end: int, inode: int, uid: int) -> TcpSocket:
    family = data[at]
    _, _, src, dst = _SOCKID.unpack_from(data, at + 4)
    rtt = last_sent = 0.0
    counts = [0, 0, 0]  # total_retrans, data_segs_out, dsack_dups
    off = at + MSG_SIZE
    while off + _RTATTR.size <= end:
        alen, atype = _RTATTR.unpack_from(data, off)
        if alen < _RTATTR.size:
            break
        info, size = off + _RTATTR.size, alen - _RTATTR.size
        if atype == INET_DIAG_INFO and size >= TCPI_RTT + 4:
            (last,) = struct.unpack_from("=I", data, info + TCPI_LAST_DATA_SENT)
            (rtt_us,) = struct.unpack_from("=I", data, info + TCPI_RTT)
            rtt, last_sent = rtt_us / 1e6, last / 1e3
            for i, field_at in enumerate((TCPI_TOTAL_RETRANS, TCPI_DATA_SEGS_OUT, TCPI_DSACK_DUPS)):
                if size >= field_at + 4:  # an older kernel's shorter tcp_info: left at 0
                    (counts[i],) = struct.unpack_from("=I", data, info + field_at)
        off += (alen + 3) & ~3
    return TcpSocket(inode, uid, _address(family, src), _address(family, dst), rtt, last_sent,
                     *counts)


def established(wanted: Wanted | None = None) -> list[TcpSocket]:
    """The established TCP sockets (IPv4 and IPv6) of this network namespace: every
    one, or those `wanted`."""
    out: list[TcpSocket] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC,
                       NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(2.0)  # the kernel answers at once; never hang a scrape on it
        for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), start=1):
            req = _REQ.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1),
                            1 << TCP_ESTABLISHED)
            nl.send(_NLMSGHDR.pack(_NLMSGHDR.size + len(req), SOCK_DIAG_BY_FAMILY,
                                   NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + req)
            done = False
            while not done:
                for s in parse(nl.recv(1 << 16), wanted):
                    if s is None:
                        done = True
                    else:
                        out.append(s)
    return out
