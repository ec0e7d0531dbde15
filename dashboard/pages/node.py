"""Node: per-GPU time series, throttle reasons over time, XID and ECC events, link health."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from clusterpulse.dashboard import data, explain, ui

s = ui.settings()
st.title("Node")
ui.operator()
range_s = ui.time_range()
node = ui.choose("Node", lambda: data.node_names(s.prometheus_url), "No node reports yet.")


@st.fragment(run_every=s.refresh_s)
def live() -> None:
    result = data.node(s.prometheus_url, node, range_s)
    if not ui.show_status(result):
        return
    d = result.value
    for gpu, reason in sorted(d["down"].items()):  # first: the rest of the page lacks it
        st.error(f"GPU {gpu} is DOWN — {explain.down_reason(reason)}. It reports nothing "
                 "else, so it is missing from the charts below.")
    cols = st.columns(2)
    for i, (title, frame) in enumerate(d["series"].items()):
        with cols[i % 2]:
            st.markdown(f"**{title}**")
            if frame.empty:
                st.caption("not reported")
            else:
                st.line_chart(frame, height=180)
    st.subheader("Throttle reasons over time")
    rows = [{"gpu": lb.get("gpu"), "reason": lb.get("reason"),
             "from": pd.Timestamp(pts[0][0], unit="s"), "until": pd.Timestamp(pts[-1][0], unit="s")}
            for lb, pts in d["throttle"]]
    if rows:
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
    else:
        st.caption("No throttling in this range.")
    c1, c2 = st.columns(2)
    # statements, not `a if c else b` expressions: Streamlit's magic renders an
    # expression's value, and that of st.dataframe/st.caption is st itself (its help)
    for col, title, frame in ((c1, "XID errors (last 10 min)", d["xid"]),
                              (c2, "ECC error counters", d["ecc"])):
        col.markdown(f"**{title}**")
        if frame.empty:
            col.caption("none")
        else:
            col.dataframe(frame, hide_index=True)
    st.subheader("Links")
    st.markdown("**GPU interconnect** (PCIe as trained against its maximum, NVLinks)")
    links = d["gpu_links"]
    if links.empty:
        st.caption("not reported")
    else:
        bad = links[links["health"] != "ok"]
        for _, r in bad.iterrows():
            st.warning(f"GPU {r['gpu']}: {r['health']}")
        st.dataframe(links, hide_index=True, width="stretch")
    st.markdown("**Network ports** (InfiniBand/RoCE and Ethernet, from sysfs)")
    if d["nics"].empty:
        st.caption("No physical network ports reported.")
    else:
        st.dataframe(d["nics"].round(2), hide_index=True, width="stretch")


live()
