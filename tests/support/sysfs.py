"""A sysfs tree in the kernel's own file format: two InfiniBand ports (one ACTIVE with
counters, one DOWN), a physical Ethernet NIC and a veth, for the NIC collector."""

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
