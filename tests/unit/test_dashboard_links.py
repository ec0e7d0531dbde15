"""Issue #28: deep links (node, GPU, run, rank, window in the URL), the Run table for a
human, alerts grouped by incident with their runbooks, one audit row per action."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml

from clusterpulse.dashboard import auditview, data, links, runbooks
from clusterpulse.dashboard.amclient import Alert
from clusterpulse.dashboard.incidents import ago, alert_groups, rank_tables, rate_against_usual
from clusterpulse.dashboard.promclient import Sample

REPO = Path(__file__).resolve().parents[2]


# -- the window and the links ------------------------------------------------------------
def test_the_window_comes_from_the_url_and_goes_back_into_links():
    assert links.window({}) == links.Window("15 min", 900)
    hour = links.window({"range": "1h"})
    assert hour.seconds == 3600 and hour.params() == {"range": "1h"}
    custom = links.window({"range": "custom", "from": "2026-01-31T14:00",
                           "until": "2026-01-31T14:30"})
    assert custom.seconds == 1800 and links.fmt_utc(custom.end) == "2026-01-31T14:30"
    assert custom.params() == {"range": "custom", "from": "2026-01-31T14:00",
                               "until": "2026-01-31T14:30"}
    # from a time up to now (an alert notification's link while it fires): the start
    # stays where the link put it, whenever it is opened and however often refreshed
    since = links.window({"range": "custom", "from": "2026-01-31T14:00"},
                         now=links.parse_utc("2026-01-31T15:00", "now"))
    assert since.end is None and since.seconds == 3600
    assert links.fmt_utc(since.bounds(now=links.parse_utc("2026-01-31T16:00", "now"))[0]) \
        == "2026-01-31T14:00"
    assert since.params() == {"range": "custom", "from": "2026-01-31T14:00"}
    # a link to another page keeps the window
    assert links.page_url("node", {"node": "n 1", "gpu": 3}, hour.params()) == \
        "node?node=n+1&gpu=3&range=1h"


@pytest.mark.parametrize(("params", "named"), [
    ({"range": "fortnight"}, "range='fortnight'"),
    ({"range": "custom", "until": "2026-01-31T14:30"}, "needs from="),
    ({"range": "custom", "from": "2999-01-31T14:00"}, "in the future"),
    ({"range": "custom", "from": "yesterday", "until": "2026-01-31T14:30"}, "from='yesterday'"),
    ({"range": "custom", "from": "2026-01-31T15:00", "until": "2026-01-31T14:30"},
     "is not after"),
])
def test_a_bad_window_in_a_link_is_named_in_one_line(params, named):
    with pytest.raises(links.LinkError) as err:
        links.window(params)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_every_alert_links_to_its_evidence():
    assert links.evidence({"run": "llm", "rank": "3", "node": "n2"}) == "run?run=llm&rank=3"
    assert links.evidence({"node": "n2", "gpu": "1"}) == "node?node=n2&gpu=1"
    assert links.evidence({"node": "n2"}) == "node?node=n2"
    assert links.evidence({"run": "llm"}) == "run?run=llm"
    assert links.evidence({}) == "alerts"


def test_every_alert_rule_carries_a_dashboard_link_and_a_runbook_section():
    """The notifications link to the evidence (the promtool tests check each path is
    the one links.evidence builds) and every runbook anchor has its section."""
    groups = yaml.safe_load((REPO / "deploy/prometheus/alerts.rules.yml").read_text())["groups"]
    rules = [r for g in groups for r in g["rules"] if "alert" in r]
    assert rules
    for r in rules:
        assert "dashboard_url" in r["annotations"], r["alert"]
        assert runbooks.text(r["annotations"]["runbook_url"]), r["alert"]
    assert runbooks.link("docs/runbooks.md#gpudown", "https://docs.example/cp") == \
        "https://docs.example/cp/runbooks.md#gpudown"
    # without published docs: the dashboard's Runbooks page at that section
    assert runbooks.link("docs/runbooks.md#gpudown", "") == "runbooks?alert=gpudown"
    assert runbooks.link("docs/runbooks.md#no-such-alert", "") is None
    assert runbooks.link("", "") is None


# -- the Run table ---------------------------------------------------------------------
def run_data() -> dict:
    ranks = pd.DataFrame({"rank": ["0", "1", "2", "3"], "node": ["a", "a", "b", "b"],
                          "local_rank": ["0", "1", "0", "1"], "gpu": ["0", "1", "0", "1"],
                          "pid": ["11", "12", "13", "14"]})
    per = {"score": {"0": 1.0, "1": 1.0, "2": 1.02, "3": 1.9},
           "flagged": {"0": 0.0, "1": 0.0, "2": 0.0, "3": 1.0},
           "compute s": {r: 0.1 for r in "0123"}, "sync wait s": {r: 0.05 for r in "0123"},
           "data wait s": {r: 0.001 for r in "0123"}, "all-reduce s": {r: 0.1 for r in "0123"},
           "all-reduce bytes": {r: 2e7 for r in "0123"}, "step": {r: 42 for r in "0123"}}
    return {"ranks": ranks, "per_rank": per, "gpu_temp": {"3": 93.0},
            "causes": {r: "compute" for r in "012"} | {"3": "thermal_throttling"}}


def test_the_run_table_puts_the_decision_first_and_shows_no_cause_for_healthy_ranks():
    table, internal = rank_tables(run_data(), {"range": "1h"})
    assert list(table.columns[:3]) == ["flag", "cause", "score"]
    assert not {"pid", "local_rank", "compute s", "step"} & set(table.columns)
    assert {"pid", "local_rank", "compute s", "step"} <= set(internal.columns)
    assert list(table["rank"]) == ["3", "2", "0", "1"] and list(internal["rank"]) == list("0123")
    top = table.iloc[0]
    assert (top["flag"], top["cause"]) == ("STRAGGLER", "thermal_throttling")
    assert set(table["cause"].iloc[1:]) == {""}  # 'compute' beside healthy ranks read as one
    assert top["evidence"] == "node?node=b&gpu=1&range=1h"
    assert top["compute ms"] == pytest.approx(100)


def test_steps_per_second_are_read_against_the_runs_own_baseline():
    assert rate_against_usual(0.9, 1.0) == "-10 % vs 15 min"
    assert rate_against_usual(1.0, None) is None and rate_against_usual(1.0, 0.0) is None


# -- alerts ----------------------------------------------------------------------------
def alert(name: str, severity: str, at: str, **labels) -> Alert:
    return Alert(name, {"alertname": name, "severity": severity, **labels},
                 {"runbook_url": f"docs/runbooks.md#{name.lower()}"}, "active", [], [], at)


def test_active_alerts_are_grouped_by_incident_root_first():
    now = pd.Timestamp("2026-01-31T14:10:00Z").timestamp()
    groups = alert_groups([
        alert("GpuCriticalXid", "critical", "2026-01-31T14:01:05Z", node="n2", gpu="1"),
        alert("CheckpointStale", "warning", "2026-01-31T14:05:00Z", run="other"),
        alert("GpuDown", "critical", "2026-01-31T14:01:00Z", node="n2", gpu="1"),
        alert("GpuTemperatureHigh", "warning", "2026-01-31T13:00:00Z", node="n7", gpu="0"),
        alert("RankHung", "critical", "2026-01-31T14:02:00Z", run="llm", rank="3", node="n2"),
    ], now)
    names = [[a.name for a in g] for g in groups]
    # the lost GPU explains its XIDs and its rank's hang: one incident, not three;
    # another run's stale checkpoint is not part of it
    assert names == [["GpuDown", "RankHung", "GpuCriticalXid"], ["CheckpointStale"],
                     ["GpuTemperatureHigh"]]
    assert ago(now - pd.Timestamp("2026-01-31T14:01:00Z").timestamp()) == "9 min ago"
    assert ago(30) == "30 s ago" and ago(2 * 86400) == "2 d ago"


def test_a_lost_gpu_is_grouped_with_the_hang_of_the_run_whose_rank_uses_it():
    """Found in review: node n1 is shared, run alpha's rank 0 on GPU 0, run beta's rank
    1 on GPU 1. GPU 1 is lost and beta's rank hangs on it; alpha's rank hangs on its
    own. The Alerts and Cluster pages grouped the lost GPU with alpha's hang, the Run
    page (which knows where the ranks are) with beta's."""
    now = pd.Timestamp("2026-12-07T14:01:00Z").timestamp()
    alerts = [alert("GpuDown", "critical", "2026-12-07T14:00:00Z", node="n1", gpu="1"),
              alert("RankHung", "critical", "2026-12-07T14:00:10Z", run="beta", rank="1",
                    node="n1"),
              alert("RankHung", "critical", "2026-12-07T14:00:12Z", run="alpha", rank="0",
                    node="n1")]
    placement = {"alpha": ({"n1"}, {("n1", "0"): {"0"}}),
                 "beta": ({"n1"}, {("n1", "1"): {"1"}})}
    groups = alert_groups(alerts, now, placement)
    assert sorted([(a.name, a.labels.get("run", "")) for a in g] for g in groups) == [
        [("GpuDown", ""), ("RankHung", "beta")], [("RankHung", "alpha")]]


