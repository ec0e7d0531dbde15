"""NIC port health from sysfs: InfiniBand/RoCE port counters and Ethernet statistics.

A slow or flapping link stretches every collective of every rank on the node, and no
GPU metric shows it. The kernel already counts what matters, in plain files:
- /sys/class/infiniband/<dev>/ports/<port>/counters/{link_downed, symbol_error,
  port_rcv_errors, port_xmit_wait, port_xmit_data, port_rcv_data} and .../state
  ("4: ACTIVE"); the *_data counters are in 4-byte words (IBTA), as is the spec;
- /sys/class/net/<iface>/statistics/{rx,tx}_{bytes,errors,dropped} and
  /sys/class/net/<iface>/carrier, carrier_changes.
Reading them is a handful of small file reads that never block on hardware, so they
are read at scrape time. `root` is a constructor argument so that the same reader
runs against a tree written by a test (the file format is the kernel's).

Counters say a link is broken; they do not say it is *slow*. A link that carries less
than the traffic offered to it (a shaped or degraded port, a congested uplink) holds
packets back in the interface's queueing discipline, and the kernel counts that
(`overlimits`, `backlog`, `drops` of the root qdisc). `QueueCounters` reads them with
`tc -s -j qdisc show` (netlink, so it sees the agent's own network namespace). For
InfiniBand the equivalent evidence is `port_xmit_wait` above.

Which interfaces are the job's (`NicSelection`): a Kubernetes node has hundreds of
veths (cali*, cni0, flannel.1), a Slurm node docker0 and bridges, and a demo or
testbed on the same host adds its own, some shaped with tbf. Their counters and
queues say nothing about the training fabric, and one congested veth made
TrainingLinkCongested page for a node whose real link was idle. So by default only
interfaces backed by a device (sysfs `device` link) and the RDMA ports are read;
`--nic` names (or globs) more, e.g. a testbed node whose only link is a veth.

A queue shows only the side of a link that is this node's own egress. When the slow
side is the other one (the switch port toward this node, a peer's egress, an ingress
policer) this node's queue is empty and the queue of the other side is where no agent
looks. What sees both sides is the job's own TCP connections (`TcpPeerRtt`): a
connection's smoothed RTT is the time from sending data to its acknowledgement, so a
queue in front of a slow link delays it whichever way the data or the acknowledgements
cross that link. Every connection of the node whose link is slow waits in that queue;
a healthy node also talks to peers whose paths avoid it.

A link that drops rather than queues (a policer, a shallow switch buffer, a bad optic)
adds little to the RTT; the connections retransmit instead. The sender counts a lost
segment (tcp_info total_retrans, less the retransmissions the receiver reports as
duplicates: dsack_dups), so a node's egress loss shows in its own connections and its
ingress loss in its peers' connections to it: the rule joins the two by address.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from clusterpulse.agent import sockdiag

log = logging.getLogger(__name__)
PREFIX = "clusterpulse_"

# IB counter file -> (metric suffix, help, scale to base units)
IB_COUNTERS: dict[str, tuple[str, str, float]] = {
    "link_downed": ("nic_link_downed", "Times the port's link went down (IB link_downed).", 1.0),
    "symbol_error": ("nic_symbol_errors", "Physical-layer symbol errors (IB symbol_error).", 1.0),
    "port_rcv_errors": ("nic_receive_errors", "Packets received with errors.", 1.0),
    "port_xmit_wait": ("nic_transmit_wait_ticks",
                       "Ticks the port had data to send but no credits (congestion).", 1.0),
    "port_xmit_data": ("nic_transmit_bytes", "Bytes sent (IB counts 4-byte words).", 4.0),
    "port_rcv_data": ("nic_receive_bytes", "Bytes received (IB counts 4-byte words).", 4.0),
}
# Ethernet statistics file -> metric suffix (same names as the IB ones where they match)
NET_COUNTERS: dict[str, tuple[str, str]] = {
    "rx_errors": ("nic_receive_errors", "Packets received with errors."),
    "tx_errors": ("nic_transmit_errors", "Packets that failed to send."),
    "rx_dropped": ("nic_receive_dropped", "Received packets dropped."),
    "tx_bytes": ("nic_transmit_bytes", "Bytes sent."),
    "rx_bytes": ("nic_receive_bytes", "Bytes received."),
}
# Interface names that are never a node's fabric link unless named with --nic: loopback,
# veth pairs, bridges, tunnels, and the CNI/container-runtime devices that sit on them.
VIRTUAL_NAMES = ("lo", "veth*", "br-*", "virbr*", "docker*", "cni*", "cali*", "flannel*",
                 "tun*", "tap*", "vxlan*", "weave*", "kube-*", "cilium*", "lxc*")


@dataclass(frozen=True)
class NicSelection:
    """Which network interfaces are the node's own links (see the module docstring).

    `named`: --nic names or globs, always read. `sysfs`: the tree that tells a
    device-backed NIC from a virtual one; None (e.g. `--sysfs none`) selects only the
    named ones, since nothing else can be told apart.
    """

    named: tuple[str, ...] = ()
    sysfs: Path | None = Path("/sys")

    def is_named(self, iface: str) -> bool:
        return any(fnmatch.fnmatchcase(iface, pat) for pat in self.named)

    def wanted(self, iface: str) -> bool:
        if self.is_named(iface):
            return True
        if self.sysfs is None or any(fnmatch.fnmatchcase(iface, p) for p in VIRTUAL_NAMES):
            return False
        dev = self.sysfs / "class" / "net" / iface
        # Kernel semantics: only a NIC on a bus has `device`; a bridge has `bridge/`
        # and a tun/tap `tun_flags` (checked too, for odd drivers that link a parent).
        return ((dev / "device").exists() and not (dev / "bridge").exists()
                and not (dev / "tun_flags").exists())


@dataclass
class Port:
    device: str  # mlx5_0 or eth0
    port: str  # IB port number; "1" for Ethernet
    kind: str  # "infiniband" or "ethernet"
    up: float | None = None
    counters: dict[str, float] = field(default_factory=dict)  # metric suffix -> value
    carrier_changes: float | None = None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def label_text(name: str) -> str:
    """A kernel name as a label value. Linux allows any byte but '/' in an interface
    name, and Python keeps the bytes that are not UTF-8 as lone surrogates, which the
    exposition cannot encode: one such name made every scrape of the node fail
    (NodeAgentDown while /healthz said ok). Those bytes read as `\\xff`: each name
    stays its own series (U+FFFD made `ens\\xff` and `ens\\xfe` one, twice)."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


