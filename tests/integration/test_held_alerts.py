"""The policy and `keep_firing_for`, against a real Prometheus: an alert that Prometheus
holds firing after its condition ended is not acted on.

Found on a clean machine (tests/cluster/test_spare.py): a node was cut off, torch went
on with the hot spare, and the cut healed; JobNodeUnreachable, held 10 s by its
`keep_firing_for`, reached the policy then, its ALERTS series still said firing, and the
restart took the returned node back into the job. ALERTS cannot tell a held alert from
one whose condition holds; Prometheus's alerts API can (`keepFiringSince`)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests

from clusterpulse.agent.audit import AuditLog
from clusterpulse.dashboard.promclient import PrometheusClient
from clusterpulse.dashboard.remediation import Policy, Remediator, Rule
from tests.support.procs import Prometheus, wait_until

pytestmark = pytest.mark.integration
BACK_S = 3  # n3's condition comes back this long after it ended, within its hold


def write_rules(path: Path, until: float) -> None:
    """JobNodeUnreachable for run "job": on n2 while time() < `until`, then held 5 s
    (resolves); on n3 too, and again from `until` + BACK_S, held 30 s (never resolves)."""
    rule = ("  - alert: JobNodeUnreachable\n    expr: vector(1) and on () ({cond})\n"
            "    keep_firing_for: {hold}\n"
            "    labels: {{run: job, node: {node}, severity: critical}}\n")
    path.write_text("groups:\n- name: held\n  interval: 1s\n  rules:\n"
                    + rule.format(cond=f"vector(time()) < {until}", hold="5s", node="n2")
                    + rule.format(cond=f"vector(time()) < {until} or vector(time()) > "
                                  f"{until + BACK_S}", hold="30s", node="n3"))


def notification(*nodes: str) -> dict:
    return {"alerts": [{"status": "firing", "startsAt": "2026-12-06T00:00:00Z", "labels": {
        "alertname": "JobNodeUnreachable", "run": "job", "node": n, "severity": "critical"}}
        for n in nodes]}


def copies(prom: Prometheus) -> dict[str, bool]:
    """node -> whether Prometheus holds its firing alert (keepFiringSince)."""
    return {a["labels"]["node"]: bool(a.get("keepFiringSince"))
            for a in PrometheusClient(prom.url).alerts() if a["state"] == "firing"}


def test_an_alert_held_after_its_condition_ended_waits_then_acts_once_or_is_dropped(tmp_path):
    rules = tmp_path / "held.rules.yml"
    write_rules(rules, 0)
    prom = Prometheus(tmp_path, [], [rules])
    try:
        until = time.time() + 4  # from now: a slow start must not eat the firing part
        write_rules(rules, until)
        requests.post(prom.url + "/-/reload", timeout=10).raise_for_status()
        audit = AuditLog(tmp_path / "audit.jsonl")

        def remediator() -> Remediator:  # each hears of the alerts first when it is asked
            return Remediator(Policy([Rule("JobNodeUnreachable", "restart")]),
                              PrometheusClient(prom.url), "agent-token-0123456789", audit)

        wait_until(lambda: copies(prom) == {"n2": False, "n3": False}, 10,
                   "both alerts firing while their conditions hold")
        assert time.time() < until, "Prometheus fired them only after their conditions ended"
        # while it holds, the policy acts (no agent knows run "job": the act fails)
        (acted,) = remediator().handle(notification("n2"))
        assert acted["outcome"] == "failed", acted
        # both conditions ended; Prometheus holds both firing, as ALERTS says
        wait_until(lambda: copies(prom) == {"n2": True, "n3": True}, 10, "both held")
        rem = remediator()
        decisions = rem.handle(notification("n2", "n3"))
        assert [d["outcome"] for d in decisions] == ["waiting"] * 2, decisions
        assert all("keep_firing_for" in d["detail"] for d in decisions), decisions
        # n3's condition holds again: acted on once, at the next tick, not at every tick
        wait_until(lambda: copies(prom).get("n3") is False, 10, "n3's condition back")
        assert sorted(d["outcome"] for d in rem.tick()) == ["failed", "waiting"]
        assert audit.read()[-1]["alert"]["node"] == "n3"  # the act (failed) was n3's
        assert [d["outcome"] for d in rem.tick()] == ["waiting"]  # n2 alone
        # n2's hold ends: it resolves, and the policy drops it without acting
        wait_until(lambda: "n2" not in copies(prom), 15, "n2's held alert resolved")
        assert [(d["outcome"], d["detail"]) for d in rem.tick()] == [
            ("resolved", "no longer firing in Prometheus")]
        assert rem.tick() == []
        assert [r["outcome"] for r in audit.read() if r["who"] == "policy"] == ["failed"] * 2
        assert [r["alert"]["node"] for r in audit.read() if r["who"] == "policy"] == [
            "n2", "n3"]
    finally:
        prom.stop()
