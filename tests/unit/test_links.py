"""NIC port health read from a sysfs tree in the kernel's own file format, exported
with clean metric names; virtual interfaces are skipped."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from clusterpulse.agent import links, sockdiag
from clusterpulse.agent.links import (
    NicCounters,
    NicSelection,
    QueueCounters,
    QueueStats,
    TcpPeerRtt,
    parse_qdiscs,
    read_qdiscs,
)
from clusterpulse.agent.sockdiag import TcpSocket
from tests.support.promtool import metrics_are_clean
from tests.support.sysfs import make_crowded_net, make_sysfs


def scrape(root: Path) -> str:
    class Collector:
        def collect(self):
            yield from NicCounters(root).families("n1")

    reg = CollectorRegistry()
    reg.register(Collector())
    return generate_latest(reg).decode()


def test_reads_infiniband_and_ethernet_counters_in_base_units(tmp_path):
    make_sysfs(tmp_path)
    ports = {(p.device, p.port): p for p in NicCounters(tmp_path).ports()}
    assert set(ports) == {("mlx5_0", "1"), ("mlx5_1", "1"), ("eth0", "1")}
    ib = ports[("mlx5_0", "1")]
    assert ib.up == 1.0 and ports[("mlx5_1", "1")].up == 0.0
    assert ib.counters["nic_link_downed"] == 2 and ib.counters["nic_symbol_errors"] == 17
    assert ib.counters["nic_transmit_bytes"] == 4000  # IB data counters are 4-byte words
    eth = ports[("eth0", "1")]
    assert eth.up == 1.0 and eth.carrier_changes == 4 and eth.counters["nic_receive_errors"] == 5


def test_exported_series_are_named_by_the_contract_and_promtool_clean(tmp_path):
    make_sysfs(tmp_path)
    text = scrape(tmp_path)
    samples = {(s.name, s.labels.get("device")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("clusterpulse_nic_port_up", "mlx5_1")] == 0.0
    assert samples[("clusterpulse_nic_symbol_errors_total", "mlx5_0")] == 17
    assert samples[("clusterpulse_nic_carrier_changes_total", "eth0")] == 4
    metrics_are_clean(text)


def test_missing_sysfs_is_no_ports_not_an_error(tmp_path):
    assert NicCounters(tmp_path / "nothing").ports() == []


# `tc -s -j qdisc show` on a machine whose eth0 has pfifo_fast, with a node's veth shaped
# by tbf at 4 Mbit/s while a TCP sender fills it (captured from iproute2 6.1).
TC_JSON = (
    '[{"kind":"noqueue","handle":"0:","dev":"lo","root":true,"refcnt":2,"options":{},'
    '"bytes":0,"packets":0,"drops":0,"overlimits":0,"requeues":0,"backlog":0,"qlen":0},'
    '{"kind":"pfifo_fast","handle":"0:","dev":"eth0","root":true,"refcnt":2,"options":'
    '{"bands":3,"multiqueue":false},"bytes":8626592,"packets":100419,"drops":0,'
    '"overlimits":0,"requeues":1,"backlog":0,"qlen":0},'
    '{"kind":"tbf","handle":"802b:","dev":"veth1","root":true,"refcnt":3,"options":'
    '{"rate":500000,"burst":32768,"lat":500000},"bytes":1643740,"packets":1094,"drops":3,'
    '"overlimits":986,"requeues":0,"backlog":266464,"qlen":41},'
    '{"kind":"fq_codel","handle":"0:","dev":"eth1","parent":"1:1","bytes":5,"packets":1,'
    '"drops":0,"overlimits":0,"requeues":0,"backlog":0,"qlen":0}]')


def test_queue_statistics_of_root_qdiscs():
    q = parse_qdiscs(TC_JSON)
    assert set(q) == {"eth0", "veth1"}  # lo has no queue; eth1's is not a root qdisc
    assert q["veth1"] == QueueStats("tbf", 986.0, 3.0, 266464.0)


def test_queue_counters_export_the_named_interfaces():
    reg = CollectorRegistry()

    class Collector:
        def collect(self):
            yield from QueueCounters(NicSelection(("veth1",), None),
                                     read=lambda: parse_qdiscs(TC_JSON)).families("n1")

    reg.register(Collector())
    samples = {(s.name, s.labels["device"]): s.value
               for f in text_string_to_metric_families(generate_latest(reg).decode())
               for s in f.samples}
    assert samples == {("clusterpulse_nic_queue_overlimits_total", "veth1"): 986.0,
                       ("clusterpulse_nic_queue_drops_total", "veth1"): 3.0,
                       ("clusterpulse_nic_queue_backlog_bytes", "veth1"): 266464.0}


def test_queue_counters_survive_a_failing_tc(caplog):
    def broken() -> dict:
        raise subprocess.TimeoutExpired(["tc"], 2)

    qc = QueueCounters(read=broken)
    assert qc.queues() == {} and qc.queues() == {}
    assert sum("cannot read queueing statistics" in r.message for r in caplog.records) == 1


def test_real_tc_reads_this_namespace():
    tc = shutil.which("tc")
    assert tc, "tc (iproute2) is installed by the test command's set-up"
    found = read_qdiscs(tc)
    assert "lo" not in found  # loopback has no queue
    assert all(isinstance(s, QueueStats) and s.overlimits >= 0 for s in found.values())


def crowded_tc(names: list[str]) -> str:
    """`tc -s -j qdisc show` where every interface has a root queue holding packets
    back (a veth shaped by another setup looks exactly like this)."""
    return json.dumps([{"kind": "tbf", "dev": n, "root": True, "drops": 1,
                        "overlimits": 50, "backlog": 100} for n in names])


def test_only_device_backed_nics_and_rdma_ports_are_read_on_a_crowded_node(tmp_path):
    names = make_crowded_net(tmp_path)
    make_sysfs(tmp_path)  # adds mlx5_0/1 (RDMA), eth0 (device) and veth0
    ports = {p.device for p in NicCounters(tmp_path).ports()}
    assert ports == {"mlx5_0", "mlx5_1", "eth0", "ens1f0"}
    queues = QueueCounters(NicSelection(sysfs=tmp_path),
                           read=lambda: parse_qdiscs(crowded_tc([*names, "eth0"])))
    assert set(queues.queues()) == {"ens1f0", "eth0"}


def test_nic_names_and_globs_add_interfaces_the_default_leaves_out(tmp_path):
    names = make_crowded_net(tmp_path, veths=3)
    select = NicSelection(("veth0001", "cali*"), tmp_path)
    ports = {p.device for p in NicCounters(tmp_path, select).ports()}
    assert ports == {"ens1f0", "veth0001"} | {n for n in names if n.startswith("cali")}
    # without sysfs (--sysfs none, e.g. a testbed node) only the named ones are read
    queues = QueueCounters(NicSelection(("eth0",), None),
                           read=lambda: parse_qdiscs(crowded_tc([*names, "eth0"])))
    assert set(queues.queues()) == {"eth0"}


# --- the job's TCP connections: slow-link evidence from either side (issue #27) --------


def test_sock_diag_reads_a_connections_rtt_as_ss_does():
    """A real TCP connection: sock_diag finds it by its inode, with the smoothed RTT and
    the time since it last sent data that `ss -ti` prints for it."""
    server = socket.create_server(("127.0.0.1", 0))
    with server, socket.create_connection(server.getsockname()) as client:
        peer, _ = server.accept()
        with peer:
            for _ in range(20):
                client.sendall(b"x" * 65536)
                got = 0
                while got < 65536:
                    got += len(peer.recv(1 << 20))
            time.sleep(0.3)
            inode = os.fstat(client.fileno()).st_ino
            found = sockdiag.established(lambda i, _: i == inode)  # decoded: this one only
            assert inode in {s.inode for s in sockdiag.established()}
            ss = subprocess.run(["ss", "-tinH", f"sport = :{client.getsockname()[1]}"],
                                capture_output=True, text=True, timeout=30).stdout
    assert len(found) == 1, found
    s = found[0]
    assert (s.local, s.remote, s.uid) == ("127.0.0.1", "127.0.0.1", os.getuid())
    rtt_ms, last_ms = (float(re.search(rf"\b{k}:([\d.]+)", ss).group(1))
                       for k in ("rtt", "lastsnd"))
    assert s.rtt_seconds == pytest.approx(rtt_ms / 1e3, abs=1e-6), ss
    assert 0.3 <= s.last_data_sent_seconds <= last_ms / 1e3 + 0.1, (s, ss)
    # ss prints "retrans:<now>/<total>" and "dsack_dups:" only where not 0
    data_segs = int(re.search(r"\bdata_segs_out:(\d+)", ss).group(1))
    retrans = re.search(r"\bretrans:\d+/(\d+)", ss)
    dups = re.search(r"\bdsack_dups:(\d+)", ss)
    assert s.data_segments_sent == data_segs >= 20, ss  # 20 writes of 64 KiB at least
    assert s.retransmitted_segments == (int(retrans.group(1)) if retrans else 0), ss
    assert s.duplicate_retransmissions == (int(dups.group(1)) if dups else 0), ss


# struct tcp_info of linux/tcp.h (6.x) up to tcpi_snd_wnd, field by field: a layout
# written out here, not the module's offsets, so that a wrong offset fails the test
TCP_INFO_FIELDS = (
    [(n, "B") for n in ("state", "ca_state", "retransmits", "probes", "backoff", "options",
                        "wscale", "flags")]
    + [(n, "I") for n in ("rto", "ato", "snd_mss", "rcv_mss", "unacked", "sacked", "lost",
                          "retrans", "fackets", "last_data_sent", "last_ack_sent",
                          "last_data_recv", "last_ack_recv", "pmtu", "rcv_ssthresh", "rtt",
                          "rttvar", "snd_ssthresh", "snd_cwnd", "advmss", "reordering",
                          "rcv_rtt", "rcv_space", "total_retrans")]
    + [(n, "Q") for n in ("pacing_rate", "max_pacing_rate", "bytes_acked", "bytes_received")]
    + [(n, "I") for n in ("segs_out", "segs_in", "notsent_bytes", "min_rtt", "data_segs_in",
                          "data_segs_out")]
    + [(n, "Q") for n in ("delivery_rate", "busy_time", "rwnd_limited", "sndbuf_limited")]
    + [(n, "I") for n in ("delivered", "delivered_ce")]
    + [(n, "Q") for n in ("bytes_sent", "bytes_retrans")]
    + [(n, "I") for n in ("dsack_dups", "reord_seen", "rcv_ooopack", "snd_wnd")])


def tcp_info(**fields: int) -> bytes:
    """A struct tcp_info with the named fields set (the rest 0): 232 bytes."""
    names = [n for n, _ in TCP_INFO_FIELDS]
    assert set(fields) <= set(names), fields
    return struct.pack("=" + "".join(t for _, t in TCP_INFO_FIELDS),
                       *(fields.get(n, 0) for n in names))


def test_the_offsets_read_are_those_of_the_kernels_tcp_info():
    assert len(tcp_info()) == 232  # sizeof(struct tcp_info) up to tcpi_snd_wnd (5.4+)
    for name, offset in (("last_data_sent", sockdiag.TCPI_LAST_DATA_SENT),
                         ("rtt", sockdiag.TCPI_RTT),
                         ("total_retrans", sockdiag.TCPI_TOTAL_RETRANS),
                         ("data_segs_out", sockdiag.TCPI_DATA_SEGS_OUT),
                         ("dsack_dups", sockdiag.TCPI_DSACK_DUPS)):
        assert tcp_info(**{name: 0xABCDEF}).index(struct.pack("=I", 0xABCDEF)) == offset, name


def _diag_message(family: int, src: bytes, dst: bytes, inode: int, rtt_us: int,
                  info_size: int = 232, **counts: int) -> bytes:
    """One SOCK_DIAG_BY_FAMILY reply as the kernel lays it out, with a tcp_info
    (`info_size` bytes of it: an older kernel's is shorter)."""
    info = tcp_info(last_data_sent=1500, rtt=rtt_us, **counts)[:info_size]
    msg = (struct.pack("=BBBB", family, 1, 0, 0) + struct.pack("!HH16s16s", 1, 2, src, dst)
           + struct.pack("=IQIIIII", 0, 0, 0, 0, 0, 1000, inode))
    attr = struct.pack("=HH", 4 + len(info), sockdiag.INET_DIAG_INFO) + bytes(info)
    body = msg + attr
    return struct.pack("=IHHII", 16 + len(body), sockdiag.SOCK_DIAG_BY_FAMILY, 2, 1, 0) + body


def test_sock_diag_replies_are_decoded_and_mapped_addresses_read_as_ipv4():
    mapped = bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 2])
    v6 = socket.inet_pton(socket.AF_INET6, "fd00::3")
    done = struct.pack("=IHHII", 20, sockdiag.NLMSG_DONE, 2, 1, 0) + bytes(4)
    got = list(sockdiag.parse(_diag_message(socket.AF_INET6, mapped, mapped, 5, 125000)
                              + _diag_message(socket.AF_INET6, v6, v6, 6, 300) + done))
    assert got == [TcpSocket(5, 1000, "10.0.0.2", "10.0.0.2", 0.125, 1.5),
                   TcpSocket(6, 1000, "fd00::3", "fd00::3", 0.0003, 1.5), None]
    error = struct.pack("=IHHII", 20, sockdiag.NLMSG_ERROR, 0, 1, 0) + struct.pack("=i", -2)
    with pytest.raises(OSError):
        list(sockdiag.parse(error))


