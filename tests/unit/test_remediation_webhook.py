"""The remediation webhook against hostile clients: authentication before the body,
payload schema, backdated or missing startsAt (no Prometheus needed: every alert
here names its run, and nothing reaches an agent)."""

import base64
import datetime
import json
import time

import pytest
import requests

from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.tokens import Tokens
from clusterpulse.dashboard import remediation
from clusterpulse.dashboard.promclient import PrometheusClient
from clusterpulse.dashboard.remediation import (
    PayloadError,
    Policy,
    Remediator,
    RetryLater,
    Rule,
    promql_string,
    serve,
    validate_payload,
)
from tests.support.procs import REPO
from tests.unit.test_http_hardening import post, raw_request, status_and_error

HOOK = "alertmanager-hook-token-0123456789"


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat()


def alert(name: str = "RankHung", **extra) -> dict:
    return {"status": "firing", "labels": {"alertname": name, "run": "demo"}, **extra}


@pytest.fixture
def webhook(tmp_path):
    # dry run: a decision is audited, nothing is requested from any agent
    rem = Remediator(Policy([Rule("RankHung", "restart")], dry_run=True),
                     PrometheusClient("http://127.0.0.1:9"), "agent-token-0123456789",
                     AuditLog(tmp_path / "audit.jsonl"))
    server = serve(rem, "127.0.0.1", 0, Tokens.single(HOOK, "alertmanager"))
    yield server.server_port, tmp_path / "audit.jsonl"
    server.shutdown()


def test_unauthenticated_alerts_are_refused(webhook):
    """Finding: a bare curl with a RankHung alert restarted the run."""
    port, audit = webhook
    url = f"http://127.0.0.1:{port}/alertmanager"
    for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"},
                    {"Authorization": "Basic " + base64.b64encode(b"x:wrong").decode()}):
        r = requests.post(url, json={"alerts": [alert()]}, headers=headers, timeout=5)
        assert r.status_code == 401 and "http_config" in r.json()["error"]
    records = [json.loads(x) for x in audit.read_text().splitlines()]
    assert [r["outcome"] for r in records] == ["refused"] * 3


@pytest.mark.parametrize("scheme", ["Bearer", "Basic", "bearer", "BASIC"])
def test_alertmanager_credentials_are_accepted(webhook, scheme):
    """The scheme in any case (RFC 7235): a client's `bearer <token>` was a 401."""
    port, _ = webhook
    auth = (f"{scheme} {HOOK}" if scheme.lower() == "bearer" else
            f"{scheme} " + base64.b64encode(f"alertmanager:{HOOK}".encode()).decode())
    r = requests.post(f"http://127.0.0.1:{port}/alertmanager", json={"alerts": [alert()]},
                      headers={"Authorization": auth}, timeout=5)
    assert r.status_code == 200 and r.json()["decisions"][0]["outcome"] == "dry_run"


def test_healthz_answers_the_probes_without_a_token(webhook):
    """The pod's liveness/readiness probes (deploy/helm, deploy/kubernetes) GET /healthz;
    it had no health path at all (405)."""
    port, audit = webhook
    r = requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    assert r.status_code == 200 and r.json() == {"status": "ok", "rules": 1, "dry_run": True}
    assert requests.get(f"http://127.0.0.1:{port}/alertmanager", timeout=5).status_code == 405
    assert not audit.exists() or audit.read_text() == ""  # a probe is not an event


def test_content_length_is_checked_before_auth(webhook):
    """Finding: `Content-Length: -1` read the whole stream before anything was checked."""
    port, _ = webhook
    answer = raw_request(port, post("/alertmanager", {"Content-Length": "-1"}))
    assert status_and_error(answer)[0] == 400
    answer = raw_request(port, post("/alertmanager", {"Content-Length": str(200 << 20)}))
    assert status_and_error(answer)[0] == 413


@pytest.mark.parametrize("payload,where", [
    ({"alerts": "all"}, "'alerts' must be a list"),
    ({"alerts": [{"status": "firing"}]}, "alerts[0].labels"),
    ({"alerts": [{"status": "maybe", "labels": {"alertname": "x"}}]}, "alerts[0].status"),
    ({"alerts": [alert(labels={"alertname": "RankHung", "run": ["demo"]})]}, "labels.run"),
    ({"alerts": [alert(startsAt=5)]}, "startsAt"),
    ({"alerts": [alert()] * 1001}, "more than 1000"),
])
def test_payload_schema(payload, where):
    with pytest.raises(PayloadError, match=where.replace("[", r"\[").replace("]", r"\]")):
        validate_payload(payload)


