"""Dashboard pages with streamlit.testing.v1.AppTest against a real Prometheus that
scrapes real simulated agents (with rank telemetry sent over the agents' real Unix sockets)."""

from __future__ import annotations

import json
import os

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from clusterpulse.agent import protocol
from tests.support.httpstub import answering
from tests.support.pages import kpis
from tests.support.ports import free_port
from tests.support.procs import REPO, RULE_FILES, Prometheus, start_agent_cli, wait_until
from tests.support.ranksock import RankProcess, connect, exchange

pytestmark = pytest.mark.integration
APP = str(REPO / "dashboard" / "app.py")


@pytest.fixture(scope="module")
def prom_with_data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dash")
    # node-b's GPU 3 falls off the bus from the start (it carries no rank)
    lost = tmp / "lost.toml"
    lost.write_text('[[fault]]\nkind = "gpu_lost"\ngpu = 3\nat_s = 0\n')
    agents = [start_agent_cli(tmp, f"node-{c}", gpus=4,
                              extra=["--scenario", str(lost)] if c == "b" else None)
              for c in "ab"]
    rules = list(RULE_FILES)
    prom = Prometheus(tmp, [f"127.0.0.1:{port}" for _, port, _ in agents], rule_files=rules)
    socks = [connect(telemetry[len("unix:"):]) for _, _, telemetry in agents]

    def report(lost: bool = False, **rank0):
        """One step of every rank; `rank0`: more fields for rank 0 (a resume record).
        With `lost`, also a step of run `lost`'s only rank, on node-b's lost GPU 3 (its
        last step time, 0.4 s, reads as healthy): run `llm`'s ranks stay on good GPUs."""
        if lost:
            socks[1].send(protocol.encode({
                "type": "step", "run": "lost", "rank": 0, "local_rank": 0, "gpu": 3,
                "pid": 2, "world_size": 1, "step": 7, "loss": 3.0, "step_seconds": 0.4,
                "compute_seconds": 0.4, "restarts": 0}))
        for i, sock in enumerate(socks):
            for local in (0, 1):
                rank = 2 * i + local
                sock.send(protocol.encode({**(rank0 if rank == 0 else {}),
                    "type": "step", "run": "llm", "rank": rank, "local_rank": local,
                    "gpu": local, "pid": 1, "world_size": 4, "step": 42, "loss": 2.5,
                    "step_seconds": 0.2, "compute_seconds": 0.3 if rank == 3 else 0.15,
                    "sync_wait_seconds": 0.0 if rank == 3 else 0.05, "data_wait_seconds": 0.001,
                    "straggler_score": 2.0 if rank == 3 else 1.0, "restarts": 0,
                    "checkpoint_step": 40, "checkpoint_timestamp_seconds": 1.7e9,
                    "goodput_ratio": 0.9, "comm_bytes": 2e7,
                    "comm_seconds": 0.05 if rank == 3 else 0.1}))

    def ready():
        report()
        return len(prom.query("clusterpulse:run_step")) == 1 and len(
            prom.query("clusterpulse_gpu_up")) == 8 and prom.query(
            "clusterpulse_gpu_down_reason")
    wait_until(ready, 60, "agents scraped and a run recorded")
    report.sockets = [telemetry[len("unix:"):] for _, _, telemetry in agents]  # node-a, -b
    yield prom, report
    prom.stop()
    for proc, _, _ in agents:
        proc.stop()


