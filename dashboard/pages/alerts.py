"""Alerts: active alerts from Alertmanager (with silenced/inhibited state) and the
recent history from Prometheus's ALERTS series."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from clusterpulse.dashboard import data, ui

s = ui.settings()
st.title("Alerts")
ui.operator()
range_s = ui.time_range()


@st.fragment(run_every=s.refresh_s)
def live() -> None:
    result = data.alerts(s.prometheus_url, s.alertmanager_url, range_s)
    if not ui.show_status(result, "Alertmanager or Prometheus"):
        return
    d = result.value
    rows = [{"alert": a.name, "severity": a.severity,
             "state": a.state + (" (inhibited)" if a.inhibited_by else "")
             + (" (silenced)" if a.silenced_by else ""),
             "node": a.labels.get("node", ""), "run": a.labels.get("run", ""),
             "rank": a.labels.get("rank", ""), "gpu": a.labels.get("gpu", ""),
             "summary": a.annotations.get("summary", ""), "since": a.starts_at[:19],
             "runbook": a.annotations.get("runbook_url", "")} for a in d["active"]]
    st.subheader(f"Active ({len(rows)})")
    if rows:
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
    else:
        st.success("No active alerts.")
    st.subheader("History")
    if d["history"].empty:
        st.caption("No alert fired in this range.")
    else:
        st.dataframe(d["history"].sort_values("last seen", ascending=False), hide_index=True,
                     width="stretch")


live()