def test_a_jobs_alerts_are_on_its_row_of_the_jobs_table():
    """Found on the demo: "Critical alerts 1" beside "All nodes and GPUs healthy" for
    9 minutes, the job-level alert (no node) nowhere on the page."""
    from clusterpulse.dashboard.incidents import run_alerts

    got = run_alerts([
        alert("CheckpointStale", "warning", "2026-01-31T14:05:00Z", run="llm"),
        alert("JobStalled", "critical", "2026-01-31T14:06:00Z", run="llm"),
        alert("RankHung", "critical", "2026-01-31T14:02:00Z", run="other", rank="3",
              node="n2"),
        alert("GpuDown", "critical", "2026-01-31T14:01:00Z", node="n2", gpu="1"),
    ])
    assert got == {"llm": "JobStalled (critical), CheckpointStale (warning)",
                   "other": "RankHung (critical)"}
    # a GPU's alert is the run's whose rank uses it (the demo's job read "training", no
    # alert, while its rank's GPU was down); a GPU no rank uses is no run's
    placement = data.placement([
        Sample({"part": "placement", "run": "other", "node": "n2", "rank": "3", "gpu": "1"}, 1),
        Sample({"part": "placement", "run": "llm", "node": "n1", "rank": "0", "gpu": "0"}, 1),
        Sample({"part": "step", "run": "llm"}, 5)])
    got = run_alerts([
        alert("GpuDown", "critical", "2026-01-31T14:01:00Z", node="n2", gpu="1"),
        alert("GpuDown", "critical", "2026-01-31T14:01:00Z", node="n2", gpu="2"),
        alert("RankHung", "critical", "2026-01-31T14:02:00Z", run="other", rank="3",
              node="n2")], placement)
    assert got == {"other": "GpuDown (critical), RankHung (critical)"}


