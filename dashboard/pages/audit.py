"""Audit: every action taken, by whom, why, and how it ended."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from clusterpulse.dashboard import ui

st.title("Audit")
operator = ui.operator()
records = ui.audit_log().read(limit=2000)
ui.audit_chain_status()
if operator is None:  # viewers: nothing about refused sign-ins or authentication
    records = [r for r in records
               if not (r.get("outcome") == "refused" and r.get("action") in (
                   "sign-in", "authenticate", "webhook"))]
if not records:
    st.info("No action has been taken yet.")
else:
    frame = pd.DataFrame(records[::-1])
    frame["ts"] = pd.to_datetime(frame["ts"], unit="s")
    first = [c for c in ("ts", "who", "action", "why", "outcome", "run", "source") if c in frame]
    st.dataframe(frame[first + [c for c in frame.columns if c not in first]],
                 hide_index=True, width="stretch")