# operstate (RFC 2863) when `carrier` cannot be read; the other states say nothing sure
_OPERSTATE_UP = {"up": 1.0, "down": 0.0, "lowerlayerdown": 0.0, "notpresent": 0.0}


def _ethernet_up(dev: Path) -> float | None:
    """1 if the interface has carrier. An interface taken down (`ip link set down`, a
    driver or NetworkManager deconfiguring it) has no carrier to read (EINVAL), and
    without a reading NicLinkDown never fired for it: its operstate says down."""
    carrier = _number(_read(dev / "carrier"))
    if carrier is not None:
        return float(carrier >= 1)
    return _OPERSTATE_UP.get(_read(dev / "operstate") or "")


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


class NicCounters:
    """RDMA ports and the selected Ethernet interfaces (`select`; default: those
    backed by a device in `root`)."""

    def __init__(self, root: Path = Path("/sys"), select: NicSelection | None = None) -> None:
        self.root = root
        self.select = select or NicSelection(sysfs=root)

    def ports(self) -> list[Port]:
        out = []
        ib = self.root / "class" / "infiniband"
        for dev in sorted(ib.glob("*")) if ib.is_dir() else []:
            for pdir in sorted((dev / "ports").glob("*")):
                p = Port(label_text(dev.name), label_text(pdir.name), "infiniband")
                state = _read(pdir / "state")  # "4: ACTIVE"
                if state is not None:
                    p.up = 1.0 if state.split(":")[0].strip() == "4" else 0.0
                for name, (suffix, _, scale) in IB_COUNTERS.items():
                    v = _number(_read(pdir / "counters" / name))
                    if v is not None:
                        p.counters[suffix] = v * scale
                out.append(p)
        net = self.root / "class" / "net"
        for dev in sorted(net.glob("*")) if net.is_dir() else []:
            if not self.select.wanted(dev.name):
                continue  # bridges, veths, tunnels, CNI devices: not the node's link
            p = Port(label_text(dev.name), "1", "ethernet")
            p.up = _ethernet_up(dev)
            p.carrier_changes = _number(_read(dev / "carrier_changes"))
            for name, (suffix, _) in NET_COUNTERS.items():
                v = _number(_read(dev / "statistics" / name))
                if v is not None:
                    p.counters[suffix] = v
            out.append(p)
        return out

    def families(self, node: str) -> Iterator:
        labels = ["node", "device", "port", "kind"]
        ports = self.ports()
        up = GaugeMetricFamily(PREFIX + "nic_port_up",
                               "1 if the port's link is up (IB ACTIVE, Ethernet carrier).",
                               labels=labels)
        flaps = CounterMetricFamily(PREFIX + "nic_carrier_changes",
                                    "Ethernet carrier changes (link flaps).", labels=labels)
        helps = {s: h for s, h, _ in IB_COUNTERS.values()} | {s: h for s, h in
                                                               NET_COUNTERS.values()}
        fams = {s: CounterMetricFamily(PREFIX + s, h, labels=labels) for s, h in helps.items()}
        for p in ports:
            lb = [node, p.device, p.port, p.kind]
            if p.up is not None:
                up.add_metric(lb, p.up)
            if p.carrier_changes is not None:
                flaps.add_metric(lb, p.carrier_changes)
            for suffix, v in p.counters.items():
                fams[suffix].add_metric(lb, v)
        yield up
        yield flaps
        yield from fams.values()