def test_sock_diag_reads_the_segments_sent_and_retransmitted():
    """tcpi_total_retrans, tcpi_data_segs_out and tcpi_dsack_dups at their places in the
    kernel's tcp_info; where the kernel's tcp_info ends before a field (4.4 has no
    data_segs_out, 4.14 no dsack_dups) it reads 0. The retransmissions of the moment
    (tcpi_retrans, tcpi_retransmits) and the segments with no data are not taken."""
    v4 = bytes([10, 0, 0, 2]) + bytes(12)
    counts = dict(total_retrans=41, data_segs_out=9000, dsack_dups=5, retrans=3,
                  retransmits=2, segs_out=12000, bytes_retrans=999)
    full, = [s for s in sockdiag.parse(_diag_message(socket.AF_INET, v4, v4, 5, 300, **counts))]
    assert (full.retransmitted_segments, full.data_segments_sent,
            full.duplicate_retransmissions) == (41, 9000, 5)
    assert full.rtt_seconds == 0.0003 and full.last_data_sent_seconds == 1.5
    for size, expect in ((104, (41, 0, 0)), (160, (41, 9000, 0)), (100, (0, 0, 0))):
        s, = sockdiag.parse(_diag_message(socket.AF_INET, v4, v4, 5, 300, info_size=size,
                                          **counts))
        assert (s.retransmitted_segments, s.data_segments_sent,
                s.duplicate_retransmissions) == expect, size
        assert s.rtt_seconds == 0.0003


