"""The cluster page at fleet scale (more nodes than a heatmap can show) and the node
page's link health. Real agents (simulated GPUs, their own HTTP servers) scraped by a
real Prometheus; Prometheus picks the nodes at the bad end of the metric, so the page
never fetches one row per GPU."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from streamlit.testing.v1 import AppTest

from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.backends.sim import SimBackend
from clusterpulse.agent.core import Agent
from clusterpulse.agent.faults import Fault
from clusterpulse.agent.links import NicCounters
from clusterpulse.agent.ranks import RankRegistry
from clusterpulse.agent.server import make_server
from clusterpulse.dashboard import data
from tests.support.pages import kpis
from tests.support.ports import free_port
from tests.support.procs import REPO, Prometheus, wait_until
from tests.support.sysfs import make_sysfs

pytestmark = pytest.mark.integration
NODES = data.HEATMAP_NODES + 2
# Overheating GPUs on the nodes that sort last by name: a page that drew the first 64
# nodes, not the 64 hottest, would leave them out.
HOT = [f"n{i:03d}" for i in range(NODES - 3, NODES)]
# A GPU whose PCIe link trained at x8 and one of whose NVLinks is down, on a node with
# InfiniBand and Ethernet ports (a sysfs tree in the kernel's format).
BAD_LINKS = "n000"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    agents, servers = [], []
    for i in range(NODES):
        name = f"n{i:03d}"
        ranks = RankRegistry()
        backend = SimBackend(gpus=1, node=name, activity=ranks.activity)
        if name in HOT:
            backend.inject(Fault(kind="overheat", gpu=0))
        agent = Agent(backend, name, ranks, AuditLog(None), interval_s=1)
        if name == BAD_LINKS:
            backend.inject(Fault(kind="pcie_degraded", gpu=0))
            backend.inject(Fault(kind="nvlink_down", gpu=0))
            sysfs = tmp_path_factory.mktemp("sysfs")
            make_sysfs(sysfs)
            agent.links.append(NicCounters(sysfs))
        agent.start()
        server = make_server(agent, "127.0.0.1", 0, None)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        agents.append(agent)
        servers.append(server)
    prom = Prometheus(tmp_path_factory.mktemp("fleet"),
                      [f"127.0.0.1:{s.server_port}" for s in servers], scrape_interval="2s")

    def hottest_are_the_hot_nodes() -> bool:
        up = prom.query("count(clusterpulse_gpu_up)")
        top = prom.query("topk(3, max by (node) (clusterpulse_gpu_temperature_celsius))")
        return (bool(up) and up[0]["value"][1] == str(NODES)
                and sorted(r["metric"]["node"] for r in top) == HOT)

    try:
        wait_until(hottest_are_the_hot_nodes, 90, "every node scraped, the hot ones hottest")
        yield prom
    finally:
        prom.stop()
        # Each shutdown waits up to one poll interval (0.5 s): all at once, not 66 in turn.
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda s: s.shutdown(), servers))
            list(pool.map(lambda a: a.stop(), agents))


def test_heatmap_shows_the_worst_nodes_and_gpus_are_counted_by_prometheus(fleet):
    am = f"http://127.0.0.1:{free_port()}"
    d = data.cluster(fleet.url, am, "temperature").value
    assert (d["gpus_up"], d["gpus_total"]) == (NODES, NODES)
    assert len(d["nodes"]) == NODES
    shown = set(d["heat"]["node"])
    assert len(shown) == data.HEATMAP_NODES and set(HOT) <= shown
    # Utilization is healthy when high: the nodes with the lowest are the ones drawn.
    util = data.cluster(fleet.url, am, "utilization").value
    assert util["heat"]["node"].nunique() == data.HEATMAP_NODES and util["good_high"]


def app(prom_url: str, monkeypatch, tmp_path) -> AppTest:
    monkeypatch.setenv("CLUSTERPULSE_PROMETHEUS_URL", prom_url)
    monkeypatch.setenv("CLUSTERPULSE_ALERTMANAGER_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("CLUSTERPULSE_AUDIT_LOG", str(tmp_path / "audit.jsonl"))
    at = AppTest.from_file(str(REPO / "dashboard" / "app.py"), default_timeout=30)
    at.run()
    return at


def test_cluster_page_says_which_nodes_it_draws(fleet, monkeypatch, tmp_path):
    at = app(fleet.url, monkeypatch, tmp_path)
    at.sidebar.selectbox(key="heat_metric").select("temperature").run()
    assert not at.exception, at.exception
    got = kpis(at)
    assert got["Nodes up"] == f"{NODES} / {NODES}"
    assert got["Healthy GPUs"] == f"{NODES} / {NODES}"
    assert any(c.value.startswith(f"The {data.HEATMAP_NODES} of {NODES} nodes with the "
                                  "highest temperature") for c in at.caption), \
        [c.value for c in at.caption]


def test_node_page_shows_link_health(fleet, monkeypatch, tmp_path):
    at = app(fleet.url, monkeypatch, tmp_path)
    at.switch_page("views/node.py").run()
    at.selectbox(key="node").select(BAD_LINKS).run()
    assert not at.exception, at.exception
    assert "GPU 0: PCIe x8 of x16; 1 NVLink(s) down" in [w.value for w in at.warning]
    tables = [df.value for df in at.dataframe]
    gpu = next(t for t in tables if "NVLinks up" in t.columns)
    assert gpu.iloc[0]["PCIe"] == "Gen5 x8 (max Gen5 x16)" and gpu.iloc[0]["NVLinks up"] == "3 / 4"
    nic = next(t for t in tables if "device" in t.columns)
    ports = {(r["device"], r["kind"]): r["up"] for _, r in nic.iterrows()}
    assert ports == {("mlx5_0", "infiniband"): 1, ("mlx5_1", "infiniband"): 0,
                     ("eth0", "ethernet"): 1}
    # A healthy node: its GPU's links say so, no warning.
    at.selectbox(key="node").select("n001").run()
    assert not at.warning
    gpu = next(df.value for df in at.dataframe if "NVLinks up" in df.value.columns)
    assert list(gpu["health"]) == ["ok"]


def test_heatmap_reads_only_the_picked_nodes_whatever_their_names(fleet):
    """The heatmap's values come from a node=~ matcher of the picked names: a name with
    regex characters (FQDNs: dots, dashes) must match itself and nothing else."""
    import json
    import re

    q = data.heatmap_query("temperature", ["gpu-7.rack.example", "n001"])
    pattern = json.loads(re.search(r'node=~("(?:[^"\\]|\\.)*")', q).group(1))
    assert re.fullmatch(pattern, "gpu-7.rack.example") and re.fullmatch(pattern, "n001")
    assert not re.fullmatch(pattern, "gpu-7xrack.example") and not re.fullmatch(pattern, "n0012")
    got = {r["metric"]["node"] for r in fleet.query(data.heatmap_query("temperature", HOT))}
    assert got == set(HOT)