@dataclass(frozen=True)
class QueueStats:
    qdisc: str  # the root queueing discipline's kind: mq, fq_codel, tbf, ...
    overlimits: float  # packets held back because the traffic exceeded the rate
    drops: float
    backlog_bytes: float  # queued now


def parse_qdiscs(text: str) -> dict[str, QueueStats]:
    """`tc -s -j qdisc show` output -> each device's root qdisc. Devices without a
    queue (`noqueue`: loopback, veths, bridges) have nothing to measure and are left out."""
    out = {}
    for q in json.loads(text):
        if not isinstance(q, dict):
            continue
        dev, kind = q.get("dev"), q.get("kind")
        if not (q.get("root") and isinstance(dev, str) and isinstance(kind, str)) \
                or kind == "noqueue":
            continue
        out[dev] = QueueStats(kind, float(q.get("overlimits", 0)), float(q.get("drops", 0)),
                              float(q.get("backlog", 0)))
    return out


def read_qdiscs(tc: str) -> dict[str, QueueStats]:
    """The root qdiscs of this network namespace, read with `tc` (2 s at most)."""
    # names that are not UTF-8 keep their bytes (surrogateescape), as /sys's listing
    # does, so that NicSelection matches them; the exporter writes them with label_text
    out = subprocess.run([tc, "-s", "-j", "qdisc", "show"], capture_output=True, text=True,
                         errors="surrogateescape", timeout=2, check=True)
    return parse_qdiscs(out.stdout)


class QueueCounters:
    """Root-qdisc statistics of the node's network interfaces, read at scrape time.

    `select`: the interfaces to export (default: those backed by a device in /sys);
    every other queue (a veth shaped by another setup on the host) is ignored. `read` is
    `read_qdiscs` with the `tc` found on PATH; a failure (no tc, a timeout, odd output)
    is logged once and the scrape goes on without these series.
    """

    def __init__(self, select: NicSelection | None = None,
                 read: Callable[[], dict[str, QueueStats]] | None = None) -> None:
        tc = shutil.which("tc")
        self.select = select or NicSelection()
        self.read = read or (lambda: read_qdiscs(tc) if tc else {})
        self._warned = tc is None and read is None
        if self._warned:
            log.warning("tc (iproute2) not found: no queue statistics for the NICs")

    def queues(self) -> dict[str, QueueStats]:
        try:
            found = self.read()
        except (OSError, subprocess.SubprocessError, ValueError, AttributeError) as err:
            if not self._warned:
                log.warning("cannot read queueing statistics: %s", err)
                self._warned = True
            return {}
        return {d: q for d, q in found.items() if self.select.wanted(d)}

    def families(self, node: str) -> Iterator:
        labels = ["node", "device", "qdisc"]
        held = CounterMetricFamily(
            PREFIX + "nic_queue_overlimits",
            "Packets the interface's root qdisc held back because more was sent than the "
            "link's rate: a link slower than its traffic (shaped, degraded or congested).",
            labels=labels)
        drops = CounterMetricFamily(PREFIX + "nic_queue_drops",
                                    "Packets the interface's root qdisc dropped.", labels=labels)
        backlog = GaugeMetricFamily(PREFIX + "nic_queue_backlog_bytes",
                                    "Bytes waiting in the interface's root qdisc.", labels=labels)
        for dev, q in sorted(self.queues().items()):
            lb = [node, label_text(dev), label_text(q.qdisc)]
            held.add_metric(lb, q.overlimits)
            drops.add_metric(lb, q.drops)
            backlog.add_metric(lb, q.backlog_bytes)
        yield held
        yield drops
        yield backlog


