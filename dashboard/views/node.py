"""Node: per-GPU time series, throttle reasons over time, XID and ECC events, link health."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from clusterpulse.agent.validate import is_digits
from clusterpulse.dashboard import data, explain, links, ui

s = ui.settings()
st.title("Node")
signin = ui.signin_box()
later: list = []  # widgets drawn after the first content (ui.signin_box)
win = ui.time_window(later)
node = ui.choose("Node", lambda: data.node_names(s.prometheus_url), "No node reports yet.",
                 "node", later)
focus = ui.url_param("gpu")  # a link to one GPU (an alert, a heatmap cell): it comes first
if focus is not None and not is_digits(focus):  # it goes into PromQL (data.gpu_now)
    st.warning(f"GPU {focus!r} from the link is not a GPU index; showing all GPUs.")
    focus = None
# The temperature the charts mark: GpuTemperatureHigh fires above it (throttling near)
THROTTLE_C = data.GPU_THROTTLE_C
# chart title -> (y axis title, threshold, its label)
AXES = {"temperature °C": ("temperature (°C)", THROTTLE_C,
                           f"GpuTemperatureHigh: {THROTTLE_C:.0f} °C, throttling near"),
        "utilization %": ("utilization (%)", None, ""),
        "power W": ("power (W)", None, ""), "SM clock MHz": ("SM clock (MHz)", None, ""),
        "memory used GiB": ("memory used (GiB)", None, ""),
        "PCIe rx MB/s": ("PCIe receive (MB/s)", None, ""),
        "NVLink tx MB/s": ("NVLink transmit (MB/s)", None, "")}


# The interconnect table fits the page at a 1024 px window with the sidebar open (564
# px), where it scrolled 71 px sideways and "health" was out of view: shorter headers
# (the window in their help), fixed widths that sum to less (stretched on a wider page),
# PCIe's and health's text wrapping over up to three lines (Streamlit wraps only in
# rows taller than 4 rem).
LINK_ROW_PX = 68
# XID and ECC tables: narrow figures, the XID's meaning wrapping (under 564 px in all)
EVENT_COLUMNS = {
    "gpu": st.column_config.TextColumn("gpu", width=45),
    "xid": st.column_config.TextColumn("xid", width=45),
    "kind": st.column_config.TextColumn("kind", width=120),
    "count": st.column_config.NumberColumn("count", width=60, format="%.0f"),
    "meaning": st.column_config.TextColumn("meaning", width=300),
}
LINK_COLUMNS = {
    "gpu": st.column_config.TextColumn("gpu", width=45),
    "PCIe": st.column_config.TextColumn("PCIe", width=125,
                                        help="as trained (its maximum)"),
    "NVLinks up": st.column_config.TextColumn("NVLinks up", width=85),
    "NVLink errors (10 min)": st.column_config.NumberColumn(
        "NVLink errors", width=95, format="%.0f", help="in the last 10 min"),
    "PCIe replays (10 min)": st.column_config.NumberColumn(
        "PCIe replays", width=95, format="%.0f", help="in the last 10 min"),
    "health": st.column_config.TextColumn("health", width=95),
}


def chart(title: str, frame: pd.DataFrame) -> None:
    st.markdown(f"**{title}**")
    if frame.empty:
        st.caption("not reported")
    else:
        y_title, threshold, label = AXES.get(title, (title, None, ""))
        ui.line_chart(frame, y_title, threshold, label)


def throttle_rows(d: dict, gpu: str | None = None) -> pd.DataFrame:
    return data.throttle_episodes(d["throttle"], d["step"], gpu)


# The GPU's line above its charts: chart title -> how its last value reads
NOW = {"temperature °C": "{:.0f} °C", "SM clock MHz": "SM clock {:,.0f} MHz",
       "utilization %": "utilization {:.0f} %", "power W": "{:.0f} W"}


def now_line(gpu: str, figures: dict[str, float], reasons: list[str]) -> str:
    """The GPU's latest figures and its throttle reasons in one line of text: it draws
    at once, where the charts below wait for the browser to load and draw them (a
    second or more on a first visit)."""
    shown = [fmt.format(figures[title]) for title, fmt in NOW.items() if title in figures]
    return (f"**GPU {gpu} now:** {' · '.join(shown) or 'no figures reported'} · "
            + (f"**throttled in this range:** {', '.join(reasons)}" if reasons
               else "no throttling in this range"))


def figures_of(d: dict, gpu: str) -> dict[str, float]:
    """The GPU's last figures from the page's series (when data.gpu_now had none)."""
    column, out = f"gpu {gpu}", {}
    for title in NOW:
        frame = d["series"].get(title, pd.DataFrame())
        values = frame[column].dropna() if column in frame else pd.Series(dtype=float)
        if not values.empty:
            out[title] = float(values.iloc[-1])
    return out


def gpu_head(gpu: str, figures: dict[str, float], reasons: list[str]) -> None:
    """The GPU's heading, its link to the whole node and its line: the page's first
    content when a link opened it at this GPU."""
    st.subheader(f"GPU {gpu}")
    st.caption(f"[All GPUs of {node}]({links.page_url('node', {'node': node}, ui.keep())})")
    st.markdown(now_line(gpu, figures, reasons))


def gpu_evidence(d: dict, gpu: str) -> None:
    """One GPU's temperature, clocks and throttle reasons together, first on the page:
    the slow GPU's evidence took 6 clicks and ~150 s to gather."""
    rows = throttle_rows(d, gpu)
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
    banners = st.container()  # down GPUs, first: filled once the page's data is in
    now = None
    if focus is not None:  # the link's GPU in a line from one query, before the page's 13
        now = data.gpu_now(s.prometheus_url, node, focus, win.seconds, win.end).value
        if now is not None and now.down is None:
            gpu_head(focus, now.figures, now.throttled)
    result = data.node(s.prometheus_url, node, win.seconds, win.end)
    if not ui.show_status(result):
        return
    d = result.value
    for gpu, reason in sorted(d["down"].items()):  # the rest of the page lacks them
        banners.error(f"GPU {gpu} is DOWN — {explain.down_reason(reason)}. It reports "
                      "nothing else, so it is missing from the charts below.")
    for gpu, f in d["failing"].items():
        if gpu not in d["down"]:
            banners.warning(explain.failing_readings(gpu, f.share, f.readings, f.now))
    if focus is not None and focus not in d["down"]:
        if now is None or now.down is not None:  # not drawn above: from the page's data
            throttled = throttle_rows(d, focus)
            gpu_head(focus, figures_of(d, focus),
                     sorted(set(throttled["reason"])) if not throttled.empty else [])
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
    # statements, not `a if c else b` expressions: Streamlit's magic renders an
    # expression's value, and that of st.dataframe/st.caption is st itself (its help).
    # One under the other, the page's width each: side by side, half of a 1024 px window's
    # page, the XID table scrolled sideways by 282 px and cut "GPU has fallen off th…".
    for title, frame in (("XID errors (last 10 min)", d["xid"]),
                         ("ECC error counters", d["ecc"])):
        st.markdown(f"**{title}**")
        if frame.empty:
            st.caption("none")
        else:
            st.dataframe(frame, hide_index=True, width="stretch", column_config=EVENT_COLUMNS,
                         row_height=LINK_ROW_PX)
    st.subheader("Links")
    st.markdown("**GPU interconnect** (PCIe as trained against its maximum, NVLinks)")
    links = d["gpu_links"]
    if links.empty:
        st.caption("not reported")
    else:
        bad = links[links["health"] != "ok"]
        for _, r in bad.iterrows():
            st.warning(f"GPU {r['gpu']}: {r['health']}")
        st.dataframe(links, hide_index=True, width="stretch", column_config=LINK_COLUMNS,
                     row_height=LINK_ROW_PX)
    st.markdown("**Network ports** (InfiniBand/RoCE and Ethernet, from sysfs)")
    if d["nics"].empty:
        st.caption("No physical network ports reported.")
    else:
        st.dataframe(d["nics"].round(2), hide_index=True, width="stretch")


live()
for draw in later:
    draw()
ui.operator(signin)  # after the GPU's line and charts: see ui.signin_box