# -- audit -----------------------------------------------------------------------------
def test_one_audit_row_per_action_names_the_person_and_puts_the_hash_last():
    recs = [
        {"ts": 100.0, "who": "alice", "action": "checkpoint-restart", "why": "rank 3 slow",
         "outcome": "accepted", "run": "llm", "source": "dashboard",
         "nodes": {"a": "c1", "b": "c2"}, "prev": "0" * 64},
        {"ts": 100.5, "who": "token", "on_behalf_of": "alice", "action": "checkpoint-restart",
         "why": "rank 3 slow", "outcome": "delivered", "run": "llm", "command": "c1",
         "node": "a", "source": "agent", "prev": "1" * 64},
        {"ts": 101.0, "who": "token", "on_behalf_of": "alice", "action": "checkpoint-restart",
         "why": "rank 3 slow", "outcome": "completed", "run": "llm", "command": "c1",
         "node": "a", "source": "agent", "prev": "2" * 64},
        {"ts": 101.5, "who": "token", "on_behalf_of": "alice", "action": "checkpoint-restart",
         "why": "rank 3 slow", "outcome": "completed", "run": "llm", "command": "c2",
         "node": "b", "source": "agent", "prev": "3" * 64},
        {"ts": 200.0, "who": "policy", "action": "drain-node", "why": "GpuDown", "outcome":
         "acted", "source": "remediation", "prev": "4" * 64},
    ]
    frame = auditview.actions(recs)
    assert len(frame) == 2 and list(frame["action"]) == ["drain-node", "checkpoint-restart"]
    row = frame.iloc[1]
    assert row["who"] == "alice" and row["records"] == 4
    assert row["nodes"] == "a: completed, b: completed"
    assert frame.columns[-1] == "prev" and "token" not in set(frame["who"])
    assert not any(isinstance(v, float) and math.isnan(v) for v in frame["who"])