# A connection whose last data left longer ago than this has no recent RTT: idle
# connections (a gloo pair of ranks that are no ring neighbours, a rendezvous store)
# keep the RTT of their last exchange, which says nothing about the link now.
ACTIVE_WITHIN_S = 10.0
# How long the socket inodes of a rank process are reused before its fds are listed
# again: a job makes its connections when its process groups start.
INODES_TTL_S = 10.0


# A peer none of the ranks' connections has led to for this long loses its counters
# (a long-lived agent on a shared cluster meets many peers over weeks).
PEER_FORGET_S = 600.0


@dataclass
class PeerSegments:
    """What the ranks' connections to one peer counted (segments), totals that only grow."""

    data_sent: int = 0
    retransmitted: int = 0
    duplicates: int = 0  # retransmissions the peer already had (D-SACK)


@dataclass(frozen=True)
class PeerReading:
    rtt: dict[str, float]  # peer -> least RTT of the active connections (seconds)
    segments: dict[str, PeerSegments]
    addresses: set[str]  # this node's addresses, as its connections to other nodes use them


def socket_inodes(fd_dir: Path) -> set[int]:
    """The inodes of the sockets a process holds open (`socket:[N]` links in its fd/).
    Raises PermissionError where the process is not ours to look into."""
    out = set()
    for fd in fd_dir.iterdir():
        try:
            target = str(fd.readlink())
        except FileNotFoundError:
            continue  # closed while listed
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


