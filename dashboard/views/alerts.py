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
# The tables fit the page at a 1024 px window with the sidebar open (564 px; an
# incident's box leaves its table 530): an incident's seven columns took 870 px and the
# history's labels read "node=s…" at 1400 px. Fewer columns (an alert's state and age
# under its name, its first and last time in one), in fixed widths that sum to less
# (stretched on a wider page); a cell's text wraps over up to four lines (Streamlit
# wraps only in rows taller than 4 rem).
ROW_PX = 90
COLUMNS = {"severity": st.column_config.TextColumn("severity", width=70),
           "alert": st.column_config.TextColumn("alert", width=140,
                                                help="its name, state and how long ago "
                                                     "it began"),
           "summary": st.column_config.TextColumn("summary", width=160),
           "seen (UTC)": st.column_config.TextColumn("seen (UTC)", width=95,
                                                     help="first, then last"),
           "labels": st.column_config.TextColumn("labels", width=185),
           "evidence": st.column_config.LinkColumn("evidence", display_text="open",
                                                   width=65),
           "runbook": st.column_config.LinkColumn("runbook", display_text="runbook",
                                                  width=70)}


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
    rows = [{"severity": a.severity,
             "alert": f"{a.name} {a.state}" + (" (inhibited)" if a.inhibited_by else "")
             + (" (silenced)" if a.silenced_by else "") + f", {ago(now - _t(a, now))}",
             "summary": a.annotations.get("summary", ""),
             "evidence": links.evidence(a.labels, ui.keep()),
             "runbook": runbooks.link(a.annotations.get("runbook_url", ""), s.docs_url)}
            for a in group]
    box.dataframe(coloured(pd.DataFrame(rows)), hide_index=True, width="stretch",
                  column_config=COLUMNS, row_height=ROW_PX,
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


def seen(first: pd.Timestamp, last: pd.Timestamp) -> str:
    """When an alert of the history fired, in one cell: "2026-12-05 12:30:01 to
    12:33:20" (the date again only where it changed)."""
    end = last.strftime("%H:%M:%S" if last.date() == first.date() else "%Y-%m-%d %H:%M:%S")
    return f"{first:%Y-%m-%d %H:%M:%S} to {end}"


def _t(alert, now: float) -> float:
    return started(alert.starts_at, now)


@st.fragment(run_every=s.refresh_s)
def live() -> None:
    # each source on its own: Alertmanager down leaves the history drawn, and the
    # banner names the one that is down
    d = data.alerts(s.prometheus_url, s.alertmanager_url, win.seconds, win.end).value
    now = time.time()
    groups = alert_groups(d["active"], now, d["placement"])
    if ui.show_status(d["sources"]["Alertmanager"], "Alertmanager"):
        st.subheader(f"Active ({len(d['active'])} alert(s), {len(groups)} incident(s))")
        if not groups:
            st.success("No active alerts.")
    else:
        st.subheader("Active")
        st.caption("The active alerts come from Alertmanager; the history below, from "
                   "Prometheus.")
    for group in groups:
        incident(group, now)
    st.subheader("History")
    hist = d["history"]
    if ui.show_status(d["sources"]["Prometheus"], "Prometheus") and hist.empty:
        st.caption("No alert fired in this range.")
    elif hist.empty:
        pass  # Prometheus is down and gave nothing yet: its banner says so
    else:
        hist = hist.sort_values("last seen", ascending=False)
        hist["evidence"] = [links.evidence(w, ui.keep()) for w in hist["where"]]
        hist["seen (UTC)"] = [seen(a, b) for a, b in zip(hist["first seen"], hist["last seen"],
                                                          strict=True)]
        hist = hist[["severity", "alert", "evidence", "seen (UTC)", "labels"]]
        st.dataframe(coloured(hist), hide_index=True, width="stretch", column_config=COLUMNS,
                     row_height=ROW_PX)


live()
