"""The alerting rules and Alertmanager config: promtool and amtool checks, promtool
unit tests for every alert, routing tests, and inhibition in a real Alertmanager."""

from __future__ import annotations

import datetime
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import yaml

from tests.support.procs import REPO, Alertmanager, wait_until
from tests.support.webhook import WebhookSink

pytestmark = pytest.mark.integration
PROM = REPO / "deploy" / "prometheus"
AM = REPO / "deploy" / "alertmanager"


def run(*args: str) -> subprocess.CompletedProcess:
    assert shutil.which(args[0]), f"{args[0]} is not installed (the test command installs it)"
    # promtool runs every rule over hours of test time: minutes on a loaded machine
    return subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=REPO)


def test_rule_files_are_valid():
    r = run("promtool", "check", "rules", str(PROM / "clusterpulse.rules.yml"),
            str(PROM / "alerts.rules.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


def in_group_order(files: list, reverse: bool, into) -> list[str]:
    """Copies of the rule test files that evaluate the rule groups of their rule files
    in file order (recording rules first: dependencies first) or in `reverse`.

    Prometheus evaluates groups independently, so an alert may read a recording rule
    from one evaluation back; promtool orders them at random (a test that passed 9 runs
    in 10 failed CI). Each test must pass with the groups in dependency order and in
    reverse, the two ends of what a real server does."""
    copies = []
    for f in files:
        doc = yaml.safe_load(f.read_text())
        doc["rule_files"] = [str((f.parent / r).resolve()) for r in doc["rule_files"]]
        order = [g["name"] for r in doc["rule_files"]
                 for g in yaml.safe_load(Path(r).read_text())["groups"]]
        doc["group_eval_order"] = order[::-1] if reverse else order
        copy = into / f.name
        copy.write_text(yaml.safe_dump(doc, sort_keys=False))
        copies.append(str(copy))
    return copies


ORDERS = ["dependencies first", "dependencies last"]


@pytest.fixture(scope="module")
def promtool_runs(tmp_path_factory) -> Iterator[dict[str, list[Future]]]:
    """Every rule test file in both group orders, each its own `promtool test rules`,
    as many at once as there are cores (promtool checks its files one after another on
    one core; ten at once on 2 cores starved the other test worker for half a minute).
    Per order: one run a file, its CompletedProcess."""
    assert shutil.which("promtool"), "promtool is not installed (the test command installs it)"
    files = sorted((PROM / "tests").glob("*_test.yml"))
    # promtool runs every rule over hours of test time: minutes on a loaded machine
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        runs = {}
        for order in ORDERS:
            into = tmp_path_factory.mktemp(order.replace(" ", "-"))
            runs[order] = [pool.submit(subprocess.run, ["promtool", "test", "rules", copy],
                                       cwd=REPO, capture_output=True, text=True, timeout=600)
                           for copy in in_group_order(files, order == "dependencies last", into)]
        yield runs


@pytest.mark.parametrize("order", ORDERS)
def test_promtool_unit_tests_pass_and_cover_every_alert(order, promtool_runs):
    files = sorted((PROM / "tests").glob("*_test.yml"))
    assert len(files) >= 2, files  # alerts_test.yml and detection_test.yml
    for f in files:  # recording rules lead, so file order is dependency order
        assert yaml.safe_load(f.read_text())["rule_files"][0].endswith(
            "clusterpulse.rules.yml"), f
    assert len(promtool_runs[order]) == len(files)
    for run_ in promtool_runs[order]:
        r = run_.result()
        assert r.returncode == 0 and "FAILED" not in r.stdout, r.stdout + r.stderr
        assert r.stdout.count("SUCCESS") == 1, r.stdout  # its one file
    alerts = {rule["alert"] for g in yaml.safe_load((PROM / "alerts.rules.yml").read_text())
              ["groups"] for rule in g["rules"] if "alert" in rule}
    tests = [case for f in files for case in yaml.safe_load(f.read_text())["tests"]]
    fired = {t["alertname"] for case in tests for t in case.get("alert_rule_test", [])
             if t.get("exp_alerts")}
    silent = {t["alertname"] for case in tests for t in case.get("alert_rule_test", [])
              if not t.get("exp_alerts")}
    assert alerts - fired == set(), "alerts without a firing test"
    assert {"TrainingStraggler", "RankHung", "NodeAgentDown"} <= silent | fired
    assert "TrainingStraggler" in silent  # the uniform-slowdown negative case


def test_every_alert_has_severity_summary_description_and_runbook():
    runbooks = (REPO / "docs" / "runbooks.md").read_text().lower()
    for group in yaml.safe_load((PROM / "alerts.rules.yml").read_text())["groups"]:
        for rule in group["rules"]:
            if "record" in rule:  # a figure two alerts of its group share
                continue
            assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
            ann = rule["annotations"]
            assert ann["summary"] and ann["description"], rule["alert"]
            anchor = ann["runbook_url"].split("#")[1]
            assert f"## {rule['alert'].lower()}" in runbooks, f"no runbook for {rule['alert']}"
            assert anchor == rule["alert"].lower()


def test_the_hang_margin_reads_the_age_no_earlier_than_the_threshold():
    """Each rule of a group is its own query at the evaluation's timestamp: a scrape
    committed between two rules is seen by the later one only, a race promtool never
    plays (it evaluates against finished data). The margin read the age from a record
    made before the threshold's rule read the phase: in CI, the age of a 12 s checkpoint
    met the 5 s threshold of the step that followed it, and RankHung paged for one
    evaluation. Read in the margin's own query, after the threshold, the age is from the
    same scrape or a later one, and leaving a long-threshold phase restarts the age."""
    (group,) = [g for g in yaml.safe_load((PROM / "clusterpulse.rules.yml").read_text())
                ["groups"] if g["name"] == "clusterpulse-progress"]
    order = [r.get("record") for r in group["rules"]]
    margin = group["rules"][order.index("clusterpulse:rank_hang_margin_seconds")]["expr"]
    assert "clusterpulse_trainer_heartbeat_age_seconds" in margin, margin
    assert "clusterpulse:rank_heartbeat_age_seconds" not in margin, margin
    assert (order.index("clusterpulse:rank_hang_threshold_seconds")
            < order.index("clusterpulse:rank_hang_margin_seconds"))


def test_alertmanager_config_and_examples_are_valid():
    r = run("amtool", "check-config", str(AM / "alertmanager.yml"),
            str(AM / "examples" / "email-slack.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("labels,receivers", [
    (["severity=critical", "alertname=GpuDown", "node=n1"], "oncall,remediation"),
    (["severity=critical", "alertname=RankHung", "run=r1"], "oncall,remediation"),
    (["severity=critical", "alertname=JobStalled", "run=r1"], "oncall,remediation"),
    (["severity=warning", "alertname=TrainingStraggler", "run=r1"], "remediation"),
    # XIDs the application causes (45 on every kill) reach the history, not the pager.
    (["severity=warning", "alertname=GpuApplicationXid", "node=n1", "xid=45"], "remediation"),
])
def test_routing(labels, receivers):
    r = run("amtool", "config", "routes", "test", f"--config.file={AM / 'alertmanager.yml'}",
            *labels)
    assert r.returncode == 0 and r.stdout.strip() == receivers, r.stdout + r.stderr


def test_a_down_node_inhibits_its_gpu_and_rank_alerts_in_a_real_alertmanager(tmp_path):
    sink = WebhookSink()
    am = Alertmanager(tmp_path, sink.url)
    try:
        now = datetime.datetime.now(datetime.UTC).isoformat()

        def alert(**labels):
            return {"labels": labels, "annotations": {"summary": "test"}, "startsAt": now}

        # Sources before their targets, one layer at a time: Alertmanager's inhibitor learns
        # of alerts asynchronously, so a target posted in the same batch as its source can
        # be dispatched (group_wait 0 s for critical) before the source is known (CI once
        # delivered RankHung n1 posted together with NodeAgentDown n1; alertmanager#2229).
        # Prometheus re-sends every firing alert each evaluation, so in a real stack the
        # source is known by the next one. RankHung is both: NodeAgentDown's target and
        # JobStalled's source.
        layers = [
            [alert(alertname="NodeAgentDown", severity="critical", node="n1"),
             # A stuck collection on n2: its GPU series are frozen, their alerts stale.
             alert(alertname="AgentCollectionStale", severity="critical", node="n2"),
             # n3's link halves its run's pace (critical): its own warning is noise
             alert(alertname="TrainingLinkCongested", severity="critical", node="n3",
                   cause="communication"),
             # GPUs lost on n5 and n6: the rank on n5's hangs with it, n6's rank on
             # another GPU hangs on its own
             alert(alertname="GpuDown", severity="critical", node="n5", gpu="1"),
             alert(alertname="GpuDown", severity="critical", node="n6", gpu="1")],
            [alert(alertname="RankHung", severity="critical", node="n1", run="r1", rank="2"),
             alert(alertname="RankHung", severity="critical", node="n2", run="r1", rank="5"),
             alert(alertname="RankHung", severity="critical", node="n5", run="r2", rank="3",
                   gpu="1"),
             alert(alertname="RankHung", severity="critical", node="n6", run="r3", rank="0",
                   gpu="0")],
            [alert(alertname="GpuDown", severity="critical", node="n1", gpu="3"),
             alert(alertname="JobStalled", severity="critical", run="r1"),
             alert(alertname="GpuThermalSlowdown", severity="warning", node="n2", gpu="0"),
             alert(alertname="TrainingLinkCongested", severity="warning", node="n3",
                   cause="communication"),
             alert(alertname="TrainingLinkCongested", severity="warning", node="n4",
                   cause="communication")],
        ]
        known = 0
        for layer in layers:
            requests.post(am.url + "/api/v2/alerts", timeout=5, json=layer).raise_for_status()
            known += len(layer)
            wait_until(lambda n=known: len(am.alerts()) == n, 20, f"{known} alerts known")
            time.sleep(1)

        def states():
            return {(a["labels"]["alertname"], a["labels"].get("node", ""))
                    + (("critical",) if a["labels"]["severity"] == "critical"
                       and a["labels"]["alertname"] == "TrainingLinkCongested" else ()): a["status"]
                    for a in am.alerts()}

        s = wait_until(lambda: (st := states()) and len(st) == 14 and st, 20, "14 alerts")
        wait_until(lambda: states()[("GpuDown", "n1")]["state"] == "suppressed", 20,
                   "GpuDown inhibited")
        s = states()
        assert s[("GpuDown", "n1")]["inhibitedBy"] and s[("RankHung", "n1")]["inhibitedBy"]
        assert s[("RankHung", "n2")]["state"] == "active"
        # the lost GPU's page names the incident; its rank's hang is evidence
        assert s[("RankHung", "n5")]["state"] == "suppressed"
        assert s[("GpuDown", "n5")]["state"] == "active"
        assert s[("RankHung", "n6")]["state"] == "active"  # not on the lost GPU
        assert s[("NodeAgentDown", "n1")]["state"] == "active"
        assert s[("JobStalled", "")]["state"] == "suppressed"  # the hung rank explains it
        assert s[("GpuThermalSlowdown", "n2")]["state"] == "suppressed"
        assert s[("AgentCollectionStale", "n2")]["state"] == "active"
        assert s[("TrainingLinkCongested", "n3", "critical")]["state"] == "active"
        assert s[("TrainingLinkCongested", "n3")]["state"] == "suppressed"
        assert s[("TrainingLinkCongested", "n4")]["state"] == "active"  # no critical there
        delivered = wait_until(lambda: {(a["labels"]["alertname"], a["labels"].get("node"))
                                        for a in sink.alerts()} or None, 20, "webhook delivery")
        wait_until(lambda: ("RankHung", "n2") in {(a["labels"]["alertname"], a["labels"].get(
            "node")) for a in sink.alerts()}, 20, "RankHung n2 delivered")
        delivered = {(a["labels"]["alertname"], a["labels"].get("node")) for a in sink.alerts()}
        assert ("GpuDown", "n1") not in delivered and ("RankHung", "n1") not in delivered
        assert ("RankHung", "n5") not in delivered
        # the shipped config authenticates to the remediation webhook
        hook = wait_until(lambda: [auth for path, auth in sink.auth if "oncall" not in path],
                          20, "remediation webhook delivery")
        assert set(hook) == {f"Bearer {am.webhook_token}"}
    finally:
        am.stop()
        sink.stop()


def test_a_cut_off_node_pages_once_though_its_stall_fires_first(tmp_path):
    """A node cut off: JobStalled fires first (the node's 1 s progress scrape fails at
    once), JobNodeUnreachable up to ~10 s later, and inhibits it; with JobStalled paged
    at once (critical, group_wait 0 s) the on-call got both. Now JobStalled waits 20 s
    for an explanation; a stall nothing explains still pages."""
    sink = WebhookSink()
    am = Alertmanager(tmp_path, sink.url)
    try:
        now = datetime.datetime.now(datetime.UTC).isoformat()

        def alert(**labels):
            return {"labels": {"severity": "critical", **labels},
                    "annotations": {"summary": "test"}, "startsAt": now}

        def pages() -> set[tuple[str, str]]:
            return {(a["labels"]["alertname"], a["labels"]["run"])
                    for (path, _), payload in zip(sink.auth, sink.received, strict=True)
                    if "oncall" in path for a in payload.get("alerts", [])}

        requests.post(am.url + "/api/v2/alerts", timeout=5, json=[
            alert(alertname="JobStalled", run="cut"), alert(alertname="JobStalled", run="hung")
        ]).raise_for_status()
        time.sleep(3)  # the cut node's main scrape times out; JobNodeUnreachable's `for`
        requests.post(am.url + "/api/v2/alerts", timeout=5, json=[
            alert(alertname="JobNodeUnreachable", run="cut", node="n3")]).raise_for_status()
        wait_until(lambda: {("JobNodeUnreachable", "cut"), ("JobStalled", "hung")} <= pages(),
                   60, "the cut node's page and the unexplained stall's")
        time.sleep(2)  # both JobStalled groups flushed together: nothing more comes
        assert pages() == {("JobNodeUnreachable", "cut"), ("JobStalled", "hung")}, pages()
    finally:
        am.stop()
        sink.stop()


def test_a_notification_links_to_the_evidence_over_the_alerts_own_time(tmp_path):
    """The Slack example's text, rendered by a real Alertmanager with the shipped
    template: the link opens the alert's page at its rank over its own time (a link to
    the last 15 minutes showed nothing of it an hour later), up to now while it fires,
    to 5 minutes after its end once resolved."""
    from urllib.parse import parse_qsl, urlsplit

    from clusterpulse.dashboard import links

    sink = WebhookSink()
    example = yaml.safe_load((AM / "examples" / "email-slack.yml").read_text())
    slack = next(r for r in example["receivers"] if r["name"] == "oncall-slack")
    url_file = tmp_path / "slack-url"
    url_file.write_text(sink.url)
    slack["slack_configs"][0]["api_url_file"] = str(url_file)
    config = {"templates": [str(AM / "examples" / "clusterpulse.tmpl")],
              "route": {"receiver": "oncall-slack", "group_by": ["alertname"],
                        "group_wait": "0s", "group_interval": "1s"},
              "receivers": [slack]}
    am = Alertmanager(tmp_path, sink.url, yaml.safe_dump(config))
    try:
        started = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=33)
        alert = {"labels": {"alertname": "RankHung", "severity": "critical", "run": "llm",
                            "rank": "3", "node": "n2"},
                 "annotations": {"summary": "Rank 3 of run llm has made no progress",
                                 "dashboard_url": "run?run=llm&rank=3",
                                 "runbook_url": "docs/runbooks.md#rankhung"},
                 "startsAt": started.isoformat()}

        def link(n: int) -> tuple[str, dict[str, str]]:
            texts = wait_until(lambda: [a["text"] for p in sink.received
                                        for a in p.get("attachments", [])][n:] or None,
                               30, f"Slack notification {n + 1}")
            url = re.search(r"<([^|>]+)\|evidence>", texts[0])
            assert url, texts[0]
            # its runbook: the dashboard's page at the alert's section
            assert "<https://clusterpulse.example.com/runbooks?alert=rankhung|runbook>" \
                in texts[0], texts[0]
            parts = urlsplit(url.group(1))
            assert parts.netloc == "clusterpulse.example.com", url.group(1)
            return parts.path, dict(parse_qsl(parts.query))

        requests.post(am.url + "/api/v2/alerts", timeout=5, json=[alert]).raise_for_status()
        page, params = link(0)
        assert page == "/run" and params["run"] == "llm" and params["rank"] == "3", params
        firing = links.window(params)
        start, end = firing.bounds()
        assert firing.end is None and "until" not in params  # up to now, while it fires
        assert start == started.timestamp() // 60 * 60 - 1200, params

        ended = datetime.datetime.now(datetime.UTC)
        requests.post(am.url + "/api/v2/alerts", timeout=5,
                      json=[{**alert, "endsAt": ended.isoformat()}]).raise_for_status()
        page, params = link(1)
        resolved = links.window(params)
        start, end = resolved.bounds()
        assert page == "/run" and start == started.timestamp() // 60 * 60 - 1200, params
        assert end == (ended.timestamp() + 300) // 60 * 60, params
    finally:
        am.stop()
        sink.stop()