@pytest.mark.parametrize("starts", [None, "backdated", "garbage", "future"])
def test_starts_at_cannot_skip_sustained_s(tmp_path, starts):
    """Finding: omitting or backdating startsAt skipped `sustained_s`."""
    now = [time.time()]
    rem = Remediator(Policy([Rule("TrainingStraggler", "restart", 120)], dry_run=True),
                     PrometheusClient("http://127.0.0.1:9"), None, AuditLog(None),
                     clock=lambda: now[0])
    extra = {"backdated": {"startsAt": iso(now[0] - 86400)}, "garbage": {"startsAt": "x"},
             "future": {"startsAt": iso(now[0] + 3600)}, None: {}}[starts]
    a = alert("TrainingStraggler", **extra)
    assert rem.handle({"alerts": [a]})[0]["outcome"] == "waiting"
    now[0] += 60
    (d,) = rem.tick()
    assert (d["outcome"], d["detail"]) == ("waiting", "firing 60 s of the 120 s the policy "
                                                      "requires")
    now[0] += 61
    # sustained: it would act now, once Prometheus confirms the alert still fires (none
    # answers here: it keeps waiting, never acts blind; the integration test has one)
    (d,) = rem.tick()
    assert (d["outcome"], d["detail"]) == ("waiting", "sustained, but Prometheus cannot "
                                                      "confirm it still fires")


def test_promql_string_escapes_quotes_and_backslashes():
    assert promql_string('x"} or up{a!="') == 'x\\"} or up{a!=\\"'
    assert promql_string("a\\b\n") == "a\\\\b\\n"


def test_the_first_rule_whose_labels_fit_decides_and_a_hardware_straggler_is_not_restarted(
        tmp_path):
    """A thermally throttled GPU is as hot after a restart in place: the shipped local
    policy restarts a straggler only for causes a new process can cure, and the Slurm
    policy drains the node of one whose GPU is at fault."""
    local = Policy.load(REPO / "deploy/local/policy.toml")
    slurm = Policy.load(REPO / "deploy/slurm/policy.toml")
    spares = Policy.load(REPO / "deploy/local/policy-spares.toml")  # a spare stands by

    def straggler(cause: str) -> dict:
        return {"alertname": "TrainingStraggler", "run": "r", "rank": "3", "node": "n1",
                "gpu": "0", "cause": cause}

    for cause in ("compute", "data_loading"):
        assert local.rule_for(straggler(cause)).action == "checkpoint-restart"
        assert slurm.rule_for(straggler(cause)) is None
        assert spares.rule_for(straggler(cause)).action == "checkpoint-restart"
    for cause in ("thermal_throttling", "power_brake", "slow_clocks", "gpu_errors"):
        assert local.rule_for(straggler(cause)) is None
        assert slurm.rule_for(straggler(cause)).action == "drain-node"
        rule = spares.rule_for(straggler(cause))  # out at once: a spare takes its place
        assert (rule.action, rule.sustained_s) == ("evict-node", 0)
    link = {"alertname": "TrainingLinkCongested", "node": "n1"}
    assert local.rule_for(link).sustained_s == 120
    assert (spares.rule_for(link).action, spares.rule_for(link).sustained_s) == ("evict-node", 0)
    assert local.rule_for({"alertname": "TrainingStraggler", "run": "r"}) is None  # no cause
    assert local.rule_for({"alertname": "RankHung", "run": "r"}).action == "restart"
    # a stall with a node of the run cut off: restarted where a spare stands by; a
    # stall with every node reachable (a hang, the training network alone) is not
    cut = {"alertname": "JobNodeUnreachable", "run": "r", "node": "n2", "severity": "critical"}
    assert local.rule_for(cut) is None
    assert (spares.rule_for(cut).action, spares.rule_for(cut).sustained_s) == ("restart", 0)
    assert spares.rule_for({"alertname": "JobStalled", "run": "r"}) is None
    # anchored: "compute" does not fit "computed", nor a part of a longer value
    path = tmp_path / "p.toml"
    path.write_text("[[rule]]\nalert = 'A'\nmatch = { cause = 'compute' }\naction = 'restart'\n"
                    "[[rule]]\nalert = 'A'\naction = 'checkpoint-restart'\n")
    p = Policy.load(path)
    assert p.rule_for({"alertname": "A", "cause": "computed"}).action == "checkpoint-restart"
    assert p.rule_for({"alertname": "A", "cause": "compute"}).action == "restart"


