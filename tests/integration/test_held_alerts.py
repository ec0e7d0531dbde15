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
LABELS = {"alertname": "JobNodeUnreachable", "run": "job", "node": "n2",
          "severity": "critical"}
HOLD_S = 4


def write_rule(path: Path, until: float) -> None:
    """JobNodeUnreachable for run "job" on n2 while time() < `until`, held HOLD_S after."""
    path.write_text(
        "groups:\n- name: held\n  interval: 1s\n  rules:\n"
        "  - alert: JobNodeUnreachable\n"
        f"    expr: vector(1) and on () (vector(time()) < {until})\n"
        f"    keep_firing_for: {HOLD_S}s\n"
        "    labels: {run: job, node: n2, severity: critical}\n")


def firing_in(prom: Prometheus) -> list[dict]:
    return prom.query('ALERTS{alertname="JobNodeUnreachable",alertstate="firing"}')


def test_an_alert_held_after_its_condition_ended_waits_and_is_dropped(tmp_path):
    rules = tmp_path / "held.rules.yml"
    write_rule(rules, 0)
    prom = Prometheus(tmp_path, [], [rules])
    try:
        until = time.time() + 5  # from now: a slow start must not eat the firing part
        write_rule(rules, until)
        requests.post(prom.url + "/-/reload", timeout=10).raise_for_status()
        audit = AuditLog(tmp_path / "audit.jsonl")

        def remediator() -> Remediator:  # each hears of the alert first when it is asked
            return Remediator(Policy([Rule("JobNodeUnreachable", "restart")]),
                              PrometheusClient(prom.url), "agent-token-0123456789", audit)

        notification = {"alerts": [{"status": "firing", "labels": LABELS,
                                    "startsAt": "2026-12-06T00:00:00Z"}]}
        wait_until(lambda: firing_in(prom), 10, "the alert firing while its condition holds")
        assert time.time() < until, "Prometheus fired it only after its condition ended"
        # while it holds, the policy acts (no agent knows run "job": the act fails)
        (acted,) = remediator().handle(notification)
        assert acted["outcome"] == "failed" and "waiting" not in acted, acted
        # its condition ended; Prometheus holds it firing (ALERTS says firing too)
        wait_until(lambda: any(a.get("keepFiringSince")
                               for a in PrometheusClient(prom.url).alerts()), 10,
                   "Prometheus holding the alert (keepFiringSince)")
        assert firing_in(prom), "ALERTS no longer says firing: the case is gone"
        rem = remediator()
        (held,) = rem.handle(notification)
        assert held["outcome"] == "waiting" and "keep_firing_for" in held["detail"], held
        assert [d["outcome"] for d in rem.tick()] == ["waiting"]  # still held
        # the hold ends: the alert resolves, and the policy drops it without acting
        wait_until(lambda: not firing_in(prom), 15, "the held alert resolved")
        assert [(d["outcome"], d["detail"]) for d in rem.tick()] == [
            ("resolved", "no longer firing in Prometheus")]
        assert rem.tick() == []
        assert [r["outcome"] for r in audit.read() if r["who"] == "policy"] == ["failed"]
    finally:
        prom.stop()
