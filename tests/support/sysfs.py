"""Sysfs trees in the kernel's own file format for the NIC collector: two InfiniBand
ports (one ACTIVE with counters, one DOWN), a physical Ethernet NIC and a veth; and a
crowded node's network interfaces."""

from __future__ import annotations

from pathlib import Path


def make_sysfs(root: Path) -> None:
    port = root / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    (port / "counters").mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    for name, v in {"link_downed": 2, "symbol_error": 17, "port_rcv_errors": 3,
                    "port_xmit_wait": 123456, "port_xmit_data": 1000,
                    "port_rcv_data": 500}.items():
        (port / "counters" / name).write_text(f"{v}\n")
    down = root / "class" / "infiniband" / "mlx5_1" / "ports" / "1"
    (down / "counters").mkdir(parents=True)
    (down / "state").write_text("1: DOWN\n")
    eth = root / "class" / "net" / "eth0"
    (eth / "statistics").mkdir(parents=True)
    (eth / "device").mkdir()  # a physical NIC has a device link
    (eth / "carrier").write_text("1\n")
    (eth / "carrier_changes").write_text("4\n")
    for name, v in {"rx_errors": 5, "tx_errors": 0, "rx_dropped": 1, "tx_bytes": 10**9,
                    "rx_bytes": 2 * 10**9}.items():
        (eth / "statistics" / name).write_text(f"{v}\n")
    veth = root / "class" / "net" / "veth0"  # virtual: no device link
    (veth / "statistics").mkdir(parents=True)
    (veth / "carrier").write_text("1\n")


def make_crowded_net(root: Path, veths: int = 200) -> list[str]:
    """/sys/class/net of a busy node, as the kernel lays it out: `veths` veth pairs'
    host ends and Calico's cali* (no `device` link), bridges with `bridge/` (docker0,
    cni0, br-*), a tun with `tun_flags`, flannel's vxlan, loopback, and one NIC on a
    bus (`device`): ens1f0. Every interface has statistics. Returns every name."""
    net = root / "class" / "net"
    names = [f"veth{i:04x}" for i in range(veths)] + [f"cali{i:08x}" for i in range(20)]
    bridges = ["docker0", "cni0", "br-3f2a1b", "virbr0"]
    names += [*bridges, "tun0", "flannel.1", "lo", "ens1f0"]
    for name in names:
        (net / name / "statistics").mkdir(parents=True)
        (net / name / "carrier").write_text("1\n")
        (net / name / "statistics" / "tx_bytes").write_text("1000\n")
    for name in bridges:
        (net / name / "bridge").mkdir()
    (net / "tun0" / "tun_flags").write_text("0x1002\n")
    (net / "ens1f0" / "device").mkdir()
    return names