def test_a_node_action_waits_for_sustained_s_too(tmp_path):
    """drain-node used to act on the first notification whatever sustained_s said:
    a straggler that lasted one evaluation would have drained its node. Each alert
    waits on its own clock: another run's straggler on the same node resolving does not
    reset or forget this one's."""
    now = [time.time()]
    audit = AuditLog(tmp_path / "audit.jsonl")
    rem = Remediator(Policy([Rule("TrainingStraggler", "drain-node", 60)], dry_run=True),
                     PrometheusClient("http://127.0.0.1:9"), None, audit,
                     clock=lambda: now[0])
    a = {"status": "firing", "labels": {"alertname": "TrainingStraggler", "run": "r",
                                        "node": "n1", "cause": "thermal_throttling"}}
    b = {"status": "firing", "labels": {**a["labels"], "run": "other"}}
    (d,) = rem.handle({"alerts": [a]})
    assert d["outcome"] == "waiting" and d["node"] == "n1", d
    now[0] += 30
    rem.handle({"alerts": [b]})
    now[0] += 20
    rem.handle({"alerts": [{**b, "status": "resolved"}]})  # the other one ends
    (d,) = rem.tick()  # this one still waits: 50 s of 60
    assert (d["outcome"], d["detail"]) == ("waiting", "firing 50 s of the 60 s the policy "
                                                      "requires"), d
    assert audit.read() == []  # nothing decided yet, nothing asked of Slurm
    now[0] += 11
    (d,) = rem.tick()  # sustained; acting waits for Prometheus to confirm (none here)
    assert d["detail"] == "sustained, but Prometheus cannot confirm it still fires", d
    assert audit.read() == []
    # resolved before its time: forgotten; a new firing waits the whole time again
    rem.handle({"alerts": [{**a, "status": "resolved"}]})
    assert rem.tick() == []
    now[0] += 100
    (d,) = rem.handle({"alerts": [a]})
    assert (d["outcome"], d["detail"]) == ("waiting", "firing 0 s of the 60 s the policy "
                                                      "requires"), d


def test_a_sustained_alert_is_decided_once_when_a_notification_and_the_ticker_race(tmp_path):
    """The webhook thread and the ticker can both find the wait over at the same time;
    for a drain that meant draining, and requeueing the node's jobs, twice."""
    import threading

    class Confirming(Remediator):
        meet = threading.Barrier(2, timeout=10)

        def _firing_now(self, alert):  # both deciders are past the wait here
            self.meet.wait()
            return True

    now = [time.time()]
    audit = AuditLog(tmp_path / "audit.jsonl")
    rem = Confirming(Policy([Rule("TrainingStraggler", "restart", 60)], dry_run=True),
                     PrometheusClient("http://127.0.0.1:9"), None, audit,
                     clock=lambda: now[0])
    a = alert("TrainingStraggler")
    rem.handle({"alerts": [a]})
    now[0] += 61
    out: list[dict] = []
    deciders = [threading.Thread(target=lambda: out.extend(rem.tick())) for _ in range(2)]
    for t in deciders:
        t.start()
    for t in deciders:
        t.join(timeout=20)
    assert sorted(d["outcome"] for d in out) == ["decided", "dry_run"], out
    assert [r["outcome"] for r in audit.read()] == ["dry_run"]


def test_a_decision_prometheus_could_not_support_is_retried_not_dropped(tmp_path):
    """Prometheus down while the policy decides: an alert that names a node, not a run
    (GpuDown, TrainingLinkCongested), found no run and was answered 200 with no
    decision and no record; one that names its run used up the run's rate-limit slot on
    the failed request, and the retry was `rate_limited`, never sent. Now the webhook
    answers 503 (Alertmanager retries), says why in the audit log, and a failed request
    keeps the slot free."""
    audit = AuditLog(tmp_path / "audit.jsonl")
    rem = Remediator(Policy([Rule("RankHung", "restart"), Rule("GpuDown", "restart")]),
                     PrometheusClient("http://127.0.0.1:9"), "agent-token-0123456789", audit)
    server = serve(rem, "127.0.0.1", 0, Tokens.single(HOOK, "alertmanager"))
    url = f"http://127.0.0.1:{server.server_port}/alertmanager"
    auth = {"Authorization": f"Bearer {HOOK}"}
    gpu_down = {"status": "firing", "labels": {"alertname": "GpuDown", "node": "n1",
                                               "gpu": "0"}}
    try:
        for _ in range(2):  # Alertmanager's retry: tried again, not rate-limited
            for a in (gpu_down, alert()):
                r = requests.post(url, json={"alerts": [a]}, headers=auth, timeout=30)
                assert r.status_code == 503, r.text
                (d,) = r.json()["decisions"]
                assert d["outcome"] == "failed" and "Prometheus" in d["detail"], d
    finally:
        server.shutdown()
    records = audit.read()
    assert [x["outcome"] for x in records] == ["failed"] * 4, records
    assert records[0]["alert"] == gpu_down["labels"]  # the alert behind every record


def link_remediator(tmp_path, now: list[float]) -> Remediator:
    """A dry-run policy that restarts on TrainingLinkCongested sustained 120 s, on the
    clock `now[0]`, with no Prometheus to ask."""
    return Remediator(Policy([Rule("TrainingLinkCongested", "restart", 120)], dry_run=True),
                      PrometheusClient("http://127.0.0.1:9"), None,
                      AuditLog(tmp_path / "audit.jsonl"), clock=lambda: now[0])


