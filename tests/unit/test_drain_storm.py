"""drain-node in an alert storm: Alertmanager groups GpuDown by node and flushes every
group at once, and the webhook server answers each on its own thread. `max_drained`
must hold however many notifications arrive together.

Slurm's client commands are small fakes on PATH (a state file of drained nodes, and a
slow `sinfo`, as a busy slurmctld is): the real Slurm runs only in tests/cluster."""

from __future__ import annotations

import json
import threading

import pytest
import requests

from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.tokens import Tokens
from clusterpulse.dashboard.promclient import PrometheusClient
from clusterpulse.dashboard.remediation import Policy, Remediator, RetryLater, serve
from tests.support.procs import REPO
from tests.support.promstub import AlertsPrometheus

HOOK = "alertmanager-hook-token-0123456789"

# "NODE REASON" per drained node; sinfo takes 0.2 s, so that the deciders overlap
FAKES = {
    "sinfo": """#!/bin/sh
sleep 0.2; touch "$STATE"
if [ "$1" = "-R" ]; then
  while read -r node reason; do echo "$reason|$node"; done < "$STATE"; exit 0
fi
grep -q "^$5 " "$STATE" && echo drained || echo idle
""",
    "scontrol": """#!/bin/sh
case "$1" in
  show) echo "$3" ;;
  update) echo "${2#NodeName=} ${4#Reason=}" >> "$STATE" ;;
  requeue) echo "$2" >> "$REQUEUED" ;;
esac
""",
    "squeue": """#!/bin/sh
echo "job-on-$5"
""",
}


def test_concurrent_notifications_drain_at_most_max_drained(tmp_path, monkeypatch):
    """Found in review: with the shipped Slurm policy (max_drained = 2), six GpuDown
    notifications posted at once drained all six nodes; each decider counted the
    drained nodes before any of the others had drained its own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, script in FAKES.items():
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    state, requeued = tmp_path / "slurm-state", tmp_path / "requeued"
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("STATE", str(state))
    monkeypatch.setenv("REQUEUED", str(requeued))
    policy = Policy.load(REPO / "deploy/slurm/policy.toml")
    assert policy.drain.max_drained == 2
    audit = AuditLog(tmp_path / "audit.jsonl")
    prom = AlertsPrometheus(lambda query: True)  # every GpuDown is firing in Prometheus
    rem = Remediator(policy, PrometheusClient(prom.url), None, audit)
    server = serve(rem, "127.0.0.1", 0, Tokens.single(HOOK, "alertmanager"))
    url = f"http://127.0.0.1:{server.server_port}/alertmanager"
    nodes = [f"node-{i}" for i in range(1, 7)]
    outcomes: dict[str, dict] = {}
    start = threading.Barrier(len(nodes), timeout=10)

    def notify(node: str) -> None:
        alert = {"status": "firing", "labels": {"alertname": "GpuDown", "node": node,
                                                "gpu": "0"}}
        start.wait()
        r = requests.post(url, json={"alerts": [alert]}, timeout=60,
                          headers={"Authorization": f"Bearer {HOOK}"})
        (outcomes[node],) = r.json()["decisions"]

    try:
        senders = [threading.Thread(target=notify, args=(n,)) for n in nodes]
        for t in senders:
            t.start()
        for t in senders:
            t.join(timeout=60)
    finally:
        server.shutdown()
        prom.close()
    drained = [line.split()[0] for line in state.read_text().splitlines()]
    acted = sorted(n for n, d in outcomes.items() if d["outcome"] == "acted")
    refused = sorted(n for n, d in outcomes.items() if d["outcome"] == "rate_limited")
    assert len(outcomes) == 6, outcomes
    assert sorted(drained) == acted and len(acted) == 2, (drained, outcomes)
    assert sorted(acted + refused) == nodes, outcomes
    for node in refused:  # each refusal says why, naming the nodes that count
        detail = outcomes[node]["detail"]
        assert "max_drained=2" in detail and all(n in detail for n in acted), detail
    # only the drained nodes' jobs move; every decision is audited, refusals included
    assert sorted(requeued.read_text().split()) == [f"job-on-{n}" for n in acted]
    records = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert sorted((r["node"], r["outcome"]) for r in records) == sorted(
        (n, d["outcome"]) for n, d in outcomes.items())


def test_a_rank_that_claims_a_gpu_it_does_not_hold_cannot_drain_the_node(tmp_path, monkeypatch):
    """A review: a local user's process reported itself a straggler on another user's
    GPU (its score, its GPU: its own word), and a GPU cause there (an XID, an idle GPU's
    clocks) made the Slurm policy drain the node and requeue every job on it. A node
    action on a rank's alert now needs NVML to list the rank's process on that GPU."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, script in FAKES.items():
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    state = tmp_path / "slurm-state"
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("STATE", str(state))
    monkeypatch.setenv("REQUEUED", str(tmp_path / "requeued"))
    (tmp_path / "policy.toml").write_text(
        "[[rule]]\nalert = 'TrainingStraggler'\naction = 'drain-node'\n"
        "match = { cause = 'gpu_errors' }\n[drain]\nrequeue = true\n")
    policy = Policy.load(tmp_path / "policy.toml")
    alert = {"status": "firing", "labels": {
        "alertname": "TrainingStraggler", "run": "fake", "rank": "1", "node": "node-1",
        "local_rank": "1", "gpu": "1", "cause": "gpu_errors"}}
    for holds, outcome in ((False, "failed"), (True, "acted")):
        queries: list[str] = []

        def found(query: str, holds: bool = holds, asked: list[str] = queries) -> bool:
            asked.append(query)
            return holds

        prom = AlertsPrometheus(lambda query: True, found)
        rem = Remediator(policy, PrometheusClient(prom.url), None,
                         AuditLog(tmp_path / f"audit-{holds}.jsonl"))
        try:
            (decision,) = rem.handle({"alerts": [alert]})
        finally:
            prom.close()
        assert decision["outcome"] == outcome, decision
        assert any("clusterpulse_gpu_process_info" in q and 'gpu="1"' in q and 'rank="1"' in q
                   for q in queries), queries
        if not holds:
            assert "that GPU is the rank's own claim" in decision["detail"], decision
            assert not state.exists() or not state.read_text(), "the node was drained"
    assert state.read_text().split()[0] == "node-1"  # drained once NVML says it holds it
    # Prometheus failing that question: nothing done, and the notification is answered
    # 503 so that Alertmanager asks again (a review: 'failed' waited for its 4 h repeat)
    state.write_text("")
    prom = AlertsPrometheus(lambda query: True,
                            lambda query: None if "gpu_process_info" in query else False)
    rem = Remediator(policy, PrometheusClient(prom.url), None, AuditLog(tmp_path / "a.jsonl"))
    try:
        with pytest.raises(RetryLater):
            rem.handle({"alerts": [alert]})
    finally:
        prom.close()
    assert not state.read_text()
