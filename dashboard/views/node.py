"""Node: per-GPU time series, throttle reasons over time, XID and ECC events, link health."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from clusterpulse.dashboard import data, explain, links, ui

s = ui.settings()
st.title("Node")
ui.operator()
win = ui.time_window()
node = ui.choose("Node", lambda: data.node_names(s.prometheus_url), "No node reports yet.",
                 "node")
focus = ui.url_param("gpu")  # a link to one GPU (an alert, a heatmap cell): it comes first
# The temperature the charts mark: GpuTemperatureHigh fires above it (throttling near)
THROTTLE_C = 85.0
# chart title -> (y axis title, threshold, its label)
AXES = {"temperature °C": ("temperature (°C)", THROTTLE_C,
                           f"GpuTemperatureHigh: {THROTTLE_C:.0f} °C, throttling near"),
        "utilization %": ("utilization (%)", None, ""),
        "power W": ("power (W)", None, ""), "SM clock MHz": ("SM clock (MHz)", None, ""),
        "memory used GiB": ("memory used (GiB)", None, ""),
        "PCIe rx MB/s": ("PCIe receive (MB/s)", None, ""),
        "NVLink tx MB/s": ("NVLink transmit (MB/s)", None, "")}


def chart(title: str, frame: pd.DataFrame) -> None:
    st.markdown(f"**{title}**")
    if frame.empty:
        st.caption("not reported")
    else:
        y_title, threshold, label = AXES.get(title, (title, None, ""))
        ui.line_chart(frame, y_title, threshold, label)


def throttle_rows(d: dict, gpu: str | None = None) -> pd.DataFrame:
    return pd.DataFrame([{"gpu": lb.get("gpu"), "reason": lb.get("reason"),
                          "from (UTC)": pd.Timestamp(pts[0][0], unit="s"),
                          "until (UTC)": pd.Timestamp(pts[-1][0], unit="s")}
                         for lb, pts in d["throttle"] if gpu is None or lb.get("gpu") == gpu])


# The GPU's line above its charts: chart title -> how its last value reads
NOW = {"temperature °C": "{:.0f} °C", "SM clock MHz": "SM clock {:,.0f} MHz",
       "utilization %": "utilization {:.0f} %", "power W": "{:.0f} W"}


def now_line(d: dict, gpu: str, throttled: pd.DataFrame) -> str:
    """The GPU's latest figures and its throttle reasons in one line of text: it draws
    at once, where the charts below wait for the browser to load and draw them (a
    second or more on a first visit)."""
    column = f"gpu {gpu}"
    figures = []
    for title, fmt in NOW.items():
        frame = d["series"].get(title, pd.DataFrame())
        values = frame[column].dropna() if column in frame else pd.Series(dtype=float)
        if not values.empty:
            figures.append(fmt.format(values.iloc[-1]))
    reasons = sorted(set(throttled["reason"])) if not throttled.empty else []
    return (f"**GPU {gpu} now:** {' · '.join(figures) or 'no figures reported'} · "
            + (f"**throttled in this range:** {', '.join(reasons)}" if reasons
               else "no throttling in this range"))


def gpu_evidence(d: dict, gpu: str) -> None:
    """One GPU's temperature, clocks and throttle reasons together, first on the page:
    the slow GPU's evidence took 6 clicks and ~150 s to gather."""
    st.subheader(f"GPU {gpu}")
    st.caption(f"[All GPUs of {node}]({links.page_url('node', {'node': node}, ui.keep())})")
    rows = throttle_rows(d, gpu)
    st.markdown(now_line(d, gpu, rows))
    column = f"gpu {gpu}"
    cols = st.columns(2)
    for i, title in enumerate(("temperature °C", "SM clock MHz")):
        frame = d["series"].get(title, pd.DataFrame())
        with cols[i]:
            chart(title, frame[[column]] if column in frame else pd.DataFrame())
    if not rows.empty:  # the line above says when there is none
        st.dataframe(rows, hide_index=True, width="stretch")


@st.fragment(run_every=s.refresh_s)
def live() -> None:
    result = data.node(s.prometheus_url, node, win.seconds, win.end)
    if not ui.show_status(result):
        return
    d = result.value
    for gpu, reason in sorted(d["down"].items()):  # first: the rest of the page lacks it
        st.error(f"GPU {gpu} is DOWN — {explain.down_reason(reason)}. It reports nothing "
                 "else, so it is missing from the charts below.")
    if focus is not None and focus not in d["down"]:
        gpu_evidence(d, focus)
        st.subheader("All GPUs")
    cols = st.columns(2)
    for i, (title, frame) in enumerate(d["series"].items()):
        with cols[i % 2]:
            chart(title, frame)
    st.subheader("Throttle reasons over time")
    rows = throttle_rows(d)
    if not rows.empty:
        st.dataframe(rows, hide_index=True, width="stretch")
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
