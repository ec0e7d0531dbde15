"""ClusterPulse dashboard: `clusterpulse-dashboard` (or `streamlit run dashboard/app.py`)."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from clusterpulse.dashboard import ui

# Not `pages/`: Streamlit treats a folder of that name beside the main script as a legacy
# multipage app until a session runs st.navigation, so a restarted server whose first
# visitor followed a deep link (an alert's /node?node=...) served the bare page scripts,
# without this navigation, page config or style, to every visitor until someone opened /.
PAGES = Path(__file__).parent / "views"

st.set_page_config(page_title="ClusterPulse", page_icon=":material/monitor_heart:",
                   layout="wide")
ui.readable_text()
nav = st.navigation([
    st.Page(PAGES / "cluster.py", title="Cluster", icon=":material/dns:", default=True),
    st.Page(PAGES / "node.py", title="Node", icon=":material/memory:"),
    st.Page(PAGES / "run.py", title="Run", icon=":material/model_training:"),
    st.Page(PAGES / "alerts.py", title="Alerts", icon=":material/notifications:"),
    st.Page(PAGES / "audit.py", title="Audit", icon=":material/receipt_long:"),
    st.Page(PAGES / "runbooks.py", title="Runbooks", icon=":material/menu_book:"),
])
nav.run()
