"""Alerts: active alerts from Alertmanager grouped by incident (root first, severity
coloured, each with its evidence and runbook), and the recent history from
Prometheus's ALERTS series."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from clusterpulse.dashboard import data, links, runbooks, ui
from clusterpulse.dashboard.incidents import ago, alert_groups, started

s = ui.settings()
st.title("Alerts")
ui.operator()
win = ui.time_window()
# colour and word together: readable without colour vision, and in grey
SEVERITY_STYLE = {"critical": "background-color: #b71c1c; color: white",
                  "warning": "background-color: #ffb300; color: black",
                  "info": "background-color: #1565c0; color: white"}
ICON = {"critical": ":material/error:", "warning": ":material/warning:"}
COLUMNS = {"evidence": st.column_config.LinkColumn("evidence", display_text="open"),
           "runbook": st.column_config.LinkColumn("runbook", display_text="runbook")}


def coloured(frame: pd.DataFrame):
    return frame.style.map(lambda v: SEVERITY_STYLE.get(v, ""), subset=["severity"])


def incident(group: list, now: float) -> None:
    root = group[0]
    where = ", ".join(f"{k} {root.labels[k]}" for k in ("run", "node", "rank", "gpu")
                      if root.labels.get(k))
    box = st.container(border=True)
    box.markdown(f"**{root.name}** on {where or 'the cluster'} — since "
                 f"{ago(now - min(_t(a, now) for a in group))}"
                 + (f" · with {', '.join(a.name for a in group[1:])}" if group[1:] else ""))
    rows = [{"severity": a.severity, "alert": a.name,
             "state": a.state + (" (inhibited)" if a.inhibited_by else "")
             + (" (silenced)" if a.silenced_by else ""),
             "summary": a.annotations.get("summary", ""), "since": ago(now - _t(a, now)),
             "evidence": links.evidence(a.labels, ui.keep()),
             "runbook": runbooks.link(a.annotations.get("runbook_url", ""), s.docs_url)}
            for a in group]
    box.dataframe(coloured(pd.DataFrame(rows)), hide_index=True, width="stretch",
                  column_config=COLUMNS,
                  column_order=[c for c in rows[0]
                                if c != "runbook" or any(r["runbook"] for r in rows)])
    if not s.docs_url:
        for url in dict.fromkeys(a.annotations.get("runbook_url", "") for a in group):
            body = runbooks.text(url)
            if body:
                name = next(a.name for a in group
                            if a.annotations.get("runbook_url", "") == url)
                with box.expander(f"Runbook: {name}"):
                    st.markdown(body)


def _t(alert, now: float) -> float:
    return started(alert.starts_at, now)


@st.fragment(run_every=s.refresh_s)
def live() -> None:
    result = data.alerts(s.prometheus_url, s.alertmanager_url, win.seconds, win.end)
    if not ui.show_status(result, "Alertmanager or Prometheus"):
        return
    d = result.value
    now = time.time()
    groups = alert_groups(d["active"], now)
    st.subheader(f"Active ({len(d['active'])} alert(s), {len(groups)} incident(s))")
    if not groups:
        st.success("No active alerts.")
    for group in groups:
        incident(group, now)
    st.subheader("History")
    hist = d["history"]
    if hist.empty:
        st.caption("No alert fired in this range.")
    else:
        hist = hist.sort_values("last seen", ascending=False)
        hist["evidence"] = [links.evidence(w, ui.keep()) for w in hist["where"]]
        for col in ("first seen", "last seen"):
            hist[col] = hist[col].dt.floor("s")
        hist = hist.drop(columns="where").rename(columns={
            "first seen": "first seen (UTC)", "last seen": "last seen (UTC)"})
        hist = hist[["severity", "alert", "evidence", "first seen (UTC)", "last seen (UTC)",
                     "labels"]]
        st.dataframe(coloured(hist), hide_index=True, width="stretch", column_config=COLUMNS)


live()
