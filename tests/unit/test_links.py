"""NIC port health read from a sysfs tree in the kernel's own file format, exported
with clean metric names; virtual interfaces are skipped."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from clusterpulse.agent.links import (
    NicCounters,
    NicSelection,
    QueueCounters,
    QueueStats,
    parse_qdiscs,
    read_qdiscs,
)
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
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed (the test command installs it)"
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


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