def app(monkeypatch, prom_url: str, tmp_path) -> AppTest:
    monkeypatch.setenv("CLUSTERPULSE_PROMETHEUS_URL", prom_url)
    monkeypatch.setenv("CLUSTERPULSE_ALERTMANAGER_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("CLUSTERPULSE_AUDIT_LOG", str(tmp_path / "audit.jsonl"))
    at = AppTest.from_file(APP, default_timeout=30)
    at.run()
    return at


def charts(at: AppTest) -> list:
    """The page's Vega-Lite charts: AppTest names them `arrow_vega_lite_chart` up to
    Streamlit 1.5x, the floor pyproject.toml states, and `vega_lite_chart` in 1.67."""
    return list(at.get("vega_lite_chart")) or list(at.get("arrow_vega_lite_chart"))


def test_cluster_page_shows_the_fleet(prom_with_data, monkeypatch, tmp_path):
    prom, _ = prom_with_data
    at = app(monkeypatch, prom.url, tmp_path)
    assert not at.exception, at.exception
    m = kpis(at)
    assert m["Nodes up"] == "2 / 2" and m["Healthy GPUs"] == "7 / 8"  # node-b GPU 3 lost
    assert m["Running jobs"] == "1"
    (job,) = next(d.value for d in at.dataframe if "state" in d.value.columns).itertuples()
    assert (job.run, job.step, job.state) == ("llm", 42, "training")
    # Alertmanager is down in this test: said plainly, the page still renders.
    assert any("Alertmanager" in w.value for w in at.warning)
    assert any("PromQL queries per refresh" in c.value for c in at.caption)


def test_run_page_flags_the_straggler_with_its_evidence(prom_with_data, monkeypatch, tmp_path):
    prom, report = prom_with_data

    def cause_recorded() -> bool:  # the last rule of its group: evaluated after run_step
        report()
        return any(s["metric"].get("rank") == "3" for s in prom.query(
            'clusterpulse:rank_straggler_cause{run="llm"}'))
    wait_until(cause_recorded, 60, "the straggler's cause recorded")
    at = app(monkeypatch, prom.url, tmp_path)
    at.switch_page("views/run.py").run()
    assert not at.exception, at.exception
    assert kpis(at)["Step"] == "42"
    table = at.dataframe[0].value
    top = table.iloc[0]
    assert top["rank"] == "3" and top["flag"] == "STRAGGLER" and top["cause"] == "compute"
    assert top["node"] == "node-b"
    # the gradient all-reduce: bytes over its window; the straggler's window is short
    assert top["bus MB/s"] == pytest.approx(400)
    internal = at.dataframe[1].value.set_index("rank")  # raw seconds, behind an expander
    assert internal.loc["3", "all-reduce s"] == 0.05 and "pid" in internal.columns
    # a rank with no figures yet (a restart) reads a dash, not Streamlit's "None"
    assert at.dataframe[0].proto.placeholder == at.dataframe[1].proto.placeholder == "—"
    assert list(table["bus MB/s"].iloc[1:]) == pytest.approx([200] * 3)
    # the median rank's, once the rule has seen both nodes' scrapes (evaluated between
    # them it is the median of node-b's two ranks: 3e8, a fresh-machine run saw it)
    wait_until(lambda: [float(b["value"][1]) for b in prom.query(
        'clusterpulse:run_comm_bandwidth_bytes_per_second{run="llm"}')] == [2e8], 30,
        "the run's bus bandwidth: the median rank's 2e8 B/s")
    assert any("Rank 3 on node-b" in w.value for w in at.warning)
    # A viewer sees no action form.
    assert any("Viewers are read-only" in i.value for i in at.info)
    assert not at.button or all(b.label != "Request" for b in at.button)


def test_a_past_window_says_which_parts_of_the_run_page_are_now(prom_with_data, monkeypatch,
                                                                tmp_path):
    """The KPI row and straggler table are Prometheus's latest values whatever the
    window: on a custom past window they read as if they were of it."""
    import time as _time

    from clusterpulse.dashboard import links

    prom, _ = prom_with_data
    at = app(monkeypatch, prom.url, tmp_path)
    now = _time.time()
    at.query_params.update({"range": links.CUSTOM, "from": links.fmt_utc(now - 3600),
                            "until": links.fmt_utc(now - 60)})
    at.switch_page("views/run.py").run()
    assert not at.exception, at.exception
    note = [c.value for c in at.caption if "are **now**" in c.value]
    assert note and "the chosen window" in note[0] and links.fmt_utc(now - 60) in note[0]
    at.query_params.clear()


def test_a_firing_alerts_link_opens_a_window_from_its_start_up_to_now(
        prom_with_data, monkeypatch, tmp_path):
    """A notification of a firing alert links `range=custom&from=…` (no until:
    deploy/alertmanager/examples/clusterpulse.tmpl): the page shows the alert's start
    up to now, live (no past-window note), and the window stays open across pages."""
    import time as _time

    from clusterpulse.dashboard import links

    prom, _ = prom_with_data
    at = app(monkeypatch, prom.url, tmp_path)
    since = links.fmt_utc(_time.time() - 1800)
    at.query_params.update({"run": "llm", "range": links.CUSTOM, "from": since})
    at.switch_page("views/run.py").run()
    assert not at.exception, at.exception
    assert at.selectbox(key="range_choice").value == links.CUSTOM
    assert at.text_input(key="range_from").value == since
    assert at.text_input(key="range_until").value == ""  # up to now
    assert not [c.value for c in at.caption if "are **now**" in c.value]
    at.switch_page("views/node.py").run()
    assert not at.exception, at.exception
    assert at.query_params["from"] in (since, [since]) and "until" not in at.query_params
    at.query_params.clear()


def test_a_runbook_link_opens_the_alerts_section_in_the_dashboard(prom_with_data, monkeypatch,
                                                                  tmp_path):
    """An alert's runbook_url (docs/runbooks.md#gpudown) is a repository path no browser
    opens; without published docs it links here (runbooks.link), and a notification can
    too (clusterpulse.tmpl's clusterpulse.runbook_url)."""
    from clusterpulse.dashboard import runbooks

    prom, _ = prom_with_data
    at = app(monkeypatch, prom.url, tmp_path)
    at.query_params["alert"] = "gpudown"
    at.switch_page("views/runbooks.py").run()
    assert not at.exception, at.exception
    assert at.selectbox(key="runbook").value == "gpudown"
    assert any(m.value == runbooks.text("#gpudown") for m in at.markdown), at.markdown
    at.selectbox(key="runbook").select("rankhung").run()  # another section, in the URL
    assert any(m.value == runbooks.text("#rankhung") for m in at.markdown)
    assert at.query_params["alert"] in ("rankhung", ["rankhung"])
    at.query_params["alert"] = "GpuDown"  # the alert's own name, not only its anchor
    at.run()
    assert at.selectbox(key="runbook").value == "gpudown", at.warning
    at.query_params["alert"] = "nosuchalert"
    at.run()
    assert not at.exception, at.exception
    assert any("alert='nosuchalert'" in w.value for w in at.warning), at.warning
    at.query_params.clear()


def test_node_page_shows_per_gpu_series(prom_with_data, monkeypatch, tmp_path):
    prom, _ = prom_with_data
    at = app(monkeypatch, prom.url, tmp_path)
    at.switch_page("views/node.py").run()
    assert not at.exception, at.exception
    assert at.selectbox(key="node").options == ["node-a", "node-b"]


def test_a_link_opens_the_node_page_at_its_gpu_and_the_window_is_kept(
        prom_with_data, monkeypatch, tmp_path):
    """Issue #28: node, GPU, run and window were not in the URL, so an alert could not
    link to its evidence, and the range reset to 15 min on every page change."""
    prom, _ = prom_with_data
    at = app(monkeypatch, prom.url, tmp_path)
    at.query_params.update({"node": "node-b", "gpu": "1", "range": "1h"})
    at.switch_page("views/node.py").run()
    assert not at.exception, at.exception
    assert at.selectbox(key="node").value == "node-b"
    assert at.selectbox(key="range_choice").value == "1 h"
    assert any(h.value == "GPU 1" for h in at.subheader), at.subheader
    # its figures in a line of text above its charts (drawn at once; the charts load)
    (now,) = [m.value for m in at.markdown if m.value.startswith("**GPU 1 now:**")]
    assert "°C · SM clock" in now and "throttl" in now, now
    specs = [json.loads(e.proto.spec) for e in charts(at)]
    titled = [json.dumps(x, ensure_ascii=False) for x in specs]
    assert any('"temperature (°C)"' in x and '"rule"' in x and
               '"time (UTC)"' in x for x in titled), titled[:1]
    at.switch_page("views/run.py").run()  # a page change keeps the window
    assert not at.exception, at.exception
    assert at.selectbox(key="range_choice").value == "1 h"
    assert at.query_params["range"] in ("1h", ["1h"])
    at.selectbox(key="range_choice").select("6 h").run()  # a choice is not undone by the URL
    assert at.selectbox(key="range_choice").value == "6 h"
    assert at.query_params["range"] in ("6h", ["6h"])
    at.query_params["range"] = "fortnight"  # a bad link: said in a line, not a traceback
    at.run()
    assert not at.exception, at.exception
    assert any("range='fortnight'" in w.value for w in at.sidebar.warning), at.sidebar.warning


def test_the_cluster_pages_links_keep_the_window_of_the_link_that_opened_it(
        prom_with_data, monkeypatch, tmp_path):
    """Found in review: the Cluster page (no time picker) opened from a link with
    `range=1h`; a click on a heatmap cell opened the Node page at 15 min."""
    import pyarrow as pa

    prom, _ = prom_with_data
    at = app(monkeypatch, prom.url, tmp_path)
    at.query_params["range"] = "1h"
    at.run()
    assert not at.exception, at.exception
    (heat,) = [e for e in charts(at) if e.proto.data.data]
    urls = pa.ipc.open_stream(heat.proto.data.data).read_all().column("url").to_pylist()
    assert urls and all("range=1h" in u and u.startswith("node?") for u in urls), urls[:3]
    # and the pages the sidebar opens from there (found in the second review)
    at.switch_page("views/alerts.py").run()
    assert not at.exception, at.exception
    assert at.selectbox(key="range_choice").value == "1 h"


# Element kinds whose code a browser loads when the first of them appears, and draws
# with or after the others of its first screen: widgets, tables, charts.
LAZY = {"text_input", "selectbox", "arrow_data_frame", "arrow_vega_lite_chart", "radio",
        "checkbox", "button", "form_submit_button"}


def _drawn(monkeypatch) -> list[tuple[str, str]]:
    """What page runs draw from now on, in the order their deltas are sent: (element
    kind, its text), and ("fetch", name) where the Node page's fetch is called."""
    from streamlit.delta_generator import DeltaGenerator

    from clusterpulse.dashboard import data

    drawn: list[tuple[str, str]] = []
    enqueue, node = DeltaGenerator._enqueue, data.node

    def record(self, delta_type, element_proto, *args, **kwargs):
        drawn.append((delta_type, getattr(element_proto, "body", "")))
        return enqueue(self, delta_type, element_proto, *args, **kwargs)

    def fetch(*args, **kwargs):
        drawn.append(("fetch", "data.node"))
        return node(*args, **kwargs)

    monkeypatch.setattr(DeltaGenerator, "_enqueue", record)
    monkeypatch.setattr(data, "node", fetch)
    return drawn


@pytest.mark.parametrize("page, params, first", [
    ("cluster", {}, "Nodes up"),
    ("run", {"run": "llm", "rank": "3"}, "Step"),
    ("node", {"node": "node-b", "gpu": "1"}, "**GPU 1 now:**")])
def test_each_page_draws_its_first_content_before_widgets_tables_and_charts(
        prom_with_data, monkeypatch, tmp_path, page, params, first):
    """Issue #28 item 8: on a first visit the browser loads the code of each widget,
    table and chart kind when its first element appears; the sign-in form, the selectors
    and the time picker came before the pages' figures and held them back. They are
    drawn after them now, in their places (ui.signin_box); the Node page's line comes
    from one query before the page's 13 (data.gpu_now)."""
    prom, _ = prom_with_data
    at = app(monkeypatch, prom.url, tmp_path)
    at.query_params.update(params)
    drawn = _drawn(monkeypatch)
    at.switch_page(f"views/{page}.py").run()
    assert not at.exception, at.exception
    kinds = [kind for kind, _ in drawn]
    (at_first,) = [i for i, (kind, text) in enumerate(drawn) if text.startswith(first)][:1]
    lazy = [i for i, kind in enumerate(kinds) if kind in LAZY]
    assert lazy and at_first < lazy[0], drawn[:lazy[0] + 1]
    if page == "node":
        assert at_first < kinds.index("fetch"), drawn
    # the widgets are still drawn, in the sidebar's order: sign-in first
    assert "text_input" in kinds[at_first:] and "selectbox" in kinds[at_first:], drawn
    assert at.sidebar.text_input(key="login_name") is not None


def test_a_lost_gpu_is_down_on_the_heatmap_and_the_node_page(prom_with_data, monkeypatch,
                                                              tmp_path):
    """It was a blank heatmap cell under a default (utilization) scale that made the
    overheating GPU look best, and on the Node page `Gennan xnan`, NVLinks 0 / 0,
    health ok, with `gpu_is_lost` and XID 79 unexplained."""
    prom, _ = prom_with_data
    wait_until(lambda: prom.query('clusterpulse:gpu_xid_recent{node="node-b",gpu="3"} > 0'),
               30, "the lost GPU's XID 79 recorded by the rules")
    st.cache_data.clear()  # a page an earlier test read within the cache's 5 s, before it
    at = app(monkeypatch, prom.url, tmp_path)
    assert not at.exception, at.exception
    assert at.selectbox(key="heat_metric").value == "temperature"
    spec = next(e.proto.spec for e in charts(at))
    assert '"DOWN"' in spec and "viridis" in spec
    # GPU columns in numeric order in every layer, and a colour scale fixed round the
    # throttle line (a relative one drew 63 °C as bright as 89 °C)
    layers = json.loads(spec)["layer"]
    assert all(m["encoding"]["x"]["sort"] == [0, 1, 2, 3] for m in layers)
    assert layers[0]["encoding"]["color"]["scale"]["domain"] == [30, 95]
    assert any(c.value.startswith("Colours on a fixed scale, 30-95 °C") for c in at.caption)
    words = [c.value for c in at.caption if c.value.startswith("Temperature (°C) of 7 GPU")]
    assert words and "1 GPU(s) DOWN: node-b GPU 3 (gpu_is_lost)" in words[0], at.caption
    at.switch_page("views/node.py").run()
    at.selectbox(key="node").select("node-b").run()
    assert not at.exception, at.exception
    assert any(e.value.startswith("GPU 3 is DOWN — gpu_is_lost: fell off the bus")
               for e in at.error), at.error
    links = next(d.value for d in at.dataframe if "PCIe" in d.value.columns).set_index("gpu")
    assert links.loc["3", "health"].startswith("DOWN: gpu_is_lost")
    assert "nan" not in " ".join(links["PCIe"]) + " ".join(links["NVLinks up"])
    xid = next(d.value for d in at.dataframe if "xid" in d.value.columns)
    assert "fallen off the bus" in xid.set_index("xid").loc["79", "meaning"]


def test_the_compute_heatmap_marks_a_rank_down_while_its_gpu_is_lost(prom_with_data,
                                                                      monkeypatch, tmp_path):
    """In the demo the banner said rank 2's GPU was DOWN and the table flagged it, while the compute
    heatmap drew its latest cell in the brightest colour (its last step time) as if it
    were healthy. Its cells while its GPU is down are marked DOWN, as on the Cluster
    page's heatmap, and said in words. (Run `lost` has one rank, on node-b's GPU 3.)"""
    import pyarrow as pa

    from clusterpulse.dashboard import ui

    prom, report = prom_with_data

    def down_a_while() -> bool:  # over a few of the page's 4.5 s steps (15 min window)
        report(lost=True)
        return bool(prom.query('count_over_time((clusterpulse:rank_gpu{run="lost"} and on '
                               '(node, gpu) (clusterpulse_gpu_up == 0))[1m:1s]) >= 12'))
    wait_until(down_a_while, 60, "run lost's rank on the lost GPU for 12 s")
    st.cache_data.clear()
    at = app(monkeypatch, prom.url, tmp_path)
    at.query_params.update({"run": "lost"})
    at.switch_page("views/run.py").run()
    assert not at.exception, at.exception
    assert any(e.value.startswith("Rank 0 on node-b: its GPU 3 is DOWN") for e in at.error)
    (heat,) = [e for e in charts(at) if '"rank"' in e.proto.spec]
    spec = json.loads(heat.proto.spec)
    word = next((m for m in spec.get("layer", []) if m["mark"]["type"] == "text"), None)
    assert word and word["mark"]["text"] == "DOWN", spec
    cells = pa.ipc.open_stream(heat.proto.data.data).read_all().to_pandas()
    latest = cells[cells[ui.TIME_TITLE] == cells[ui.TIME_TITLE].iloc[-1]]
    assert list(latest["state"]) == ["GPU down"], cells.tail()  # not its 0.4 s as healthy
    assert (cells["state"] == "GPU down").sum() >= 2, cells  # each column it was down in
    words = [c.value for c in at.caption if "GPU DOWN" in c.value]
    assert words and "rank 0" in words[0], [c.value for c in at.caption]


def test_prometheus_down_shows_a_banner_not_a_traceback(monkeypatch, tmp_path):
    at = app(monkeypatch, f"http://127.0.0.1:{free_port()}", tmp_path)
    assert not at.exception
    assert any("Prometheus is unavailable" in e.value for e in at.error)


@pytest.mark.parametrize("body", [
    '{"status": "success", "data": {}}', '{"status": "success"}',
    '{"status": "success", "data": null}',
    '{"status": "success", "data": {"resultType": "vector", "result": '
    '[{"metric": null, "value": [1, "1"]}]}}',
    '{"status": "success", "data": {"resultType": "vector", "result": '
    '[{"metric": {}, "value": [1, "abc"]}]}}'])
def test_a_store_answering_json_of_another_shape_is_named_not_a_traceback(
        body, monkeypatch, tmp_path):
    """Found by a review: a success of the wrong shape was a KeyError or TypeError on
    every data page, and the last good figures were lost with it."""
    with answering(body) as url:
        at = app(monkeypatch, url, tmp_path)
    assert not at.exception, at.exception
    assert any("is not a Prometheus result (is it a Prometheus API?)" in e.value
               for e in at.error), at.error


@pytest.mark.parametrize("body", ['[{}]', '{"a": 1}', 'null', '"x"',
                                  '[{"labels": null, "status": {"state": "active"}}]',
                                  '[{"labels": {"alertname": "X"}, "status": {}}]'])
def test_an_alertmanager_answering_json_of_another_shape_is_named_not_a_traceback(
        body, prom_with_data, monkeypatch, tmp_path):
    """Found by a review: KeyError 'labels' and the like on the Cluster and Alerts pages."""
    prom, _ = prom_with_data
    with answering(body) as url:
        monkeypatch.setenv("CLUSTERPULSE_ALERTMANAGER_URL", url)
        monkeypatch.setenv("CLUSTERPULSE_PROMETHEUS_URL", prom.url)
        monkeypatch.setenv("CLUSTERPULSE_AUDIT_LOG", str(tmp_path / "audit.jsonl"))
        st.cache_data.clear()
        at = AppTest.from_file(APP, default_timeout=30)
        at.run()
        assert not at.exception, at.exception
        assert any("is not a list of alerts" in w.value for w in at.warning), at.warning
        at.switch_page("views/alerts.py").run()
        assert not at.exception, at.exception


def test_a_damaged_audit_record_leaves_the_runs_incidents_drawn(prom_with_data, monkeypatch,
                                                                 tmp_path):
    """A review found the Audit page's filter missing from the Run page's timeline: one
    record with "ts": "yesterday" made the incidents panel stale, its banner blaming
    Prometheus."""
    prom, report = prom_with_data
    report()
    from clusterpulse.agent.audit import AuditLog

    log = tmp_path / "audit.jsonl"
    AuditLog(log).write("ops@dashboard", "checkpoint-restart", "slow", "accepted", run="llm")
    with log.open("a") as f:
        f.write('{"ts": "yesterday", "run": "llm", "outcome": "accepted"}\n')
    at = app(monkeypatch, prom.url, tmp_path)
    at.switch_page("views/run.py").run()
    assert not at.exception, at.exception
    assert not [e.value for e in at.error if "unavailable" in e.value], at.error


def test_an_alert_without_annotations_is_drawn(prom_with_data, monkeypatch, tmp_path):
    """`annotations: null` passed the client and failed later on the page."""
    prom, _ = prom_with_data
    body = ('[{"labels": {"alertname": "GpuDown", "node": "node-b", "gpu": "3", '
            '"severity": "critical"}, "annotations": null, "status": {"state": "active"}, '
            '"startsAt": "2026-12-06T10:00:00Z"}]')
    with answering(body) as url:
        monkeypatch.setenv("CLUSTERPULSE_ALERTMANAGER_URL", url)
        st.cache_data.clear()
        monkeypatch.setenv("CLUSTERPULSE_PROMETHEUS_URL", prom.url)
        monkeypatch.setenv("CLUSTERPULSE_AUDIT_LOG", str(tmp_path / "audit.jsonl"))
        at = AppTest.from_file(APP, default_timeout=30)
        at.run()
        assert not at.exception, at.exception
        at.switch_page("views/alerts.py").run()
        assert not at.exception, at.exception
        assert "GpuDown" in " ".join(str(m.value) for m in at.markdown)


@pytest.mark.parametrize("refresh", ["soon", "0", "inf"])
def test_a_bad_setting_is_named_on_the_page_not_a_traceback(refresh, monkeypatch, tmp_path):
    monkeypatch.setenv("CLUSTERPULSE_REFRESH_S", refresh)
    at = app(monkeypatch, f"http://127.0.0.1:{free_port()}", tmp_path)
    assert not at.exception, at.exception
    assert any(f"CLUSTERPULSE_REFRESH_S={refresh!r}" in e.value for e in at.error), at.error


@pytest.mark.parametrize("var", ["CLUSTERPULSE_PROMETHEUS_PASSWORD_FILE",
                                 "CLUSTERPULSE_ALERTMANAGER_PASSWORD_FILE"])
def test_a_password_file_that_cannot_be_read_is_named_on_the_page(var, monkeypatch, tmp_path):
    """It was sent as no credentials: a store or Alertmanager behind basic auth
    answered 401 on every panel, and the page asked whether it was a Prometheus API."""
    missing = tmp_path / "no-such-password"
    monkeypatch.setenv(var, str(missing))
    at = app(monkeypatch, f"http://127.0.0.1:{free_port()}", tmp_path)
    assert not at.exception, at.exception
    assert [e.value for e in at.error] == [
        f"Dashboard setting: {var}: cannot read the password file {missing}: "
        "No such file or directory"]


def test_operator_sign_in_uses_hashed_credentials(prom_with_data, monkeypatch, tmp_path):
    from clusterpulse.dashboard.auth import hash_password

    prom, _ = prom_with_data
    ops = tmp_path / "operators.toml"
    ops.write_text(f'[operators]\nalice = "{hash_password("correct horse")}"\n')
    monkeypatch.setenv("CLUSTERPULSE_OPERATORS_FILE", str(ops))
    at = app(monkeypatch, prom.url, tmp_path)
    at.text_input(key="login_name").input("alice")
    at.text_input(key="login_password").input("wrong")
    at.sidebar.button[0].click().run()
    assert any("Wrong operator name or password" in e.value for e in at.error)
    at.text_input(key="login_name").input("alice")
    at.text_input(key="login_password").input("correct horse")
    at.sidebar.button[0].click().run()
    assert at.session_state["operator"] == "alice"
    audit = (tmp_path / "audit.jsonl").read_text()
    assert '"outcome": "refused"' in audit and '"outcome": "ok"' in audit


def sign_in(monkeypatch, prom_url: str, tmp_path) -> AppTest:
    from clusterpulse.dashboard.auth import hash_password

    ops = tmp_path / "operators.toml"
    ops.write_text(f'[operators]\nalice = "{hash_password("correct horse")}"\n')
    monkeypatch.setenv("CLUSTERPULSE_OPERATORS_FILE", str(ops))
    at = app(monkeypatch, prom_url, tmp_path)
    at.text_input(key="login_name").input("alice")
    at.text_input(key="login_password").input("correct horse")
    at.sidebar.button[0].click().run()
    assert at.session_state["operator"] == "alice"
    return at


def test_a_request_with_an_unreadable_agent_token_names_the_file(prom_with_data, monkeypatch,
                                                                  tmp_path):
    """An agent token file the dashboard cannot read was taken as no token: the request
    was refused for a token "not configured", naming neither the file nor why."""
    prom, _ = prom_with_data
    token = tmp_path / "agent-token"
    token.write_bytes(b"tok\xff\xfe" + b"a" * 40)
    monkeypatch.setenv("CLUSTERPULSE_AGENT_TOKEN_FILE", str(token))
    at = sign_in(monkeypatch, prom.url, tmp_path)
    at.switch_page("views/run.py").run()
    at.text_input(key="reason").input("rank 3 is slow")
    at.checkbox(key="confirm").check()
    at.button(key="FormSubmitter:action-Request").click().run()
    assert not at.exception, at.exception
    assert any(e.value.startswith("Not sent: CLUSTERPULSE_AGENT_TOKEN_FILE: cannot read the "
                                  f"token file {token}: 'utf-8' codec") for e in at.error), \
        at.error


def test_a_request_clears_the_form_and_its_progress_names_the_step_resumed_from(
        prom_with_data, monkeypatch, tmp_path):
    """After a restart was requested the form kept the reason and the ticked
    confirmation: one more click restarted the run again without confirming. The step
    the run resumed from was never shown. (These agents run without a control token,
    so the request fails at each agent: audited, nothing restarts.)"""
    import json
    import time

    at = _restart_form(prom_with_data, monkeypatch, tmp_path)
    at.button(key="FormSubmitter:action-Request").click().run()
    assert not at.exception, at.exception

    def requests_audited() -> list[dict]:
        return [r for r in map(json.loads, (tmp_path / "audit.jsonl").read_text().splitlines())
                if r["action"] == "checkpoint-restart"]
    assert [(r["run"], r["outcome"]) for r in requests_audited()] == [("llm", "failed")]
    assert at.checkbox(key="confirm").value is False and at.text_input(key="reason").value == ""
    assert any("checkpoint-restart requested at" in c.value and "rank 3 is slow" in c.value
               for c in at.caption), at.caption
    at.button(key="FormSubmitter:action-Request").click().run()  # the accidental click
    assert any("Tick the confirmation first" in e.value for e in at.error), at.error
    assert len(requests_audited()) == 1
    # the trainer's resume record, newer than the request, is shown with the progress
    _, report = prom_with_data
    resumed = {"resume_step": 40, "resume_steps_recomputed": 2,
               "resume_timestamp_seconds": time.time()}

    def shown() -> bool:
        report(**resumed)
        at.run()
        return any("Resumed from step 40 (2 steps recomputed)" in x.value for x in at.success)
    wait_until(shown, 60, "the resume record on the Run page")
    assert not at.exception, at.exception


def _restart_form(prom_with_data, monkeypatch, tmp_path):
    """The Run page of a signed-in operator, its restart form filled in and confirmed;
    the agents' token is not theirs (a request fails at each agent: nothing restarts)."""
    prom, _ = prom_with_data
    token = tmp_path / "agent-token"
    token.write_text("not-the-agents-token\n")
    monkeypatch.setenv("CLUSTERPULSE_AGENT_TOKEN_FILE", str(token))
    at = sign_in(monkeypatch, prom.url, tmp_path)
    at.switch_page("views/run.py").run()
    assert not at.exception, at.exception
    at.text_input(key="reason").input("rank 3 is slow")
    at.checkbox(key="confirm").check()
    return at


def test_a_restart_seen_completed_stays_completed_when_its_agent_forgets_it(
        prom_with_data, monkeypatch, tmp_path):
    """Found in review: the Run page refreshed the restart's progress every 2 s from the
    request's first answers; once node-a's agent forgot the completed command (restarted
    since, or its book of finished commands rolled over: 404), it turned "lost" and the
    page said "Some nodes failed". Each refresh starts from the last one's states, and a
    command seen final is not asked about again."""
    from clusterpulse.dashboard import actions

    answers = [(200, {"state": "completed", "detail": "all ranks resumed"}),
               (404, {"error": "no command 'node-a-1765100000-1'"})]
    asked: list[str] = []

    def agent(path: str) -> tuple[int, str]:
        status, body = answers[min(len(asked), 1)]
        asked.append(path)
        return status, json.dumps(body)

    prom, _ = prom_with_data
    token = "agent-token-0123456789abcdef"
    (tmp_path / "agent-token").write_text(token + "\n")
    monkeypatch.setenv("CLUSTERPULSE_AGENT_TOKEN_FILE", str(tmp_path / "agent-token"))
    with answering(agent) as agent_url:
        at = app(monkeypatch, prom.url, tmp_path)
        at.session_state["last_action"] = {
            "run": "llm", "at": 0.0, "action": "restart", "reason": "hung",
            "results": [actions.NodeResult(
                "node-a", agent_url, True,
                "node-a-1765100000-1", "pending",
                token_id=actions.token_id(actions.token_for(token, "node-a")))]}
        at.switch_page("views/run.py").run()
        assert not at.exception, at.exception
        assert any(x.value == "All ranks resumed." for x in at.success), at.success
        at.run()  # the next refresh: the agent answers 404 now
        assert not at.exception, at.exception
        assert any(x.value == "All ranks resumed." for x in at.success), at.success
        assert not any("Some nodes failed" in e.value for e in at.error), at.error
        assert asked == ["/v1/commands/node-a-1765100000-1"]  # and not asked again


def test_a_gpu_whose_readings_fail_is_named_on_the_node_page(monkeypatch, tmp_path):
    """GpuReadingsFailing's GPU is up, so the Node page showed it healthy, its
    temperature chart without it, and nothing said why (the alert, after 5 minutes, was
    the only word of it). A real agent over the fake NVML whose GPU 0 answers its
    temperature with NVML_ERROR_UNKNOWN, scraped by a real Prometheus."""
    proc, port, _ = start_agent_cli(tmp_path, "flaky", module="tests.fakes.nvml_agent",
                                    extra=["--failing-call", "nvmlDeviceGetTemperature"])
    prom = Prometheus(tmp_path, [f"127.0.0.1:{port}"])
    try:
        # two scrapes: what the page's share (an increase) needs
        wait_until(lambda: prom.query('count_over_time(clusterpulse_gpu_reading_failing'
                                      '{node="flaky"}[1m]) >= 2'), 30, "two scrapes")
        st.cache_data.clear()
        at = app(monkeypatch, prom.url, tmp_path)
        at.switch_page("views/node.py").run()
        assert not at.exception, at.exception
        assert at.selectbox(key="node").value == "flaky"
        (line,) = [w.value for w in at.warning if "NVML fails" in w.value]
        assert line.startswith("GPU 0: NVML fails its readings in 100% of the agent's "
                               "cycles of the last 10 minutes (temperature_celsius), and in "
                               "the latest cycle (temperature_celsius)."), line
        assert not any(e.value.startswith("GPU 0 is DOWN") for e in at.error), at.error
    finally:
        prom.stop()
        proc.stop()


# The tests below add runs named z… (after "llm" and "lost": the pages' default run is the
# first by name) whose exited ranks the agents keep for their grace: they run last.
def test_a_request_is_refused_when_its_operator_was_removed_before_the_click(
        prom_with_data, monkeypatch, tmp_path):
    """A review found the Run page's button acting as the operator of the page drawn
    before the click: one removed from the operators file since could still restart."""
    at = _restart_form(prom_with_data, monkeypatch, tmp_path)
    ops = tmp_path / "operators.toml"
    before = ops.stat().st_mtime_ns
    ops.write_text("[operators]\n")  # the administrator removes alice
    os.utime(ops, ns=(before + 10**6, before + 10**6))
    at.button(key="FormSubmitter:action-Request").click().run()
    assert not at.exception, at.exception
    assert any(e.value.startswith("Not sent: you are not signed in") for e in at.error), \
        at.error
    audit = (tmp_path / "audit.jsonl").read_text()
    assert '"checkpoint-restart"' not in audit and "operator" not in at.session_state


def test_a_relaunched_rank_shows_its_live_process_not_the_exited_one(prom_with_data):
    """A relaunch renumbered the ranks: rank 0's old process on node-a exited, the new
    rank 0 steps on node-b. The old one's series stay exported for the agent's grace
    (5 min), and the straggler table showed two rows for rank 0, the dead one's
    compute time and growing heartbeat age among the live figures."""
    from clusterpulse.dashboard import data
    from clusterpulse.dashboard.incidents import rank_tables

    prom, report = prom_with_data
    node_a, node_b = report.sockets
    run = {"type": "step", "run": "zrelaunch", "rank": 0, "local_rank": 0, "world_size": 1}
    old = RankProcess(node_a, [{**run, "gpu": 1, "step": 100, "compute_seconds": 2.5}])
    sel = 'run="zrelaunch",rank="0"'
    wait_until(lambda: prom.query(f'clusterpulse_trainer_compute_seconds{{{sel}}}'), 30,
               "the old process's rank 0 scraped")
    old.stop()
    new = connect(node_b)
    step = [101]

    def relaunched() -> bool:
        exchange(new, **{**run, "gpu": 0, "step": step[0], "compute_seconds": 0.1})
        step[0] += 1
        return bool(prom.query(f'clusterpulse_trainer_process_alive{{{sel},node="node-a"}}'
                               " == 0") and prom.query(
            f'clusterpulse_trainer_compute_seconds{{{sel},node="node-b"}}'))
    wait_until(relaunched, 30, "the old process exited and the new one scraped")
    st.cache_data.clear()
    d = data.run(prom.url, "zrelaunch", 300).value
    assert [tuple(r) for r in d["ranks"][["rank", "node"]].itertuples(index=False)] == [
        ("0", "node-b")]
    assert d["per_rank"]["compute s"] == {"0": 0.1}
    assert d["per_rank"]["step"]["0"] >= 101
    table, _ = rank_tables(d)
    assert list(table["node"]) == ["node-b"] and list(table["compute ms"]) == [100.0]
    new.close()


def _jobs_table(report, prom, monkeypatch, tmp_path):
    """The Cluster page drawn now: (the app, its Jobs table, run -> state)."""
    report()
    st.cache_data.clear()
    at = app(monkeypatch, prom.url, tmp_path)
    assert not at.exception, at.exception
    jobs = next(d.value for d in at.dataframe if "state" in d.value.columns)
    return at, jobs, dict(zip(jobs["run"], jobs["state"], strict=True))


def test_a_finished_run_is_not_a_running_job(prom_with_data, monkeypatch, tmp_path):
    """A run that finished cleanly (its exit event, then its process ended) read
    "training" and counted in "Running jobs" for the agent's 5-minute grace."""
    prom, report = prom_with_data
    RankProcess(report.sockets[0], [
        {"type": "step", "run": "zdone", "rank": 0, "local_rank": 0, "gpu": 0, "step": 500},
        {"type": "event", "event": "exit", "outcome": "finished", "run": "zdone", "rank": 0,
         "step": 500}]).stop()
    wait_until(lambda: prom.query('clusterpulse_trainer_phase{run="zdone",phase="exited"}')
               and prom.query('clusterpulse_trainer_step{run="zdone"}'), 30,
               "the finished run's last series scraped")
    at, jobs, states = _jobs_table(report, prom, monkeypatch, tmp_path)
    assert states["zdone"] == "exited" and states["llm"] == "training", states
    running = sum(state != "exited" for state in states.values())
    assert kpis(at)["Running jobs"] == str(running)
    assert jobs.set_index("run").loc["zdone", "step"] == 500
    # its Run page: the last step its ranks reported, as the table says (a review saw
    # "Step 0", "Loss nan", "Goodput 0 %" there); listed once the rules have recorded it
    wait_until(lambda: prom.query('clusterpulse:run_step{run="zdone"}'), 30,
               "the finished run recorded")
    st.cache_data.clear()
    at.switch_page("views/run.py")
    at.query_params["run"] = "zdone"
    at.run()
    assert not at.exception, at.exception
    figures = kpis(at)
    assert figures["Step"] == "500" and figures["Goodput"] == "\u2014", figures


def test_a_run_whose_processes_were_killed_is_restarting_not_exited(prom_with_data,
                                                                      monkeypatch, tmp_path):
    """Found in review: after a hard restart (its ranks SIGKILLed) or a torchrun
    relaunch, the old ranks' process_alive is 0 with no exit event (phase not exited),
    and until the new processes registered the Jobs table said "exited" and "Running
    jobs" left the run out. A run is exited only when its ranks left cleanly (the
    finished run above stays exited); one whose process is gone is restarting."""
    prom, report = prom_with_data
    RankProcess(report.sockets[1], [  # SIGKILLed: no exit event
        {"type": "step", "run": "zkilled", "rank": 0, "local_rank": 0, "gpu": 1,
         "step": 300}]).stop()
    wait_until(lambda: prom.query('clusterpulse_trainer_process_alive{run="zkilled"} == 0')
               and prom.query('clusterpulse_trainer_step{run="zkilled"}'), 30,
               "the killed rank's last series scraped")
    at, _, states = _jobs_table(report, prom, monkeypatch, tmp_path)
    assert states["zkilled"] == "restarting (process gone)", states
    assert states.get("zdone", "exited") == "exited", states
    assert kpis(at)["Running jobs"] == str(sum(s != "exited" for s in states.values()))


def test_alertmanager_down_leaves_the_alert_history_drawn(prom_with_data, monkeypatch,
                                                          tmp_path):
    """Alertmanager and Prometheus were fetched as one: with Alertmanager down the
    Alerts page showed nothing, not even the history Prometheus still had."""
    prom, _ = prom_with_data
    wait_until(lambda: prom.query('ALERTS{alertstate="firing",alertname="GpuDown"}'), 60,
               "node-b's lost GPU paged")
    st.cache_data.clear()
    at = app(monkeypatch, prom.url, tmp_path)  # Alertmanager: a port nobody listens on
    at.switch_page("views/alerts.py").run()
    assert not at.exception, at.exception
    errors = [e.value for e in at.error]
    assert any(e.startswith("Alertmanager is unavailable") for e in errors), errors
    assert not any(e.startswith("Prometheus") for e in errors), errors
    (hist,) = [d.value for d in at.dataframe]
    assert "GpuDown" in set(hist["alert"]), hist