def test_agent_records_written_before_their_request_join_it():
    """The remediation policy's restart, as the demo's audit log holds it: each agent
    wrote "delivered" before the policy wrote its request (it names the command ids the
    agents answered). The Audit page showed 3 rows for the one action."""
    recs = [
        {"ts": 10.52, "who": "token", "on_behalf_of": "policy", "action": "restart",
         "outcome": "delivered", "source": "agent", "node": "n0", "command": "n0-1"},
        {"ts": 10.58, "who": "token", "on_behalf_of": "policy", "action": "restart",
         "outcome": "delivered", "source": "agent", "node": "n1", "command": "n1-1"},
        {"ts": 10.60, "who": "policy", "action": "restart", "outcome": "accepted",
         "run": "demo", "why": "policy: RankHung -> restart", "source": "remediation",
         "nodes": {"n0": "n0-1", "n1": "n1-1"}},
        {"ts": 43.2, "who": "token", "on_behalf_of": "policy", "action": "restart",
         "outcome": "completed", "source": "agent", "node": "n1", "command": "n1-1"},
        {"ts": 55.0, "who": "token", "action": "fault:gpu_lost", "outcome": "applied",
         "source": "agent", "node": "n1"},
    ]
    frame = auditview.actions(recs)
    assert list(frame["action"]) == ["fault:gpu_lost", "restart"], frame
    row = frame.iloc[1]
    assert row["who"] == "policy" and row["records"] == 4 and row["outcome"] == "accepted"
    assert row["nodes"] == "n0: delivered, n1: completed"
    assert row["time (UTC)"] == pd.Timestamp(10.60, unit="s").floor("s")


def test_the_audit_tables_say_when_who_what_how_it_ended_and_why_in_five_columns():
    """The Audit page's table had eleven columns (1623 px) and cut its nodes at 1400 px
    ("sim-node-1: refu…"): the page shows five, the run with the action and each
    node's outcome with the action's; the log's bookkeeping is in a table of its own."""
    frame = auditview.actions([
        {"ts": 100.0, "who": "alice", "action": "checkpoint-restart", "why": "slow",
         "outcome": "accepted", "run": "llm", "source": "dashboard",
         "nodes": {"a": "c1", "b": "c2"}, "prev": "0" * 64},
        {"ts": 200.0, "who": "bob", "action": "drain-node", "outcome": "acted",
         "source": "remediation", "prev": "1" * 64}])
    main, rest = auditview.shown(frame)
    assert list(main.columns) == auditview.SHOWN
    assert list(main["action"]) == ["drain-node", "checkpoint-restart on run llm"]
    assert list(main["outcome"]) == ["acted", "accepted; a: accepted, b: accepted"]
    assert list(main["time (UTC)"]) == ["1970-01-01 00:03:20", "1970-01-01 00:01:40"]
    assert list(rest.columns) == auditview.BOOKKEEPING and rest["prev"][1] == "0" * 64
    empty = auditview.shown(frame.iloc[0:0])[0]
    assert empty.empty and list(empty.columns) == auditview.SHOWN


