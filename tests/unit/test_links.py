"""NIC port health read from a sysfs tree in the kernel's own file format, exported
with clean metric names; virtual interfaces are skipped."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from clusterpulse.agent.links import NicCounters
from tests.support.sysfs import make_sysfs


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