class TcpPeerRtt:
    """The smoothed RTT of the training ranks' TCP connections to each peer address,
    read at scrape time over sock_diag (`agent.sockdiag`): slow-link evidence that sees
    both sides of the link (see the module docstring).

    `ranks` gives the (pid, uid) of the node's live, kernel-verified rank processes.
    Their connections are the sockets their fd tables hold; where a process's fds
    cannot be read (an agent without CAP_SYS_PTRACE under another user), every socket
    of its uid counts instead. Per peer, the least RTT of the connections that sent
    data within ACTIVE_WITHIN_S: the path's own delay plus what waits in its queues
    (a connection carrying small messages adds the peer's delayed acknowledgement, up
    to 40 ms; the least of them is the path). Connections to the node's own addresses
    (ranks of one node) cross no link and are left out. Ranks in another network
    namespace than the agent's (a Kubernetes pod without hostNetwork) are not seen.

    Per peer too, counters of the data segments the connections sent, of those sent
    again and of the retransmissions the peer reported it already had (D-SACK): the
    rest were lost. Each connection's growth since the last read is added to its peer's
    totals, so they only grow while connections come and go (a job's restart). And the
    node's own addresses that its connections to other nodes use, so that a rule finds
    which node another node's `peer` is.
    """

    def __init__(self, ranks: Callable[[], Iterable[tuple[int, int]]],
                 proc: Path = Path("/proc"),
                 read: Callable[[sockdiag.Wanted], list[sockdiag.TcpSocket]] = sockdiag.established,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ranks, self.proc, self.read_sockets, self.clock = ranks, proc, read, clock
        self._inodes: dict[int, tuple[float, set[int]]] = {}  # pid -> (listed at, inodes)
        # inode -> peer, its counts, when last seen
        self._conns: dict[int, tuple[str, int, int, int, float]] = {}
        self._totals: dict[str, PeerSegments] = {}
        self._peer_seen: dict[str, float] = {}  # peer -> when a connection to it was last seen
        self._lock = threading.Lock()  # two scrapes at once (two Prometheus) add each growth once
        self._warned = False

    def _selection(self) -> tuple[set[int], set[int]]:
        """The ranks' socket inodes, and the uids of ranks whose fds cannot be read."""
        inodes: set[int] = set()
        uids: set[int] = set()
        now, live = self.clock(), dict(self.ranks())
        for pid in list(self._inodes):
            if pid not in live:
                del self._inodes[pid]
        for pid, uid in live.items():
            hit = self._inodes.get(pid)
            if hit is None or now - hit[0] > INODES_TTL_S:
                try:
                    hit = self._inodes[pid] = (now, socket_inodes(self.proc / str(pid) / "fd"))
                except PermissionError:
                    uids.add(uid)
                    continue
                except OSError:
                    continue  # exited since the registry saw it
            inodes |= hit[1]
        return inodes, uids

    def read(self) -> PeerReading:
        """One sock_diag read of the ranks' connections: each peer's RTT, its counters
        (accumulated over connections, see `PeerSegments`), the node's own addresses."""
        with self._lock:
            return self._read()

    def _read(self) -> PeerReading:
        inodes, uids = self._selection()
        if not inodes and not uids:
            return PeerReading({}, self._counters(self.clock(), []), set())
        try:
            socks = self.read_sockets(lambda inode, uid: inode in inodes or uid in uids)
        except OSError as err:
            if not self._warned:
                log.warning("cannot read TCP connections (sock_diag): %s", err)
                self._warned = True
            return PeerReading({}, self._counters(self.clock(), []), set())
        own = {s.local for s in socks}  # the addresses the ranks use: the node's
        rtt: dict[str, float] = {}
        links = [s for s in socks if s.remote not in own]
        for s in links:
            if s.last_data_sent_seconds <= ACTIVE_WITHIN_S and s.rtt_seconds > 0:
                rtt[s.remote] = min(s.rtt_seconds, rtt.get(s.remote, s.rtt_seconds))
        return PeerReading(rtt, self._counters(self.clock(), links), {s.local for s in links})

    def _counters(self, now: float, links: list[sockdiag.TcpSocket]) -> dict[str, PeerSegments]:
        """Per peer, what its connections counted since the agent first saw each: a
        connection's counters are its own and end with it (a job's restart makes new
        ones), so each one's growth is added to its peer's running totals.

        A connection missing from one read (no live rank while torchrun restarts its
        workers, a failed sock_diag read, a rank whose fds were not listed) keeps what
        it had counted until PEER_FORGET_S: forgotten at once, it came back with its
        whole lifetime added again (torchrun's store connection lives through every
        restart). An inode now on another peer, or counts that went down, is another
        connection: counted from zero."""
        for s in links:
            now_counts = (s.data_segments_sent, s.retransmitted_segments,
                          s.duplicate_retransmissions)
            peer, *before, _ = self._conns.get(s.inode, (s.remote, 0, 0, 0, now))
            if peer != s.remote or any(a < b for a, b in zip(now_counts, before, strict=True)):
                before = [0, 0, 0]
            total = self._totals.setdefault(s.remote, PeerSegments())
            total.data_sent += now_counts[0] - before[0]
            total.retransmitted += now_counts[1] - before[1]
            total.duplicates += now_counts[2] - before[2]
            self._peer_seen[s.remote] = now
            self._conns[s.inode] = (s.remote, *now_counts, now)
        for inode, (*_, at) in list(self._conns.items()):
            if now - at > PEER_FORGET_S:
                del self._conns[inode]
        for peer, at in list(self._peer_seen.items()):
            if now - at > PEER_FORGET_S:
                del self._peer_seen[peer], self._totals[peer]
        return dict(self._totals)

    def peers(self) -> dict[str, float]:
        """Peer address -> the least RTT (seconds) of the ranks' active connections to it."""
        return self.read().rtt

    def families(self, node: str) -> Iterator:
        got = self.read()
        rtt = GaugeMetricFamily(
            PREFIX + "tcp_peer_rtt_seconds",
            "Least smoothed round-trip time of the training ranks' TCP connections to the "
            "peer that sent data in the last 10 s: the path's delay plus its queues, on "
            "either side of a slow link.", labels=["node", "peer"])
        for peer, seconds in sorted(got.rtt.items()):
            rtt.add_metric([node, peer], seconds)
        yield rtt
        labels = ["node", "peer"]
        sent = CounterMetricFamily(
            PREFIX + "tcp_peer_data_segments_sent",
            "Segments carrying data that the training ranks' TCP connections sent to the "
            "peer, retransmissions included (tcp_info data_segs_out).", labels=labels)
        again = CounterMetricFamily(
            PREFIX + "tcp_peer_retransmitted_segments",
            "Segments the training ranks' TCP connections to the peer sent again (tcp_info "
            "total_retrans): lost on the way, or acknowledged late.", labels=labels)
        dups = CounterMetricFamily(
            PREFIX + "tcp_peer_duplicate_retransmissions",
            "Retransmissions the peer reported it had already received (D-SACK, tcp_info "
            "dsack_dups): sent again although nothing was lost.", labels=labels)
        for peer, c in sorted(got.segments.items()):
            sent.add_metric([node, peer], c.data_sent)
            again.add_metric([node, peer], c.retransmitted)
            dups.add_metric([node, peer], c.duplicates)
        yield sent
        yield again
        yield dups
        addresses = GaugeMetricFamily(
            PREFIX + "tcp_local_address_info",
            "1 for each address of this node that the training ranks' connections to other "
            "nodes use: which node a peer address of another node's series is.",
            labels=["node", "address"])
        for address in sorted(got.addresses):
            addresses.add_metric([node, address], 1)
        yield addresses
