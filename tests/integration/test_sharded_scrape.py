"""Past one machine, at small scale: the scrape sharded across two vmagent instances
(deploy/victoriametrics/vmagent.yml: hashmod of each target's address), both
remote-writing into one VictoriaMetrics, vmalert evaluating the shipped rules against
it and notifying a real Alertmanager, and the dashboard's query layer reading
VictoriaMetrics' Prometheus API unchanged. Real processes on loopback, started with
the shipped flags (tests/support/victoria.py).

The nodes: 12 served by tests/bench/fleet_static.py (each on its own loopback address,
2 simulated GPUs and a training rank on each, in runs of 4 nodes) and one real agent
process, which the test stops: a dead node, paged by NodeAgentDown through vmalert.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import requests
import yaml

from clusterpulse.dashboard import data
from tests.bench.fleet_static import node_address
from tests.support.ports import free_port
from tests.support.procs import REPO, RULE_FILES, Alertmanager, start_agent_cli, wait_until
from tests.support.victoria import (
    Shard,
    VmAlert,
    default_value,
    victoria_metrics,
    write_targets,
)
from tests.support.webhook import WebhookSink

pytestmark = pytest.mark.integration
FLEET_NODES, FLEET_GPUS, RUN_NODES, AGENT_GPUS = 12, 2, 4, 2
VICTIM = "victim"
GPUS = FLEET_NODES * FLEET_GPUS + AGENT_GPUS
# As shipped (2): each shard gets some of the 13 agents unless all 13 addresses hash
# alike, a chance of 2 in 2^13 for the ports a run draws.
SHARDS = int(default_value("clusterpulse-vmagent.default", "CLUSTERPULSE_SHARDS"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp: Path = tmp_path_factory.mktemp("sharded")
    procs: list = []
    fleet_port = free_port()
    fleet = subprocess.Popen(
        [sys.executable, "-m", "tests.bench.fleet_static", str(FLEET_NODES), str(FLEET_GPUS),
         str(fleet_port), str(RUN_NODES)], cwd=REPO, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    try:
        assert int(fleet.stdout.readline()) == FLEET_NODES
        # No NIC ports (--sysfs none): this machine's own would make the test depend on
        # them (see the last test for what VictoriaMetrics makes of their counters).
        agent, agent_port, _ = start_agent_cli(tmp, VICTIM, gpus=AGENT_GPUS,
                                               extra=["--sysfs", "none"])
        procs.append(agent)
        addresses = [f"{node_address(i)}:{fleet_port}" for i in range(FLEET_NODES)]
        addresses.append(f"127.0.0.1:{agent_port}")
        write_targets(tmp / "targets", addresses)
        vm = victoria_metrics(tmp)
        procs.append(vm)
        shards = [Shard(tmp, n, SHARDS, vm.url, tmp / "targets") for n in range(SHARDS)]
        procs += shards
        sink = WebhookSink()
        am = Alertmanager(tmp, sink.url)
        procs.append(am)
        vmalert = VmAlert(tmp, vm.url, am.url)
        procs.append(vmalert)
        yield {"vm": vm, "shards": shards, "vmalert": vmalert, "am": am, "agent": agent,
               "addresses": addresses, "sink": sink}
    finally:
        for p in reversed(procs):
            p.stop()
        fleet.stdin.close()
        fleet.wait(timeout=30)


def _gpus_in_store(vm) -> bool:
    return vm.scalar("count(clusterpulse_gpu_up)") == GPUS


def test_every_target_is_scraped_by_exactly_one_shard(stack):
    """What each shard says it scrapes: together every agent, no agent twice."""
    vm, shards = stack["vm"], stack["shards"]
    wait_until(lambda: _gpus_in_store(vm), 60, "every GPU in VictoriaMetrics", interval=1)
    scraped = {s.shard: [t["labels"]["instance"] for t in s.targets()
                         if t["labels"]["job"] == "clusterpulse"] for s in shards}
    counts = Counter(a for targets in scraped.values() for a in targets)
    assert sorted(counts) == sorted(stack["addresses"]), scraped
    assert set(counts.values()) == {1}, scraped
    assert all(scraped.values()), f"a shard scrapes nothing: {scraped}"
    # The store holds one `up` per agent, every one of them 1, and every rank.
    up = {r["metric"]["instance"]: r["value"][1]
          for r in vm.query('up{job="clusterpulse"}')}
    assert up == dict.fromkeys(stack["addresses"], "1")
    assert vm.scalar("count(clusterpulse_trainer_step)") == FLEET_NODES * FLEET_GPUS


def test_dashboard_reads_the_sharded_store_unchanged(stack):
    """The cluster page's data, from VictoriaMetrics' Prometheus API, the same queries."""
    vm, am = stack["vm"], stack["am"]
    wait_until(lambda: _gpus_in_store(vm), 60, "every GPU in VictoriaMetrics", interval=1)
    d = data.cluster(vm.url, am.url, "temperature").value
    assert (d["gpus_up"], d["gpus_total"]) == (GPUS, GPUS)
    assert set(d["runs"]["run"]) == {f"job-{i:03d}" for i in range(FLEET_NODES // RUN_NODES)}
    assert len(d["heat"]) == GPUS  # fewer nodes than the heatmap's 64: every GPU drawn
    assert dict(zip(d["nodes"]["node"], d["nodes"]["up"], strict=True)) == {
        **{f"n{i:04d}": 1 for i in range(FLEET_NODES)}, VICTIM: 1}


def test_vmalert_records_and_a_dead_node_pages_through_it(stack):
    """Recording rules evaluated by vmalert land in the store; a healthy fleet with
    jobs running pages nothing; the agent stopped, NodeAgentDown names its node in
    Alertmanager, and the dashboard shows it (node down, active alert, and the alert
    history: the ALERTS series vmalert writes back)."""
    vm, vmalert, am = stack["vm"], stack["vmalert"], stack["am"]
    wait_until(lambda: _gpus_in_store(vm), 60, "every GPU in VictoriaMetrics", interval=1)
    assert vmalert.alerts() == [] and am.alerts() == []
    stack["agent"].stop()

    def paged() -> list[dict]:
        return [a for a in am.alerts() if a["labels"]["alertname"] == "NodeAgentDown"]

    got = wait_until(paged, 60, "NodeAgentDown in Alertmanager, sent by vmalert", interval=1)
    assert [a["labels"]["node"] for a in got] == [VICTIM]  # named from its last build_info
    # A rule recorded from rules recorded before it: vmalert's results reach the next
    # rule through the store, one evaluation later for each link of the chain.
    wait_until(lambda: vm.scalar("count(clusterpulse:rank_current)") == FLEET_NODES * FLEET_GPUS,
               60, "vmalert's recorded clusterpulse:rank_current in the store", interval=1)
    # By now every group has evaluated the fleet with jobs running at least once: the
    # dead node is all that pages.
    assert {a["name"] for a in vmalert.alerts()} == {"NodeAgentDown"}
    assert {a["labels"]["alertname"] for a in am.alerts()} == {"NodeAgentDown"}

    d = data.cluster(vm.url, am.url, "temperature").value
    nodes = dict(zip(d["nodes"]["node"], d["nodes"]["up"], strict=True))
    assert nodes[VICTIM] == 0 and sum(nodes.values()) == FLEET_NODES
    assert [(a.name, a.labels["node"]) for a in d["alerts"]] == [("NodeAgentDown", VICTIM)]

    def history() -> set[str]:
        return set(data.alerts(vm.url, am.url, 600).value["history"].get("alert", []))

    assert wait_until(history, 30, "NodeAgentDown in the alert history", interval=1) \
        == {"NodeAgentDown"}


# NicLinkDegraded's expression (deploy/prometheus/alerts.rules.yml), asked of a node that
# appeared 5 minutes ago (a new node, or its agent back after a long outage) whose
# Ethernet port had changed carrier 4 times since boot and never since.
FLAPS = "clusterpulse_nic_carrier_changes_total"


# Not strict: whether VictoriaMetrics 1.79 answers with the first sample as growth
# varied between runs of this test here (it paged in some, not in others).
@pytest.mark.xfail(strict=False, reason=(
    "MetricsQL's increase() counts a series' first sample as its increase when nothing "
    "comes before the window (Prometheus extrapolates between samples in the window): "
    "on VictoriaMetrics 1.79 a new node (or one back after 10 min) whose NIC counters "
    "are not 0 is paged with NicLinkDegraded; the same holds for every increase() rule "
    "over a counter (docs/scaling.md, 'Rules on vmalert')"))
def test_counters_that_did_not_move_page_nothing_on_victoriametrics(stack):
    vm = stack["vm"]
    rules = yaml.safe_load(RULE_FILES[1].read_text())["groups"]
    expr = next(r["expr"] for g in rules for r in g["rules"]
                if r.get("alert") == "NicLinkDegraded")
    now = int(time.time())
    labels = 'node="flaps",device="eth0",port="",kind="ethernet"'
    lines = [f"{FLAPS}{{{labels}}} 4 {(now - s) * 1000}" for s in range(300, -1, -5)]
    r = requests.post(vm.url + "/api/v1/import/prometheus", data="\n".join(lines) + "\n",
                      timeout=30)
    r.raise_for_status()
    requests.get(vm.url + "/internal/force_flush", timeout=30).raise_for_status()
    wait_until(lambda: vm.query(f'count_over_time({FLAPS}{{node="flaps"}}[11m])'), 30,
               "the imported counter in VictoriaMetrics", interval=1)
    fired = [x for x in vm.query(expr) if x["metric"].get("node") == "flaps"]
    assert fired == [], fired  # Prometheus: increase() over a flat counter is 0
