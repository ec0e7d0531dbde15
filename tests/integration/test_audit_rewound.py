"""Records cut from the end of the central audit log, or one deleted with the chain
rebuilt after it: the file alone reads "intact" (found in reviews of issue #29: policy
records erased, no trace anywhere). Its head is published by the remediation receiver
and kept by a real Prometheus with the project's rules; AuditLogRewound fires for a cut,
and the dashboard's Audit page (the real page) names both."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusterpulse.agent.audit import AuditLog, verify
from clusterpulse.agent.tokens import Tokens
from clusterpulse.dashboard.promclient import PrometheusClient
from clusterpulse.dashboard.remediation import Policy, Remediator, Rule, serve
from tests.support.procs import REPO, Prometheus, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def watched(tmp_path) -> Iterator[tuple[Path, Prometheus]]:
    """A central log of 5 policy records, its receiver, and a Prometheus (the project's
    rules) that has scraped its head."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    for i in range(5):
        log.write("policy", "restart", "policy: RankHung -> restart", "accepted", run=f"r{i}")
    rem = Remediator(Policy([Rule("RankHung", "restart")], dry_run=True),
                     PrometheusClient("http://127.0.0.1:9"), "agent-token-0123456789",
                     AuditLog(path))
    server = serve(rem, "127.0.0.1", 0, Tokens.single("hook-token-0123456789", "alertmanager"))
    rules = tmp_path / "alerts.rules.yml"  # the audit group has no interval of its own
    rules.write_text((REPO / "deploy/prometheus/alerts.rules.yml").read_text())
    prom = Prometheus(tmp_path, [f"127.0.0.1:{server.server_port}"],
                      [REPO / "deploy/prometheus/clusterpulse.rules.yml", rules])
    try:
        wait_until(lambda: prom.query('clusterpulse_audit_head_sequence{log="central"} == 5'),
                   30, "Prometheus holding the central log's head")
        yield path, prom
    finally:
        prom.stop()
        server.shutdown()
        server.server_close()


def audit_page_errors(monkeypatch, path: Path, prom: Prometheus) -> list[str]:
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("CLUSTERPULSE_AUDIT_LOG", str(path))
    monkeypatch.setenv("CLUSTERPULSE_PROMETHEUS_URL", prom.url)
    at = AppTest.from_file(str(REPO / "dashboard" / "views" / "audit.py"), default_timeout=60)
    at.run()
    assert not at.exception
    return [e.value for e in at.error]


def test_records_cut_from_the_central_log_page_and_show_on_the_audit_page(watched,
                                                                         monkeypatch):
    path, prom = watched
    lines = path.read_text().splitlines()
    path.write_text("".join(line + "\n" for line in lines[:3]))
    assert verify(path).intact  # the file alone cannot tell
    (alert,) = wait_until(lambda: prom.query(
        'ALERTS{alertname="AuditLogRewound",alertstate="firing"}'), 30,
        "AuditLogRewound firing")
    assert alert["metric"]["log"] == "central"
    (error,) = [e for e in audit_page_errors(monkeypatch, path, prom) if "rewound" in e]
    assert "Prometheus saw record 5, the file ends at 3" in error


def test_a_record_deleted_with_the_chain_rebuilt_shows_on_the_audit_page(watched,
                                                                        monkeypatch):
    """Found in the second review: delete record 2, renumber and re-chain the rest,
    append one: `verify` said intact, AuditLogRewound stayed quiet (the sequence never
    went down). The Audit page checks the file against every head Prometheus saw."""
    path, prom = watched
    kept = [json.loads(x) for x in path.read_text().splitlines()]
    del kept[1]  # the restart of r1 is erased ...
    path.unlink()
    forged = AuditLog(path)  # ... and the rest chained anew, plus one more
    for rec in [*kept, {"who": "ops", "action": "restart", "why": "w", "outcome": "ok"}]:
        forged.write(rec["who"], rec["action"], rec["why"], rec["outcome"])
    assert verify(path).intact and verify(path).head.seq == 5  # the file alone: fine
    (error,) = [e for e in audit_page_errors(monkeypatch, path, prom) if "chain broken" in e]
    assert "record 5 differs from the published head" in error