def _rank_fds(proc: Path, pid: int, inodes: list[int]) -> None:
    fd = proc / str(pid) / "fd"
    fd.mkdir(parents=True)
    (fd / "0").symlink_to("/dev/null")
    for i, inode in enumerate(inodes, start=3):
        (fd / str(i)).symlink_to(f"socket:[{inode}]")


def selecting(socks: list[TcpSocket]):
    """A sock_diag reader over `socks` that keeps what its caller wants, as the kernel
    dump is filtered."""
    return lambda wanted: [s for s in socks if wanted(s.inode, s.uid)]


def _exposition(rtt: TcpPeerRtt) -> str:
    """What the agent's /metrics says of these peers (node n1)."""
    reg = CollectorRegistry()

    class Collector:
        def collect(self):
            yield from rtt.families("n1")

    reg.register(Collector())
    return generate_latest(reg).decode()


def _sock(inode: int, remote: str, rtt: float, last_sent: float = 0.2, uid: int = 0,
          local: str = "10.0.0.1", counts: tuple[int, int, int] = (0, 0, 0)) -> TcpSocket:
    """counts: retransmitted segments, data segments sent, duplicate retransmissions."""
    return TcpSocket(inode, uid, local, remote, rtt, last_sent, *counts)


def test_the_ranks_active_connections_give_each_peer_its_least_rtt(tmp_path, monkeypatch):
    """Rank 100's sockets are read from its fd table; rank 101's fds cannot be read (an
    agent without CAP_SYS_PTRACE under another user), so its uid's sockets count. Per
    peer the least RTT of the connections that sent data in the last 10 s; another
    process's sockets, idle connections and the node's own addresses are left out."""
    _rank_fds(tmp_path, 100, [11, 12, 13, 14])
    _rank_fds(tmp_path, 101, [])
    real = links.socket_inodes

    def inodes(fd_dir: Path) -> set[int]:
        if fd_dir.parent.name == "101":
            raise PermissionError(13, "Permission denied")
        return real(fd_dir)

    monkeypatch.setattr(links, "socket_inodes", inodes)
    socks = [_sock(11, "10.0.0.2", 0.30), _sock(12, "10.0.0.2", 0.25),   # one peer, 2 paths
             _sock(13, "10.0.0.3", 0.0004, last_sent=30.0),              # idle since long
             _sock(14, "10.0.0.1", 0.00002),                              # a rank of this node
             _sock(20, "10.0.0.4", 0.5),                                  # not a rank's
             _sock(30, "10.0.0.5", 0.0009, uid=1000)]                     # rank 101's user
    rtt = TcpPeerRtt(lambda: {(100, 0), (101, 1000)}, tmp_path, read=selecting(socks))
    assert rtt.peers() == {"10.0.0.2": 0.25, "10.0.0.5": 0.0009}
    text = _exposition(rtt)
    samples = {s.labels["peer"]: s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == "clusterpulse_tcp_peer_rtt_seconds"}
    assert samples == {"10.0.0.2": 0.25, "10.0.0.5": 0.0009}
    metrics_are_clean(text)