def link_alert(status: str, **labels: str) -> dict:
    """A TrainingLinkCongested notification for run r1 on node n3."""
    return {"status": status, "labels": {"alertname": "TrainingLinkCongested", "run": "r1",
                                         "node": "n3", **labels}}


def test_one_rail_recovering_leaves_the_other_rails_wait_alone(tmp_path):
    """Two congested rails of one node (device mlx5_0, mlx5_1) shared one wait: the
    alert's identity left out `device`, so the recovered rail's resolved notification
    dropped the still-congested rail's sustained_s clock."""
    now = [time.time()]
    rem = link_remediator(tmp_path, now)

    def rail(device: str, status: str = "firing") -> dict:
        return link_alert(status, device=device)

    rem.handle({"alerts": [rail("mlx5_0"), rail("mlx5_1")]})
    now[0] += 60
    (d,) = rem.handle({"alerts": [rail("mlx5_0"), rail("mlx5_1", "resolved")]})
    assert (d["outcome"], d["detail"]) == ("waiting", "firing 60 s of the 120 s the policy "
                                                      "requires"), d
    now[0] += 61
    (d,) = rem.tick()  # still on its own clock: sustained now
    assert d["detail"] == "sustained, but Prometheus cannot confirm it still fires", d


def test_a_link_alert_escalating_to_critical_keeps_the_warnings_clock(tmp_path):
    """TrainingLinkCongested has two severities on the same labels (the critical one
    when the run's pace halves). Without severity in the identity they were one alert:
    the critical resolving (a run hovering at 2x its usual step) dropped the warning's
    sustained_s clock, and the eviction could be put off for ever."""
    now = [time.time()]
    rem = link_remediator(tmp_path, now)

    def link(severity: str, status: str = "firing") -> dict:
        return link_alert(status, device="eth0", severity=severity)

    rem.handle({"alerts": [link("warning")]})
    now[0] += 100
    (d,) = rem.handle({"alerts": [link("critical")]})
    assert d["detail"] == "firing 0 s of the 120 s the policy requires", d
    now[0] += 10
    rem.handle({"alerts": [link("critical", "resolved")]})
    now[0] += 11
    (d,) = rem.handle({"alerts": [link("warning")]})  # 121 s on its own clock
    assert d["outcome"] == "dry_run", d


@pytest.mark.parametrize(("status", "body", "retried"), [
    (400, b'{"status":"error","errorType":"bad_data","error":"parse error"}', False),
    (503, b'{"message":"Rate exceeded"}', True),  # a gateway's overload, with JSON
    (429, b'{"message":"Too many requests"}', True)])