def test_the_audit_page_filters_by_person_and_refreshes(tmp_path, monkeypatch):
    """Issue #28 item 6: filters and a refresh on the Audit page (its table was the
    whole log, as it was when the page opened)."""
    import json

    from streamlit.testing.v1 import AppTest

    from tests.support.ports import free_port
    from tests.support.procs import REPO

    log = tmp_path / "audit.jsonl"
    records = [{"ts": 100.0, "who": "alice", "action": "checkpoint-restart", "why": "slow",
                "outcome": "accepted", "run": "llm", "source": "dashboard"},
               {"ts": 200.0, "who": "policy", "action": "restart", "why": "RankHung",
                "outcome": "accepted", "run": "demo", "source": "remediation"}]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.setenv("CLUSTERPULSE_AUDIT_LOG", str(log))
    monkeypatch.setenv("CLUSTERPULSE_PROMETHEUS_URL", f"http://127.0.0.1:{free_port()}")
    at = AppTest.from_file(str(REPO / "dashboard" / "views" / "audit.py"), default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    assert list(at.dataframe[0].value["who"]) == ["policy", "alice"]
    who = next(m for m in at.multiselect if m.label == "Who")
    who.select("alice").run()
    assert list(at.dataframe[0].value["who"]) == ["alice"]
    assert any("**alice** checkpoint-restart" in m.value for m in at.markdown)
    with log.open("a") as f:  # a new action by alice, after the page was drawn
        f.write(json.dumps({**records[0], "ts": 300.0, "why": "again"}) + "\n")
    next(b for b in at.button if b.label == "Refresh").click().run()
    assert not at.exception, at.exception
    assert list(at.dataframe[0].value["why"]) == ["again", "slow"]


def test_the_newest_action_is_one_line_of_plain_text_from_the_log():
    """The Audit page says the newest action in words above its table. Every value is
    the log's: an operator's reason with a link, an image or HTML in it stays text,
    and a time's colons are escaped (an emoji code like `:33:` makes the browser load
    a plugin before drawing the line, which then came with the table)."""
    frame = auditview.actions([
        {"ts": 100.0, "who": "alice", "action": "checkpoint-restart", "outcome": "accepted",
         "why": "see [this](http://evil) ![x](http://evil/i.png) <b>now</b>\nand *more*",
         "run": "llm", "source": "dashboard", "nodes": {"a": "c1"}, "prev": "0" * 64},
        {"ts": 3723.0, "who": "bob", "action": "drain-node", "outcome": "acted",
         "source": "remediation", "prev": "1" * 64}])
    line = auditview.newest_line(frame)
    assert line == r"**Newest action:** 1970-01-01 01\:02\:03 UTC, **bob** drain-node: acted"
    older = auditview.newest_line(frame.iloc[1:])
    assert older.startswith(r"**Newest action:** 1970-01-01 00\:01\:40 UTC, **alice** "
                            r"checkpoint-restart on run llm: accepted (a\: accepted)")
    assert r"because: see \[this\]\(http\://evil\) \!\[x\]\(http\://evil/i.png\) " \
           r"\<b\>now\</b\> and \*more\*" in older and "\n" not in older
    assert not re.search(r":(?!material/|streamlit:)[\w+-][\w_+-]*:", line + older)
    assert auditview.newest_line(frame.iloc[:0]) == ""


def _kpi_row() -> None:
    import streamlit as st

    from clusterpulse.dashboard import ui

    c = st.columns(3)
    ui.kpi(c[0], "Steps / s", "4.69", "+3 % vs 15 min")
    ui.kpi(c[1], "Goodput", "91 %", help="time on steps that count / wall time")
    ui.kpi(c[2], "Steps / s (slow)", "1.20", "-12 % vs 15 min")


def test_a_top_row_figure_is_markdown_and_a_heading_with_its_delta_as_a_badge():
    """ui.kpi draws what st.metric drew (label, value, a green or red delta with its
    arrow, help) with elements in Streamlit's main script: st.metric's own script made
    the Cluster and Run pages' rows wait on a first visit."""
    from streamlit.testing.v1 import AppTest

    from tests.support.pages import kpis

    at = AppTest.from_function(_kpi_row).run()
    assert not at.exception and not at.metric
    assert kpis(at) == {"Steps / s": "4.69", "Goodput": "91 %", "Steps / s (slow)": "1.20"}
    badges = [m.value for m in at.markdown if "-badge[" in m.value]
    assert badges == [r":green-badge[:material/arrow_upward: \+3 % vs 15 min]",
                      r":red-badge[:material/arrow_downward: \-12 % vs 15 min]"]
    assert [m.help for m in at.markdown if m.value == "Goodput"] == [
        "time on steps that count / wall time"]


def test_a_restart_refused_for_one_in_flight_is_one_row():
    """Found in the second review: one refused click read as three rows ("admin restart
    refused", "sim-node-1: refused", "sim-node-0: refused"): each agent writes its
    refusal (naming the restart in flight, no command of its own) before the request."""
    recs = [
        {"ts": 20.10, "who": "dashboard", "on_behalf_of": "admin", "action": "restart",
         "outcome": "refused", "run": "demo", "source": "agent", "node": "n0",
         "in_flight": "n0-20-1"},
        {"ts": 20.12, "who": "dashboard", "on_behalf_of": "admin", "action": "restart",
         "outcome": "refused", "run": "demo", "source": "agent", "node": "n1",
         "in_flight": "n1-20-1"},
        {"ts": 20.20, "who": "admin", "action": "restart", "outcome": "refused", "run": "demo",
         "why": "second tab", "source": "dashboard",
         "nodes": {"n0": "a restart is in flight", "n1": "a restart is in flight"}},
        # another run's refusal, minutes later, stays its own row
        {"ts": 400.0, "who": "policy", "action": "restart", "outcome": "refused",
         "run": "other", "source": "agent", "node": "n0", "in_flight": "n0-390-2"},
    ]
    frame = auditview.actions(recs)
    assert len(frame) == 2, frame
    row = frame.iloc[1]
    assert row["who"] == "admin" and row["records"] == 3 and row["outcome"] == "refused"
    assert row["nodes"] == "n0: refused, n1: refused"
    assert frame.iloc[0]["run"] == "other"


def test_line_charts_order_series_naturally_on_a_scale_of_distinct_hues(monkeypatch):
    """Found in the second review: GPUs 2 and 3 were red and pink (Streamlit's palette),
    'gpu 10' sorted before 'gpu 2', and the restarts axis had ticks at 0.5."""
    from clusterpulse.dashboard import ui

    drawn = []
    monkeypatch.setattr(ui, "_chart", lambda frame, spec: drawn.append(spec))
    t = pd.date_range("2026-12-05 10:00", periods=3, freq="min")
    ui.line_chart(pd.DataFrame({f"gpu {i}": [1.0, 2.0, 3.0] for i in (10, 2, 1)}, index=t),
                  "temperature (°C)")
    ui.line_chart(pd.DataFrame({"run": [0.0, 1.0, 1.0]}, index=t), "restarts (count)",
                  counts=True)
    color = drawn[0]["encoding"]["color"]
    assert color["sort"] == ["gpu 1", "gpu 2", "gpu 10"]
    assert color["scale"] == {"scheme": "tableau10"}
    assert drawn[1]["encoding"]["y"]["axis"] == {"tickMinStep": 1, "format": "d"}


def test_a_rank_whose_gpu_is_down_is_flagged_first():
    """Found in the second review: while its GPU was lost, rank 0's row read score
    1.00x, heartbeat 0.0 and a dash for GPU °C: the dash hid the lost GPU."""
    d = run_data() | {"gpu_down": {"0"}}
    table, _ = rank_tables(d, {})
    assert list(table["rank"])[:2] == ["0", "3"], table
    assert list(table["flag"])[:2] == ["GPU DOWN", "STRAGGLER"]
    assert table.iloc[0]["cause"] == ""


def test_a_rank_flagged_for_recurring_slowness_is_named_after_the_stragglers():
    d = run_data()
    d["per_rank"] = d["per_rank"] | {"recurring": {"0": 0.0, "1": 1.27, "2": 0.0, "3": 0.0}}
    table, _ = rank_tables(d, {})
    assert list(table["rank"])[:2] == ["3", "1"], table
    assert list(table["flag"])[:3] == ["STRAGGLER", "RECURRING", ""]
    assert table.iloc[1]["cause"] == "short stalls recurring: the job 1.27x slower"


def test_cells_are_drawn_only_from_series_with_a_node_and_a_gpu_index():
    """Found by a review: another exporter writing these metric names with gpu="GPU-3"
    (or without node or reason) stopped the Cluster page with a ValueError in int()."""
    from clusterpulse.dashboard.data import gpu_cells

    good = Sample({"node": "n1", "gpu": "3", "reason": "gpu_is_lost"}, 1.0)
    bad = [Sample({"node": "n1", "gpu": "GPU-3", "reason": "x"}, 1.0),
           Sample({"node": "n1", "gpu": "\u00b2", "reason": "x"}, 1.0),
           Sample({"gpu": "1", "reason": "x"}, 1.0),
           Sample({"node": "n1", "gpu": "1"}, 1.0)]
    assert gpu_cells([good, *bad], "reason") == [good]
    assert gpu_cells([good, bad[3]]) == [good, bad[3]]



def test_natural_order_takes_names_with_digits_int_cannot_read():
    """A series name from the store with '²' ('²'.isdigit() is true, int('²') raises)
    stopped the chart it was in."""
    from clusterpulse.dashboard.ui import _natural

    assert sorted(["gpu 10", "\u00b2", "gpu 2", "3"], key=_natural) == [
        "3", "gpu 2", "gpu 10", "\u00b2"]