def test_no_rank_no_reading_and_a_failing_read_is_logged_once(tmp_path, caplog):
    calls = []
    assert TcpPeerRtt(lambda: set(), tmp_path, read=lambda _: calls.append(1) or []).peers() == {}
    assert calls == []  # nothing to select: the sockets are not even dumped
    _rank_fds(tmp_path, 100, [11])

    def broken(_: sockdiag.Wanted) -> list[TcpSocket]:
        raise OSError(93, "Protocol not supported")

    rtt = TcpPeerRtt(lambda: {(100, 0)}, tmp_path, read=broken)
    assert rtt.peers() == {} and rtt.peers() == {}
    assert sum("cannot read TCP connections" in r.message for r in caplog.records) == 1


def test_a_ranks_fds_are_listed_again_only_after_a_while(tmp_path):
    """A job makes its connections when its process groups start: the fd table of a
    rank is listed once per INODES_TTL_S, not at every scrape."""
    _rank_fds(tmp_path, 100, [11])
    now = [0.0]
    socks = [_sock(11, "10.0.0.2", 0.001), _sock(12, "10.0.0.3", 0.002)]
    rtt = TcpPeerRtt(lambda: {(100, 0)}, tmp_path, read=selecting(socks), clock=lambda: now[0])
    assert rtt.peers() == {"10.0.0.2": 0.001}
    (tmp_path / "100" / "fd" / "4").symlink_to("socket:[12]")
    now[0] = links.INODES_TTL_S / 2
    assert rtt.peers() == {"10.0.0.2": 0.001}
    now[0] = links.INODES_TTL_S + 1
    assert rtt.peers() == {"10.0.0.2": 0.001, "10.0.0.3": 0.002}