def test_a_prometheus_error_that_will_not_pass_is_answered_not_retried(tmp_path, status,
                                                                       body, retried):
    """Only an error that may pass (unreachable, a timeout, an overload) asks
    Alertmanager to send the notification again: a bad query, or a URL that is no
    Prometheus, would fail the same way at every resend, for ever."""
    import http.server
    import threading

    from clusterpulse.dashboard.remediation import RetryLater

    class BadData(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    prom = http.server.ThreadingHTTPServer(("127.0.0.1", 0), BadData)
    threading.Thread(target=prom.serve_forever, daemon=True).start()
    audit = AuditLog(tmp_path / "audit.jsonl")
    rem = Remediator(Policy([Rule("GpuDown", "restart")]),
                     PrometheusClient(f"http://127.0.0.1:{prom.server_port}"),
                     "agent-token-0123456789", audit)
    notification = {"alerts": [{"status": "firing", "labels": {
        "alertname": "GpuDown", "node": "n1", "gpu": "0"}}]}
    try:
        if retried:
            with pytest.raises(RetryLater):
                rem.handle(notification)
        else:
            (d,) = rem.handle(notification)
            assert d["outcome"] == "failed" and "bad_data" in d["detail"], d
            assert "retry" not in d
    finally:
        prom.shutdown()
    assert [r["outcome"] for r in audit.read()] == ["failed"]


def test_one_bad_alert_never_costs_the_others(tmp_path):
    """Found in review: a label holding a lone surrogate ("\\ud800" in JSON) killed the
    webhook request unanswered (the PromQL query could not be encoded), and the other
    alerts of the notification were never decided. Now that alert is refused by name,
    the others are decided, and the history file is created 0600."""
    import os
    import stat

    old = os.umask(0)
    try:
        rem = Remediator(Policy([Rule("RankHung", "restart")], dry_run=True),
                         PrometheusClient("http://127.0.0.1:9"), "agent-token-0123456789",
                         AuditLog(tmp_path / "audit.jsonl"), tmp_path / "history.jsonl")
        server = serve(rem, "127.0.0.1", 0, Tokens.single(HOOK, "alertmanager"))
        try:
            body = ('{"alerts": [{"status": "firing", "labels": {"alertname": "RankHung", '
                    '"node": "n\\ud800"}}, {"status": "firing", "labels": {"alertname": '
                    '"RankHung", "run": "demo"}}]}')
            r = requests.post(f"http://127.0.0.1:{server.server_port}/alertmanager",
                              data=body, timeout=10,
                              headers={"Authorization": f"Bearer {HOOK}",
                                       "Content-Type": "application/json"})
        finally:
            server.shutdown()
    finally:
        os.umask(old)
    assert r.status_code == 200, r.text
    decisions = r.json()["decisions"]
    assert decisions[0]["outcome"] == "refused"
    assert "alerts[0].labels.node is not valid Unicode" in decisions[0]["detail"]
    assert decisions[1]["run"] == "demo" and decisions[1]["outcome"] == "dry_run"
    assert stat.S_IMODE((tmp_path / "history.jsonl").stat().st_mode) == 0o600
    assert len((tmp_path / "history.jsonl").read_text().splitlines()) == 1


def test_an_alert_nested_too_deep_to_keep_spares_the_others(tmp_path):
    """Found in the second review: annotations nested 979 deep parsed, then broke the
    history line (RecursionError): 500 for the whole notification, for ever resent."""
    rem = Remediator(Policy([Rule("RankHung", "restart")], dry_run=True),
                     PrometheusClient("http://127.0.0.1:9"), "agent-token-0123456789",
                     AuditLog(tmp_path / "audit.jsonl"), tmp_path / "history.jsonl")
    server = serve(rem, "127.0.0.1", 0, Tokens.single(HOOK, "alertmanager"))
    depth = 979
    deep = '{"a": ' * depth + "1" + "}" * depth
    body = ('{"alerts": [{"status": "firing", "labels": {"alertname": "RankHung", '
            f'"run": "deep"}}, "annotations": {deep}}}, {{"status": "firing", "labels": '
            '{"alertname": "RankHung", "run": "demo"}}]}')
    try:
        r = requests.post(f"http://127.0.0.1:{server.server_port}/alertmanager", data=body,
                          timeout=10, headers={"Authorization": f"Bearer {HOOK}",
                                               "Content-Type": "application/json"})
    finally:
        server.shutdown()
    assert r.status_code == 200, r.text
    refused, decided = r.json()["decisions"]
    assert refused["outcome"] == "refused" and "alerts[0] nests deeper than 8" in \
        refused["detail"]
    assert (decided["run"], decided["outcome"]) == ("demo", "dry_run")
    assert len((tmp_path / "history.jsonl").read_text().splitlines()) == 1


def test_a_bug_deciding_one_alert_is_answered_and_spares_the_others(tmp_path, monkeypatch):
    rem = Remediator(Policy([Rule("RankHung", "restart")], dry_run=True),
                     PrometheusClient("http://127.0.0.1:9"), "agent-token-0123456789",
                     AuditLog(tmp_path / "audit.jsonl"))
    real = rem._decide

    def flaky(rule, run, alert, recheck=False):
        if run == "bad":
            raise KeyError("a bug")
        return real(rule, run, alert, recheck)

    monkeypatch.setattr(rem, "_decide", flaky)
    decisions = rem.handle({"alerts": [alert(labels={"alertname": "RankHung", "run": "bad"}),
                                       alert()]})
    assert [d["outcome"] for d in decisions] == ["failed", "dry_run"]
    assert decisions[0]["detail"] == "internal error: KeyError"


def test_the_policy_acts_only_on_alerts_prometheus_has_firing(tmp_path):
    """Found in review: any local user POSTed an alert to the shipped Alertmanager's
    open API, and the policy killed the victim's ranks 2 s later. Now every automatic
    action first asks Prometheus for ALERTS{alertname, alertstate="firing", the
    alert's labels}: a notification Prometheus does not back is refused and audited,
    and when Prometheus cannot answer nothing is done (503: Alertmanager retries)."""
    from tests.support.promstub import AlertsPrometheus

    prom = AlertsPrometheus(lambda q: 'run="real"' in q and 'rank="3"' in q)
    audit = AuditLog(tmp_path / "audit.jsonl")
    rem = Remediator(Policy([Rule("RankHung", "restart"), Rule("GpuDown", "drain-node")]),
                     PrometheusClient(prom.url), "agent-token-0123456789", audit)
    try:
        forged = [alert(labels={"alertname": "RankHung", "run": "victim", "rank": "0"}),
                  alert(labels={"alertname": "RankHung", "run": "real", "rank": "0"}),
                  alert(labels={"alertname": "GpuDown", "node": "victim-node", "gpu": "0"})]
        decisions = rem.handle({"alerts": forged})
    finally:
        prom.close()
    assert [d["outcome"] for d in decisions] == ["refused"] * 3, decisions
    assert all("no such alert firing" in d["detail"] for d in decisions)
    asked = [q for q in prom.queries if q.startswith("ALERTS{")]
    assert 'ALERTS{alertstate="firing",alertname="RankHung",run="victim",rank="0"}' in asked
    assert [r["outcome"] for r in audit.read()] == ["refused"] * 3
    # Prometheus unreachable: fail closed
    rem.prom = PrometheusClient("http://127.0.0.1:9")
    from clusterpulse.dashboard.remediation import RetryLater

    with pytest.raises(RetryLater) as err:
        rem.handle({"alerts": [alert(labels={"alertname": "GpuDown", "node": "n1",
                                             "gpu": "0"})]})
    (d,) = err.value.decisions
    assert d["outcome"] == "failed" and "cannot confirm" in d["detail"]


def test_an_action_refused_because_an_agent_could_not_answer_is_retried(tmp_path,
                                                                       monkeypatch):
    """Review finding: when an agent of the run could not say who runs its ranks (down,
    busy, timed out), the ownership check failed closed, but the decision kept the run's
    rate-limit slot and was never tried again: a 3 s timeout cost that alert its
    remediation for good. Nothing was asked of any agent, so the slot is free again and
    the notification is answered for a retry."""
    import clusterpulse.dashboard.remediation as remediation
    from clusterpulse.dashboard.actions import NodeResult, OwnersUnknown

    calls: list[str] = []

    def request_action(*_a, **_kw):
        calls.append("asked")
        if len(calls) == 1:
            raise OwnersUnknown("cannot tell who runs 'r1': the agent on n2 did not answer")
        return [NodeResult("n1", "http://n1", True, "c1", "pending")]

    monkeypatch.setattr(remediation, "request_action", request_action)
    monkeypatch.setattr(Remediator, "_unconfirmed", lambda *_a: None)  # Prometheus agrees
    audit = AuditLog(tmp_path / "audit.jsonl")
    rem = Remediator(Policy([Rule("RankHung", "restart")]),
                     PrometheusClient("http://127.0.0.1:9"), "agent-token-0123456789", audit)
    with pytest.raises(RetryLater) as answered:  # 503: Alertmanager sends it again
        rem.handle({"alerts": [alert()]})
    (d,) = answered.value.decisions
    assert d["outcome"] == "failed" and "did not answer" in d["detail"], d
    (d,) = rem.handle({"alerts": [alert()]})  # Alertmanager's retry (max 1 per window)
    assert d["outcome"] == "acted", d
    assert calls == ["asked", "asked"]


def test_a_store_password_file_that_cannot_be_read_is_an_error_naming_it(tmp_path, capsys):
    """The same option and message as the dashboard's and clusterpulse-ctl's (one piece
    of code): not a traceback, nor a store answering 401 to every check."""
    (tmp_path / "hook-token").write_text(HOOK + "\n")
    missing = tmp_path / "no-such-password"
    assert remediation.main(["--policy", str(REPO / "deploy/local/policy.toml"),
                             "--webhook-token-file", str(tmp_path / "hook-token"),
                             "--prometheus-password-file", str(missing)]) == 2
    assert capsys.readouterr().err == ("clusterpulse-remediate: error: "
                                       "--prometheus-password-file: cannot read the password "
                                       f"file {missing}: No such file or directory\n")


@pytest.mark.parametrize(("listen", "reason"), [
    ("127.0.0.1:{taken}", "Address already in use"),
    ("127.0.0.1:http", "--listen must be HOST:PORT"),
])
def test_an_address_the_webhook_cannot_listen_on_is_one_line_naming_it(listen, reason,
                                                                      tmp_path, capsys):
    """As the agent's: a held port or a malformed --listen was a traceback."""
    import socket

    (tmp_path / "hook-token").write_text(HOOK + "\n")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        listen = listen.format(taken=held.getsockname()[1])
        code = remediation.main(["--policy", str(REPO / "deploy/local/policy.toml"),
                                 "--webhook-token-file", str(tmp_path / "hook-token"),
                                 "--audit-log", str(tmp_path / "audit.jsonl"),
                                 "--listen", listen])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("clusterpulse-remediate: error: ") and err.count("\n") == 1, err
    assert listen in err and reason in err, err


def test_a_restart_no_agent_took_is_a_failure_that_frees_the_runs_slot(
        sim_agent, tmp_path, monkeypatch):
    """Found in review: every agent refused or failed the policy's restart; the decision
    said "partial" (the audit: "failed"), the webhook answered 200, so Alertmanager
    sent nothing again, and the slot taken for it rate-limited the next hang for 15 min.
    Here the run's only agent knows no rank of it (it answers 409, failed) until one
    starts."""
    from clusterpulse.dashboard import actions
    from tests.conftest import TOKEN
    from tests.support.ranksock import RankProcess

    monkeypatch.setattr(actions, "run_agents", lambda _prom, _run, _token, lookback="":
                        actions.RunAgents({"node-a": sim_agent.url}, {}))
    monkeypatch.setattr(Remediator, "_unconfirmed", lambda *_a: None)  # Prometheus agrees
    audit = AuditLog(tmp_path / "audit.jsonl")
    rem = Remediator(Policy([Rule("RankHung", "restart")]),
                     PrometheusClient("http://127.0.0.1:9"), TOKEN, audit)

    def hung(at: str) -> dict:
        return {"alerts": [alert(startsAt=at)]}

    # the hang, Alertmanager's resend of it (503 asks for one), and the hang again
    for at in ("2026-12-07T10:00:00Z", "2026-12-07T10:00:00Z", "2026-12-07T10:03:00Z"):
        with pytest.raises(RetryLater) as answered:
            rem.handle(hung(at))
        (d,) = answered.value.decisions
        assert d["outcome"] == "failed", d
        assert d["detail"] == ("no agent took the action: node-a: no ranks of run 'demo' "
                               "are known on this node"), d
    with RankProcess(sim_agent.socket_path, [{"type": "step", "run": "demo", "rank": 0,
                                              "step": 5}]):
        (d,) = rem.handle(hung("2026-12-07T10:05:00Z"))  # the slot is still the run's
        assert d["outcome"] == "acted", d
        (d,) = rem.handle(hung("2026-12-07T10:06:00Z"))  # and now taken
        assert d["outcome"] == "rate_limited", d
    assert [r["outcome"] for r in audit.read() if r["who"] == "policy"] == [
        "failed", "failed", "failed", "accepted", "rate_limited"]


def test_a_wall_clock_step_skips_neither_sustained_s_nor_the_rate_limit_window(
        tmp_path, monkeypatch):
    """Found in review: alerts were timed on the wall clock, so a step forward (NTP, a
    VM resumed) 2 s after a straggler's first notification acted on it at once, past
    its 300 s `sustained_s`, and emptied the rate-limit window. Durations are monotonic;
    the wall clock only stamps the history kept."""
    from clusterpulse.dashboard.actions import NodeResult

    assert Remediator.__dataclass_fields__["clock"].default is time.monotonic
    mono, wall = [1000.0], [time.time()]
    acted: list[str] = []
    monkeypatch.setattr(remediation, "request_action", lambda *a, **_kw: acted.append(a[1])
                        or [NodeResult("n", "http://n", True, "c1", "pending")])
    monkeypatch.setattr(Remediator, "_unconfirmed", lambda *_a, **_kw: None)
    monkeypatch.setattr(Remediator, "_firing_now", lambda *_a, **_kw: True)
    rem = Remediator(Policy([Rule("TrainingStraggler", "checkpoint-restart", 300),
                             Rule("RankHung", "restart")]),
                     PrometheusClient("http://127.0.0.1:9"), "agent-token-0123456789",
                     AuditLog(None), tmp_path / "history.jsonl",
                     clock=lambda: mono[0], wall_clock=lambda: wall[0])
    straggler = alert("TrainingStraggler", startsAt=iso(wall[0]))
    assert rem.handle({"alerts": [straggler]})[0]["outcome"] == "waiting"
    wall[0] += 3600  # 2 s later the host's clock is stepped an hour forward
    mono[0] += 2
    (d,) = rem.tick()
    assert (d["outcome"], d["detail"]) == ("waiting", "firing 2 s of the 300 s the policy "
                                                      "requires")
    assert acted == []
    mono[0] += 298
    assert [d["outcome"] for d in rem.tick()] == ["acted"] and acted == ["demo"]
    wall[0] += 3600  # another hour on the wall clock, 10 s on the run's window
    mono[0] += 10
    (d,) = rem.handle({"alerts": [alert(startsAt=iso(wall[0]))]})
    assert d["outcome"] == "rate_limited", d
    kept = [json.loads(x)["received"] for x in (tmp_path / "history.jsonl").read_text()
            .splitlines()]
    assert kept == [wall[0] - 3600 * 2, wall[0]]  # what is kept is stamped on the wall clock


def test_a_restart_in_flight_on_one_node_is_not_asked_for_again_whatever_the_others_said(
        tmp_path, monkeypatch):
    """Found in review: node-a refused (its restart of the run in flight) and node-b's
    answer timed out. Only "every node in flight" was the in-flight case, so this was a
    failure: the slot and the resend entry freed, 503, and every resend asked again; the
    resend after node-a's restart ended restarted the run a second time. One node in
    flight (none taking it) is the in-flight case: 200, and the resends are decided."""
    from clusterpulse.dashboard.actions import NodeResult

    asked: list[str] = []
    monkeypatch.setattr(remediation, "request_action", lambda *a, **_kw: asked.append(a[1])
                        or [NodeResult("node-a", "http://a", False, error="a restart is in "
                                       "flight", in_flight={"id": "node-a-1-1"}),
                            NodeResult("node-b", "http://b", False,
                                       error="unreachable: ReadTimeout")])
    monkeypatch.setattr(Remediator, "_unconfirmed", lambda *_a, **_kw: None)
    rem = Remediator(Policy([Rule("RankHung", "restart")]),
                     PrometheusClient("http://127.0.0.1:9"), "agent-token-0123456789",
                     AuditLog(None))
    hung = {"alerts": [alert(startsAt="2026-12-07T10:00:00Z")]}
    (d,) = rem.handle(hung)  # no RetryLater: answered 200
    assert (d["outcome"], d["nodes"]["node-b"]) == ("in_flight", "unreachable: ReadTimeout")
    assert rem._acted["demo"] == []  # nothing was done: the slot is free
    # node-a's restart has ended; Alertmanager's resends are not a second restart
    monkeypatch.setattr(remediation, "request_action", lambda *a, **_kw: asked.append(a[1])
                        or [NodeResult("node-a", "http://a", True, "node-a-2-2", "pending")])
    assert [rem.handle(hung)[0]["outcome"] for _ in range(3)] == ["decided"] * 3
    assert asked == ["demo"]


def test_a_node_that_did_not_answer_keeps_the_runs_slot_and_asks_for_no_resend(
        tmp_path, monkeypatch):
    """Found in review: a policy restart whose only agent did not answer (a timeout, a
    connection reset: the POST may have been taken) was a failure "no agent took": the
    slot freed and 503, so a resend restarted again what may be restarting. It holds
    the slot (partial, 200), and the audit says "unconfirmed", not "failed"."""
    from clusterpulse.dashboard import actions
    from tests.conftest import TOKEN

    monkeypatch.setattr(actions, "run_agents", lambda _prom, _run, _token, lookback="":
                        actions.RunAgents({"node-a": "http://127.0.0.1:28997"}, {}))
    monkeypatch.setattr(actions, "rank_owners", lambda *_a: {1000: {"node-a"}})
    monkeypatch.setattr(Remediator, "_unconfirmed", lambda *_a: None)
    audit = AuditLog(tmp_path / "audit.jsonl")
    rem = Remediator(Policy([Rule("RankHung", "restart")]),
                     PrometheusClient("http://127.0.0.1:9"), TOKEN, audit)
    (d,) = rem.handle({"alerts": [alert(startsAt="2026-12-07T10:00:00Z")]})
    assert d["outcome"] == "partial" and "retry" not in d, d
    assert d["detail"] == "no answer from node-a: it may have been taken there", d
    (d,) = rem.handle({"alerts": [alert(startsAt="2026-12-07T10:03:00Z")]})
    assert d["outcome"] == "rate_limited", d
    assert [r["outcome"] for r in audit.read() if r["who"] == "policy"] == [
        "unconfirmed", "rate_limited"]


def test_a_refusal_that_never_clears_asks_for_a_resend_three_times_a_window(
        sim_agent, tmp_path, monkeypatch):
    """Found in review: a refusal by every node freed the slot and answered 503 every
    time, and one that never clears (no ranks of the run known on the node) made every
    notification a resend for as long as the alert fired. After 3 such attempts in
    window_s the slot is held: failed, no resend, and the decision says why."""
    from clusterpulse.dashboard import actions
    from tests.conftest import TOKEN

    monkeypatch.setattr(actions, "run_agents", lambda _prom, _run, _token, lookback="":
                        actions.RunAgents({"node-a": sim_agent.url}, {}))
    monkeypatch.setattr(Remediator, "_unconfirmed", lambda *_a: None)
    audit = AuditLog(tmp_path / "audit.jsonl")
    rem = Remediator(Policy([Rule("RankHung", "restart")]),
                     PrometheusClient("http://127.0.0.1:9"), TOKEN, audit)
    hung = {"alerts": [alert(startsAt="2026-12-07T10:00:00Z")]}
    for _ in range(3):
        with pytest.raises(RetryLater):
            rem.handle(hung)
    (d,) = rem.handle(hung)  # the fourth: answered 200
    assert d["outcome"] == "failed" and "retry" not in d, d
    assert d["detail"].startswith("no agent took the action: node-a: no ranks of run "), d
    assert d["detail"].endswith("3 attempts in 900 s refused: attempts spent, the run's "
                                "slot is held and no resend is asked for"), d
    assert rem.handle(hung)[0]["outcome"] == "decided"  # its resend
    (d,) = rem.handle({"alerts": [alert(startsAt="2026-12-07T10:05:00Z")]})
    assert d["outcome"] == "rate_limited", d
    assert [r["outcome"] for r in audit.read() if r["who"] == "policy"] == [
        "failed"] * 4 + ["rate_limited"]
