"""Runbooks: what to do about each alert, the section of docs/runbooks.md its
`runbook_url` names, opened from the Alerts page or a notification
(`runbooks?alert=<anchor>`). Without published docs the annotation was a repository
path no browser could open."""

from __future__ import annotations

import streamlit as st

from clusterpulse.dashboard import runbooks

st.title("Runbooks")
titles = runbooks.titles()
if not titles:
    st.warning(f"The runbooks are not installed beside the dashboard ({runbooks.RUNBOOKS}): "
               "set CLUSTERPULSE_DOCS_URL to where docs/ is published, and the alerts link "
               "there.")
    st.stop()
keys = list(titles)
# an anchor is lower case ("gpudown"); a link may name the alert as it is ("GpuDown")
wanted = st.query_params.get("alert", "").lower()
if wanted and wanted not in titles:
    st.warning(f"No runbook for alert={wanted!r}: pick one below.")
if "runbook" not in st.session_state or (wanted in titles and wanted != st.session_state.get(
        "runbook_url")):  # a link followed: its section, not the last one picked
    st.session_state["runbook"] = wanted if wanted in titles else keys[0]
choice = st.selectbox("Alert", keys, format_func=titles.__getitem__, key="runbook")
st.session_state["runbook_url"] = st.query_params["alert"] = choice
st.markdown(runbooks.text(f"#{choice}") or "")