def test_each_peers_segment_counters_only_grow_as_connections_come_and_go(tmp_path):
    """A connection's counters start at 0 and end with it; per peer the agent adds each
    connection's growth, so the peer's counters only grow: a closed connection keeps
    what it counted, a new one adds all of its own. Idle connections count (nothing
    grows), connections between the node's own addresses do not. The node's addresses
    that reach other nodes are exported, for the rule that finds which node a peer is.
    A peer with no connection for PEER_FORGET_S is forgotten."""
    now = [100.0]
    _rank_fds(tmp_path, 100, [11, 12, 13, 14, 15])
    socks = [_sock(11, "10.0.0.2", 0.001, counts=(4, 100, 1)),
             _sock(12, "10.0.0.2", 0.002, counts=(0, 50, 0)),
             _sock(13, "10.0.0.1", 0.00002, counts=(9, 900, 0), local="10.0.0.1"),
             _sock(14, "10.0.0.3", 0.001, last_sent=30.0, counts=(0, 10, 0))]
    rtt = TcpPeerRtt(lambda: {(100, 0)}, tmp_path, read=selecting(socks), clock=lambda: now[0])

    def counts() -> dict[str, tuple[int, int, int]]:
        got = rtt.read()
        assert got.addresses == {"10.0.0.1"}
        return {p: (c.data_sent, c.retransmitted, c.duplicates) for p, c in got.segments.items()}

    assert counts() == {"10.0.0.2": (150, 4, 1), "10.0.0.3": (10, 0, 0)}
    socks[0] = _sock(11, "10.0.0.2", 0.001, counts=(6, 110, 1))  # grew
    del socks[1]  # closed: what it counted stays
    socks.append(_sock(15, "10.0.0.2", 0.001, counts=(1, 20, 0)))  # new: all of it
    assert counts() == {"10.0.0.2": (180, 7, 1), "10.0.0.3": (10, 0, 0)}
    assert counts() == {"10.0.0.2": (180, 7, 1), "10.0.0.3": (10, 0, 0)}  # nothing grew
    socks[:] = [s for s in socks if s.remote != "10.0.0.3"]
    now[0] += links.PEER_FORGET_S - 1
    assert set(counts()) == {"10.0.0.2", "10.0.0.3"}
    now[0] += 2
    assert set(counts()) == {"10.0.0.2"}

    text = _exposition(rtt)
    samples = {(s.name, s.labels.get("peer") or s.labels.get("address")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples
               if not s.name.endswith("_created")}
    assert samples == {
        ("clusterpulse_tcp_peer_rtt_seconds", "10.0.0.2"): 0.001,
        ("clusterpulse_tcp_peer_data_segments_sent_total", "10.0.0.2"): 180,
        ("clusterpulse_tcp_peer_retransmitted_segments_total", "10.0.0.2"): 7,
        ("clusterpulse_tcp_peer_duplicate_retransmissions_total", "10.0.0.2"): 1,
        ("clusterpulse_tcp_local_address_info", "10.0.0.1"): 1}
    r = subprocess.run([shutil.which("promtool") or "promtool", "check", "metrics"], input=text,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def test_a_connection_missing_from_a_read_is_not_counted_again_when_it_returns(tmp_path):
    """Between two reads with no live rank (torchrun restarting its workers) or a failed
    sock_diag read, the connections were forgotten, and the next read added each one's
    whole lifetime again: torchrun's store connection, which lives through every restart
    (and, where fds cannot be read, every socket of the user), inflated its peer's
    counters at each restart. An inode seen again on another peer, or with counts that
    went down, is another connection: counted from zero."""
    now, live, fail = [0.0], [{(100, 0)}], [False]
    _rank_fds(tmp_path, 100, [11])
    socks = [_sock(11, "10.0.0.2", 0.001, counts=(50, 100000, 0))]

    def read(wanted: sockdiag.Wanted) -> list[TcpSocket]:
        if fail[0]:
            raise OSError(105, "No buffer space available")
        return selecting(socks)(wanted)

    rtt = TcpPeerRtt(lambda: live[0], tmp_path, read=read, clock=lambda: now[0])

    def sent() -> dict[str, tuple[int, int]]:
        return {p: (c.data_sent, c.retransmitted) for p, c in rtt.read().segments.items()}

    assert sent() == {"10.0.0.2": (100000, 50)}
    live[0] = set()  # the workers restart
    assert sent() == {"10.0.0.2": (100000, 50)}
    live[0] = {(100, 0)}
    assert sent() == {"10.0.0.2": (100000, 50)}  # was (200000, 100)
    fail[0] = True
    assert sent() == {"10.0.0.2": (100000, 50)}
    fail[0] = False
    socks[0] = _sock(11, "10.0.0.2", 0.001, counts=(51, 100010, 0))
    assert sent() == {"10.0.0.2": (100010, 51)}  # its growth only
    socks[0] = _sock(11, "10.0.0.3", 0.001, counts=(0, 7, 0))  # the inode, reused
    assert sent() == {"10.0.0.2": (100010, 51), "10.0.0.3": (7, 0)}


def _agent_scrape(agent) -> dict:
    from clusterpulse.agent.exporter import AgentCollector

    reg = CollectorRegistry(auto_describe=False)
    reg.register(AgentCollector(agent))
    return {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}


def _sim_agent():
    from clusterpulse.agent.audit import AuditLog
    from clusterpulse.agent.backends.sim import SimBackend
    from clusterpulse.agent.core import Agent
    from clusterpulse.agent.ranks import RankRegistry

    agent = Agent(SimBackend(gpus=2), "n1", RankRegistry(), AuditLog(None))
    agent.collect_once()
    return agent


def test_an_interface_name_that_is_not_utf8_does_not_break_the_scrape(tmp_path):
    """Linux allows any byte in an interface name. Python keeps the bytes that are not
    UTF-8 as lone surrogates, which the exposition cannot encode: every scrape of the
    node failed (NodeAgentDown, its GPU series lost) while /healthz said ok. `tc -j`
    printing such a name dropped the queue series of every NIC. The name now reads with
    its bytes that are not UTF-8 escaped (\\xff: two such names stay two series), and
    the NIC's series are kept."""
    make_sysfs(tmp_path)
    odd = os.fsdecode(b"en\xffp1")
    (tmp_path / "class" / "net" / odd / "device").mkdir(parents=True)
    (tmp_path / "class" / "net" / odd / "carrier").write_text("1\n")
    twin = os.fsdecode(b"en\xfep1")  # the same but for one byte: another interface
    (tmp_path / "class" / "net" / twin / "device").mkdir(parents=True)
    (tmp_path / "class" / "net" / twin / "carrier").write_text("0\n")
    agent = _sim_agent()
    agent.links.append(NicCounters(tmp_path))
    fams = _agent_scrape(agent)
    samples = fams["clusterpulse_nic_port_up"].samples
    up = {s.labels["device"]: s.value for s in samples}
    assert len(up) == len(samples)  # one series per interface
    assert up["en\\xffp1"] == 1.0 and up["en\\xfep1"] == 0.0 and up["eth0"] == 1.0
    assert len(fams["clusterpulse_gpu_utilization_ratio"].samples) == 2
    tc_out = subprocess.run(
        [sys.executable, "-c", "import sys; sys.stdout.buffer.write(sys.argv[1].encode("
         "'utf-8', 'surrogateescape'))", crowded_tc(["eth0", odd])],
        capture_output=True, text=True, errors="surrogateescape", check=True).stdout
    queues = QueueCounters(NicSelection(sysfs=tmp_path), read=lambda: parse_qdiscs(tc_out))
    assert set(queues.queues()) == {"eth0", odd}  # matched against /sys's own names
    agent.links.append(queues)
    fams = _agent_scrape(agent)
    held = {s.labels["device"] for s in fams["clusterpulse_nic_queue_overlimits"].samples}
    assert held == {"eth0", "en\\xffp1"}


def test_real_tc_output_with_a_name_that_is_not_utf8_is_read(tmp_path, monkeypatch):
    """read_qdiscs itself, on `tc`'s bytes: decoding them as text failed (one warning,
    then no queue series for any NIC)."""
    fake = tmp_path / "tc"
    fake.write_bytes(b"#!/bin/sh\nprintf '[{\"kind\":\"tbf\",\"dev\":\"en\\377p1\","
                     b"\"root\":true,\"overlimits\":5},{\"kind\":\"fq\",\"dev\":\"eth0\","
                     b"\"root\":true}]'\n")
    fake.chmod(0o755)
    found = read_qdiscs(str(fake))
    assert set(found) == {os.fsdecode(b"en\xffp1"), "eth0"}
    assert found[os.fsdecode(b"en\xffp1")].overlimits == 5


def test_an_interface_taken_down_reads_down_from_its_operstate(tmp_path):
    """An interface taken down (`ip link set down`) has no carrier to read (EINVAL):
    no nic_port_up was exported for it and NicLinkDown never fired. Its operstate says
    down; an unreadable carrier with an operstate that says nothing sure stays unknown."""
    make_sysfs(tmp_path)
    eth = tmp_path / "class" / "net" / "eth0"
    (eth / "carrier").unlink()  # what an admin-down interface's read gives: nothing
    (eth / "operstate").write_text("down\n")
    ports = {p.device: p for p in NicCounters(tmp_path).ports()}
    assert ports["eth0"].up == 0.0
    (eth / "operstate").write_text("unknown\n")
    assert {p.device: p for p in NicCounters(tmp_path).ports()}["eth0"].up is None


def test_a_failing_collector_loses_only_its_own_series(caplog):
    """A subsystem's error (an odd sysfs file, an unexpected reply) failed the scrape of
    every GPU series of the node; now only that subsystem's series are left out, and
    the error is logged once."""

    class Broken:
        def families(self, node: str):
            yield from ()
            raise RuntimeError("odd reply")

    from clusterpulse.agent.exporter import AgentCollector

    agent = _sim_agent()
    agent.links.append(Broken())
    reg = CollectorRegistry(auto_describe=False)
    reg.register(AgentCollector(agent))
    for _ in range(2):
        fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
        assert len(fams["clusterpulse_gpu_utilization_ratio"].samples) == 2
        assert {s.labels["collector"]: s.value
                for s in fams["clusterpulse_agent_collector_success"].samples} == {"Broken": 0.0}
    assert sum("Broken failed" in r.message for r in caplog.records) == 1  # a minute's
