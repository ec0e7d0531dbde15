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
# The Cluster page is the default, served at `/`; Streamlit still reserves a default
# page's own path, and answers that path with "Page not found". `/cluster` (what one
# types after /node and /run) opens it through a hidden page that switches to it, the
# link's window kept; the reserved path is one nobody types.
CLUSTER = st.Page(PAGES / "cluster.py", title="Cluster", icon=":material/dns:", default=True,
                  url_path="overview")


def _to_cluster() -> None:
    """/cluster: the Cluster page at `/`, with the URL's parameters (its window)."""
    st.switch_page(CLUSTER, query_params=st.query_params.to_dict())


nav = st.navigation([
    CLUSTER,
    st.Page(_to_cluster, title="Cluster", url_path="cluster", visibility="hidden"),
    st.Page(PAGES / "node.py", title="Node", icon=":material/memory:"),
    st.Page(PAGES / "run.py", title="Run", icon=":material/model_training:"),
    st.Page(PAGES / "alerts.py", title="Alerts", icon=":material/notifications:"),
    st.Page(PAGES / "audit.py", title="Audit", icon=":material/receipt_long:"),
])
nav.run()
